"""GPU discovery and live telemetry through NVML (nvidia-ml-py), real or simulated.

This module owns the node's view of its GPUs: the inventory the placement engine uses
(UUID, index, short model name, memory, SM count, NUMA node, health from ECC / retired
pages / Xid events) and the live numbers the agent's metrics and watchdog read (memory
used, utilisation, per-process memory and SM use).

There is ONE code path, the `pynvml` module. The simulated backend (``QGPU_BACKEND=sim``,
``qgpu agent --sim 2xH100-80GB``, or NVML absent and a simulation spec given) only changes
which ``libnvidia-ml.so.1`` pynvml talks to: `enforcement.sim.load_sim_nvml` loads the
simulated library built from ``enforcement/native/sim``, and everything below runs
unchanged against it.

Short model names (``NVIDIA H100 80GB HBM3`` -> ``H100-80GB``) come from
`short_model_name`, the single mapping used by every adapter.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pynvml

from enforcement.native import NativeLibraryMissing
from qgpu.errors import QgpuError, RuleViolation
from qgpu.model import (
    DEFAULT_MAX_SLICES_PER_GPU,
    FLOOR_GIB,
    GpuDevice,
    GpuHealth,
    IsolationPolicy,
    NodeInventory,
    SlicesPerGpu,
)

log = logging.getLogger("qgpu.discovery")

BACKEND_ENV = "QGPU_BACKEND"
SIM_SPEC_ENV = "QGPU_SIM_SPEC"  # the simulated GPUs when no spec is passed (like --sim)
BACKENDS = ("auto", "nvml", "sim")

# Xids that say nothing about the GPU's health (application errors, resets on request):
# the same list the NVIDIA Kubernetes device plugin ignores.
IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# Marketing sizes a card's memory is rounded up to when its name does not carry one.
_MARKETING_GIB = (2, 4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 141, 144, 192)
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_JOIN_NEXT = {"rtx", "gtx", "titan"}
_NAME_GB = re.compile(r"(\d+)\s*GB", re.IGNORECASE)


class BackendUnavailable(QgpuError):
    """Neither NVML nor the simulated driver can be used with the given settings."""


def short_model_name(name: str, memory_mib: int | None = None) -> str:
    """The short model name used in constraints and labels: family plus memory size.

    ``NVIDIA H100 80GB HBM3`` -> ``H100-80GB``; ``NVIDIA A100-SXM4-40GB`` -> ``A100-40GB``;
    ``Tesla T4`` (15 GiB) -> ``T4-16GB``; ``NVIDIA GeForce RTX 4090`` -> ``RTX4090-24GB``.
    Names already in short form (``H100-80GB``) map to themselves.
    """
    text = name.strip()
    match = _NAME_GB.search(text)
    gib: int | None = int(match.group(1)) if match else None
    if gib is None and memory_mib:
        exact = memory_mib / 1024
        gib = next((m for m in _MARKETING_GIB if m >= exact - 0.5), math.ceil(exact))
    tokens = [t for t in re.split(r"[\s_]+", text) if t and t.lower() not in _VENDOR_WORDS]
    if not tokens:
        family = "GPU"
    else:
        first = tokens[0].split("-")[0]
        if first.lower() in _JOIN_NEXT and len(tokens) > 1:
            first = first + tokens[1].split("-")[0]
        family = first.upper() if first.isalnum() else first
    return f"{family}-{gib}GB" if gib else family


@dataclass(frozen=True)
class DeviceTelemetry:
    """Live numbers of one GPU."""

    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int | None


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (NVML compute/graphics process list)."""

    device_uuid: str
    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class UtilSample:
    """A process's newest NVML SM-utilisation sample: the percent of one sampling period
    (about 100 ms on NVIDIA's driver) the device spent on its work, and when that period
    ended (microseconds since the epoch, NVML's clock)."""

    sm_util: int
    at_us: int


# How far back process_utilization looks for each process's newest sample.
UTIL_WINDOW_US = 2_000_000


# The GPU settings the watchdog keeps as the agent found them (`GpuBackend.gpu_settings`):
# each changes the GPU for every process on it, and root may change it through NVML.
GPU_SETTINGS = ("compute_mode", "accounting_mode")


class GpuBackend(Protocol):
    """What the agent needs from a GPU source (NVML, simulated NVML, or a test double)."""

    kind: str
    workload_env: dict[str, str]

    def devices(self) -> list[GpuDevice]: ...

    def telemetry(self) -> list[DeviceTelemetry]: ...

    def processes(self) -> list[GpuProcess]: ...

    def process_utilization(self) -> dict[tuple[str, int], UtilSample]: ...

    def gpu_settings(self) -> dict[str, dict[str, int]]:
        """Per GPU, the `GPU_SETTINGS` it can report (NVML's numbers)."""
        ...

    def set_gpu_setting(self, uuid: str, name: str, value: int) -> str | None:
        """Sets one of `GPU_SETTINGS`; None when done, else why not (NVML's error)."""
        ...

    def close(self) -> None: ...


class _NoSuchError(Exception):
    pass


# Raised by pynvml's unversioned wrappers when the loaded library lacks the function.
_LibraryMismatch: type[Exception] = getattr(pynvml, "NVMLLibraryMismatchError", _NoSuchError)


def _nvml_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call: Callable[[], Any]) -> Any:
    """Call an NVML query that a driver (or the simulator) may not support."""
    try:
        return call()
    except pynvml.NVMLError as exc:
        if exc.value in (
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            pynvml.NVML_ERROR_NOT_FOUND,
            pynvml.NVML_ERROR_NO_PERMISSION,
            pynvml.NVML_ERROR_INVALID_ARGUMENT,
            pynvml.NVML_ERROR_UNKNOWN,
        ):
            return None
        raise
    except (AttributeError, OSError, _LibraryMismatch):
        return None


@dataclass
class NvmlBackend:
    """GPUs through pynvml. `kind` is ``nvml`` or ``sim`` (the simulated libnvidia-ml)."""

    kind: str = "nvml"
    workload_env: dict[str, str] = field(default_factory=dict)
    watch_xid: bool = True
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _xid: dict[str, str] = field(default_factory=dict, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _xid_thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"NVML could not be initialised: {exc}") from exc
        if self.watch_xid:
            self._start_xid_watch()

    @contextmanager
    def _nvml(self) -> Iterator[None]:
        with self._lock:
            yield

    def _handles(self) -> list[tuple[int, Any]]:
        count = pynvml.nvmlDeviceGetCount()
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]

    def devices(self) -> list[GpuDevice]:
        with self._nvml():
            return [self._device(i, h) for i, h in self._handles()]

    def _device(self, index: int, handle: Any) -> GpuDevice:
        uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(handle))
        name = _nvml_str(pynvml.nvmlDeviceGetName(handle))
        memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
        attrs = _optional(lambda: pynvml.nvmlDeviceGetAttributes(handle))
        sm_count = int(getattr(attrs, "multiprocessorCount", 0) or 0)
        numa = _optional(lambda: pynvml.nvmlDeviceGetNumaNodeId(handle))
        if numa is None:
            numa = _numa_from_pci(handle)
        reason = self._unhealthy_reason(uuid, handle)
        return GpuDevice(
            uuid=uuid,
            index=index,
            model=short_model_name(name, memory_mib),
            memory_mib=memory_mib,
            sm_count=sm_count,
            numa_node=numa if numa is not None and numa >= 0 else None,
            health=GpuHealth.UNHEALTHY if reason else GpuHealth.HEALTHY,
            health_reason=reason,
        )

    def _unhealthy_reason(self, uuid: str, handle: Any) -> str | None:
        if uuid in self._xid:
            return self._xid[uuid]
        ecc = _optional(
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        if ecc:
            return f"{ecc} uncorrectable ECC errors since the driver loaded"
        pending = _optional(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        if pending:
            return "retired memory pages pending (reset the GPU)"
        return None

    def telemetry(self) -> list[DeviceTelemetry]:
        out = []
        with self._nvml():
            for _i, handle in self._handles():
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                util = _optional(lambda h=handle: pynvml.nvmlDeviceGetUtilizationRates(h))
                out.append(
                    DeviceTelemetry(
                        uuid=_nvml_str(pynvml.nvmlDeviceGetUUID(handle)),
                        memory_total_bytes=int(mem.total),
                        memory_used_bytes=int(mem.used),
                        utilization_percent=None if util is None else int(util.gpu),
                    )
                )
        return out

    def processes(self) -> list[GpuProcess]:
        out: dict[tuple[str, int], GpuProcess] = {}
        with self._nvml():
            for _i, handle in self._handles():
                uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(handle))
                for query in (
                    pynvml.nvmlDeviceGetComputeRunningProcesses,
                    pynvml.nvmlDeviceGetGraphicsRunningProcesses,
                ):
                    for proc in _optional(lambda q=query, h=handle: q(h)) or []:
                        used = getattr(proc, "usedGpuMemory", None)
                        key = (uuid, int(proc.pid))
                        prev = out.get(key)
                        total = (
                            used if prev is None else (prev.used_memory_bytes or 0) + (used or 0)
                        )
                        out[key] = GpuProcess(uuid, int(proc.pid), None if used is None else total)
        return list(out.values())

    def process_utilization(self) -> dict[tuple[str, int], UtilSample]:
        """Each GPU process's newest SM-utilisation sample from the last
        `UTIL_WINDOW_US`, per (device, pid). Stateless: the metrics and the watchdog each
        see every sample (a remembered "last seen" would hand each sample to one reader)."""
        out: dict[tuple[str, int], UtilSample] = {}
        since = max(0, int(time.time() * 1_000_000) - UTIL_WINDOW_US)
        with self._nvml():
            for _i, handle in self._handles():
                uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(handle))
                samples = _optional(
                    lambda h=handle: pynvml.nvmlDeviceGetProcessUtilization(h, since)
                )
                for sample in samples or []:
                    key = (uuid, int(sample.pid))
                    at = int(sample.timeStamp)
                    prev = out.get(key)
                    if prev is None or at > prev.at_us:
                        out[key] = UtilSample(int(sample.smUtil), at)
        return out

    def gpu_settings(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._nvml():
            for _i, handle in self._handles():
                uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(handle))
                read = {
                    "compute_mode": _optional(lambda h=handle: pynvml.nvmlDeviceGetComputeMode(h)),
                    "accounting_mode": _optional(
                        lambda h=handle: pynvml.nvmlDeviceGetAccountingMode(h)
                    ),
                }
                out[uuid] = {k: int(v) for k, v in read.items() if v is not None}
        return out

    def set_gpu_setting(self, uuid: str, name: str, value: int) -> str | None:
        setters = {
            "compute_mode": pynvml.nvmlDeviceSetComputeMode,
            "accounting_mode": pynvml.nvmlDeviceSetAccountingMode,
        }
        if name not in setters:
            return f"{name!r} is not a GPU setting the agent keeps (one of {GPU_SETTINGS})"
        with self._nvml():
            try:
                setters[name](pynvml.nvmlDeviceGetHandleByUUID(uuid), value)
            except pynvml.NVMLError as exc:
                return str(exc)
        return None

    def _start_xid_watch(self) -> None:
        with self._nvml():
            event_set = _optional(pynvml.nvmlEventSetCreate)
            if event_set is None:
                return
            handles = {}
            for _i, handle in self._handles():
                uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(handle))
                ok = _optional(
                    lambda h=handle: (
                        pynvml.nvmlDeviceRegisterEvents(
                            h, pynvml.nvmlEventTypeXidCriticalError, event_set
                        )
                        or True
                    )
                )
                if ok:
                    handles[uuid] = handle
        if not handles:
            return
        thread = threading.Thread(
            target=self._xid_loop, args=(event_set,), name="qgpu-xid", daemon=True
        )
        self._xid_thread = thread
        thread.start()

    def _xid_loop(self, event_set: Any) -> None:
        while not self._stop.is_set():
            try:
                event = pynvml.nvmlEventSetWait_v2(event_set, 1000)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    continue
                log.warning("Xid watch stopped: %s", exc)
                return
            xid = int(event.eventData)
            if xid in IGNORED_XIDS:
                continue
            uuid = _nvml_str(pynvml.nvmlDeviceGetUUID(event.device))
            self._xid[uuid] = f"critical Xid {xid}"
            log.error("GPU %s reported critical Xid %d; marked unhealthy", uuid, xid)

    def close(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=2)
        with self._nvml():
            _optional(pynvml.nvmlShutdown)


def _numa_from_pci(handle: Any) -> int | None:
    pci = _optional(lambda: pynvml.nvmlDeviceGetPciInfo(handle))
    if pci is None:
        return None
    bus = _nvml_str(pci.busId).lower()
    # NVML gives an 8-digit domain (00000000:3B:00.0); sysfs uses 4 digits (0000:3b:00.0).
    if len(bus.split(":")[0]) == 8:
        bus = bus[4:]
    try:
        return int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return None


def nvml_available() -> bool:
    """True when the real libnvidia-ml can be loaded and initialised."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def open_backend(
    mode: str | None = None,
    *,
    sim_spec: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    node_name: str | None = None,
    watch_xid: bool = True,
) -> NvmlBackend:
    """Open the GPU backend: ``nvml``, ``sim`` or ``auto`` (``QGPU_BACKEND`` overrides auto).

    `sim_spec` defaults to ``QGPU_SIM_SPEC``. ``auto`` uses the simulator when a spec is
    given, else real NVML when it loads, else fails with a message saying what to do.
    """
    mode = (mode or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
    spec_field = "sim" if sim_spec else SIM_SPEC_ENV  # what an error names
    sim_spec = sim_spec or os.environ.get(SIM_SPEC_ENV) or None
    if mode not in BACKENDS:
        raise RuleViolation("backend", mode, "must be one of " + ", ".join(BACKENDS))
    if mode == "auto" and sim_spec:
        mode = "sim"
    if mode == "auto":
        if not nvml_available():
            raise BackendUnavailable(
                "NVML (libnvidia-ml.so.1) is not available on this machine; run with "
                f"--sim 2xH100-80GB (or {SIM_SPEC_ENV}=2xH100-80GB) for the simulated GPUs"
            )
        mode = "nvml"
    if mode == "nvml":
        return NvmlBackend(kind="nvml", watch_xid=watch_xid)
    if not sim_spec:
        raise RuleViolation(
            "sim",
            sim_spec,
            f"the simulated backend needs a spec such as 2xH100-80GB (--sim or {SIM_SPEC_ENV})",
        )
    if state_dir is None:
        raise RuleViolation("state_dir", None, "the simulated backend needs a state directory")
    env = _load_sim(sim_spec, Path(state_dir), node_name, spec_field)
    return NvmlBackend(kind="sim", workload_env=env, watch_xid=watch_xid)


def _load_sim(
    spec: str, state_dir: Path, node_name: str | None, field: str = "sim"
) -> dict[str, str]:
    """Write the simulator's config, point pynvml at the simulated libnvidia-ml.

    Returns the environment a workload needs to use the same simulated GPUs.
    """
    try:
        from enforcement import sim
    except ImportError as exc:
        raise BackendUnavailable(
            f"the simulated backend needs enforcement.sim and its native library ({exc})"
        ) from exc
    sim_dir = state_dir / "sim"
    config_path = sim_dir / "gpus.conf"
    try:
        sim.write_sim_config(config_path, spec, node=node_name or "sim-node")
    except ValueError as exc:
        raise RuleViolation(field, spec, str(exc)) from exc
    try:
        sim.load_sim_nvml(config_path)
        env = sim.sim_environment(config_path)
    except (OSError, NativeLibraryMissing) as exc:
        raise BackendUnavailable(f"the simulated libnvidia-ml could not be loaded: {exc}") from exc
    return {k: str(v) for k, v in env.items()}


def node_slice_policy(
    value: str | None,
    override_file: str | Path | None,
    floor_cap: int = DEFAULT_MAX_SLICES_PER_GPU,
) -> SlicesPerGpu:
    """The node's slices-per-GPU policy: the override file's text when the file exists
    (Kubernetes: written by the chart's label-node step from the node label
    ``<prefix>/qgpu-slices-per-gpu``), else `value` (a flag: ``floor-gib`` or 1..16).
    ``floor-gib`` is capped at `floor_cap` (``--max-slices-per-gpu``)."""
    policy = _slice_policy_text(value, override_file)
    return policy if policy.fixed else SlicesPerGpu(limit=floor_cap)


def _slice_policy_text(value: str | None, override_file: str | Path | None) -> SlicesPerGpu:
    if override_file is not None:
        path = Path(override_file)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = None
        except OSError as exc:
            raise RuleViolation("slices_per_gpu_file", str(path), f"cannot be read: {exc}") from exc
        if text is not None:
            return SlicesPerGpu.parse(text, f"{path}")
    return SlicesPerGpu.parse(value if value is not None else FLOOR_GIB, "--slices-per-gpu")


def discover(
    backend: GpuBackend,
    node_name: str,
    *,
    max_slices_per_gpu: int = DEFAULT_MAX_SLICES_PER_GPU,
    default_isolation: IsolationPolicy | str = IsolationPolicy.BEST_EFFORT,
    labels: dict[str, str] | None = None,
    fixed_slices: bool = False,
) -> NodeInventory:
    """The node's inventory for the ledger and the placement engine."""
    gpus = backend.devices()
    out_labels = {"qgpu.io/backend": backend.kind}
    models = sorted({g.model for g in gpus})
    if models:
        out_labels["qgpu.io/gpu-models"] = "_".join(models)
    out_labels.update(labels or {})
    return NodeInventory(
        name=node_name,
        gpus=gpus,
        labels=out_labels,
        max_slices_per_gpu=max_slices_per_gpu,
        fixed_slices=fixed_slices,
        default_isolation=IsolationPolicy.parse(default_isolation, "default_isolation"),
    )


__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "DeviceTelemetry",
    "GpuBackend",
    "GpuProcess",
    "NvmlBackend",
    "discover",
    "nvml_available",
    "open_backend",
    "short_model_name",
]
