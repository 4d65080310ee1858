"""The extender's FastAPI app: ``POST /filter``, ``/prioritize``, ``/bind`` and ``GET /healthz``.

Bodies and replies use kube-scheduler's Go field names (`k8s_bridge.extender.models`).
Filter and prioritize are short CPU work and run on the event loop; bind talks to the
apiserver and runs in the thread pool, so binds to different nodes proceed in parallel (as
kube-scheduler's asynchronous binding cycle issues them).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from k8s_bridge.extender.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
)
from k8s_bridge.extender.service import Extender


def create_app(extender: Extender) -> FastAPI:
    app = FastAPI(title="qgpu scheduler extender", docs_url=None, redoc_url=None)

    @app.post("/filter", response_model=ExtenderFilterResult, response_model_by_alias=True)
    async def filter_(args: ExtenderArgs) -> ExtenderFilterResult:
        return extender.filter(args)

    @app.post("/prioritize", response_model=list[HostPriority], response_model_by_alias=True)
    async def prioritize(args: ExtenderArgs) -> list[HostPriority]:
        return extender.prioritize(args)

    @app.post("/bind", response_model=ExtenderBindingResult, response_model_by_alias=True)
    async def bind(args: ExtenderBindingArgs) -> ExtenderBindingResult:
        return await run_in_threadpool(extender.bind, args)

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        with extender.state.lock:
            return {
                "ok": True,
                "nodes": len(extender.state.inventories),
                "pods": len(extender.state.pods),
            }

    return app
