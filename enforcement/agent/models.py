"""The agent API's pydantic models: every request body and every response.

The slice itself is the core `qgpu.model.SliceRequest` (one source of truth for the rules);
the owner is the core `qgpu.model.Owner`. Errors are `ErrorBody`: the first violation's
field, value and rule at the top level, all of them under ``violations``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qgpu.model import (
    SLICE_ID_PATTERN,
    GpuHealth,
    IsolationPolicy,
    NodeInventory,
    Owner,
    SliceRequest,
)

MAX_LEASE_S = 7 * 24 * 3600.0
MAX_ID = 2**32 - 2  # uid/gid: (uid_t)-1 means "unchanged" to chown

LeaseSeconds = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_LEASE_S,
        description="lease: the slice is released after this many seconds unless renewed "
        "(POST /v1/slices/{id}/lease)",
    ),
]
PosixId = Annotated[int, Field(ge=0, le=MAX_ID)]


class Violation(BaseModel):
    field: str
    value: Any = None
    rule: str


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer of the agent."""

    error: Literal[
        "invalid", "too-large", "no-fit", "not-found", "unauthorized", "unavailable", "internal"
    ]
    field: str
    value: Any = None
    rule: str
    violations: list[Violation] = Field(default_factory=list)
    reasons: dict[str, int] = Field(
        default_factory=dict, description="no-fit: GPUs ruled out per reason"
    )


class WorkloadIdentity(BaseModel):
    """Who the slice's processes run as: its ledger belongs to them, nobody else can open it.

    Default: the owner's process (a ``pid`` owner, a Dask worker's ``meta.pid``), else the
    agent's own user."""

    model_config = ConfigDict(extra="forbid")

    uid: PosixId | None = Field(default=None, description="user of the slice's processes")
    gid: PosixId | None = Field(default=None, description="their group")


class ReserveRequest(WorkloadIdentity):
    """POST /v1/slices body."""

    request: SliceRequest
    owner: Owner = Field(default_factory=Owner)
    slice_id: str | None = Field(
        default=None,
        pattern=SLICE_ID_PATTERN,
        description="idempotency key chosen by the client (the Python client always sends "
        "one): a retry with the same id and owner returns the same slice",
    )
    expires_s: LeaseSeconds | None = None


class LeaseRequest(BaseModel):
    """POST /v1/slices/{id}/lease body: renew the lease, or end it (the slice is kept)."""

    model_config = ConfigDict(extra="forbid")

    expires_s: LeaseSeconds | None = Field(
        description="seconds from now; null makes the slice permanent (until released)"
    )


class RecordRequest(WorkloadIdentity):
    """POST /v1/slices/record body: a placement decided elsewhere (the Kubernetes scheduler
    extender, the Ray SDK) that this node must enforce and account for."""

    slice_id: str = Field(pattern=SLICE_ID_PATTERN)
    request: SliceRequest
    device_uuids: list[str] = Field(
        min_length=1, max_length=64, description="the GPUs chosen: one for a share"
    )
    owner: Owner = Field(default_factory=Owner)
    expires_s: LeaseSeconds | None = None


class Reservation(BaseModel):
    """A reserved slice and what a workload must apply to run inside it."""

    slice_id: str
    node: str
    device_uuid: str = Field(description="the (first) GPU of the slice")
    device_uuids: list[str]
    device_indexes: list[int]
    core: int = Field(description="per GPU: the share 1..99, or 100 for whole GPUs")
    memory_gib: int
    memory_limit_bytes: int
    isolation: IsolationPolicy
    enforcement: Literal["interposer", "mps", "none"] = Field(
        description="how the caps are enforced: interposer, mps, or none (whole GPUs)"
    )
    owner: Owner
    created_at: float
    expires_at: float | None = Field(
        default=None, description="lease end (unix time); null: held until released"
    )
    uid: int | None = Field(default=None, description="user the slice's files belong to")
    gid: int | None = Field(default=None, description="group the slice's files belong to")
    slice_dir: str | None = Field(
        default=None, description="the slice's directory (limits file, ledger directory)"
    )
    limits_file: str | None = Field(description="KEY=VALUE limits file read at cuInit")
    env: dict[str, str] = Field(description="environment to apply before the process starts")


class SliceUsage(BaseModel):
    """Live use of a slice; None where the source does not report it."""

    memory_used_bytes: int | None = None
    core_used_percent: float | None = None
    throttled_seconds: float | None = None
    oom_refusals: int | None = None
    pids: list[int] = Field(default_factory=list)
    source: Literal["interposer", "nvml", "sim", "none"] = "none"


class SliceInfo(Reservation):
    usage: SliceUsage = Field(default_factory=SliceUsage)


class SliceList(BaseModel):
    node: str
    slices: list[SliceInfo]


class ReleaseResult(BaseModel):
    slice_id: str
    released: bool = Field(description="true if it was held; false if already gone")


class DeviceInfo(BaseModel):
    uuid: str
    index: int
    model: str
    memory_mib: int
    sm_count: int
    numa_node: int | None
    health: GpuHealth
    health_reason: str | None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    utilization_percent: int | None = None
    slices: int
    max_slices: int
    core_committed: int
    memory_committed_gib: int


class DeviceList(BaseModel):
    node: str
    backend: str
    devices: list[DeviceInfo]


class NodeInfo(BaseModel):
    """What a node-level adapter (Ray's resource provider, ...) needs to know of the node."""

    node: str
    backend: str
    enforcement: Literal["interposer", "mps"]
    inventory: NodeInventory = Field(description="the node as the placement engine sees it")
    workload_env: dict[str, str] = Field(
        description="environment every workload process of this node needs: QGPU_STATE_DIR, "
        "and in simulation the simulated driver (QGPU_SIM_CONFIG, LD_LIBRARY_PATH)"
    )
    hook_path: str | None = Field(description="the interposer library, when it is built")


class Health(BaseModel):
    """``ok``; ``degraded`` (problems, but it serves); ``failing`` (it cannot record slices:
    the state directory is full or read-only): then /v1/health answers 503."""

    status: Literal["ok", "degraded", "failing"]
    node: str
    backend: str
    enforcement: str
    devices: int
    unhealthy_devices: list[str]
    slices: int
    uptime_s: float
    last_reconcile_at: float | None
    problems: list[str] = Field(default_factory=list)
    version: str
