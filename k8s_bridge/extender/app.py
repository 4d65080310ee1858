"""The extender's FastAPI app: ``POST /filter``, ``/prioritize``, ``/bind`` and ``GET /healthz``.

Bodies and replies use kube-scheduler's Go field names (`k8s_bridge.extender.models`). The
hot verbs validate the raw body with pydantic-core's JSON parser and serialize the reply
once (FastAPI's own body/response models would validate 1,000-entry lists twice). Filter
and prioritize are short CPU work and run on the event loop; bind talks to the apiserver
and runs on a few threads (`BIND_THREADS`), so binds to different nodes proceed in
parallel (as kube-scheduler's asynchronous binding cycle issues them).
"""

from __future__ import annotations

import anyio
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ValidationError

from k8s_bridge.extender.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    host_priority_list_json,
)
from k8s_bridge.extender.service import Extender
from qgpu.errors import first_violation

JSON = "application/json"


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(by_alias=True), media_type=JSON)


def _bad_request(exc: ValidationError) -> Response:
    v = first_violation(exc)
    return Response(
        f'{{"Error": {v.as_dict()["rule"]!r}}}'.replace("'", '"'),
        status_code=400,
        media_type=JSON,
    )


BIND_THREADS = 4


def create_app(extender: Extender, bind_threads: int = BIND_THREADS) -> FastAPI:
    app = FastAPI(title="qgpu scheduler extender", docs_url=None, redoc_url=None)
    # Binds wait on the apiserver, but every thread also competes for the GIL with the
    # event loop and the watches: a few threads keep binds parallel without the thrash.
    binders = anyio.CapacityLimiter(bind_threads)

    @app.post("/filter")
    async def filter_(request: Request) -> Response:
        try:
            args = ExtenderArgs.model_validate_json(await request.body())
        except ValidationError as exc:
            return _bad_request(exc)
        return _json(extender.filter(args))

    @app.post("/prioritize")
    async def prioritize(request: Request) -> Response:
        try:
            args = ExtenderArgs.model_validate_json(await request.body())
        except ValidationError as exc:
            return _bad_request(exc)
        names, scores = extender.prioritize_scores(args)
        return Response(host_priority_list_json(names, scores.tolist()), media_type=JSON)

    @app.post("/bind")
    async def bind(request: Request) -> Response:
        try:
            args = ExtenderBindingArgs.model_validate_json(await request.body())
        except ValidationError as exc:
            return _bad_request(exc)
        return _json(await anyio.to_thread.run_sync(extender.bind, args, limiter=binders))

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        with extender.state.lock:
            return {
                "ok": True,
                "nodes": len(extender.state.inventories),
                "pods": len(extender.state.pods),
            }

    return app
