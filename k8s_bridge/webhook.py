"""Mutating admission webhook (AdmissionReview v1): route qgpu pods to the qgpu scheduler.

For a pod CREATE whose containers ask for ``<prefix>/qgpu-core`` / ``<prefix>/qgpu-memory``:
- valid request -> allowed, with a JSONPatch (base64) setting ``spec.schedulerName`` to the
  scheduler that runs the qgpu extender (no patch when it is already set so);
- invalid request -> denied (HTTP 400 in the Status) with the rule that was broken, named
  by container and resource, e.g. ``spec.containers[0].resources.limits[...qgpu-core]=150:
  must be 1..99 ...``.
Pods without qgpu resources, and other operations, are allowed untouched.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from k8s_bridge.resources import Names, asks_for_qgpu, parse_pod, pod_slice_requests
from qgpu.errors import RuleViolation

ADMISSION_API = "admission.k8s.io/v1"
DEFAULT_SCHEDULER = "qgpu-scheduler"


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class AdmissionRequest(_Wire):
    uid: str
    operation: str = "CREATE"
    namespace: str | None = None
    object: dict[str, Any] | None = None


class AdmissionStatus(_Wire):
    code: int
    message: str
    reason: str = ""


class AdmissionResponse(_Wire):
    uid: str
    allowed: bool
    status: AdmissionStatus | None = None
    patch: str | None = None
    patch_type: str | None = Field(default=None, alias="patchType")
    warnings: list[str] | None = None


class AdmissionReview(_Wire):
    api_version: str = Field(default=ADMISSION_API, alias="apiVersion")
    kind: str = "AdmissionReview"
    request: AdmissionRequest | None = None
    response: AdmissionResponse | None = None


def review(names: Names, scheduler_name: str, req: AdmissionRequest) -> AdmissionResponse:
    """The admission decision for one request."""
    pod = req.object
    if req.operation != "CREATE" or not pod or not asks_for_qgpu(names, pod):
        return AdmissionResponse(uid=req.uid, allowed=True)
    try:
        pod_slice_requests(names, parse_pod(pod))
    except RuleViolation as exc:
        return AdmissionResponse(
            uid=req.uid,
            allowed=False,
            status=AdmissionStatus(code=400, reason="BadRequest", message=f"qgpu: {exc}"),
        )
    if (pod.get("spec") or {}).get("schedulerName") == scheduler_name:
        return AdmissionResponse(uid=req.uid, allowed=True)
    ops = [{"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}]
    return AdmissionResponse(
        uid=req.uid,
        allowed=True,
        patch=base64.b64encode(json.dumps(ops).encode()).decode(),
        patchType="JSONPatch",
    )


def create_app(names: Names, scheduler_name: str = DEFAULT_SCHEDULER) -> FastAPI:
    app = FastAPI(title="qgpu mutating webhook", docs_url=None, redoc_url=None)

    @app.post(
        "/mutate",
        response_model=AdmissionReview,
        response_model_by_alias=True,
        response_model_exclude_none=True,
    )
    async def mutate(body: AdmissionReview) -> AdmissionReview:
        if body.request is None:
            return AdmissionReview(
                response=AdmissionResponse(
                    uid="",
                    allowed=False,
                    status=AdmissionStatus(code=400, message="AdmissionReview without request"),
                )
            )
        return AdmissionReview(response=review(names, scheduler_name, body.request))

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app
