"""The agent's HTTP API (FastAPI): routes, error mapping and the TCP bearer-token guard.

Routes (all JSON, pydantic models from `enforcement.agent.models`):

=======  ===============================  ============================================
GET      /v1/node                         inventory and workload environment (adapters)
GET      /v1/devices                      the node's GPUs, committed and live use
POST     /v1/slices                       reserve a slice -> Reservation (201)
POST     /v1/slices/record                record a slice placed elsewhere -> Reservation
GET      /v1/slices                       every slice with live usage
GET      /v1/slices/{slice_id}            one slice -> Reservation
DELETE   /v1/slices/{slice_id}            release (idempotent) -> ReleaseResult
POST     /v1/slices/{slice_id}/release    the same, for clients without DELETE
POST     /v1/slices/{slice_id}/lease      renew or end a slice's lease -> Reservation
GET      /v1/health                       status, problems, counts (503 when failing)
GET      /metrics                         Prometheus text format
=======  ===============================  ============================================

Every rejection is an `ErrorBody`: 422 invalid input (field, value, rule), 413 a body over
the size limit, 409 no GPU can take the slice now (with per-reason counts), 404 unknown
slice or route, 401 missing or wrong bearer token on TCP, 503 the state directory is full
or read-only (nothing was recorded; retry later), 500 an internal error (also counted in
metrics). Bodies are checked by `enforcement.agent.http_guard.BodyGuard` first.

A reservation whose client has gone by the time the agent reaches it (it waited behind
other writes) is not made: nothing is committed for a request nobody will read. Once
committed, a reservation is kept; a client that lost the answer retries with the same
``slice_id`` and gets the same slice, and a lease (``expires_s``) returns the slices of a
client that vanished.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import re
import sqlite3
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from enforcement.agent.errors import error_response, violations_from_request_errors
from enforcement.agent.http_guard import DEFAULT_MAX_BODY, JSON_SCOPE_KEY, BodyGuard
from enforcement.agent.metrics import build_registry, request_histogram, route_label
from enforcement.agent.models import (
    SLICE_ID_PATTERN,
    DeviceList,
    ErrorBody,
    Health,
    LeaseRequest,
    NodeInfo,
    RecordRequest,
    ReleaseResult,
    Reservation,
    ReserveRequest,
    SliceList,
)
from enforcement.agent.service import VERSION, Agent, NotFound
from qgpu.errors import NoFit, RuleViolation
from qgpu.ledger import OverCommit

log = logging.getLogger("qgpu.agent.api")

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token (TCP only)"},
    404: {"model": ErrorBody, "description": "no such slice or endpoint"},
    409: {"model": ErrorBody, "description": "valid, but no GPU can take it now"},
    413: {"model": ErrorBody, "description": "the request body is over the size limit"},
    422: {"model": ErrorBody, "description": "invalid input: field, value and rule"},
    500: {"model": ErrorBody, "description": "internal error"},
    503: {"model": ErrorBody, "description": "the state directory is full or read-only"},
}

WRITE_THREADS = 1
JSON_TYPE = "application/json"
# SQLite's errors when its file cannot be written; OSErrors of a full or read-only disk
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}

SliceId = Annotated[str, Path(pattern=SLICE_ID_PATTERN, description="slice id")]


class ClientGone(Exception):
    """The client disconnected before its write reached the front of the queue."""


def is_storage_error(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        return True
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def create_app(
    agent: Agent, *, max_body_bytes: int = DEFAULT_MAX_BODY, hot_routes: bool = True
) -> FastAPI:
    """The API over one `Agent`. Serve it with `enforcement.agent.server`. `hot_routes`:
    reserve and release skip the route search and FastAPI's request handling
    (`HotRoutes`; the same answers, a test compares them)."""
    app = FastAPI(
        title="qgpu node agent",
        version=VERSION,
        description="Reserve, list and release fractional GPU slices on this node.",
        responses=ERRORS,
        # FastAPI's OpenTelemetry bridge asks the global providers on every request; the
        # agent exports Prometheus metrics (docs/metrics.md) and configures no providers
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    registry = build_registry(agent)
    app.state.agent = agent
    app.state.metrics_registry = registry
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestTimer, histogram=request_histogram(registry), node=agent.node)

    def count_invalid(request: Request) -> None:
        if request.url.path.startswith("/v1/slices") and request.method == "POST":
            agent.counters.add("reservations", "invalid")

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_invalid(request)
        return error_response(422, "invalid", violations_from_request_errors(list(exc.errors())))

    @app.exception_handler(RuleViolation)
    async def _rule(request: Request, exc: RuleViolation) -> JSONResponse:
        count_invalid(request)
        return error_response(422, "invalid", [exc])

    @app.exception_handler(NoFit)
    async def _nofit(request: Request, exc: NoFit) -> JSONResponse:
        agent.counters.add("reservations", "no-fit")
        rule = f"no GPU on node {agent.node} can take this slice now: {exc}"
        return error_response(409, "no-fit", [RuleViolation("request", None, rule)], exc.reasons)

    @app.exception_handler(OverCommit)
    async def _overcommit(request: Request, exc: OverCommit) -> JSONResponse:
        agent.counters.add("reservations", "no-fit")
        rule = f"would over-commit a GPU: {exc}"
        return error_response(409, "no-fit", [RuleViolation("request", None, rule)])

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        return error_response(404, "not-found", [exc.violation])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            rule = "no such endpoint (see /docs or docs/agent.md)"
            return error_response(404, "not-found", [RuleViolation("path", request.url.path, rule)])
        if exc.status_code == 405:
            rule = f"method {request.method} is not allowed on {request.url.path}"
            return error_response(405, "invalid", [RuleViolation("method", request.method, rule)])
        kind = "invalid" if 400 <= exc.status_code < 500 else "internal"
        field = "body" if exc.status_code == 400 else "request"
        return error_response(exc.status_code, kind, [RuleViolation(field, None, str(exc.detail))])

    async def _storage_or_internal(request: Request, exc: Exception) -> JSONResponse:
        if not is_storage_error(exc):
            return await _internal(request, exc)
        reason = agent.storage_failed(exc)
        if request.url.path.startswith("/v1/slices") and request.method == "POST":
            agent.counters.add("reservations", "unavailable")
        rule = f"{reason}; nothing was recorded, retry once /v1/health is ok"
        return error_response(
            503,
            "unavailable",
            [RuleViolation("state_dir", str(agent.config.state_dir), rule)],
            headers={"Retry-After": "5"},
        )

    for kind in (sqlite3.Error, OSError):
        app.add_exception_handler(kind, _storage_or_internal)  # type: ignore[arg-type]

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        agent.counters.add("errors", type(exc).__name__)
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        rule = f"internal error ({type(exc).__name__}); see the agent's log"
        return error_response(500, "internal", [RuleViolation("request", None, rule)])

    @app.get("/v1/node", response_model=NodeInfo, tags=["devices"])
    def node() -> Response:
        """The node's inventory and the environment its workloads need (for adapters)."""
        return answer(agent.node_info())

    @app.get("/v1/devices", response_model=DeviceList, tags=["devices"])
    def devices() -> Response:
        """The node's GPUs: inventory, health, committed slices and live memory/utilisation."""
        return answer(agent.devices())

    writer = Writer()
    app.state.writer = writer
    weakref.finalize(app, writer.close)  # its thread ends with the app (tests make many)

    async def write(request: Request, fn: Any, *args: Any) -> Any:
        """Run a mutation when its turn comes, unless its client has left meanwhile."""
        return await writer.run(fn, *args, gone=request.is_disconnected)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        agent.counters.add("reservations", "abandoned")
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    @app.post("/v1/slices", response_model=Reservation, status_code=201, tags=["slices"])
    async def reserve(request: Request, body: ReserveRequest) -> Response:
        """Reserve a slice. The answer carries the environment the workload must apply.
        A repeat with the same ``slice_id`` and owner returns the same slice."""
        return answer(await write(request, agent.reserve, body), 201)

    @app.post("/v1/slices/record", response_model=Reservation, status_code=201, tags=["slices"])
    async def record(request: Request, body: RecordRequest) -> Response:
        """Account for and enforce a slice placed elsewhere (scheduler extender, Ray SDK):
        the ledger checks the GPUs exist and have room; a repeat by the same owner is a no-op.
        """
        return answer(await write(request, agent.record, body), 201)

    @app.get("/v1/slices", response_model=SliceList, tags=["slices"])
    def slices() -> Response:
        """Every slice of this node with its live usage."""
        return answer(agent.slices())

    @app.get("/v1/slices/{slice_id}", response_model=Reservation, tags=["slices"])
    def get_slice(slice_id: SliceId) -> Response:
        """One slice (the same answer its reservation got)."""
        return answer(agent.get(slice_id))

    @app.delete("/v1/slices/{slice_id}", response_model=ReleaseResult, tags=["slices"])
    async def release(slice_id: SliceId) -> Response:
        """Release a slice; releasing one that is already gone answers released=false."""
        return answer(await writer.run(agent.release, slice_id))

    @app.post("/v1/slices/{slice_id}/release", response_model=ReleaseResult, tags=["slices"])
    async def release_post(slice_id: SliceId) -> Response:
        """Release a slice (POST form of DELETE)."""
        return answer(await writer.run(agent.release, slice_id))

    @app.post("/v1/slices/{slice_id}/lease", response_model=Reservation, tags=["slices"])
    async def lease(slice_id: SliceId, body: LeaseRequest) -> Response:
        """Renew a slice's lease (``expires_s`` from now) or end it (``null``: the slice is
        kept until released). 404 when the slice is gone (its lease may have run out)."""
        return answer(await writer.run(agent.renew, slice_id, body.expires_s))

    @app.get(
        "/v1/health",
        response_model=Health,
        tags=["health"],
        responses={503: {"model": Health, "description": "failing: cannot record slices"}},
    )
    def health() -> Response:
        """ok, degraded (problems listed), or failing (503: the state directory is full or
        read-only, so no slice can be recorded)."""
        h = agent.health()
        status = 503 if h.status == "failing" else 200
        return answer(h, status)

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    def metrics() -> Response:
        """Prometheus metrics (text exposition format); see docs/metrics.md."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if hot_routes:
        app.router.middleware_stack = HotRoutes(app.router.middleware_stack, agent, writer)
    return app


T = TypeVar("T")


class Writer:
    """The agent's mutations, one at a time in arrival order, on one thread of their own.

    The agent serialises its writes anyway (one write lock, one SQLite writer); a turn
    taken here, before the thread, keeps them from crowding a thread pool and lets a
    request whose client left while it waited be dropped unmade. The thread is a plain
    executor: anyio's worker threads cost about twice its CPU per hand-off."""

    def __init__(self) -> None:
        self._turn = anyio.CapacityLimiter(WRITE_THREADS)
        self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="qgpu-write")

    def close(self) -> None:
        """End the write thread once the writes handed to it are done."""
        self._pool.shutdown(wait=False)

    async def run(
        self, fn: Callable[..., T], *args: Any, gone: Callable[[], Any] | None = None
    ) -> T:
        """`fn(*args)` on the write thread when its turn comes; `gone` (an awaitable
        check) is asked then: True raises `ClientGone` and nothing runs."""
        async with self._turn:
            if gone is not None and await gone():
                raise ClientGone
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


_RELEASE_PATH = re.compile(r"/v1/slices/([^/]+)")
_SLICE_ID = re.compile(SLICE_ID_PATTERN)


class HotRoutes:
    """Wraps the router (inside FastAPI's exception handling and the agent's middlewares):
    ``POST /v1/slices`` and ``DELETE /v1/slices/{id}``, what a reserve/release loop sends,
    are answered without the route search and FastAPI's request handling (dependency
    solving, its own body reading and validation, the endpoint wrappers), about a quarter
    of a millisecond of CPU per request.

    Only requests whose answer cannot differ are taken: a JSON body (``Content-Type:
    application/json``) that `BodyGuard` has parsed and that validates as `ReserveRequest`
    (the model FastAPI validates it with), or a release whose id matches the path pattern.
    Anything else (an invalid or missing body, another content type, a bad id, a root
    path) goes to the router as it came, so its answer is FastAPI's; an exception raised
    here is answered by the same handlers as one raised in the route. The routes stay
    declared for the OpenAPI document and for the requests passed on."""

    def __init__(self, app: ASGIApp, agent: Agent, writer: Writer) -> None:
        self.app = app
        self.agent = agent
        self.writer = writer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            method, path = scope["method"], scope["path"]
            if method == "POST" and path == "/v1/slices":
                body = _reservation(scope)
                if body is not None:
                    await receive()  # BodyGuard's replay of the body it checked
                    request = Request(scope, receive)
                    result = await self.writer.run(
                        self.agent.reserve, body, gone=request.is_disconnected
                    )
                    await answer(result, 201)(scope, receive, send)
                    return
            elif method == "DELETE" and (m := _RELEASE_PATH.fullmatch(path)):
                slice_id = m.group(1)
                if _SLICE_ID.fullmatch(slice_id):
                    result = await self.writer.run(self.agent.release, slice_id)
                    await answer(result)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _reservation(scope: Scope) -> ReserveRequest | None:
    """The request's body as FastAPI would pass it to the reserve route, or None where
    this cannot be told without FastAPI (no JSON document parsed by `BodyGuard`, another
    content type) or where it would not pass (invalid: FastAPI answers with its own error
    locations)."""
    doc = scope.get(JSON_SCOPE_KEY)
    if doc is None or not _json_content(scope):
        return None
    try:
        return ReserveRequest.model_validate(doc)
    except Exception:  # a ValidationError, or anything a validator raised:
        return None  # FastAPI validates it again and answers as it always did


def _json_content(scope: Scope) -> bool:
    """Whether the request's (first) Content-Type is application/json, which FastAPI
    parses as JSON (anything else is left to it)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def answer(model: BaseModel, status_code: int = 200) -> Response:
    """A model's JSON, serialised once. Returned as a model, FastAPI would validate it
    against the route's ``response_model`` again before serialising it (the decorators
    keep ``response_model`` for the OpenAPI document)."""
    return Response(
        model.model_dump_json(by_alias=True), status_code=status_code, media_type=JSON_TYPE
    )


class RequestTimer:
    """ASGI middleware: ``qgpu_agent_request_duration_seconds`` per method, route, status."""

    def __init__(self, app: ASGIApp, histogram: Histogram, node: str) -> None:
        self.app = app
        self.histogram = histogram
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # the app raised before answering: uvicorn answers 500
        answered = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = int(message["status"]), True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
            if not answered:
                status = 499  # returned without an answer: the client left first
        finally:
            self.histogram.labels(
                self.node, scope["method"], route_label(scope["path"]), str(status)
            ).observe(time.perf_counter() - start)


class TokenGuard:
    """ASGI wrapper: requests that arrived over TCP need ``Authorization: Bearer <token>``.

    Unix-socket connections (uvicorn reports them with no port) are protected by the
    socket's 0600 mode instead. Anything that is not clearly a unix socket needs the token.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not _is_unix(scope) and not self._authorised(scope):
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] == "http" and not _is_unix(scope) and not self._authorised(scope):
            response = error_response(
                401,
                "unauthorized",
                [
                    RuleViolation(
                        "Authorization",
                        None,
                        "requests over TCP need the header 'Authorization: Bearer <token>' "
                        "with the agent's token",
                    )
                ],
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False


def _is_unix(scope: Scope) -> bool:
    server = scope.get("server")
    return server is not None and len(server) == 2 and server[1] is None


__all__ = ["HotRoutes", "TokenGuard", "Writer", "create_app", "error_response", "is_storage_error"]
