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
GET      /v1/health                       status, problems, counts
GET      /metrics                         Prometheus text format
=======  ===============================  ============================================

Every rejection is an `ErrorBody`: 422 invalid input (field, value, rule), 409 no GPU can
take the slice now (with per-reason counts), 404 unknown slice or route, 401 missing or
wrong bearer token on TCP, 500 an internal error (also counted in metrics).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Annotated, Any

import anyio
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from enforcement.agent.metrics import build_registry, request_histogram, route_label
from enforcement.agent.models import (
    SLICE_ID_PATTERN,
    DeviceList,
    ErrorBody,
    Health,
    NodeInfo,
    RecordRequest,
    ReleaseResult,
    Reservation,
    ReserveRequest,
    SliceList,
    Violation,
)
from enforcement.agent.service import VERSION, Agent, NotFound
from qgpu.errors import NoFit, RuleViolation
from qgpu.ledger import OverCommit

log = logging.getLogger("qgpu.agent.api")

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token (TCP only)"},
    404: {"model": ErrorBody, "description": "no such slice or endpoint"},
    409: {"model": ErrorBody, "description": "valid, but no GPU can take it now"},
    422: {"model": ErrorBody, "description": "invalid input: field, value and rule"},
    500: {"model": ErrorBody, "description": "internal error"},
}

WRITE_THREADS = 1

SliceId = Annotated[str, Path(pattern=SLICE_ID_PATTERN, description="slice id")]


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return repr(value)


def error_response(
    status: int,
    kind: str,
    violations: list[RuleViolation],
    reasons: dict[str, int] | None = None,
) -> JSONResponse:
    items = [Violation(field=v.field, value=_json_value(v.value), rule=v.rule) for v in violations]
    first = items[0]
    body = ErrorBody(
        error=kind,  # type: ignore[arg-type]
        field=first.field,
        value=first.value,
        rule=first.rule,
        violations=items,
        reasons=reasons or {},
    )
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"))


def violations_from_request_errors(errors: list[dict[str, Any]]) -> list[RuleViolation]:
    """FastAPI's request validation errors as field/value/rule (body prefix dropped)."""
    out: list[RuleViolation] = []
    for err in errors:
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, RuleViolation):
            out.append(inner)
            continue
        loc = [str(p) for p in err.get("loc", ())]
        if loc and loc[0] in ("body", "path", "query", "header"):
            loc = loc[1:] or loc
        field = ".".join(loc) or "request"
        kind = err.get("type", "")
        value = err.get("input")
        if kind == "missing":
            out.append(RuleViolation(field, None, "this field is required"))
        elif kind == "extra_forbidden":
            out.append(RuleViolation(field, value, "unknown field"))
        elif kind == "json_invalid":
            out.append(RuleViolation("body", None, "must be valid JSON"))
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            out.append(RuleViolation(field, value, msg))
    return out or [RuleViolation("request", None, "invalid request")]


def create_app(agent: Agent) -> FastAPI:
    """The API over one `Agent`. Serve it with `enforcement.agent.server`."""
    app = FastAPI(
        title="qgpu node agent",
        version=VERSION,
        description="Reserve, list and release fractional GPU slices on this node.",
        responses=ERRORS,
    )
    registry = build_registry(agent)
    app.state.agent = agent
    app.state.metrics_registry = registry
    app.add_middleware(RequestTimer, histogram=request_histogram(registry), node=agent.node)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path.startswith("/v1/slices") and request.method == "POST":
            agent.counters.add("reservations", "invalid")
        return error_response(422, "invalid", violations_from_request_errors(list(exc.errors())))

    @app.exception_handler(RuleViolation)
    async def _rule(request: Request, exc: RuleViolation) -> JSONResponse:
        if request.url.path.startswith("/v1/slices") and request.method == "POST":
            agent.counters.add("reservations", "invalid")
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
        kind = "invalid" if 400 <= exc.status_code < 500 else "internal"
        rule = str(exc.detail)
        return error_response(
            exc.status_code, kind, [RuleViolation("method", request.method, rule)]
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        agent.counters.add("errors", type(exc).__name__)
        log.exception("internal error on %s %s", request.method, request.url.path)
        rule = f"internal error ({type(exc).__name__}); see the agent's log"
        return error_response(500, "internal", [RuleViolation("request", None, rule)])

    @app.get("/v1/node", response_model=NodeInfo, tags=["devices"])
    def node() -> NodeInfo:
        """The node's inventory and the environment its workloads need (for adapters)."""
        return agent.node_info()

    @app.get("/v1/devices", response_model=DeviceList, tags=["devices"])
    def devices() -> DeviceList:
        """The node's GPUs: inventory, health, committed slices and live memory/utilisation."""
        return agent.devices()

    # Mutations are serialised by the ledger anyway; a small limiter keeps them from
    # crowding the shared thread pool (40 threads fighting over the GIL and one lock).
    writes = anyio.CapacityLimiter(WRITE_THREADS)

    @app.post("/v1/slices", response_model=Reservation, status_code=201, tags=["slices"])
    async def reserve(body: ReserveRequest) -> Reservation:
        """Reserve a slice. The answer carries the environment the workload must apply."""
        return await anyio.to_thread.run_sync(agent.reserve, body, limiter=writes)

    @app.post("/v1/slices/record", response_model=Reservation, status_code=201, tags=["slices"])
    async def record(body: RecordRequest) -> Reservation:
        """Account for and enforce a slice placed elsewhere (scheduler extender, Ray SDK):
        the ledger checks the GPUs exist and have room; a repeat by the same owner is a no-op.
        """
        return await anyio.to_thread.run_sync(agent.record, body, limiter=writes)

    @app.get("/v1/slices", response_model=SliceList, tags=["slices"])
    def slices() -> SliceList:
        """Every slice of this node with its live usage."""
        return agent.slices()

    @app.get("/v1/slices/{slice_id}", response_model=Reservation, tags=["slices"])
    def get_slice(slice_id: SliceId) -> Reservation:
        """One slice (the same answer its reservation got)."""
        return agent.get(slice_id)

    @app.delete("/v1/slices/{slice_id}", response_model=ReleaseResult, tags=["slices"])
    async def release(slice_id: SliceId) -> ReleaseResult:
        """Release a slice; releasing one that is already gone answers released=false."""
        return await anyio.to_thread.run_sync(agent.release, slice_id, limiter=writes)

    @app.post("/v1/slices/{slice_id}/release", response_model=ReleaseResult, tags=["slices"])
    async def release_post(slice_id: SliceId) -> ReleaseResult:
        """Release a slice (POST form of DELETE)."""
        return await anyio.to_thread.run_sync(agent.release, slice_id, limiter=writes)

    @app.get("/v1/health", response_model=Health, tags=["health"])
    def health() -> Health:
        """ok, or degraded with the problems listed."""
        return agent.health()

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    def metrics() -> Response:
        """Prometheus metrics (text exposition format); see docs/metrics.md."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


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
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
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


__all__ = ["TokenGuard", "create_app", "error_response"]
