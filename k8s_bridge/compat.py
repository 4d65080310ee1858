"""Compatibility mode: HAMi and Koordinator GPU-sharing names translated into qgpu slices.

Owns the mapping from other projects' pod names to qgpu's own (`Names`), and nothing of
what they mean: the translated resources are then validated by `pod_slice_requests`, whose
rules are the core's (`qgpu.model.SliceRequest`). A translation is either exact or refused
with the rule (a `RuleViolation` naming the container, the foreign name and the value):

HAMi (per container; ``nvidia.com/gpu`` is the number of vGPUs, default 1; each vGPU
takes ``nvidia.com/gpucores`` percent and ``nvidia.com/gpumem`` MiB or
``nvidia.com/gpumem-percentage`` percent of ONE card):

=====================================================  =======================================
1 vGPU, gpucores 1..99, gpumem M MiB                    qgpu-core = cores, qgpu-memory =
                                                        ceil(M / 1024) GiB (rounded UP: the
                                                        slice never gets less than asked)
1 vGPU, gpucores 1..99, gpumem-percentage P (or none)   qgpu-memory-percentage = P (100)
N vGPUs, gpucores 100, no memory cap                    qgpu-core = 100 x N (whole GPUs)
2 vGPUs, gpucores 51..99                                qgpu-core = 2 x cores (a multi-GPU
                                                        share: refused by the Kubernetes rule
                                                        until the interposer caps 2 GPUs)
=====================================================  =======================================

Refused: no ``nvidia.com/gpucores`` (HAMi's default is "no compute limit", which a qgpu
share cannot express), gpucores 0, a memory cap on whole GPUs, 3+ vGPUs that are not whole
GPUs, 2 vGPUs of 50% or less, both gpumem and gpumem-percentage.

Koordinator: ``koordinator.sh/gpu-core`` (percent; multiples of 100 are whole GPUs),
``koordinator.sh/gpu-memory`` (a byte quantity, e.g. ``8Gi``: GiB rounded up),
``koordinator.sh/gpu-memory-ratio`` (percent of the card; 100 x N with whole GPUs) and
the shorthand ``koordinator.sh/gpu`` (core and memory ratio alike).

Annotations: ``hami.io/node-scheduler-policy`` / ``hami.io/gpu-scheduler-policy``
(binpack, spread) -> ``<prefix>/qgpu-placement`` / ``<prefix>/qgpu-gpu-placement``;
``nvidia.com/use-gpuuuid`` / ``nvidia.com/nouse-gpuuuid`` -> include / exclude UUIDs;
``nvidia.com/use-gputype`` -> ``<prefix>/qgpu-model`` (both match a substring of the model,
case-insensitively); the QoS annotation ``metax-tech.com/sgpu-qos-policy`` (MetaX sGPU
under Koordinator: best-effort, fixed-share, burst-share) -> ``<prefix>/qgpu-schedule-policy``.
``hami.io/gpu-scheduler-policy: topology-aware`` and ``nvidia.com/nouse-gputype`` have no
qgpu equivalent and are refused.

`translate` returns the JSON-patch operations that rewrite the pod (foreign resources
removed, qgpu resources and annotations added, and ``<prefix>/qgpu-compat-translation``
recording what was done) and one warning line per translation, for the admission response.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from k8s_bridge.resources import Names
from qgpu.errors import RuleViolation
from qgpu.model import WHOLE_GPU_CORE, IsolationPolicy, PlacementPolicy
from qgpu.units import BYTES_PER_GIB, MIB_PER_GIB

HAMI_COUNT = "nvidia.com/gpu"
HAMI_MEMORY = "nvidia.com/gpumem"
HAMI_MEMORY_PERCENT = "nvidia.com/gpumem-percentage"
HAMI_CORES = "nvidia.com/gpucores"
KOORD_GPU = "koordinator.sh/gpu"
KOORD_CORE = "koordinator.sh/gpu-core"
KOORD_MEMORY = "koordinator.sh/gpu-memory"
KOORD_RATIO = "koordinator.sh/gpu-memory-ratio"

HAMI_RESOURCES = (HAMI_MEMORY, HAMI_MEMORY_PERCENT, HAMI_CORES)
KOORD_RESOURCES = (KOORD_GPU, KOORD_CORE, KOORD_MEMORY, KOORD_RATIO)
FOREIGN_RESOURCES = HAMI_RESOURCES + KOORD_RESOURCES
"""Resource names that mean a GPU share in another project (``nvidia.com/gpu`` alone is the
NVIDIA device plugin's whole GPU and is not one of them)."""

HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
HAMI_GPU_POLICY = "hami.io/gpu-scheduler-policy"
HAMI_USE_UUID = "nvidia.com/use-gpuuuid"
HAMI_NOUSE_UUID = "nvidia.com/nouse-gpuuuid"
HAMI_USE_TYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_TYPE = "nvidia.com/nouse-gputype"
QOS_ANNOTATION = "metax-tech.com/sgpu-qos-policy"
FOREIGN_ANNOTATIONS = (
    HAMI_NODE_POLICY,
    HAMI_GPU_POLICY,
    HAMI_USE_UUID,
    HAMI_NOUSE_UUID,
    HAMI_USE_TYPE,
    HAMI_NOUSE_TYPE,
    QOS_ANNOTATION,
)

_INT = re.compile(r"^\s*[0-9]+\s*$")


def family(resource: str) -> str:
    """``HAMi`` or ``Koordinator``: whose name a foreign resource is."""
    return "Koordinator" if resource.startswith("koordinator.sh/") else "HAMi"


def foreign_in(raw_pod: dict[str, Any]) -> list[tuple[str, str]]:
    """(container name, foreign resource) for every container that asks for one."""
    spec = raw_pod.get("spec") or {}
    out: list[tuple[str, str]] = []
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        names = set(res.get("limits") or {}) | set(res.get("requests") or {})
        out.extend((str(c.get("name", "")), r) for r in FOREIGN_RESOURCES if r in names)
    return out


def foreign_reason(names: Names, raw_pod: dict[str, Any], compat: bool) -> str | None:
    """Why a qgpu node refuses a pod that asks for foreign GPU-sharing names (None: it asks
    for none). Such a pod reached the extender untranslated: on a qgpu node nothing would
    isolate it."""
    found = foreign_in(raw_pod)
    if not found:
        return None
    container, resource = found[0]
    what = f"qgpu: container {container} asks for {resource} ({family(resource)})"
    if compat:
        return (
            f"{what}, untranslated: the qgpu webhook translates HAMi and Koordinator names when "
            "the pod is created (is webhook.enabled set, and was the pod created after it?)"
        )
    return (
        f"{what}, which qgpu nodes do not isolate: enable compat mode (chart value "
        f"compat.enabled) to translate it, or ask for {names.core} and {names.memory}"
    )


@dataclass
class Translation:
    """What compat mode did to one pod."""

    ops: list[dict[str, Any]] = field(default_factory=list)  # JSON patch
    warnings: list[str] = field(default_factory=list)
    pod: dict[str, Any] = field(default_factory=dict)  # the pod after the patch
    record: dict[str, Any] = field(default_factory=dict)  # the annotation's content

    @property
    def changed(self) -> bool:
        return bool(self.ops)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _int(field_name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT.match(value):
        return int(value)
    raise RuleViolation(field_name, value, "must be a plain whole number")


def _bytes(field_name: str, value: Any) -> int:
    from kubernetes.utils import parse_quantity  # the client's own quantity parser

    try:
        q = parse_quantity(value)
    except (ValueError, TypeError) as exc:
        raise RuleViolation(field_name, value, "must be a byte quantity such as 8Gi") from exc
    if q <= 0 or q != int(q):
        raise RuleViolation(field_name, value, "must be a whole number of bytes > 0")
    return int(q)


def _gib_up(n_bytes: int) -> int:
    return math.ceil(n_bytes / BYTES_PER_GIB)


class _Container:
    """One container's foreign amounts (limits; requests, when given, must equal them)."""

    def __init__(self, where: str, c: dict[str, Any]) -> None:
        self.where = where
        res = c.get("resources") or {}
        self.limits: dict[str, Any] = dict(res.get("limits") or {})
        self.requests: dict[str, Any] = dict(res.get("requests") or {})
        for key in set(self.requests) & {*FOREIGN_RESOURCES, HAMI_COUNT}:
            if key not in self.limits:
                raise RuleViolation(
                    f"{where}.resources.requests[{key}]",
                    self.requests[key],
                    "extended resources must be set in limits (requests may be omitted)",
                )
            if str(self.requests[key]) != str(self.limits[key]):
                raise RuleViolation(
                    f"{where}.resources.requests[{key}]",
                    self.requests[key],
                    f"requests must equal limits ({self.limits[key]})",
                )

    def field(self, key: str) -> str:
        return f"{self.where}.resources.limits[{key}]"

    def get(self, key: str) -> Any:
        return self.limits.get(key)

    def has(self, key: str) -> bool:
        return key in self.limits


def _hami(c: _Container) -> tuple[dict[str, int], list[str]]:
    """qgpu resource amounts (by short name) for a HAMi container, and what was rounded."""
    count = _int(c.field(HAMI_COUNT), c.get(HAMI_COUNT)) if c.has(HAMI_COUNT) else 1
    if count < 1:
        raise RuleViolation(c.field(HAMI_COUNT), c.get(HAMI_COUNT), "must be at least 1 vGPU")
    if not c.has(HAMI_CORES):
        raise RuleViolation(
            c.field(HAMI_CORES),
            None,
            "is required in compat mode: without it HAMi puts no compute limit on a shared "
            "GPU, which a qgpu slice cannot express; set it to the share (1..99) or to 100 "
            "for whole GPUs",
        )
    cores = _int(c.field(HAMI_CORES), c.get(HAMI_CORES))
    if not 1 <= cores <= WHOLE_GPU_CORE:
        raise RuleViolation(
            c.field(HAMI_CORES), c.get(HAMI_CORES), "must be 1..100 percent of one GPU"
        )
    if c.has(HAMI_MEMORY) and c.has(HAMI_MEMORY_PERCENT):
        raise RuleViolation(
            c.field(HAMI_MEMORY_PERCENT),
            c.get(HAMI_MEMORY_PERCENT),
            f"cannot be combined with {HAMI_MEMORY} (one memory cap)",
        )
    notes: list[str] = []
    if cores == WHOLE_GPU_CORE:
        pct = c.get(HAMI_MEMORY_PERCENT)
        capped = pct is not None and _int(c.field(HAMI_MEMORY_PERCENT), pct) != 100
        if c.has(HAMI_MEMORY) or capped:
            key = HAMI_MEMORY if c.has(HAMI_MEMORY) else HAMI_MEMORY_PERCENT
            raise RuleViolation(
                c.field(key),
                c.get(key),
                "a memory cap on whole GPUs (nvidia.com/gpucores: 100) has no qgpu equivalent: "
                "whole GPUs get the whole card; drop it, or ask for a share (gpucores < 100)",
            )
        return {"core": WHOLE_GPU_CORE * count}, notes
    if count > 2:
        raise RuleViolation(
            c.field(HAMI_COUNT),
            count,
            "a share spans at most 2 GPUs in qgpu (more vGPUs need nvidia.com/gpucores: 100)",
        )
    if count == 2 and cores * 2 <= WHOLE_GPU_CORE:
        raise RuleViolation(
            c.field(HAMI_CORES),
            cores,
            "2 vGPUs of 50% or less have no qgpu equivalent (a qgpu share over 2 GPUs takes "
            "more than 50% of each: qgpu-core 101..199)",
        )
    out = {"core": cores * count}
    if c.has(HAMI_MEMORY):
        mib = _int(c.field(HAMI_MEMORY), c.get(HAMI_MEMORY))
        if mib < 1:
            raise RuleViolation(c.field(HAMI_MEMORY), mib, "must be at least 1 MiB")
        gib = math.ceil(mib / MIB_PER_GIB)
        if gib * MIB_PER_GIB != mib:
            notes.append(f"{HAMI_MEMORY}={mib} MiB rounded up to {gib} GiB")
        out["memory"] = gib * count
    else:
        pct = c.get(HAMI_MEMORY_PERCENT)
        out["memory_percent"] = _int(c.field(HAMI_MEMORY_PERCENT), pct) if pct is not None else 100
    return out, notes


def _koordinator(c: _Container) -> tuple[dict[str, int], list[str]]:
    notes: list[str] = []
    if c.has(KOORD_GPU):
        others = [k for k in (KOORD_CORE, KOORD_MEMORY, KOORD_RATIO) if c.has(k)]
        if others:
            raise RuleViolation(
                c.field(others[0]), c.get(others[0]), f"cannot be combined with {KOORD_GPU}"
            )
        n = _int(c.field(KOORD_GPU), c.get(KOORD_GPU))
        core, ratio, mem = n, n, None
    else:
        if not c.has(KOORD_CORE):
            key = KOORD_MEMORY if c.has(KOORD_MEMORY) else KOORD_RATIO
            raise RuleViolation(
                c.field(KOORD_CORE),
                None,
                f"is required in compat mode with {key}: a qgpu slice needs a compute share",
            )
        core = _int(c.field(KOORD_CORE), c.get(KOORD_CORE))
        ratio = _int(c.field(KOORD_RATIO), c.get(KOORD_RATIO)) if c.has(KOORD_RATIO) else None
        mem = _bytes(c.field(KOORD_MEMORY), c.get(KOORD_MEMORY)) if c.has(KOORD_MEMORY) else None
        if ratio is not None and mem is not None:
            raise RuleViolation(
                c.field(KOORD_RATIO), ratio, f"cannot be combined with {KOORD_MEMORY}"
            )
    key = KOORD_GPU if c.has(KOORD_GPU) else KOORD_CORE
    if core < 1 or (core > WHOLE_GPU_CORE and core % WHOLE_GPU_CORE):
        raise RuleViolation(
            c.field(key), core, "must be 1..100 percent of one GPU or a multiple of 100"
        )
    if core % WHOLE_GPU_CORE == 0:
        if mem is not None or (ratio is not None and ratio != core):
            bad = KOORD_MEMORY if mem is not None else KOORD_RATIO
            raise RuleViolation(
                c.field(bad),
                c.get(bad),
                f"whole GPUs ({key}={core}) take the whole card: the memory must be absent or "
                f"{KOORD_RATIO}={core}",
            )
        return {"core": core}, notes
    if mem is None and ratio is None:
        raise RuleViolation(
            c.field(KOORD_MEMORY),
            None,
            f"is required for a share (or {KOORD_RATIO}, percent of the card)",
        )
    if mem is not None:
        gib = _gib_up(mem)
        if gib * BYTES_PER_GIB != mem:
            notes.append(f"{KOORD_MEMORY}={c.get(KOORD_MEMORY)} rounded up to {gib} GiB")
        return {"core": core, "memory": gib}, notes
    assert ratio is not None
    return {"core": core, "memory_percent": ratio}, notes


def _annotations(names: Names, ann: dict[str, str]) -> dict[str, str]:
    """The qgpu annotations the foreign ones translate to; RuleViolation when one cannot."""
    out: dict[str, str] = {}

    def placement(key: str, target: str) -> None:
        value = ann[key].strip().lower()
        try:
            out[target] = PlacementPolicy.parse(value, f"metadata.annotations[{key}]").value
        except RuleViolation:
            raise RuleViolation(
                f"metadata.annotations[{key}]",
                ann[key],
                "compat mode translates binpack and spread (qgpu's frag has no HAMi name; "
                "topology-aware has no qgpu equivalent)",
            ) from None

    if HAMI_NODE_POLICY in ann:
        placement(HAMI_NODE_POLICY, names.placement_annotation)
    if HAMI_GPU_POLICY in ann:
        placement(HAMI_GPU_POLICY, names.gpu_placement_annotation)
    if HAMI_USE_UUID in ann:
        out[names.include_annotation] = ann[HAMI_USE_UUID]
    if HAMI_NOUSE_UUID in ann:
        out[names.exclude_annotation] = ann[HAMI_NOUSE_UUID]
    if HAMI_USE_TYPE in ann:
        out[names.model_annotation] = "|".join(
            t.strip() for t in ann[HAMI_USE_TYPE].split(",") if t.strip()
        )
    if HAMI_NOUSE_TYPE in ann:
        raise RuleViolation(
            f"metadata.annotations[{HAMI_NOUSE_TYPE}]",
            ann[HAMI_NOUSE_TYPE],
            "has no qgpu equivalent (qgpu selects GPU models to use, not to avoid): use "
            f"{HAMI_USE_TYPE} or {names.model_annotation}",
        )
    if QOS_ANNOTATION in ann:
        out[names.policy_label] = IsolationPolicy.parse(
            ann[QOS_ANNOTATION], f"metadata.annotations[{QOS_ANNOTATION}]"
        ).value
    for key, value in out.items():
        if key in ann and ann[key] != value:
            raise RuleViolation(
                f"metadata.annotations[{key}]",
                ann[key],
                f"conflicts with the translated value {value!r} of a HAMi/Koordinator annotation",
            )
    return {k: v for k, v in out.items() if ann.get(k) != v}


def translate(names: Names, raw_pod: dict[str, Any]) -> Translation:
    """The pod with HAMi/Koordinator names rewritten to qgpu's, or RuleViolation."""
    pod = copy.deepcopy(raw_pod)
    out = Translation(pod=pod)
    spec = pod.setdefault("spec", {})
    for i, c in enumerate(spec.get("initContainers") or []):
        res = c.get("resources") or {}
        used = set(res.get("limits") or {}) | set(res.get("requests") or {})
        hit = [r for r in FOREIGN_RESOURCES if r in used]
        if hit:
            raise RuleViolation(
                f"spec.initContainers[{i}].resources.limits[{hit[0]}]",
                (res.get("limits") or {}).get(hit[0]),
                "GPU slices are supported on containers, not init containers",
            )
    record: dict[str, Any] = {}
    for i, c in enumerate(spec.get("containers") or []):
        where = f"spec.containers[{i}]"
        cont = _Container(where, c)
        hami = [r for r in HAMI_RESOURCES if cont.has(r) or r in cont.requests]
        koord = [r for r in KOORD_RESOURCES if cont.has(r) or r in cont.requests]
        if not hami and not koord:
            continue
        if hami and koord:
            raise RuleViolation(
                cont.field(koord[0]), cont.get(koord[0]), f"cannot be combined with {hami[0]}"
            )
        mine = [r for r in names.resources if r in cont.limits or r in cont.requests]
        if mine:
            raise RuleViolation(
                cont.field(mine[0]),
                cont.get(mine[0]),
                f"cannot be combined with {(hami or koord)[0]} in one container",
            )
        amounts, notes = _hami(cont) if hami else _koordinator(cont)
        removed = [*(hami or koord), *([HAMI_COUNT] if hami and cont.has(HAMI_COUNT) else [])]
        target = {
            names.core: amounts["core"],
            names.memory: amounts.get("memory"),
            names.memory_percent: amounts.get("memory_percent"),
        }
        added = {k: str(v) for k, v in target.items() if v is not None}
        _rewrite(out, i, c, removed, added)
        before = ", ".join(f"{k}={cont.limits[k]}" for k in removed if k in cont.limits)
        after = ", ".join(f"{k}={v}" for k, v in added.items())
        extra = f" ({'; '.join(notes)})" if notes else ""
        out.warnings.append(
            f"qgpu compat: container {c.get('name')}: {before} -> {after}{extra}"
        )
        source = {k: str(cont.limits[k]) for k in removed if k in cont.limits}
        record[str(c.get("name"))] = {"from": source, "to": added}
    meta = pod.setdefault("metadata", {})
    ann = dict(meta.get("annotations") or {})
    foreign_ann = any(k in ann for k in FOREIGN_ANNOTATIONS)
    translated = _annotations(names, ann) if (record or foreign_ann) else {}
    for key, value in translated.items():
        out.warnings.append(
            f"qgpu compat: annotation {_source_of(key, names)} -> {key}={value}"
        )
    if record or translated:
        if translated:
            record["annotations"] = translated
        new = {**translated, names.compat_annotation: json.dumps(record, sort_keys=True)}
        if not meta.get("annotations"):
            out.ops.append({"op": "add", "path": "/metadata/annotations", "value": new})
        else:
            for key, value in new.items():
                out.ops.append(
                    {"op": "add", "path": f"/metadata/annotations/{_escape(key)}", "value": value}
                )
        meta["annotations"] = {**ann, **new}
    out.record = record
    return out


def _source_of(key: str, names: Names) -> str:
    sources = {
        names.placement_annotation: HAMI_NODE_POLICY,
        names.gpu_placement_annotation: HAMI_GPU_POLICY,
        names.include_annotation: HAMI_USE_UUID,
        names.exclude_annotation: HAMI_NOUSE_UUID,
        names.model_annotation: HAMI_USE_TYPE,
        names.policy_label: QOS_ANNOTATION,
    }
    return sources.get(key, key)


def _rewrite(
    out: Translation, i: int, c: dict[str, Any], removed: list[str], added: dict[str, str]
) -> None:
    """Patch ops (and the same change on `c`): foreign names out, qgpu names into limits."""
    res = c.setdefault("resources", {})
    base = f"/spec/containers/{i}/resources"
    for part in ("limits", "requests"):
        values = res.get(part)
        if not values:
            continue
        for key in removed:
            if key in values:
                out.ops.append({"op": "remove", "path": f"{base}/{part}/{_escape(key)}"})
                del values[key]
    limits = res.get("limits")
    if limits is None:
        res["limits"] = dict(added)
        out.ops.append({"op": "add", "path": f"{base}/limits", "value": dict(added)})
        return
    for key, value in added.items():
        limits[key] = value
        out.ops.append({"op": "add", "path": f"{base}/limits/{_escape(key)}", "value": value})
