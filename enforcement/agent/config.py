"""The agent's settings (one pydantic model, validated like every other input).

Paths derive from `state_dir` unless given: the ledger ``ledger.sqlite``, one directory
per slice (limits file and interposer ledger) and one per GPU (its roster and its slices'
activity files) under ``slices/``
(`enforcement.state_tree`), MPS pipe/log directories under ``mps/`` and the simulator's
files under ``sim/``.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qgpu.errors import RuleViolation
from qgpu.model import (
    DEFAULT_MAX_SLICES_PER_GPU,
    IsolationPolicy,
    PlacementPolicy,
    SlicesPerGpu,
)

DEFAULT_STATE_DIR = "/var/lib/qgpu"
DEFAULT_SOCKET = "/run/qgpu/agent.sock"
SOCKET_ENV = "QGPU_AGENT_SOCKET"
MAX_UNIX_PATH = 100

Enforcement = Literal["interposer", "mps"]
# What the watchdog kills: nothing; what breaks a share slice's promise (the default:
# fixed- and burst-share slices over their memory cap or core, and any slice over its compute
# allowance beside busy neighbours); or also best-effort slices over their memory cap.
WatchdogKill = Literal["off", "share", "all"]
# What the watchdog does with a GPU process of no slice on a GPU that holds a slice it kills
# for: kill it (after the grace), or only report it.
WatchdogUnowned = Literal["kill", "report"]
# Per-slice cgroups for slices owned by a process: auto (when root, not --test-mode, and
# cgroup v2 is writable), on (required: the agent refuses to start without them), off.
SliceCgroupMode = Literal["auto", "on", "off"]


class AgentConfig(BaseModel):
    """Everything `qgpu agent` can be told; the CLI flags map one to one onto it."""

    model_config = ConfigDict(extra="forbid")

    node_name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    socket_path: Path | None = Field(default=None, description="default: /run/qgpu/agent.sock")
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = Field(default=None, ge=0, le=65535)
    token: str | None = Field(default=None, min_length=16, repr=False)
    backend: Literal["auto", "nvml", "sim"] = "auto"
    sim_spec: str | None = None
    max_slices_per_gpu: int = Field(default=DEFAULT_MAX_SLICES_PER_GPU, ge=1, le=64)
    slices_per_gpu: SlicesPerGpu | None = Field(
        default=None,
        description="floor-gib or a fixed count 1..16; None: floor-gib capped at "
        "max_slices_per_gpu",
    )
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="also serve GET /metrics (and nothing else) on this TCP port, for "
        "Prometheus; read-only, no token",
    )
    default_isolation: IsolationPolicy = IsolationPolicy.BEST_EFFORT
    placement: PlacementPolicy | None = None
    gpu_placement: PlacementPolicy | None = None
    reconcile_interval_s: float = Field(default=10.0, gt=0)
    watchdog_interval_s: float = Field(default=5.0, gt=0)
    watchdog_kill: WatchdogKill = "all"  # memory is a hard cap whatever the isolation
    watchdog_grace_s: float = Field(
        default=10.0, ge=0, description="how long a slice may stay over its cap before a kill"
    )
    watchdog_core_margin: int = Field(
        default=15,
        ge=1,
        le=100,
        description="percentage points a slice's measured SM use may exceed its compute "
        "allowance before the watchdog counts it over (100: never)",
    )
    watchdog_unowned: WatchdogUnowned = Field(
        default="kill",
        description="GPU processes of no slice on a GPU holding a slice that --watchdog-kill "
        "covers: kill (after the grace) or report",
    )
    slice_cgroups: SliceCgroupMode = Field(
        default="auto",
        description="make a cgroup per slice owned by a process, for attribution that its "
        "environment cannot forge",
    )
    enforcement: Enforcement = "interposer"
    mps_control: str = "nvidia-cuda-mps-control"
    hook_path: Path | None = None
    real_libcuda: Path | None = None
    test_mode: bool = Field(
        default=False, description="skip root ownership of limits files (tests, laptops)"
    )
    kubelet_pods_dir: Path = Path("/var/lib/kubelet/pods")
    workload_gid: int = Field(
        default=0,
        ge=0,
        le=2**32 - 2,
        description="group of the GPUs' shared state (.gpu-<uuid>/: the roster and the "
        "slices' activity files the interposer coordinates compute with), which every "
        "tenant of the GPUs must be in to read it; 0: root only",
    )
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    head_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("default_isolation", mode="before")
    @classmethod
    def _isolation(cls, value: object) -> IsolationPolicy:
        return IsolationPolicy.parse(value, "default_isolation")

    @field_validator("slices_per_gpu", mode="before")
    @classmethod
    def _slices(cls, value: object) -> SlicesPerGpu | None:
        return None if value is None else SlicesPerGpu.parse(value, "slices_per_gpu")

    @model_validator(mode="after")
    def _slices_default(self) -> Self:
        if self.slices_per_gpu is None:
            self.slices_per_gpu = SlicesPerGpu(limit=self.max_slices_per_gpu)
        return self

    @property
    def slice_policy(self) -> SlicesPerGpu:
        assert self.slices_per_gpu is not None  # set by the validator
        return self.slices_per_gpu

    @field_validator("tcp_host")
    @classmethod
    def _loopback_only(cls, value: str) -> str:
        if value == "localhost":
            return "127.0.0.1"
        try:
            addr = ipaddress.ip_address(value)
        except ValueError as exc:
            raise RuleViolation("tcp_host", value, "must be a loopback IP address") from exc
        if not addr.is_loopback:
            raise RuleViolation(
                "tcp_host",
                value,
                "must be a loopback address (127.0.0.0/8 or ::1); "
                "the agent never listens on a network interface",
            )
        return value

    @field_validator("metrics_host")
    @classmethod
    def _ip(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise RuleViolation(
                "metrics_host", value, "must be an IP address, e.g. 0.0.0.0 (all) or 127.0.0.1"
            ) from exc
        return value

    @field_validator("socket_path")
    @classmethod
    def _short_socket(cls, value: Path | None) -> Path | None:
        if value is not None and len(str(value)) >= MAX_UNIX_PATH:
            raise RuleViolation(
                "socket", str(value), f"unix socket paths must be shorter than {MAX_UNIX_PATH}"
            )
        return value

    @property
    def socket(self) -> Path:
        return self.socket_path or Path(DEFAULT_SOCKET)

    @property
    def ledger_path(self) -> Path:
        return self.state_dir / "ledger.sqlite"

    @property
    def legacy_limits_dir(self) -> Path:
        """Where limits files lived before per-slice directories (cleaned up at start)."""
        return self.state_dir / "limits"

    @property
    def slices_dir(self) -> Path:
        return self.state_dir / "slices"

    @property
    def mps_dir(self) -> Path:
        return self.state_dir / "mps"
