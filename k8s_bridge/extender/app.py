"""The extender's FastAPI app: ``POST /filter``, ``/prioritize``, ``/bind``, ``GET /healthz``
and ``GET /metrics``.

Bodies and replies use kube-scheduler's Go field names (`k8s_bridge.extender.models`). The
three verbs are one function each (`Verbs`) taking the raw body and returning the status and
the JSON reply: the body is validated with pydantic-core's JSON parser and the reply is
serialized once (FastAPI's own body/response models would validate 1,000-entry lists twice).

The verbs are registered as FastAPI routes, and the app (`ExtenderApp`) also answers an
exact ``POST /filter|/prioritize|/bind`` itself before FastAPI's middleware and routing: the
same functions, about half the per-request CPU (kube-scheduler calls the extender three
times per pod, so this is a tenth of the extender's CPU per pod). Anything else -- other
paths, a root path, other methods -- goes through FastAPI as usual.

prioritize's hold on the node it ranks first (`k8s_bridge.extender.state.ExtenderState.assume`)
is made after its reply has left, in the event loop's next turn: kube-scheduler waits for the
reply and no decision after it can miss the hold (each one makes a pending hold first; see
`ExtenderState.hold_after_reply`). That takes the hold, about a tenth of the extender's work
per pod with frag, off kube-scheduler's serial path.

Filter and prioritize are short CPU work and run on the event loop; bind talks to the
apiserver and runs on a few threads (`BIND_THREADS`), so binds to different nodes proceed
in parallel (as kube-scheduler's asynchronous binding cycle issues them). Those threads are
scheduled as background work (`k8s_bridge.extender.background`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from k8s_bridge.extender.background import as_background_thread
from k8s_bridge.extender.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
)
from k8s_bridge.extender.service import Extender
from k8s_bridge.http_errors import ExtenderViolationBody, errors, name_http_errors
from k8s_bridge.http_serving import json_body_openapi
from k8s_bridge.metrics import exposition
from qgpu.errors import first_violation

log = logging.getLogger(__name__)

JSON = "application/json"
BIND_THREADS = 4

Reply = tuple[int, bytes]
Verb = Callable[[bytes], Awaitable[Reply]]


def _bad_request(exc: ValidationError) -> Reply:
    """400 with kube-scheduler's ``Error`` and the field, value and rule (value cut short)."""
    v = first_violation(exc)
    return 400, json.dumps({"Error": str(v), **v.as_dict()}).encode()


class Verbs:
    """filter / prioritize / bind: raw JSON body in, (HTTP status, JSON body) out; each
    call timed in ``qgpu_extender_request_duration_seconds`` (its outcome is counted by the
    extender; a failure here as ``outcome="error"``)."""

    def __init__(self, extender: Extender, bind_threads: int = BIND_THREADS) -> None:
        self.extender = extender
        # Binds wait on the apiserver, but every thread also competes for the GIL with the
        # event loop and the watches: a few threads keep binds parallel without the thrash.
        # (A plain executor: its hand-off costs about 60 us of CPU, anyio's about 80.) The
        # threads are batch work: a bind's answer does not preempt the verbs' event loop.
        self.binders = ThreadPoolExecutor(
            bind_threads, thread_name_prefix="qgpu-bind", initializer=as_background_thread
        )

    @contextmanager
    def _observed(self, verb: str) -> Iterator[None]:
        m = self.extender.metrics
        with m.timed(verb):
            try:
                yield
            except Exception:
                m.requests.labels(verb, "error").inc()
                raise

    def _invalid(self, verb: str, exc: ValidationError) -> Reply:
        self.extender.metrics.requests.labels(verb, "invalid").inc()
        return _bad_request(exc)

    async def filter(self, body: bytes) -> Reply:
        with self._observed("filter"):
            try:
                args = ExtenderArgs.model_validate_json(body)
            except ValidationError as exc:
                return self._invalid("filter", exc)
            return 200, self.extender.filter(args).model_dump_json(by_alias=True).encode()

    async def prioritize(self, body: bytes) -> Reply:
        with self._observed("prioritize"):
            try:
                args = ExtenderArgs.model_validate_json(body)
            except ValidationError as exc:
                return self._invalid("prioritize", exc)
            names, scores = self.extender.prioritize_scores(args, hold_after_reply=True)
            return 200, self.extender.state.priority_list_json(names, scores)

    def after_reply(self) -> None:
        """Run once a verb's reply is written: the hold prioritize left pending is made
        after the reply has left (`k8s_bridge.http_serving.CoalescingTransport` hands the
        reply to the socket at the end of this event-loop turn; this runs in the next)."""
        asyncio.get_running_loop().call_soon(self.extender.state.settle)

    async def bind(self, body: bytes) -> Reply:
        with self._observed("bind"):
            try:
                args = ExtenderBindingArgs.model_validate_json(body)
            except ValidationError as exc:
                return self._invalid("bind", exc)
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self.binders, self.extender.bind, args)
            return 200, result.model_dump_json(by_alias=True).encode()

    def routes(self) -> dict[str, Verb]:
        return {"/filter": self.filter, "/prioritize": self.prioritize, "/bind": self.bind}


class ExtenderApp(FastAPI):
    """FastAPI, with the three verbs answered before FastAPI's middleware and routing."""

    def __init__(self, verbs: Verbs, fast_path: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.verbs = verbs
        self._hot = verbs.routes() if fast_path else {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and scope["path"] in self._hot
        ):
            await self._answer(self._hot[scope["path"]], receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _answer(self, verb: Verb, receive: Any, send: Any) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            status, body = await verb(b"".join(chunks))
        except Exception:  # the same answer FastAPI's error middleware would give
            log.exception("extender verb failed")
            status, body = 500, b'{"Error": "internal error in the qgpu extender"}'
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", JSON.encode()),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
        finally:
            self.verbs.after_reply()


def create_app(
    extender: Extender, bind_threads: int = BIND_THREADS, fast_path: bool = True
) -> ExtenderApp:
    """The extender's app; ``fast_path=False`` sends the verbs through FastAPI's routing too."""
    verbs = Verbs(extender, bind_threads)
    app = ExtenderApp(
        verbs,
        fast_path,
        title="qgpu scheduler extender",
        docs_url=None,
        redoc_url=None,
        responses=errors(ExtenderViolationBody),
    )
    name_http_errors(app, error_key="Error")

    def route(verb: Verb) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                status, body = await verb(await request.body())
            except BaseException:
                extender.state.settle()
                raise
            # Starlette runs the background task once the response is sent
            return Response(
                body,
                status_code=status,
                media_type=JSON,
                background=BackgroundTask(extender.state.settle),
            )

        return endpoint

    bodies = {"/filter": ExtenderArgs, "/prioritize": ExtenderArgs, "/bind": ExtenderBindingArgs}
    replies: dict[str, Any] = {
        "/filter": ExtenderFilterResult,
        "/prioritize": list[HostPriority],
        "/bind": ExtenderBindingResult,
    }
    for path, verb in verbs.routes().items():
        app.add_api_route(
            path,
            route(verb),
            methods=["POST"],
            name=path.strip("/"),
            openapi_extra=json_body_openapi(bodies[path]),
            responses={
                200: {"model": replies[path], "description": "kube-scheduler's reply"},
                400: {"model": ExtenderViolationBody, "description": "the field, value, rule"},
            },
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        """Prometheus metrics (text exposition format); see docs/metrics.md."""
        body, content_type = exposition(extender.metrics.registry)
        return Response(body, media_type=content_type)

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        with extender.state.lock:
            return {
                "ok": True,
                "nodes": len(extender.state.inventories),
                "pods": len(extender.state.pods),
            }

    return app
