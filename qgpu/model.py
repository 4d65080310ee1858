"""The slice model (DESIGN.md §1): requests, devices, node inventories and allocations.

This module is the single source of truth for the slice rules. Every adapter (Ray, Dask,
Kubernetes, the node agent, the CLI) validates through `SliceRequest` and the enums here;
every rejection is a `qgpu.errors.RuleViolation` naming the field, the value and the rule.

Rules:
- ``qgpu-core``: integer; 1..99 is a share of one GPU; 100, 200, ... are whole GPUs.
- ``qgpu-memory``: whole GiB >= 1 of one GPU; required for a share; for whole GPUs it is
  optional and, when given, the minimum card size.
- slices per GPU: at most ``floor(card GiB / 4)`` and at most 16 (configurable per node).
- isolation: ``best-effort`` (``be``), ``fixed-share`` (``fs``), ``burst-share`` (``bs``).
- placement: ``binpack``, ``spread``, ``frag`` (fragmentation-aware, `qgpu.frag`) at node
  level and GPU level.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from qgpu.errors import RuleViolation, first_violation
from qgpu.units import CORE_FIELD, MEMORY_FIELD, mib_to_gib_floor, parse_core, parse_memory_gib

DEFAULT_MAX_SLICES_PER_GPU = 16
MIN_GIB_PER_SLICE = 4
WHOLE_GPU_CORE = 100

_T = TypeVar("_T")

CORE_RULE = "must be 1..99 (a share of one GPU) or a multiple of 100 (whole GPUs: 100, 200, ...)"


def parse_choice(
    value: Any, choices: Mapping[str, _T], field: str, names: str | None = None
) -> _T:
    """The one case rule for every enumerated value (isolation, placement, owner kinds, and
    the command lines' --backend, --enforcement, --log-level...): a value is matched
    ignoring case and surrounding whitespace against the lower-case names in `choices`
    (``BinPack`` and `` binpack `` are ``binpack``); anything else raises `RuleViolation`
    naming the field, the value and the accepted names (`names`, else the keys)."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in choices:
            return choices[key]
    listed = names if names is not None else ", ".join(choices)
    raise RuleViolation(field, value, f"must be one of {listed} (case does not matter)")


class IsolationPolicy(StrEnum):
    """How a slice's compute is capped on its GPU; memory is always a hard cap."""

    BEST_EFFORT = "best-effort"
    FIXED_SHARE = "fixed-share"
    BURST_SHARE = "burst-share"

    @property
    def abbreviation(self) -> str:
        return _ISOLATION_ABBREVIATIONS_REV[self]

    @classmethod
    def parse(cls, value: Any, field: str = "isolation") -> IsolationPolicy:
        if isinstance(value, IsolationPolicy):
            return value
        table = {m.value: m for m in cls} | _ISOLATION_ABBREVIATIONS
        names = ", ".join(f"{m.value} ({m.abbreviation})" for m in cls)
        return parse_choice(value, table, field, names)


_ISOLATION_ABBREVIATIONS = {
    "be": IsolationPolicy.BEST_EFFORT,
    "fs": IsolationPolicy.FIXED_SHARE,
    "bs": IsolationPolicy.BURST_SHARE,
}
_ISOLATION_ABBREVIATIONS_REV = {v: k for k, v in _ISOLATION_ABBREVIATIONS.items()}


class PlacementPolicy(StrEnum):
    """Where a slice lands: fill first, emptiest first, or fragmentation-aware."""

    BINPACK = "binpack"
    SPREAD = "spread"
    FRAG = "frag"

    @classmethod
    def parse(cls, value: Any, field: str = "placement") -> PlacementPolicy:
        if isinstance(value, PlacementPolicy):
            return value
        return parse_choice(value, {m.value: m for m in cls}, field)


DEFAULT_PLACEMENT = PlacementPolicy.FRAG  # measured best on the Alibaba trace (docs/placement.md)
DEFAULT_ISOLATION = IsolationPolicy.BEST_EFFORT


def _isolation(value: Any) -> Any:
    return None if value is None else IsolationPolicy.parse(value)


def _placement(field: str):
    def parse(value: Any) -> Any:
        return None if value is None else PlacementPolicy.parse(value, field)

    return parse


def _core(value: Any) -> int:
    core = parse_core(value)
    if core < 1 or (core >= WHOLE_GPU_CORE and core % WHOLE_GPU_CORE):
        raise RuleViolation(CORE_FIELD, value, CORE_RULE)
    return core


def _memory(value: Any) -> Any:
    return None if value is None else parse_memory_gib(value)


_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _uuid_list(field: str):
    def parse(value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [v for v in re.split(r"[,\s]+", value) if v]
        if not isinstance(value, list | tuple | set | frozenset):
            raise RuleViolation(field, value, "must be a list of GPU UUIDs")
        out = []
        for item in value:
            if not isinstance(item, str) or not _UUID_RE.match(item):
                raise RuleViolation(field, item, "must be a GPU UUID such as GPU-5f3c...")
            out.append(item)
        return out

    return parse


def _model_constraint(value: Any) -> Any:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise RuleViolation("model", value, "must be GPU model names separated by '|'")
    parts = [p.strip() for p in value.split("|")]
    if any(not p or not re.fullmatch(r"[A-Za-z0-9 ._-]+", p) for p in parts):
        raise RuleViolation(
            "model", value, "must be GPU model names separated by '|', e.g. 'T4|V100M32'"
        )
    return "|".join(parts)


class SliceRequest(BaseModel):
    """One request for a slice of one GPU (or for whole GPUs on one node)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    core: Annotated[int, BeforeValidator(_core)] = Field(
        validation_alias=AliasChoices("core", CORE_FIELD),
        description="qgpu-core: 1..99 = percent of one GPU; 100, 200, ... = whole GPUs",
    )
    memory_gib: Annotated[int | None, BeforeValidator(_memory)] = Field(
        default=None,
        validation_alias=AliasChoices("memory_gib", "memory", MEMORY_FIELD),
        description="qgpu-memory: GiB of one GPU (required for a share)",
    )
    isolation: Annotated[IsolationPolicy | None, BeforeValidator(_isolation)] = Field(
        default=None, description="compute isolation; None = the node's default"
    )
    placement: Annotated[PlacementPolicy | None, BeforeValidator(_placement("placement"))] = Field(
        default=None, description="node-level placement; None = cluster default"
    )
    gpu_placement: Annotated[
        PlacementPolicy | None, BeforeValidator(_placement("gpu_placement"))
    ] = Field(default=None, description="GPU-level placement; None = same as placement")
    model: Annotated[str | None, BeforeValidator(_model_constraint)] = Field(
        default=None, description="allowed GPU models, '|'-separated (e.g. 'T4|V100M32')"
    )
    include_uuids: Annotated[list[str], BeforeValidator(_uuid_list("include_uuids"))] = Field(
        default_factory=list, description="only these GPUs"
    )
    exclude_uuids: Annotated[list[str], BeforeValidator(_uuid_list("exclude_uuids"))] = Field(
        default_factory=list, description="never these GPUs"
    )
    cpu_milli: int = Field(default=0, ge=0, description="host CPU the workload needs (milli)")
    host_memory_mib: int = Field(default=0, ge=0, description="host memory it needs (MiB)")

    @model_validator(mode="after")
    def _memory_required_for_share(self) -> Self:
        if not self.is_whole_gpu and self.memory_gib is None:
            raise RuleViolation(MEMORY_FIELD, None, "is required for a share (qgpu-core 1..99)")
        overlap = set(self.include_uuids) & set(self.exclude_uuids)
        if overlap:
            raise RuleViolation(
                "exclude_uuids", sorted(overlap)[0], "a GPU cannot be both included and excluded"
            )
        return self

    @classmethod
    def parse(cls, value: SliceRequest | Mapping[str, Any], where: str = "request") -> SliceRequest:
        """Validate a mapping (or pass a request through); a broken rule raises
        `RuleViolation` naming the field, the value and the rule — the one entry point
        adapters use for requests that arrive as plain data."""
        if isinstance(value, SliceRequest):
            return value
        if not isinstance(value, Mapping):
            raise RuleViolation(where, value, "must be a mapping such as {'core': 30, 'memory': 8}")
        try:
            return cls.model_validate(dict(value))
        except ValidationError as exc:
            raise first_violation(exc) from exc

    @property
    def is_whole_gpu(self) -> bool:
        return self.core >= WHOLE_GPU_CORE

    @property
    def gpu_count(self) -> int:
        return self.core // WHOLE_GPU_CORE if self.is_whole_gpu else 1

    @property
    def core_per_gpu(self) -> int:
        return WHOLE_GPU_CORE if self.is_whole_gpu else self.core

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(self.model.split("|")) if self.model else ()

    def effective_isolation(self, node_default: IsolationPolicy | None = None) -> IsolationPolicy:
        return self.isolation or node_default or DEFAULT_ISOLATION

    def check_against(self, gpu: GpuDevice) -> None:
        """Raise RuleViolation when this request can never fit `gpu` (whatever its load)."""
        self.check_card_memory(gpu.memory_gib, f"{gpu.memory_gib} GiB on {gpu.model} {gpu.uuid}")

    def check_card_memory(self, card_gib: int, card: str) -> None:
        """Raise RuleViolation when this request asks more memory than a card of `card_gib`
        GiB holds; `card` says which card that is, in the message's parentheses."""
        if self.memory_gib is not None and self.memory_gib > card_gib:
            raise RuleViolation(MEMORY_FIELD, self.memory_gib, f"must not exceed the card ({card})")

    def to_resources(self) -> dict[str, int]:
        """The request as resource-name amounts (qgpu-core, qgpu-memory)."""
        out = {CORE_FIELD: self.core}
        if self.memory_gib is not None:
            out[MEMORY_FIELD] = self.memory_gib
        return out


class GpuHealth(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class GpuDevice(BaseModel):
    """One physical GPU as discovered on a node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uuid: str = Field(min_length=1, max_length=128)
    index: int = Field(ge=0)
    model: str = Field(min_length=1, description="short model name, e.g. H100-80GB or T4")
    memory_mib: int = Field(gt=0, description="the card's memory in MiB")
    sm_count: int = Field(default=0, ge=0)
    numa_node: int | None = None
    health: GpuHealth = GpuHealth.HEALTHY
    health_reason: str | None = None

    @property
    def memory_gib(self) -> int:
        return mib_to_gib_floor(self.memory_mib)

    @property
    def healthy(self) -> bool:
        return self.health is GpuHealth.HEALTHY

    def max_slices(self, configured: int = DEFAULT_MAX_SLICES_PER_GPU) -> int:
        """At most floor(card GiB / 4) slices, and at most `configured` (16 by default)."""
        return max(1, min(configured, self.memory_gib // MIN_GIB_PER_SLICE))

    def matches_model(self, names: tuple[str, ...]) -> bool:
        if not names:
            return True
        mine = self.model.lower()
        return any(n.lower() == mine or n.lower() in mine for n in names)


class NodeInventory(BaseModel):
    """A node and its GPUs (plus, optionally, host CPU and memory for placement)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    gpus: list[GpuDevice] = Field(default_factory=list)
    cpu_milli: int | None = Field(default=None, ge=0)
    memory_mib: int | None = Field(default=None, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    max_slices_per_gpu: int = Field(default=DEFAULT_MAX_SLICES_PER_GPU, ge=1, le=64)
    default_isolation: IsolationPolicy = DEFAULT_ISOLATION

    @field_validator("default_isolation", mode="before")
    @classmethod
    def _parse_isolation(cls, value: Any) -> IsolationPolicy:
        return IsolationPolicy.parse(value, "default_isolation")

    @model_validator(mode="after")
    def _unique_gpus(self) -> Self:
        seen: set[str] = set()
        for gpu in self.gpus:
            if gpu.uuid in seen:
                raise RuleViolation("gpus.uuid", gpu.uuid, "GPU UUIDs must be unique on a node")
            seen.add(gpu.uuid)
        return self


class OwnerKind(StrEnum):
    """Who holds a slice; the node agent's reconcile asks a checker per kind if it lives."""

    PID = "pid"
    RAY_ACTOR = "ray-actor"
    RAY_TASK = "ray-task"
    POD = "pod"
    DASK_WORKER = "dask-worker"
    MANUAL = "manual"


class Owner(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: OwnerKind = OwnerKind.MANUAL
    id: str = Field(default="", max_length=256)
    meta: dict[str, str] = Field(default_factory=dict)

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> OwnerKind:
        if isinstance(value, OwnerKind):
            return value
        return parse_choice(value, {k.value: k for k in OwnerKind}, "owner.kind")


class Allocation(BaseModel):
    """A placed slice: which node and GPU(s), with what caps, held by whom."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slice_id: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    node: str
    gpu_uuids: list[str] = Field(min_length=1)
    core: int = Field(description="per GPU: the share, or 100 for whole GPUs")
    memory_gib: int = Field(ge=1, description="per GPU memory cap in GiB")
    isolation: IsolationPolicy = DEFAULT_ISOLATION
    owner: Owner = Field(default_factory=Owner)
    created_at: float = Field(default_factory=time.time)

    @property
    def is_whole_gpu(self) -> bool:
        return self.core >= WHOLE_GPU_CORE
