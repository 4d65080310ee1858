"""Mutating admission webhook (AdmissionReview v1): route qgpu pods to the qgpu scheduler.

For a pod CREATE whose containers ask for ``<prefix>/qgpu-core`` / ``<prefix>/qgpu-memory``:
- valid request -> allowed, with a JSONPatch (base64) setting ``spec.schedulerName`` to the
  scheduler that runs the qgpu extender (no patch when it is already set so). The
  apiserver defaults an unset ``schedulerName`` to ``default-scheduler`` before admission,
  so that value counts as unset;
- a pod that explicitly names *another* scheduler -> denied, naming the field: its slices
  would never be assigned (the device plugin refuses pods the extender did not bind), and
  silently moving it to qgpu-scheduler would overrule its author;
- invalid request -> denied (HTTP 400 in the Status) with the rule that was broken, named
  by container and resource, e.g. ``spec.containers[0].resources.limits[...qgpu-core]=150:
  must be 1..99 ...``. The slice rules are the core's (`qgpu.model.SliceRequest`, through
  `k8s_bridge.resources`).
For a pod UPDATE the same request rules hold (denied when broken) and the qgpu amounts may
not change (a slice is allocated once); nothing is patched. Pods without qgpu resources,
and other operations, are allowed untouched.

The body is read raw and parsed with pydantic's JSON parser: malformed JSON, lone
surrogates, numbers past 4,300 digits and nesting deeper than its limit are refused as
data. A body that is not an AdmissionReview gets HTTP 400 with field, value and rule; a
review whose pod is malformed (``containers: "x"``) gets a denial naming the field.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k8s_bridge.http_serving import json_body_openapi
from k8s_bridge.resources import (
    ContainerRequest,
    Names,
    asks_for_qgpu,
    parse_pod,
    pod_slice_requests,
)
from qgpu.errors import RuleViolation, first_violation

ADMISSION_API = "admission.k8s.io/v1"
DEFAULT_SCHEDULER = "qgpu-scheduler"
UNSET_SCHEDULERS = ("", "default-scheduler")  # the apiserver's default fills an unset name


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class AdmissionRequest(_Wire):
    uid: str = Field(max_length=128)
    operation: str = "CREATE"
    namespace: str | None = None
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = Field(default=None, alias="oldObject")


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


def _deny(uid: str, message: str) -> AdmissionResponse:
    return AdmissionResponse(
        uid=uid,
        allowed=False,
        status=AdmissionStatus(code=400, reason="BadRequest", message=f"qgpu: {message}"),
    )


def _requests(names: Names, pod: dict[str, Any]) -> list[ContainerRequest]:
    return pod_slice_requests(names, parse_pod(pod))


def _amounts(reqs: list[ContainerRequest]) -> list[tuple[str, int, int | None]]:
    return [(cr.container, cr.request.core, cr.request.memory_gib) for cr in reqs]


def review(names: Names, scheduler_name: str, req: AdmissionRequest) -> AdmissionResponse:
    """The admission decision for one request."""
    pod = req.object
    if req.operation not in ("CREATE", "UPDATE") or not pod:
        return AdmissionResponse(uid=req.uid, allowed=True)
    try:
        parsed = parse_pod(pod)  # only a hostile caller sends a pod that does not parse
        if not asks_for_qgpu(names, pod):
            return AdmissionResponse(uid=req.uid, allowed=True)
        reqs = pod_slice_requests(names, parsed)
    except RuleViolation as exc:
        return _deny(req.uid, str(exc))
    if req.operation == "UPDATE":
        try:
            before = _requests(names, req.old_object) if req.old_object else reqs
        except RuleViolation:
            before = []
        if _amounts(before) != _amounts(reqs):
            return _deny(
                req.uid,
                "spec.containers[*].resources: qgpu resources cannot change on an existing "
                "pod (its slices are allocated once): delete and recreate it",
            )
        return AdmissionResponse(uid=req.uid, allowed=True)
    named = parsed.spec.scheduler_name or ""
    if named == scheduler_name:
        return AdmissionResponse(uid=req.uid, allowed=True)
    if named not in UNSET_SCHEDULERS:
        return _deny(
            req.uid,
            str(
                RuleViolation(
                    "spec.schedulerName",
                    named,
                    f"pods that ask for qgpu resources must be scheduled by {scheduler_name} "
                    "(leave schedulerName unset)",
                )
            ),
        )
    ops = [{"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}]
    return AdmissionResponse(
        uid=req.uid,
        allowed=True,
        patch=base64.b64encode(json.dumps(ops).encode()).decode(),
        patchType="JSONPatch",
    )


def _reply(status: int, body: BaseModel | dict[str, Any]) -> Response:
    if isinstance(body, BaseModel):
        data = body.model_dump_json(by_alias=True, exclude_none=True).encode()
    else:
        data = json.dumps(body).encode()
    return Response(data, status_code=status, media_type="application/json")


def mutate_body(names: Names, scheduler_name: str, raw: bytes) -> tuple[int, BaseModel | dict]:
    """(HTTP status, reply) for one raw request body."""
    try:
        review_in = AdmissionReview.model_validate_json(raw)
    except ValidationError as exc:
        return 400, first_violation(exc).as_dict()
    if review_in.request is None:
        return 400, RuleViolation("request", None, "an AdmissionReview needs a request").as_dict()
    return 200, AdmissionReview(response=review(names, scheduler_name, review_in.request))


def create_app(names: Names, scheduler_name: str = DEFAULT_SCHEDULER) -> FastAPI:
    app = FastAPI(title="qgpu mutating webhook", docs_url=None, redoc_url=None)

    @app.post(
        "/mutate",
        openapi_extra=json_body_openapi(AdmissionReview),
    )
    async def mutate(request: Request) -> Response:
        status, body = mutate_body(names, scheduler_name, await request.body())
        return _reply(status, body)

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app
