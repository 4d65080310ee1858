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
A pod CREATE that presets what only the qgpu scheduler's bind writes is denied, naming the
field: the assignment / claim annotations (``<prefix>/qgpu-assignment``,
``<prefix>/qgpu-allocated``) on any pod the webhook sees, and ``spec.nodeName`` on a pod
that asks for qgpu resources (it would skip the scheduler and the extender; the device
plugin would hand out whatever GPU the forged assignment names). The bind itself is a
``pods/binding`` CREATE and the device plugin's claim a plain pod UPDATE; neither is routed
here (docs/kubernetes.md, trust model).
For a pod UPDATE the same request rules hold (denied when broken) and the qgpu amounts may
not change (a slice is allocated once); nothing is patched. Pods without qgpu resources,
and other operations, are allowed untouched.

The body is read raw and parsed with pydantic's JSON parser: malformed JSON, lone
surrogates, numbers past 4,300 digits and nesting deeper than its limit are refused as
data. A body that is not an AdmissionReview gets HTTP 400 with field, value and rule; a
review whose pod is malformed (``containers: "x"``) gets a denial naming the field.

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
from pathlib import PurePosixPath
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k8s_bridge import compat
from k8s_bridge.http_errors import ViolationBody, errors, name_http_errors
from k8s_bridge.http_serving import json_body_openapi
from k8s_bridge.metrics import WebhookMetrics, exposition, rule_key
from k8s_bridge.pod_guard import DEFAULT_NODE_STATE_DIR, check_pod
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


def _deny(uid: str, exc: RuleViolation, warnings: list[str]) -> AdmissionResponse:
    return AdmissionResponse(
        uid=uid,
        allowed=False,
        status=AdmissionStatus(code=400, reason="BadRequest", message=f"qgpu: {exc}"),
        warnings=warnings or None,
    )


def _requests(names: Names, pod: dict[str, Any]) -> list[ContainerRequest]:
    return pod_slice_requests(names, parse_pod(pod))


def _amounts(reqs: list[ContainerRequest]) -> list[tuple[str, int, int | None]]:
    return [(cr.container, cr.request.core, cr.request.memory_gib) for cr in reqs]


Decision = tuple[AdmissionResponse, RuleViolation | None, list[str]]


def _preset_binding(names: Names, pod: dict[str, Any], asks: bool) -> RuleViolation | None:
    """What only the qgpu scheduler's bind (and the device plugin) may write, preset by the
    pod's author: the assignment / claim annotations (on any pod), and, on a pod that asks
    for qgpu resources (`asks`), ``spec.nodeName`` (which skips the scheduler and extender)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if not asks:
        for key in (
            names.assignment_annotation,
            names.assignment_mac_annotation,
            names.allocated_annotation,
        ):
            if key in annotations:
                return RuleViolation(
                    f"metadata.annotations[{key}]",
                    annotations[key],
                    "only the qgpu scheduler's bind and the device plugin may set it: "
                    "remove it (a pod cannot choose its own GPU or slice)",
                )
        return None
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        return RuleViolation(
            "spec.nodeName",
            node,
            "a pod that asks for qgpu resources is placed by the qgpu scheduler's bind: "
            "leave nodeName unset (use a nodeSelector or node affinity to choose nodes)",
        )
    return None


def _decide_update(names: Names, req: AdmissionRequest) -> Decision:
    """An UPDATE (in-place resize): the request rules hold and the qgpu amounts stay."""
    raw, old = req.object or {}, req.old_object
    if not asks_for_qgpu(names, raw) and not (old and asks_for_qgpu(names, old)):
        return AdmissionResponse(uid=req.uid, allowed=True), None, []
    try:
        reqs = _requests(names, raw)
    except RuleViolation as exc:
        return _deny(req.uid, exc, []), exc, []
    try:
        before = _requests(names, old) if old else reqs
    except RuleViolation:
        before = []
    if _amounts(before) != _amounts(reqs):
        exc = RuleViolation(
            "spec.containers[*].resources",
            None,
            "qgpu resources cannot change on an existing pod (its slices are allocated "
            "once): delete and recreate it",
        )
        return _deny(req.uid, exc, []), exc, []
    return AdmissionResponse(uid=req.uid, allowed=True), None, []


def decide(
    names: Names,
    scheduler_name: str,
    req: AdmissionRequest,
    compat_mode: bool = False,
    state_dir: PurePosixPath | None = DEFAULT_NODE_STATE_DIR,
) -> Decision:
    """The admission decision for one request, the rule a denial broke, and the sources
    (HAMi, Koordinator, annotation) of what compat mode translated."""
    raw = req.object
    if req.operation not in ("CREATE", "UPDATE") or not raw:
        return AdmissionResponse(uid=req.uid, allowed=True), None, []
    try:
        parse_pod(raw)  # only a hostile caller sends a pod that does not parse
    except RuleViolation as exc:
        return _deny(req.uid, exc, []), exc, []
    if req.operation == "UPDATE":
        return _decide_update(names, req)
    forged = _preset_binding(names, raw, asks=False)
    if forged is not None:
        return _deny(req.uid, forged, []), forged, []
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
        check_pod(names, parse_pod(pod), state_dir)  # the requests, then what would override
        preset = _preset_binding(names, pod, asks=True)
        if preset is not None:
            raise preset
    except RuleViolation as exc:
        return _deny(req.uid, exc, warnings), exc, []
    named = (pod.get("spec") or {}).get("schedulerName") or ""
    if named != scheduler_name:
        if named not in UNSET_SCHEDULERS:
            exc = RuleViolation(
                "spec.schedulerName",
                named,
                f"pods that ask for qgpu resources must be scheduled by {scheduler_name} "
                "(leave schedulerName unset)",
            )
            return _deny(req.uid, exc, warnings), exc, []
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


def _reply(status: int, body: BaseModel | dict[str, Any]) -> Response:
    if isinstance(body, BaseModel):
        data = body.model_dump_json(by_alias=True, exclude_none=True).encode()
    else:
        data = json.dumps(body).encode()
    return Response(data, status_code=status, media_type="application/json")


def review(
    names: Names,
    scheduler_name: str,
    req: AdmissionRequest,
    compat_mode: bool = False,
    state_dir: PurePosixPath | None = DEFAULT_NODE_STATE_DIR,
) -> AdmissionResponse:
    """The admission decision for one request."""
    return decide(names, scheduler_name, req, compat_mode, state_dir)[0]


def create_app(
    names: Names,
    scheduler_name: str = DEFAULT_SCHEDULER,
    compat_mode: bool = False,
    metrics: WebhookMetrics | None = None,
    state_dir: PurePosixPath | None = DEFAULT_NODE_STATE_DIR,
) -> FastAPI:
    app = FastAPI(
        title="qgpu mutating webhook",
        docs_url=None,
        redoc_url=None,
        responses=errors(ViolationBody),
    )
    name_http_errors(app)
    m = metrics or WebhookMetrics()
    app.state.metrics = m

    @app.post(
        "/mutate",
        openapi_extra=json_body_openapi(AdmissionReview),
        responses={
            200: {"model": AdmissionReview, "description": "the review with its response"},
            400: {"model": ViolationBody, "description": "not an AdmissionReview"},
        },
    )
    async def mutate(request: Request) -> Response:
        with m.timed("mutate"):
            raw = await request.body()
            try:
                review_in = AdmissionReview.model_validate_json(raw)
                if review_in.request is None:
                    raise RuleViolation("request", None, "an AdmissionReview needs a request")
            except (ValidationError, RuleViolation) as exc:
                bad = first_violation(exc) if isinstance(exc, ValidationError) else exc
                m.admissions.labels("denied").inc()
                m.denials.labels("request").inc()
                return _reply(400, bad.as_dict())
            resp, broken, sources = decide(
                names, scheduler_name, review_in.request, compat_mode, state_dir
            )
            if broken is not None:
                m.admissions.labels("denied").inc()
                m.denials.labels(rule_key(broken)).inc()
            else:
                m.admissions.labels("mutated" if resp.patch else "allowed").inc()
            for source in sources:
                m.translations.labels(source).inc()
            return _reply(200, AdmissionReview(response=resp))

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics_endpoint() -> Response:
        body, content_type = exposition(m.registry)
        return Response(body, media_type=content_type)

    return app
