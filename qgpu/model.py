"""The slice model (DESIGN.md §1): requests, devices, node inventories and allocations.

This module is the single source of truth for the slice rules. Every adapter (Ray, Dask,
Kubernetes, the node agent, the CLI) validates through `SliceRequest` and the enums here;
every rejection is a `qgpu.errors.RuleViolation` naming the field, the value and the rule.

Rules:
- ``qgpu-core``: integer; 1..99 is a share of one GPU; 100, 200, ... are whole GPUs;
  101..199 is a multi-GPU share (TKE's multi-card mode): split evenly over ceil(core/100) = 2
  GPUs of one node, rounding down (160 -> 2 x 80; 121 -> 2 x 60), memory likewise
  (60 GiB -> 2 x 30). Each GPU's part is its own slice. Adapters take requests through
  `SliceRequest.parse`, which refuses multi-GPU shares unless the caller can enforce them.
- ``qgpu-memory``: whole GiB >= 1 of one GPU (of each GPU for a multi-GPU share: the total is
  split); required for a share unless ``qgpu-memory-percentage`` is given; for whole GPUs it is
  optional and, when given, the minimum card size.
- ``qgpu-memory-percentage``: 1..100 percent of the card's memory, instead of
  ``qgpu-memory`` (a share only): the cap on a card of G GiB is floor(G * pct / 100) GiB,
  at least 1.
- slices per GPU (`SlicesPerGpu`): ``floor-gib`` (the default: at most ``floor(card GiB / 4)``
  and at most 16) or a fixed count 1..16 whatever the card's memory (MetaX sGPU's rule).
- isolation: ``best-effort`` (``be``), ``fixed-share`` (``fs``), ``burst-share`` (``bs``).
- placement: ``binpack``, ``spread``, ``frag`` (fragmentation-aware, `qgpu.frag`) at node
  level and GPU level.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from qgpu.errors import RuleViolation, first_violation
from qgpu.units import (
    CORE_FIELD,
    MAX_MEMORY_GIB,
    MAX_MEMORY_RULE,
    MEMORY_FIELD,
    mib_to_gib_floor,
    parse_core,
    parse_memory_gib,
)

DEFAULT_MAX_SLICES_PER_GPU = 16
MAX_FIXED_SLICES_PER_GPU = 16
MIN_GIB_PER_SLICE = 4
WHOLE_GPU_CORE = 100
MAX_WHOLE_GPUS = 1024  # per request (one node); far above any node, far below int32 arithmetic
MAX_CORE = MAX_WHOLE_GPUS * WHOLE_GPU_CORE

CORE_LIMIT_RULE = f"must be at most {MAX_CORE} ({MAX_WHOLE_GPUS} whole GPUs)"
MAX_SHARE_GPUS = 2  # a multi-GPU share spans at most this many GPUs (TKE's first version)

_T = TypeVar("_T")

CORE_RULE = (
    "must be 1..99 (a share of one GPU), 101..199 (a share split evenly over 2 GPUs of one "
    "node) or a multiple of 100 (whole GPUs: 100, 200, ...)"
)
MULTI_GPU_SHARE_RULE = (
    "is a share split over 2 GPUs (qgpu-core 101..199), which {where} cannot enforce (the "
    "interposer caps one GPU per process); use 1..99 (a share of one GPU) or a multiple of "
    "100 (whole GPUs)"
)
MEMORY_PERCENT_FIELD = "qgpu-memory-percentage"
MEMORY_PERCENT_RULE = "must be an integer percent of the card's memory, 1..100"

# A slice id names files and directories on the node (its directory under the state dir,
# its limits file): an ASCII letter or digit first, so never ".", ".." or a hidden ".x".
SLICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
SLICE_ID_RULE = "must match [A-Za-z0-9][A-Za-z0-9._-]{0,63} (a letter or digit first, 1..64 chars)"
_SLICE_ID_RE = re.compile(SLICE_ID_PATTERN)


def is_slice_id(value: object) -> bool:
    """True for a valid slice id (the one rule; `check_slice_id` raises instead)."""
    return isinstance(value, str) and _SLICE_ID_RE.fullmatch(value) is not None


def new_slice_id() -> str:
    """A fresh random slice id (``s-`` and 16 hex digits)."""
    return "s-" + uuid.uuid4().hex[:16]


def check_slice_id(value: object, field: str = "slice_id") -> str:
    """The slice id, or a `RuleViolation` naming `field`."""
    if not is_slice_id(value):
        raise RuleViolation(field, value, SLICE_ID_RULE)
    return value  # type: ignore[return-value]


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
    multi_gpu_share = WHOLE_GPU_CORE < core < WHOLE_GPU_CORE * MAX_SHARE_GPUS
    if core < 1 or (core >= WHOLE_GPU_CORE and core % WHOLE_GPU_CORE and not multi_gpu_share):
        raise RuleViolation(CORE_FIELD, value, CORE_RULE)
    if core > MAX_CORE:
        raise RuleViolation(CORE_FIELD, value, CORE_LIMIT_RULE)
    return core


def _memory_percent(value: Any) -> Any:
    if value is None:
        return None
    pct = parse_core(value, MEMORY_PERCENT_FIELD)  # the same integer-percent syntax
    if not 1 <= pct <= 100:
        raise RuleViolation(MEMORY_PERCENT_FIELD, value, MEMORY_PERCENT_RULE)
    return pct


def _memory(value: Any) -> Any:
    if value is None:
        return None
    gib = parse_memory_gib(value)
    if gib > MAX_MEMORY_GIB:
        raise RuleViolation(MEMORY_FIELD, value, MAX_MEMORY_RULE)
    return gib


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
        description="qgpu-memory: GiB of one GPU (a multi-GPU share: in all, split evenly); "
        "a share needs it or memory_percent",
    )
    memory_percent: Annotated[int | None, BeforeValidator(_memory_percent)] = Field(
        default=None,
        validation_alias=AliasChoices("memory_percent", MEMORY_PERCENT_FIELD),
        description="qgpu-memory-percentage: percent of the card's memory (a share only)",
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
    cpu_milli: int = Field(
        default=0, ge=0, le=10**7, description="host CPU the workload needs (milli)"
    )
    host_memory_mib: int = Field(
        default=0, ge=0, le=2**31, description="host memory it needs (MiB)"
    )

    @model_validator(mode="after")
    def _memory_required_for_share(self) -> Self:
        if self.memory_percent is not None:
            if self.is_whole_gpu:
                raise RuleViolation(
                    MEMORY_PERCENT_FIELD,
                    self.memory_percent,
                    "applies to shares only (whole GPUs take the whole card's memory)",
                )
            if self.memory_gib is not None:
                raise RuleViolation(
                    MEMORY_PERCENT_FIELD,
                    self.memory_percent,
                    f"cannot be combined with {MEMORY_FIELD}={self.memory_gib} (one memory cap)",
                )
        elif not self.is_whole_gpu and self.memory_gib is None:
            raise RuleViolation(
                MEMORY_FIELD,
                None,
                f"is required for a share (qgpu-core 1..99 or 101..199), "
                f"unless {MEMORY_PERCENT_FIELD} is given",
            )
        too_little = self.memory_gib is not None and self.memory_gib < self.gpu_count
        if self.is_multi_gpu_share and too_little:
            raise RuleViolation(
                MEMORY_FIELD,
                self.memory_gib,
                f"must be at least {self.gpu_count} GiB for a share split over "
                f"{self.gpu_count} GPUs (each GPU's part is memory/{self.gpu_count} "
                "rounded down, at least 1 GiB)",
            )
        overlap = set(self.include_uuids) & set(self.exclude_uuids)
        if overlap:
            raise RuleViolation(
                "exclude_uuids", sorted(overlap)[0], "a GPU cannot be both included and excluded"
            )
        return self

    @classmethod
    def parse(
        cls,
        value: SliceRequest | Mapping[str, Any],
        where: str = "request",
        multi_gpu_shares: bool = False,
    ) -> SliceRequest:
        """Validate a mapping (or pass a request through); a broken rule raises
        `RuleViolation` naming the field, the value and the rule — the one entry point
        adapters use for requests that arrive as plain data. A multi-GPU share (qgpu-core
        101..199) is refused unless the caller says it enforces one (`multi_gpu_shares`)."""
        if isinstance(value, SliceRequest):
            req = value
        elif not isinstance(value, Mapping):
            raise RuleViolation(where, value, "must be a mapping such as {'core': 30, 'memory': 8}")
        else:
            try:
                req = cls.model_validate(dict(value))
            except ValidationError as exc:
                raise first_violation(exc) from exc
        if not multi_gpu_shares:
            req.require_single_gpu_share("qgpu" if where == "request" else where)
        return req

    def require_single_gpu_share(self, where: str = "this adapter") -> Self:
        """Refuse a multi-GPU share where it cannot be enforced (the rule names `where`)."""
        if self.is_multi_gpu_share:
            raise RuleViolation(CORE_FIELD, self.core, MULTI_GPU_SHARE_RULE.format(where=where))
        return self

    @property
    def is_whole_gpu(self) -> bool:
        return self.core >= WHOLE_GPU_CORE and self.core % WHOLE_GPU_CORE == 0

    @property
    def is_multi_gpu_share(self) -> bool:
        """A share split evenly over 2 GPUs of one node (qgpu-core 101..199)."""
        return self.core > WHOLE_GPU_CORE and not self.is_whole_gpu

    @property
    def gpu_count(self) -> int:
        if self.is_whole_gpu:
            return self.core // WHOLE_GPU_CORE
        return -(-self.core // WHOLE_GPU_CORE)  # ceil: 1 for 1..99, 2 for 101..199

    @property
    def core_per_gpu(self) -> int:
        """Each GPU's core: 100 for whole GPUs, the share split evenly rounding down."""
        return WHOLE_GPU_CORE if self.is_whole_gpu else self.core // self.gpu_count

    @property
    def memory_gib_per_gpu(self) -> int | None:
        """Each GPU's memory cap in GiB when it does not depend on the card (a share asking
        for qgpu-memory: split evenly rounding down); None for whole GPUs and percentages."""
        if self.is_whole_gpu or self.memory_gib is None:
            return None
        return self.memory_gib // self.gpu_count

    def memory_on(self, card_gib: int) -> int:
        """The memory cap (GiB) this request takes on a card of `card_gib` GiB: the whole
        card for whole GPUs, floor(card * pct / 100) for a percentage, else the per-GPU part
        (0 when a percentage leaves less than 1 GiB: such a card cannot take it)."""
        if self.is_whole_gpu:
            return card_gib
        if self.memory_percent is not None:
            return card_gib * self.memory_percent // 100
        assert self.memory_gib_per_gpu is not None
        return self.memory_gib_per_gpu

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
        if self.memory_percent is not None:
            if self.memory_on(card_gib) < 1:
                raise RuleViolation(
                    MEMORY_PERCENT_FIELD,
                    self.memory_percent,
                    f"leaves less than 1 GiB of the card ({card})",
                )
            return
        per_gpu = self.memory_gib if self.is_whole_gpu else self.memory_gib_per_gpu
        if per_gpu is not None and per_gpu > card_gib:
            part = " per GPU" if self.is_multi_gpu_share else ""
            raise RuleViolation(
                MEMORY_FIELD, self.memory_gib, f"must not exceed the card{part} ({card})"
            )

    def to_resources(self) -> dict[str, int]:
        """The request as resource-name amounts (qgpu-core, qgpu-memory, percentage)."""
        out = {CORE_FIELD: self.core}
        if self.memory_gib is not None:
            out[MEMORY_FIELD] = self.memory_gib
        if self.memory_percent is not None:
            out[MEMORY_PERCENT_FIELD] = self.memory_percent
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

    def max_slices(self, configured: int = DEFAULT_MAX_SLICES_PER_GPU, fixed: bool = False) -> int:
        """At most floor(card GiB / 4) slices, and at most `configured` (16 by default); with
        `fixed` (a `SlicesPerGpu` fixed count) exactly `configured`, whatever the memory."""
        if fixed:
            return configured
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
    fixed_slices: bool = Field(
        default=False, description="max_slices_per_gpu is the count itself (not floor(GiB/4))"
    )
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


SLICES_PER_GPU_RULE = (
    "must be floor-gib (at most floor(card GiB / 4) slices per GPU, and at most 16) or a fixed "
    f"count 1..{MAX_FIXED_SLICES_PER_GPU}"
)
FLOOR_GIB = "floor-gib"


class SlicesPerGpu(BaseModel):
    """How many slices one GPU may hold: ``floor-gib`` or a fixed count 1..16.

    Written as text where it is configured (a chart value, a node label, CLI flags):
    ``floor-gib`` or ``"8"``. `limit` and `fixed` are what `GpuDevice.max_slices` takes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int = Field(default=DEFAULT_MAX_SLICES_PER_GPU, ge=1, le=64)
    fixed: bool = False

    @classmethod
    def parse(cls, value: Any, field: str = "slices_per_gpu") -> SlicesPerGpu:
        if isinstance(value, SlicesPerGpu):
            return value
        text = value.strip().lower() if isinstance(value, str) else value
        if text == FLOOR_GIB:
            return cls()
        if isinstance(text, bool):
            raise RuleViolation(field, value, SLICES_PER_GPU_RULE)
        if isinstance(text, int) or (isinstance(text, str) and text.isdigit()):
            count = int(text)
            if 1 <= count <= MAX_FIXED_SLICES_PER_GPU:
                return cls(limit=count, fixed=True)
        raise RuleViolation(field, value, SLICES_PER_GPU_RULE)

    def __str__(self) -> str:
        if self.fixed:
            return str(self.limit)
        return FLOOR_GIB if self.limit == DEFAULT_MAX_SLICES_PER_GPU else f"floor-gib<={self.limit}"


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
    meta: dict[
        Annotated[str, StringConstraints(max_length=128)],
        Annotated[str, StringConstraints(max_length=4096)],
    ] = Field(default_factory=dict, max_length=64)

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> OwnerKind:
        if isinstance(value, OwnerKind):
            return value
        return parse_choice(value, {k.value: k for k in OwnerKind}, "owner.kind")


class Allocation(BaseModel):
    """A placed slice: which node and GPU(s), with what caps, held by whom."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slice_id: str = Field(pattern=SLICE_ID_PATTERN)
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
