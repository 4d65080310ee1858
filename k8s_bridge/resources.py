"""Kubernetes names and pod parsing: what a pod asks for, in the core's terms.

Owns:
- `Names`: the resource names (``<prefix>/qgpu-core``, ``<prefix>/qgpu-memory``), the node
  label ``<prefix>/qgpu-schedule-policy`` and every annotation key of the protocol, all
  derived from one prefix (default ``tke.cloud.tencent.com``, so TKE qGPU manifests run
  unchanged).
- `PodModel` and friends: the pydantic view of the parts of a v1.Pod this bridge reads.
- `pod_slice_requests()`: a pod's per-container `qgpu.model.SliceRequest`s. Only the
  Kubernetes-specific rules live here (quantities are plain integers because extended
  resources count device IDs; limits are required and requests, when given, equal them;
  no qgpu resources in init containers); the slice rules themselves (memory >= 1 GiB,
  core 1..99 or a multiple of 100) are the core's, raised as `RuleViolation`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qgpu.errors import RuleViolation, echo, first_violation
from qgpu.model import IsolationPolicy, SliceRequest

DEFAULT_PREFIX = "tke.cloud.tencent.com"
_PREFIX_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_INT_RE = re.compile(r"^\s*[0-9]+\s*$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"
)
MAX_AMOUNT_DIGITS = 18  # an int64; longer amounts go to the core's rule as written


TERMINATED_PHASES = ("Succeeded", "Failed")  # a pod in these holds no GPU any more


@dataclass(frozen=True)
class Names:
    """Every Kubernetes name the bridge uses, derived from the resource prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix) or len(self.prefix) > 253:
            raise RuleViolation("prefix", self.prefix, "must be a DNS subdomain, e.g. qgpu.io")

    @property
    def core(self) -> str:
        return f"{self.prefix}/qgpu-core"

    @property
    def memory(self) -> str:
        return f"{self.prefix}/qgpu-memory"

    @property
    def memory_percent(self) -> str:
        """Memory as a percentage of the card: an extender-managed resource (no device IDs;
        kube-scheduler and kubelet leave it to the extender)."""
        return f"{self.prefix}/qgpu-memory-percentage"

    @property
    def slices_label(self) -> str:
        """Node label: slices one GPU may hold (floor-gib or 1..16), overriding the chart."""
        return f"{self.prefix}/qgpu-slices-per-gpu"

    @property
    def compat_annotation(self) -> str:
        """Pod annotation set by the webhook in compat mode: what it translated, and from."""
        return f"{self.prefix}/qgpu-compat-translation"

    @property
    def policy_label(self) -> str:
        """Node label (and pod annotation override) for the isolation policy."""
        return f"{self.prefix}/qgpu-schedule-policy"

    @property
    def placement_annotation(self) -> str:
        """Pod annotation: node-level placement policy override."""
        return f"{self.prefix}/qgpu-placement"

    @property
    def gpu_placement_annotation(self) -> str:
        """Pod annotation: GPU-level placement policy override."""
        return f"{self.prefix}/qgpu-gpu-placement"

    @property
    def model_annotation(self) -> str:
        return f"{self.prefix}/qgpu-model"

    @property
    def include_annotation(self) -> str:
        return f"{self.prefix}/qgpu-include-uuids"

    @property
    def exclude_annotation(self) -> str:
        return f"{self.prefix}/qgpu-exclude-uuids"

    @property
    def assignment_annotation(self) -> str:
        """Pod annotation set by the Binding: the per-container GPU assignment (JSON)."""
        return f"{self.prefix}/qgpu-assignment"

    @property
    def assignment_mac_annotation(self) -> str:
        """Pod annotation set by the Binding: the extender's MAC of the assignment
        (`k8s_bridge.assignment_mac`), which the device plugin checks."""
        return f"{self.prefix}/qgpu-assignment-mac"

    @property
    def allocated_annotation(self) -> str:
        """Pod annotation written by the device plugin: which parts kubelet allocated."""
        return f"{self.prefix}/qgpu-allocated"

    @property
    def inventory_annotation(self) -> str:
        """Node annotation published by the device plugin: the node's GPUs (JSON)."""
        return f"{self.prefix}/qgpu-inventory"

    @property
    def lock_annotation(self) -> str:
        """Node annotation: the per-node bind lock (holder + expiry)."""
        return f"{self.prefix}/qgpu-node-lock"

    @property
    def epoch_annotation(self) -> str:
        """Node annotation: bumped by every bind, so a stale extender view is detected."""
        return f"{self.prefix}/qgpu-node-epoch"

    def is_qgpu(self, resource: str) -> bool:
        return resource in (self.core, self.memory, self.memory_percent)

    @property
    def resources(self) -> tuple[str, str, str]:
        return (self.core, self.memory, self.memory_percent)


def dns_label(field: str, value: Any) -> str:
    """A namespace (RFC 1123 label: lower-case alphanumerics and '-', at most 63)."""
    if not isinstance(value, str) or not _DNS_LABEL_RE.match(value):
        raise RuleViolation(
            field, value, "must be a DNS label (a-z, 0-9 and '-', at most 63, e.g. default)"
        )
    return value


def dns_subdomain(field: str, value: Any) -> str:
    """A pod or node name (RFC 1123 subdomain: labels joined by '.', at most 253)."""
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN_RE.match(value):
        raise RuleViolation(
            field,
            value,
            "must be a DNS subdomain (a-z, 0-9, '-' and '.', at most 253, e.g. worker-0)",
        )
    return value


# --- the v1.Pod subset we read -----------------------------------------------------------


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResourceRequirements(_Loose):
    limits: dict[str, Any] | None = None
    requests: dict[str, Any] | None = None


class ContainerModel(_Loose):
    name: str
    resources: ResourceRequirements | None = None
    env: list[dict[str, Any]] | None = None
    env_from: list[dict[str, Any]] | None = Field(default=None, alias="envFrom")
    volume_mounts: list[dict[str, Any]] | None = Field(default=None, alias="volumeMounts")
    security_context: dict[str, Any] | None = Field(default=None, alias="securityContext")


class PodSpecModel(_Loose):
    containers: list[ContainerModel] = Field(default_factory=list)
    init_containers: list[ContainerModel] | None = Field(default=None, alias="initContainers")
    scheduler_name: str | None = Field(default=None, alias="schedulerName")
    node_name: str | None = Field(default=None, alias="nodeName")
    security_context: dict[str, Any] | None = Field(default=None, alias="securityContext")
    host_pid: bool | None = Field(default=None, alias="hostPID")
    volumes: list[dict[str, Any]] | None = None


class ObjectMetaModel(_Loose):
    name: str = ""
    generate_name: str | None = Field(default=None, alias="generateName")
    namespace: str = "default"
    uid: str = ""
    resource_version: str | None = Field(default=None, alias="resourceVersion")
    creation_timestamp: str | None = Field(default=None, alias="creationTimestamp")
    deletion_timestamp: str | None = Field(default=None, alias="deletionTimestamp")
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class PodStatusModel(_Loose):
    phase: str | None = None


class PodModel(_Loose):
    """The parts of a v1.Pod the bridge reads (unknown fields are ignored)."""

    metadata: ObjectMetaModel = Field(default_factory=ObjectMetaModel)
    spec: PodSpecModel = Field(default_factory=PodSpecModel)
    status: PodStatusModel | None = None

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def annotations(self) -> dict[str, str]:
        return self.metadata.annotations or {}

    @property
    def terminated(self) -> bool:
        phase = self.status.phase if self.status else None
        return phase in TERMINATED_PHASES


def parse_pod(raw: dict[str, Any]) -> PodModel:
    try:
        return PodModel.model_validate(raw)
    except ValidationError as exc:
        raise first_violation(exc) from exc


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerRequest:
    """One container's slice request (the core's SliceRequest) and its name."""

    container: str
    request: SliceRequest


def _amount(field: str, value: Any) -> int | str:
    """A plain whole number; one longer than an int64 is passed on as written, for the
    core's range rule to refuse (and name)."""
    if isinstance(value, bool):
        raise RuleViolation(field, value, "must be a whole number")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INT_RE.match(value):
        digits = value.strip().lstrip("0")
        return int(value) if len(digits) <= MAX_AMOUNT_DIGITS else value.strip()
    raise RuleViolation(
        field,
        value,
        "must be a plain whole number (extended resources count device IDs: "
        "qgpu-memory '8' means 8 GiB, '8Gi' is not accepted)",
    )


def _container_amounts(names: Names, c: ContainerModel, where: str) -> dict[str, int | str]:
    res = c.resources or ResourceRequirements()
    limits = {k: v for k, v in (res.limits or {}).items() if names.is_qgpu(k)}
    requests = {k: v for k, v in (res.requests or {}).items() if names.is_qgpu(k)}
    out: dict[str, int | str] = {}
    for key in sorted(set(limits) | set(requests)):
        field = f"{where}.resources.limits[{key}]"
        if key not in limits:
            raise RuleViolation(
                f"{where}.resources.requests[{key}]",
                requests[key],
                "extended resources must be set in limits (requests may be omitted)",
            )
        limit = _amount(field, limits[key])
        if key in requests:
            request = _amount(f"{where}.resources.requests[{key}]", requests[key])
            if request != limit:
                raise RuleViolation(
                    f"{where}.resources.requests[{key}]",
                    requests[key],
                    f"requests must equal limits ({echo(limits[key])})",
                )
        out[key] = limit
    return out


@dataclass(frozen=True)
class PodOverrides:
    """Per-pod policy and GPU-selection overrides read from the pod's annotations."""

    isolation: IsolationPolicy | None = None
    placement: str | None = None
    gpu_placement: str | None = None
    model: str | None = None
    include_uuids: str | None = None
    exclude_uuids: str | None = None


def pod_overrides(names: Names, pod: PodModel) -> PodOverrides:
    ann = pod.annotations
    iso = ann.get(names.policy_label)
    return PodOverrides(
        isolation=IsolationPolicy.parse(iso, names.policy_label) if iso else None,
        placement=ann.get(names.placement_annotation) or None,
        gpu_placement=ann.get(names.gpu_placement_annotation) or None,
        model=ann.get(names.model_annotation) or None,
        include_uuids=ann.get(names.include_annotation) or None,
        exclude_uuids=ann.get(names.exclude_annotation) or None,
    )


def pod_slice_requests(names: Names, pod: PodModel) -> list[ContainerRequest]:
    """The pod's qgpu requests, one per container that asks; [] when it asks for none.

    Raises RuleViolation (field names the container and resource) on an invalid request.
    """
    for i, c in enumerate(pod.spec.init_containers or []):
        if _container_amounts(names, c, f"spec.initContainers[{i}]"):
            raise RuleViolation(
                f"spec.initContainers[{i}]",
                c.name,
                "qgpu resources are supported on containers, not init containers",
            )
    over: PodOverrides | None = None
    out: list[ContainerRequest] = []
    for i, c in enumerate(pod.spec.containers):
        where = f"spec.containers[{i}]"
        amounts = _container_amounts(names, c, where)
        if not amounts:
            continue
        if names.core not in amounts:
            other = names.memory if names.memory in amounts else names.memory_percent
            raise RuleViolation(
                f"{where}.resources.limits[{names.core}]",
                None,
                f"is required when {other} is set",
            )
        if over is None:
            over = pod_overrides(names, pod)
        raw: dict[str, Any] = {"core": amounts[names.core]}
        if names.memory in amounts:
            raw["memory_gib"] = amounts[names.memory]
        if names.memory_percent in amounts:
            raw["memory_percent"] = amounts[names.memory_percent]
        for key in ("isolation", "placement", "gpu_placement", "model"):
            value = getattr(over, key)
            if value is not None:
                raw[key] = value
        if over.include_uuids:
            raw["include_uuids"] = over.include_uuids
        if over.exclude_uuids:
            raw["exclude_uuids"] = over.exclude_uuids
        fields = {
            "qgpu-core": names.core,
            "core": names.core,
            "qgpu-memory": names.memory,
            "memory_gib": names.memory,
            "qgpu-memory-percentage": names.memory_percent,
            "memory_percent": names.memory_percent,
        }
        try:
            req = SliceRequest.parse(raw, where, multi_gpu_shares=True).require_single_gpu_share(
                "Kubernetes (the device plugin hands a container one capped GPU)"
            )
        except RuleViolation as v:
            if v.field in fields:
                field = f"{where}.resources.limits[{fields[v.field]}]"
            else:
                field = f"{where}: {v.field}"
            raise RuleViolation(field, v.value, v.rule) from v
        out.append(ContainerRequest(c.name, req))
    return out


def asks_for_qgpu(names: Names, raw_pod: Any) -> bool:
    """True when any (init) container mentions a qgpu resource in limits or requests.

    Reads raw JSON of any shape (a malformed pod is not this function's to refuse: it
    answers for the parts that have the expected types)."""
    spec = raw_pod.get("spec") if isinstance(raw_pod, dict) else None
    if not isinstance(spec, dict):
        return False
    for part in ("containers", "initContainers"):
        containers = spec.get(part)
        for c in containers if isinstance(containers, list) else []:
            res = c.get("resources") if isinstance(c, dict) else None
            if not isinstance(res, dict):
                continue
            for kind in ("limits", "requests"):
                amounts = res.get(kind)
                if isinstance(amounts, dict) and any(names.is_qgpu(k) for k in amounts):
                    return True
    return False
