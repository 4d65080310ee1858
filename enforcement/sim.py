"""Simulation mode: simulated GPUs served by the simulated driver (``libcuda.so.1``) and
NVML (``libnvidia-ml.so.1``) built from ``enforcement/native/sim``.

A spec such as ``"2xH100-80GB"`` or ``"H100-80GB,A10-24GB"`` becomes a config file (one
``key=value`` per line, read by the C libraries through ``QGPU_SIM_CONFIG``). GPU UUIDs are
derived from the node name and index, so a node always has the same simulated GPUs. Each GPU
has a state file (memory, device timeline, per-process slots) next to the config; this module
also reads it, for tests, benchmarks and the node agent.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from enforcement.native import sim_library_dir

GIB = 1 << 30
_UUID_NAMESPACE = uuid.UUID("6f1d3c1e-5a0b-4c8e-9d27-2b1f0e7a9c44")


@dataclass(frozen=True)
class GpuModel:
    """A GPU model the simulator knows: marketing name, memory, SM count, compute capability,
    resident threads per SM, BAR1 aperture (MiB; None: a large BAR, the memory rounded up to
    a power of two, as data-centre GPUs have)."""

    key: str
    name: str
    memory_gib: int
    sms: int
    cc: str
    threads_per_sm: int = 2048
    context_memory: int = 512 << 20  # what a context costs by default (see CONTEXT_MEMORY)
    bar1_mib: int | None = None

    @property
    def bar1_bytes(self) -> int:
        if self.bar1_mib is not None:
            return self.bar1_mib << 20
        size = 1 << 20
        while size < self.memory_gib * GIB:
            size <<= 1
        return size


MODELS: dict[str, GpuModel] = {
    m.key.lower(): m
    for m in (
        GpuModel("T4-16GB", "Tesla T4", 16, 40, "7.5", 1024, bar1_mib=256),
        GpuModel("V100-16GB", "Tesla V100-SXM2-16GB", 16, 80, "7.0"),
        GpuModel("V100-32GB", "Tesla V100-SXM2-32GB", 32, 80, "7.0"),
        GpuModel("A10-24GB", "NVIDIA A10", 24, 72, "8.6", 1536),
        GpuModel("A30-24GB", "NVIDIA A30", 24, 56, "8.0"),
        GpuModel("A100-40GB", "NVIDIA A100-SXM4-40GB", 40, 108, "8.0"),
        GpuModel("A100-80GB", "NVIDIA A100-SXM4-80GB", 80, 108, "8.0"),
        GpuModel("L4-24GB", "NVIDIA L4", 24, 58, "8.9", 1536),
        GpuModel("L40S-48GB", "NVIDIA L40S", 48, 142, "8.9", 1536),
        GpuModel("RTX4090-24GB", "NVIDIA GeForce RTX 4090", 24, 128, "8.9", 1536, bar1_mib=256),
        GpuModel("H100-80GB", "NVIDIA H100 80GB HBM3", 80, 132, "9.0", 2048, 640 << 20),
        GpuModel("H200-141GB", "NVIDIA H200", 141, 132, "9.0", 2048, 640 << 20),
    )
}
# short aliases: the model without its memory, when that is unambiguous
_ALIASES = {
    "t4": "t4-16gb",
    "a10": "a10-24gb",
    "a30": "a30-24gb",
    "l4": "l4-24gb",
    "l40s": "l40s-48gb",
    "rtx4090": "rtx4090-24gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "v100m32": "v100-32gb",
    "v100": "v100-16gb",
}
_ITEM_RE = re.compile(r"^(?:(\d+)\s*[xX]\s*)?([A-Za-z0-9._-]+)$")


SCHEDULERS = ("timesliced", "fifo")
PROCADDR_MODES = ("internal", "exported")
# What one context costs on a simulated GPU unless its model says otherwise: the interposer's
# default charge (QGPU_CONTEXT_MEMORY), which it charges at least for every context. NVIDIA
# publishes no figure; real contexts take a few hundred MiB, more on GPUs that hold more
# threads: the default stack alone is reserved for every thread the device can hold at once.
# Hopper (H100, H200: 132 SMs x 2048 threads) reserves 264 MiB for the default 1 KiB stack,
# so its contexts cost more here (640 MiB: the stack, the default heap and printf FIFO, the
# device runtime's default reservations and the driver's own state) than the interposer's
# default charge, which it must then measure. Chosen, not measured on a real card.
CONTEXT_MEMORY = 512 << 20
# What a green context costs itself (its default stream's work queues and its own state): it
# also retains the device's primary context, which costs the model's context_memory when the
# green context creates it. NVIDIA publishes no figure; configuration.
GREEN_CONTEXT_MEMORY = 32 << 20
# what the device runtime reserves (cuCtxSetLimit; NVIDIA does not publish the sizes): per
# pending device-side launch above the default 2048, and per thread the device can hold at
# once per device-side sync depth level above the default 2
# What an executable graph keeps on its GPU per node, from its instantiation to its
# destruction: the launch descriptors the driver builds for its work and the parameters it
# keeps for them (up to 4 KiB of kernel parameters each, the limit before CUDA 12.1). NVIDIA
# documents neither where nor how much: chosen, not measured; the interposer measures it.
GRAPH_NODE_BYTES = 4 << 10
GRAPH_WORK_AT = ("first_use", "instantiation")  # when an executable graph takes it
DEVRT_LAUNCH_BYTES = 8 << 10
DEVRT_SYNC_THREAD_BYTES = 4 << 10
# The Linux driver each CUDA release shipped with (NVIDIA's CUDA release notes, "CUDA Toolkit
# and Corresponding Driver Versions"): what the simulated driver and NVML report as their
# driver version when the config names only the CUDA version.
DRIVER_OF_CUDA = {
    11080: "520.61.05",
    12000: "525.60.13",
    12010: "530.30.02",
    12020: "535.54.03",
    12030: "545.23.06",
    12040: "550.54.14",
    12050: "555.42.02",
    12060: "560.28.03",
    12080: "570.26",
    12090: "575.51.03",
    13000: "580.65.06",
}
_OLDEST_DRIVER = "450.51.05"  # CUDA 11.0's, for an 11.x version not listed


class SimSpecError(ValueError):
    """A simulated-GPU spec that cannot be parsed; the message names the part and the rule."""


@dataclass(frozen=True)
class SimGpu:
    index: int
    uuid: str
    model: str
    name: str
    memory_bytes: int
    sms: int
    cc: str
    threads_per_sm: int = 2048
    context_memory: int = CONTEXT_MEMORY
    devrt_launch_bytes: int = DEVRT_LAUNCH_BYTES
    devrt_sync_thread_bytes: int = DEVRT_SYNC_THREAD_BYTES
    green_context_memory: int = GREEN_CONTEXT_MEMORY
    bar1_bytes: int = 256 << 20

    @property
    def memory_gib(self) -> int:
        return self.memory_bytes // GIB


MPS_PIPE_DIRECTORY = Path("/tmp/nvidia-mps")  # NVIDIA's default MPS pipe directory


@dataclass(frozen=True)
class SimConfig:
    path: Path
    node: str
    state_dir: Path
    gpus: tuple[SimGpu, ...]
    scheduler: str = "timesliced"
    timeslice_us: int = 2000
    cuda_version: int = 13000
    driver_version: str = DRIVER_OF_CUDA[13000]
    procaddr: str = "internal"
    accounting: bool = False
    mps_pipe_directory: Path = MPS_PIPE_DIRECTORY
    graph_node_bytes: int = GRAPH_NODE_BYTES
    graph_work_at: str = GRAPH_WORK_AT[0]

    def device_sharing_env(self) -> dict[str, str]:
        """How these GPUs share themselves between processes, in the interposer's terms
        (QGPU_DEVICE_SHARING): what a slice's limits need on them. Real GPUs time-slice
        (the interposer's default); ``serial`` exists only for the ``fifo`` model."""
        return {"QGPU_DEVICE_SHARING": "timesliced" if self.scheduler == "timesliced" else "serial"}

    def gpu(self, key: int | str) -> SimGpu:
        """A GPU by index or UUID."""
        for g in self.gpus:
            if g.index == key or g.uuid == key:
                return g
        raise KeyError(f"no simulated GPU {key!r} in {self.path}")

    def state_path(self, key: int | str) -> Path:
        return self.state_dir / f"{self.gpu(key).uuid}.gpu"


def parse_spec(spec: str) -> list[GpuModel]:
    """``"2xH100-80GB,A10-24GB"`` -> [H100, H100, A10]."""
    models: list[GpuModel] = []
    for raw in spec.split(","):
        item = raw.strip()
        m = _ITEM_RE.match(item)
        if not m:
            raise SimSpecError(f"sim spec item {item!r}: must be [COUNTx]MODEL, e.g. 2xH100-80GB")
        count = int(m.group(1) or 1)
        key = m.group(2).lower()
        key = _ALIASES.get(key, key)
        if key not in MODELS:
            known = ", ".join(sorted(m.key for m in MODELS.values()))
            raise SimSpecError(f"sim spec item {item!r}: unknown model (known: {known})")
        if count < 1 or count > 64:
            raise SimSpecError(f"sim spec item {item!r}: count must be 1..64")
        models.extend([MODELS[key]] * count)
    if len(models) > 64:
        raise SimSpecError(f"sim spec {spec!r}: at most 64 GPUs")
    return models


def gpu_uuid(node: str, index: int) -> str:
    """The deterministic UUID of simulated GPU ``index`` on ``node``."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


def write_sim_config(
    path: str | os.PathLike[str],
    spec: str,
    node: str = "sim-node",
    state_dir: str | os.PathLike[str] | None = None,
    *,
    scheduler: str = "timesliced",
    timeslice_us: int = 2000,
    cuda_version: int = 13000,
    driver_version: str | None = None,
    procaddr: str = "internal",
    context_memory: int | Mapping[str, int] | None = None,
    devrt_launch_bytes: int = DEVRT_LAUNCH_BYTES,
    devrt_sync_thread_bytes: int = DEVRT_SYNC_THREAD_BYTES,
    green_context_memory: int | Mapping[str, int] = GREEN_CONTEXT_MEMORY,
    accounting: bool = False,
    mps_pipe_directory: str | os.PathLike[str] = MPS_PIPE_DIRECTORY,
    graph_node_bytes: int = GRAPH_NODE_BYTES,
    graph_work_at: str = GRAPH_WORK_AT[0],
) -> SimConfig:
    """Write the config file for ``spec`` and return what it describes.

    ``scheduler``: ``timesliced`` (processes take turns on the device in ``timeslice_us``
    slices, as on a real GPU) or ``fifo`` (one queue in submission order). ``cuda_version``:
    the CUDA version the simulated driver reports (12.x or 13.x as ``12080``, ``13000``; it
    also decides which entry points cuGetProcAddress serves); ``driver_version``: the driver
    release NVML reports (default: the one that CUDA version shipped with). ``procaddr``:
    ``internal`` (cuGetProcAddress hands out entry points that are not the exported symbols,
    as a real driver may) or ``exported``. ``context_memory``: bytes each regular or primary
    context costs on the device, for every GPU, or per GPU model (``{"T4": 300 << 20}``);
    models not named cost their model's default (GpuModel.context_memory: CONTEXT_MEMORY, more
    on Hopper). ``green_context_memory``: what a green context costs itself beyond the primary
    context it retains, likewise (default GREEN_CONTEXT_MEMORY). ``devrt_launch_bytes`` /
    ``devrt_sync_thread_bytes``: what the device runtime reserves per pending launch above
    2048 and per resident thread per sync-depth level above 2 (cuCtxSetLimit), on every
    GPU. ``accounting``: NVML's per-process accounting mode on every GPU (an administrator's
    ``nvidia-smi -am 1``; off by default, as on NVIDIA's driver). ``mps_pipe_directory``:
    where a process looks for an MPS control daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is unset
    (NVIDIA's default, ``/tmp/nvidia-mps``; tests name their own; docs/enforcement.md, "The
    simulated driver"). ``graph_node_bytes``: what an executable graph keeps on its GPU per
    node until it is destroyed (GRAPH_NODE_BYTES), from its first upload or launch
    (``first_use``, cuda.h: an upload "uploads the work") or from its ``instantiation``."""
    path = Path(path)
    models = parse_spec(spec)
    if scheduler not in SCHEDULERS:
        raise SimSpecError(f"scheduler {scheduler!r}: must be one of {', '.join(SCHEDULERS)}")
    if procaddr not in PROCADDR_MODES:
        raise SimSpecError(f"procaddr {procaddr!r}: must be one of {', '.join(PROCADDR_MODES)}")
    if not 1 <= timeslice_us <= 1_000_000:
        raise SimSpecError(f"timeslice_us {timeslice_us!r}: must be 1..1000000")
    if not (11000 <= cuda_version <= 13990 and cuda_version % 10 == 0):
        raise SimSpecError(
            f"cuda_version {cuda_version!r}: must be a CUDA 11.x-13.x version number such as "
            "12080 or 13000"
        )
    if driver_version is None:
        known = [v for v in DRIVER_OF_CUDA if v <= cuda_version]
        driver_version = DRIVER_OF_CUDA[max(known)] if known else _OLDEST_DRIVER
    if not re.fullmatch(r"\d+(\.\d+)+", driver_version):
        raise SimSpecError(f"driver_version {driver_version!r}: must look like 580.65.06")
    ctx_cost = _context_costs(models, context_memory, "context_memory")
    green_cost = _context_costs(models, green_context_memory, "green_context_memory")
    for name, value in (
        ("devrt_launch_bytes", devrt_launch_bytes),
        ("devrt_sync_thread_bytes", devrt_sync_thread_bytes),
    ):
        if not isinstance(value, int) or value < 0:
            raise SimSpecError(f"{name} {value!r}: must be >= 0 bytes")
    if not isinstance(graph_node_bytes, int) or not 0 <= graph_node_bytes <= GIB:
        raise SimSpecError(f"graph_node_bytes {graph_node_bytes!r}: must be 0..{GIB} bytes")
    if graph_work_at not in GRAPH_WORK_AT:
        raise SimSpecError(
            f"graph_work_at {graph_work_at!r}: must be one of {', '.join(GRAPH_WORK_AT)}"
        )
    mps_dir = Path(mps_pipe_directory)
    if not mps_dir.is_absolute() or "\n" in str(mps_dir) or len(str(mps_dir)) >= 1024:
        raise SimSpecError(
            f"mps_pipe_directory {str(mps_dir)!r}: must be an absolute path of one line, "
            "shorter than 1024 bytes"
        )
    state = Path(state_dir) if state_dir else Path(f"{path}.state")
    lines = [
        "# qgpu simulated GPUs (enforcement/sim.py)",
        f"node={node}",
        f"state_dir={state}",
        f"scheduler={scheduler}",
        f"timeslice_us={timeslice_us}",
        f"cuda_version={cuda_version}",
        f"driver_version={driver_version}",
        f"procaddr={procaddr}",
        f"accounting={'enabled' if accounting else 'disabled'}",
        f"mps_pipe_directory={mps_dir}",
        f"graph_node_bytes={graph_node_bytes}",
        f"graph_work_at={graph_work_at}",
    ]
    gpus = []
    for i, m in enumerate(models):
        g = SimGpu(
            i,
            gpu_uuid(node, i),
            m.key,
            m.name,
            m.memory_gib * GIB,
            m.sms,
            m.cc,
            m.threads_per_sm,
            ctx_cost[m.key],
            devrt_launch_bytes,
            devrt_sync_thread_bytes,
            green_cost[m.key],
            m.bar1_bytes,
        )
        gpus.append(g)
        lines += [
            f"gpu{i}.uuid={g.uuid}",
            f"gpu{i}.name={g.name}",
            f"gpu{i}.model={g.model}",
            f"gpu{i}.memory={g.memory_bytes}",
            f"gpu{i}.sms={g.sms}",
            f"gpu{i}.cc={g.cc}",
            f"gpu{i}.threads_per_sm={g.threads_per_sm}",
            f"gpu{i}.context_memory={g.context_memory}",
            f"gpu{i}.devrt_launch_bytes={g.devrt_launch_bytes}",
            f"gpu{i}.devrt_sync_thread_bytes={g.devrt_sync_thread_bytes}",
            f"gpu{i}.green_context_memory={g.green_context_memory}",
            f"gpu{i}.bar1={g.bar1_bytes}",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return SimConfig(
        path,
        node,
        state,
        tuple(gpus),
        scheduler,
        timeslice_us,
        cuda_version,
        driver_version,
        procaddr,
        accounting,
        mps_dir,
        graph_node_bytes,
        graph_work_at,
    )


def _context_costs(
    models: list[GpuModel], cost: int | Mapping[str, int] | None, what: str
) -> dict[str, int]:
    """Bytes a context (``what``: context_memory or green_context_memory) costs on each model
    of ``models``: one number for all, or per model (by model key or alias,
    case-insensitive); ``None`` or a model not named: the model's default."""

    def default(m: GpuModel) -> int:
        return m.context_memory if what == "context_memory" else GREEN_CONTEXT_MEMORY

    if cost is None or isinstance(cost, Mapping):
        per_model: dict[str, int] = {}
        for name, value in (cost or {}).items():
            key = _ALIASES.get(name.lower(), name.lower())
            if key not in MODELS:
                raise SimSpecError(f"{what} model {name!r}: unknown model")
            per_model[MODELS[key].key] = value
        costs = {m.key: per_model.get(m.key, default(m)) for m in models}
    else:
        costs = {m.key: cost for m in models}
    for key, value in costs.items():
        if not isinstance(value, int) or value < 0:
            raise SimSpecError(f"{what} for {key} {value!r}: must be >= 0 bytes")
    return costs


def load_sim_config(path: str | os.PathLike[str]) -> SimConfig:
    """Read a config written by write_sim_config."""
    path = Path(path)
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            values[k.strip()] = v.strip()
    gpus = []
    i = 0
    while f"gpu{i}.uuid" in values:
        p = f"gpu{i}."
        gpus.append(
            SimGpu(
                i,
                values[p + "uuid"],
                values.get(p + "model", ""),
                values.get(p + "name", ""),
                int(values[p + "memory"]),
                int(values.get(p + "sms", "80")),
                values.get(p + "cc", "8.0"),
                int(values.get(p + "threads_per_sm", "2048")),
                int(values.get(p + "context_memory", str(CONTEXT_MEMORY))),
                int(values.get(p + "devrt_launch_bytes", str(DEVRT_LAUNCH_BYTES))),
                int(values.get(p + "devrt_sync_thread_bytes", str(DEVRT_SYNC_THREAD_BYTES))),
                int(values.get(p + "green_context_memory", str(GREEN_CONTEXT_MEMORY))),
                int(values.get(p + "bar1", str(256 << 20))),
            )
        )
        i += 1
    state = Path(values.get("state_dir") or f"{path}.state")
    return SimConfig(
        path,
        values.get("node", ""),
        state,
        tuple(gpus),
        values.get("scheduler", "timesliced"),
        int(values.get("timeslice_us", "2000")),
        int(values.get("cuda_version", "13000")),
        values.get("driver_version", DRIVER_OF_CUDA[13000]),
        values.get("procaddr", "internal"),
        values.get("accounting", "disabled") == "enabled",
        Path(values.get("mps_pipe_directory") or MPS_PIPE_DIRECTORY),
        int(values.get("graph_node_bytes", str(GRAPH_NODE_BYTES))),
        values.get("graph_work_at", GRAPH_WORK_AT[0]),
    )


def sim_environment(config_path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment that makes a process use the simulated driver and NVML."""
    lib_dir = str(sim_library_dir())
    old = os.environ.get("LD_LIBRARY_PATH", "")
    ld = lib_dir if not old else f"{lib_dir}:{old}"
    return {"LD_LIBRARY_PATH": ld, "QGPU_SIM_CONFIG": str(Path(config_path).resolve())}


def load_sim_nvml(config_path: str | os.PathLike[str]) -> ctypes.CDLL:
    """Load the simulated NVML into this process so that ``pynvml`` uses it.

    pynvml opens ``CDLL("libnvidia-ml.so.1")``; the dynamic loader answers a name that
    matches the SONAME of an already-loaded library with that library, so loading ours first
    (RTLD_GLOBAL) is enough. Call before ``pynvml.nvmlInit()``.
    """
    os.environ["QGPU_SIM_CONFIG"] = str(Path(config_path).resolve())
    return ctypes.CDLL(str(sim_library_dir() / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)


# --- reading the shared per-GPU state (layout: enforcement/native/sim/sim.h) ---

_HEADER = struct.Struct("<QIIQQqQQq")  # magic .. created_ns, offsets 0..64
_SCHED = struct.Struct("<Iq")  # scheduler, slice_ns: offsets 388, 392
_DONE_TOTAL = struct.Struct("<Q")  # done_total_ns, offset 424
_UNOWNED = struct.Struct("<Q")  # unowned, offset 432
_PROC = struct.Struct("<iIQQQqQQQ")  # pid .. contexts, the first 64 bytes of sim_proc_t
_USNAPS = 8  # per-process utilisation samples (SIM_USNAPS)
_USNAP = struct.Struct(f"<{_USNAPS}q{_USNAPS}QI")  # usnap_t, usnap_done, usnap_head: 592
_PROC_SIZE = 760 + 16 * 512 + 8 * 16  # sim_proc_t: SIM_MARKERS 512, SIM_CTX_QUEUES 16
_MANAGED = struct.Struct("<Q")  # managed_bytes, the last 16 bytes of sim_proc_t hold it
_MANAGED_OFFSET = _PROC_SIZE - 16
_PROCS_OFFSET = 512
_MAX_PROCS = 64
_MAGIC = 0x364D495355504751  # "QGPUSIM6"


@dataclass(frozen=True)
class SimProcess:
    pid: int
    mem_used: int
    busy_ns: int  # device time of the work it submitted
    done_ns: int  # device time of its work the device had run when the snapshot was taken
    launches: int
    contexts: int = 0
    sm_util: int = 0  # percent of the last sampling period (~100 ms) spent on its work (NVML)
    sm_util_at_ns: int = 0  # when that period ended (CLOCK_MONOTONIC; 0: no sample yet)
    # its managed memory on this GPU: part of mem_used, left out of NVML's per-process lists
    # (as NVIDIA's are), and evicted to the host when another allocation needs the room
    managed: int = 0


@dataclass(frozen=True)
class SimGpuState:
    """A snapshot of one simulated GPU, taken at ``now_ns`` (CLOCK_MONOTONIC)."""

    now_ns: int
    mem_total: int
    mem_used: int
    busy_total_ns: int
    done_total_ns: int
    launches: int
    scheduler: str = "timesliced"
    processes: tuple[SimProcess, ...] = field(default=())
    timeslice_ns: int = 0  # the time-sliced model's slice length
    # shared memory (exported to file descriptors) that only open descriptors keep: in
    # mem_used, charged to no process
    unowned: int = 0

    @property
    def busy_completed_ns(self) -> int:
        return self.done_total_ns

    def process(self, pid: int) -> SimProcess | None:
        return next((p for p in self.processes if p.pid == pid), None)


def _sm_util(data: bytes, offset: int) -> tuple[int, int]:
    """A process's latest utilisation sample and when its period ended, computed as the
    simulated NVML does (nvmlDeviceGetProcessUtilization): busy time between its two newest
    samples; (0, 0) before it has two."""
    *vals, head = _USNAP.unpack_from(data, offset + 592)
    times, done = vals[:_USNAPS], vals[_USNAPS:]
    h = head % _USNAPS
    prev = (h + _USNAPS - 1) % _USNAPS
    span = times[h] - times[prev]
    if not times[h] or not times[prev] or span <= 0:
        return 0, 0
    return min(100, (100 * (done[h] - done[prev]) + span // 2) // span), times[h]


_advance_lib: ctypes.CDLL | None = None


def _advance(path: Path) -> None:
    """Bring the GPU's device model up to now (the simulated driver's qgpuSimAdvance)."""
    global _advance_lib
    if _advance_lib is None:
        lib = ctypes.CDLL(str(sim_library_dir() / "libnvidia-ml.so.1"))
        lib.qgpuSimAdvance.argtypes = [ctypes.c_char_p]
        lib.qgpuSimAdvance.restype = ctypes.c_int
        _advance_lib = lib
    if _advance_lib.qgpuSimAdvance(os.fsencode(path)) != 0:
        raise ValueError(f"{path} is not a simulated GPU state file")


def read_gpu_state(config: SimConfig | str | os.PathLike[str], gpu: int | str = 0) -> SimGpuState:
    """Snapshot of a simulated GPU's shared state (memory, device time, processes), with the
    device model brought up to now first."""
    cfg = config if isinstance(config, SimConfig) else load_sim_config(config)
    path = cfg.state_path(gpu)
    _advance(path)
    now = _monotonic_ns()
    data = path.read_bytes()
    header = _HEADER.unpack_from(data, 0)
    magic, _ver, _nprocs, total, used, _tail, busy, launches, _created = header
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a simulated GPU state file")
    sched, slice_ns = _SCHED.unpack_from(data, 388)
    (done_total,) = _DONE_TOTAL.unpack_from(data, 424)
    (unowned,) = _UNOWNED.unpack_from(data, 432)
    procs = []
    for i in range(_MAX_PROCS):
        offset = _PROCS_OFFSET + i * _PROC_SIZE
        pid, _h, _start, mem, pbusy, _last, plaunch, pdone, ctxs = _PROC.unpack_from(data, offset)
        if pid:
            util, util_at = _sm_util(data, offset)
            (managed,) = _MANAGED.unpack_from(data, offset + _MANAGED_OFFSET)
            procs.append(SimProcess(pid, mem, pbusy, pdone, plaunch, ctxs, util, util_at, managed))
    return SimGpuState(
        now,
        total,
        used,
        busy,
        done_total,
        launches,
        SCHEDULERS[0] if sched == 1 else SCHEDULERS[1],
        tuple(procs),
        slice_ns,
        unowned,
    )


def gpu_memory_used(config: SimConfig | str | os.PathLike[str], gpu: int | str = 0) -> int:
    return read_gpu_state(config, gpu).mem_used


def process_memory(
    config: SimConfig | str | os.PathLike[str], gpu: int | str = 0
) -> dict[int, int]:
    """pid -> bytes held on the simulated GPU (slots of dead processes may linger until the
    next allocation or NVML query reclaims them)."""
    return {p.pid: p.mem_used for p in read_gpu_state(config, gpu).processes}


def busy_share(before: SimGpuState, after: SimGpuState, pid: int | None = None) -> float:
    """Fraction of the wall time between two snapshots the device spent on ``pid``'s work
    (or on anyone's, when pid is None)."""
    span = after.now_ns - before.now_ns
    if span <= 0:
        raise ValueError("snapshots must be in time order")
    if pid is None:
        return (after.done_total_ns - before.done_total_ns) / span
    a, b = before.process(pid), after.process(pid)
    done_a = a.done_ns if a else 0
    done_b = b.done_ns if b else 0
    return (done_b - done_a) / span


def utilization(
    config: SimConfig | str | os.PathLike[str], gpu: int | str = 0, seconds: float = 0.5
) -> float:
    """Device utilisation (0..1) over the next ``seconds``."""
    import time

    before = read_gpu_state(config, gpu)
    time.sleep(seconds)
    return busy_share(before, read_gpu_state(config, gpu))


def _monotonic_ns() -> int:
    import time

    return time.monotonic_ns()
