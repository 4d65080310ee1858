"""Mutating admission webhook (AdmissionReview v1): route qgpu pods to the qgpu scheduler.

For a pod CREATE whose containers ask for ``<prefix>/qgpu-core`` / ``<prefix>/qgpu-memory``:
- valid request -> allowed, with a JSONPatch (base64) setting ``spec.schedulerName`` to the
  scheduler that runs the qgpu extender (no patch when it is already set so);
- invalid request -> denied (HTTP 400 in the Status) with the rule that was broken, named
  by container and resource, e.g. ``spec.containers[0].resources.limits[...qgpu-core]=150:
  must be 1..99 ...``.
Pods without qgpu resources, and other operations, are allowed untouched.

HAMi and Koordinator names (`k8s_bridge.compat`): with ``--compat`` they are translated
into qgpu's (the patch rewrites the container's resources and annotations, records the
translation in ``<prefix>/qgpu-compat-translation``, and each translation is a line in the
response's ``warnings``, which kubectl prints); what cannot be translated exactly is denied
with the rule. Without ``--compat`` a pod mixing them with qgpu names is denied, and a pod
asking only for them is allowed with a warning (the extender refuses qgpu nodes for it).

``GET /metrics``: `k8s_bridge.metrics.WebhookMetrics`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from fastapi import FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field

from k8s_bridge import compat
from k8s_bridge.metrics import WebhookMetrics, exposition, rule_key
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


def _deny(uid: str, exc: RuleViolation, warnings: list[str]) -> AdmissionResponse:
    return AdmissionResponse(
        uid=uid,
        allowed=False,
        status=AdmissionStatus(code=400, reason="BadRequest", message=f"qgpu: {exc}"),
        warnings=warnings or None,
    )


def decide(
    names: Names, scheduler_name: str, req: AdmissionRequest, compat_mode: bool = False
) -> tuple[AdmissionResponse, RuleViolation | None, list[str]]:
    """The admission decision for one request, the rule a denial broke, and the sources
    (HAMi, Koordinator, annotation) of what compat mode translated."""
    raw = req.object
    if req.operation != "CREATE" or not raw:
        return AdmissionResponse(uid=req.uid, allowed=True), None, []
    foreign = compat.foreign_in(raw)
    ours = asks_for_qgpu(names, raw)
    if not ours and not foreign and not compat_mode:
        return AdmissionResponse(uid=req.uid, allowed=True), None, []
    pod, ops, warnings, sources = raw, [], [], []
    try:
        if compat_mode:
            t = compat.translate(names, raw)
            pod, ops, warnings = t.pod, t.ops, t.warnings
            sources = [compat.family(r) for _, r in foreign] + (
                ["annotation"] * len(t.record.get("annotations", {}))
            )
        elif foreign and ours:
            container, resource = foreign[0]
            raise RuleViolation(
                f"container {container}: {resource}",
                None,
                f"{compat.family(resource)} names cannot be mixed with qgpu resources: enable "
                "compat mode (qgpu webhook --compat) to translate them, or remove them",
            )
        elif foreign:
            reason = compat.foreign_reason(names, raw, compat=False)
            return AdmissionResponse(uid=req.uid, allowed=True, warnings=[reason]), None, []
        if not asks_for_qgpu(names, pod):
            return AdmissionResponse(uid=req.uid, allowed=True), None, []
        pod_slice_requests(names, parse_pod(pod))
    except RuleViolation as exc:
        return _deny(req.uid, exc, warnings), exc, []
    if (pod.get("spec") or {}).get("schedulerName") != scheduler_name:
        ops = [*ops, {"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}]
    if not ops:
        return AdmissionResponse(uid=req.uid, allowed=True, warnings=warnings or None), None, []
    resp = AdmissionResponse(
        uid=req.uid,
        allowed=True,
        patch=base64.b64encode(json.dumps(ops).encode()).decode(),
        patchType="JSONPatch",
        warnings=warnings or None,
    )
    return resp, None, sources


def review(
    names: Names, scheduler_name: str, req: AdmissionRequest, compat_mode: bool = False
) -> AdmissionResponse:
    """The admission decision for one request."""
    return decide(names, scheduler_name, req, compat_mode)[0]


def create_app(
    names: Names,
    scheduler_name: str = DEFAULT_SCHEDULER,
    compat_mode: bool = False,
    metrics: WebhookMetrics | None = None,
) -> FastAPI:
    app = FastAPI(title="qgpu mutating webhook", docs_url=None, redoc_url=None)
    m = metrics or WebhookMetrics()
    app.state.metrics = m

    @app.post(
        "/mutate",
        response_model=AdmissionReview,
        response_model_by_alias=True,
        response_model_exclude_none=True,
    )
    async def mutate(body: AdmissionReview) -> AdmissionReview:
        with m.timed("mutate"):
            if body.request is None:
                m.admissions.labels("denied").inc()
                m.denials.labels("request").inc()
                return AdmissionReview(
                    response=AdmissionResponse(
                        uid="",
                        allowed=False,
                        status=AdmissionStatus(code=400, message="AdmissionReview without request"),
                    )
                )
            resp, broken, sources = decide(names, scheduler_name, body.request, compat_mode)
            if broken is not None:
                m.admissions.labels("denied").inc()
                m.denials.labels(rule_key(broken)).inc()
            else:
                m.admissions.labels("mutated" if resp.patch else "allowed").inc()
            for source in sources:
                m.translations.labels(source).inc()
            return AdmissionReview(response=resp)

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        body, content_type = exposition(m.registry)
        return Response(body, media_type=content_type)

    return app
