"""The interposer's limits contract, from the Python side: the one place that turns a
validated slice (``qgpu.model``) into the ``QGPU_*`` variables or the limits file that
``libqgpu_hook.so`` reads at ``cuInit``.

Keys (docs/enforcement.md has the full contract)::

    QGPU_SLICE_ID      [A-Za-z0-9][A-Za-z0-9._-]{0,63}
    QGPU_DEVICE_UUID   the physical GPU (CUDA_VISIBLE_DEVICES is set to it as well)
    QGPU_MEMORY_LIMIT  bytes, integer > 0 (absent: no memory cap, whole GPUs)
    QGPU_CORE_LIMIT    1..100 (100 = no compute cap)
    QGPU_ISOLATION     best-effort | fixed-share | burst-share
    QGPU_STATE_DIR     the slices root: <dir>/<slice>/ledger/ holds the slice's shared ledger,
                       <dir>/.gpu-<uuid>/ what the GPU's slices tell each other
                       (default /tmp/qgpu-state; layout in `enforcement.state_tree`)
    QGPU_LIMITS_FILE   the limits file (default /etc/qgpu/limits.conf)
    QGPU_REAL_LIBCUDA  driver to forward to (default libcuda.so.1)
    QGPU_SIM_CONFIG    simulated GPUs
    QGPU_MPS_PIPE_DIRECTORY  the agent's MPS backend: the slice GPU's MPS daemon; the
                       interposer then sets the slice's MPS caps (CUDA_MPS_*) from these
                       limits at cuInit, over the process's own environment, and does not
                       gate compute (MPS partitions the GPU instead)

A limits file owned by root and not writable by group/other wins over the environment.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from qgpu.errors import RuleViolation
from qgpu.model import SLICE_ID_RULE, Allocation, IsolationPolicy, SliceRequest, is_slice_id
from qgpu.units import BYTES_PER_GIB

DEFAULT_STATE_DIR = "/tmp/qgpu-state"
DEFAULT_LIMITS_FILE = "/etc/qgpu/limits.conf"
LIMIT_KEYS = (
    "QGPU_SLICE_ID",
    "QGPU_DEVICE_UUID",
    "QGPU_MEMORY_LIMIT",
    "QGPU_CORE_LIMIT",
    "QGPU_ISOLATION",
    "QGPU_STATE_DIR",
    "QGPU_LIMITS_FILE",
    "QGPU_REAL_LIBCUDA",
    "QGPU_SIM_CONFIG",
    "QGPU_MPS_PIPE_DIRECTORY",
)
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_SAFE_VALUE = re.compile(r"^[^\n\r\x00]*$")


@dataclass(frozen=True)
class SliceLimits:
    """What the interposer enforces for one slice on one GPU."""

    slice_id: str
    device_uuid: str
    memory_bytes: int | None
    core: int = 100
    isolation: IsolationPolicy = IsolationPolicy.BEST_EFFORT
    state_dir: str | None = None
    real_libcuda: str | None = None
    sim_config: str | None = None
    mps_pipe_directory: str | None = None

    def __post_init__(self) -> None:
        if not is_slice_id(self.slice_id):
            raise RuleViolation("QGPU_SLICE_ID", self.slice_id, SLICE_ID_RULE)
        if not _UUID.match(self.device_uuid):
            raise RuleViolation(
                "QGPU_DEVICE_UUID", self.device_uuid, "must be a GPU UUID such as GPU-5f3c2a1b-..."
            )
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise RuleViolation(
                "QGPU_MEMORY_LIMIT", self.memory_bytes, "must be an integer number of bytes > 0"
            )
        if not 1 <= self.core <= 100:
            raise RuleViolation(
                "QGPU_CORE_LIMIT", self.core, "must be an integer 1..100 (100 = no compute cap)"
            )
        mps = self.mps_pipe_directory
        if mps is not None and (
            not mps.startswith("/") or len(mps) >= 1024 or not _SAFE_VALUE.match(mps)
        ):
            raise RuleViolation(
                "QGPU_MPS_PIPE_DIRECTORY", mps, "must be an absolute path of one line, shorter "
                "than 1024 bytes (the MPS daemon's pipe directory of the slice's GPU)"
            )

    def to_env(self) -> dict[str, str]:
        """The QGPU_* variables (also the lines of a limits file)."""
        env = {
            "QGPU_SLICE_ID": self.slice_id,
            "QGPU_DEVICE_UUID": self.device_uuid,
            "QGPU_CORE_LIMIT": str(self.core),
            "QGPU_ISOLATION": self.isolation.value,
        }
        if self.memory_bytes is not None:
            env["QGPU_MEMORY_LIMIT"] = str(self.memory_bytes)
        if self.state_dir:
            env["QGPU_STATE_DIR"] = self.state_dir
        if self.real_libcuda:
            env["QGPU_REAL_LIBCUDA"] = self.real_libcuda
        if self.sim_config:
            env["QGPU_SIM_CONFIG"] = self.sim_config
        if self.mps_pipe_directory:
            env["QGPU_MPS_PIPE_DIRECTORY"] = self.mps_pipe_directory
        return env

    @classmethod
    def from_mapping(cls, values: Mapping[str, str]) -> SliceLimits:
        """Parse QGPU_* values (an environment or a limits file) with the interposer's rules."""
        unknown = sorted(k for k in values if k.startswith("QGPU_") and k not in LIMIT_KEYS)
        if unknown:
            raise RuleViolation(
                unknown[0], values[unknown[0]], "is not a key of the limits contract"
            )
        slice_id = values.get("QGPU_SLICE_ID", "")
        mem = values.get("QGPU_MEMORY_LIMIT")
        core = values.get("QGPU_CORE_LIMIT", "100")
        if mem is not None and not mem.isdigit():
            raise RuleViolation("QGPU_MEMORY_LIMIT", mem, "must be an integer number of bytes > 0")
        if not core.isdigit():
            raise RuleViolation("QGPU_CORE_LIMIT", core, "must be an integer 1..100")
        return cls(
            slice_id=slice_id,
            device_uuid=values.get("QGPU_DEVICE_UUID", ""),
            memory_bytes=int(mem) if mem is not None else None,
            core=int(core),
            isolation=IsolationPolicy.parse(
                values.get("QGPU_ISOLATION", IsolationPolicy.BEST_EFFORT.value), "QGPU_ISOLATION"
            ),
            state_dir=values.get("QGPU_STATE_DIR"),
            real_libcuda=values.get("QGPU_REAL_LIBCUDA"),
            sim_config=values.get("QGPU_SIM_CONFIG"),
            mps_pipe_directory=values.get("QGPU_MPS_PIPE_DIRECTORY"),
        )


def new_slice_id(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def limits_for_request(
    request: SliceRequest,
    *,
    slice_id: str,
    device_uuid: str,
    node_default: IsolationPolicy | None = None,
    state_dir: str | None = None,
) -> SliceLimits:
    """Limits of a validated request placed on ``device_uuid``. Whole-GPU requests get no
    memory cap and no compute cap."""
    if request.is_whole_gpu:
        return SliceLimits(slice_id, device_uuid, None, 100, IsolationPolicy.BEST_EFFORT, state_dir)
    assert request.memory_gib is not None  # SliceRequest requires it for a share
    return SliceLimits(
        slice_id=slice_id,
        device_uuid=device_uuid,
        memory_bytes=request.memory_gib * BYTES_PER_GIB,
        core=request.core,
        isolation=request.effective_isolation(node_default),
        state_dir=state_dir,
    )


def limits_for_allocation(alloc: Allocation, *, state_dir: str | None = None) -> SliceLimits:
    """Limits of a share allocation (a slice of ``alloc.gpu_uuids[0]``)."""
    return SliceLimits(
        slice_id=alloc.slice_id,
        device_uuid=alloc.gpu_uuids[0],
        memory_bytes=alloc.memory_gib * BYTES_PER_GIB,
        core=min(alloc.core, 100),
        isolation=alloc.isolation,
        state_dir=state_dir,
    )


def allocation_env(
    alloc: Allocation,
    *,
    hook_path: str | os.PathLike[str] | None = None,
    state_dir: str | None = None,
) -> dict[str, str]:
    """Environment that puts a worker process in ``alloc`` before CUDA starts.

    Shares get ``LD_PRELOAD`` (the built interposer unless ``hook_path`` is given),
    ``CUDA_VISIBLE_DEVICES=<uuid>`` and the limits; whole GPUs get the devices and the slice
    id only. Node-level settings (QGPU_STATE_DIR, simulation) are added only when given.
    """
    if alloc.core >= 100:
        return {"CUDA_VISIBLE_DEVICES": ",".join(alloc.gpu_uuids), "QGPU_SLICE_ID": alloc.slice_id}
    if hook_path is None:
        from enforcement.native import hook_library_path

        hook_path = hook_library_path()
    env = limits_for_allocation(alloc, state_dir=state_dir).to_env()
    env["CUDA_VISIBLE_DEVICES"] = alloc.gpu_uuids[0]
    env["LD_PRELOAD"] = str(hook_path)
    return env


def render_limits(limits: SliceLimits | Mapping[str, str]) -> str:
    """The limits file text: sorted KEY=VALUE lines."""
    values = limits.to_env() if isinstance(limits, SliceLimits) else dict(limits)
    lines = ["# qgpu slice limits (read by libqgpu_hook.so at cuInit)"]
    for key in sorted(values):
        if key not in LIMIT_KEYS:
            raise RuleViolation(key, values[key], "is not a key of the limits contract")
        if not _SAFE_VALUE.match(values[key]):
            raise RuleViolation(key, values[key], "must not contain a newline or NUL")
        lines.append(f"{key}={values[key]}")
    return "\n".join(lines) + "\n"


def write_limits_file(
    path: str | os.PathLike[str],
    limits: SliceLimits | Mapping[str, str],
    *,
    mode: int = 0o444,
    root_owned: bool = False,
    owner: tuple[int, int] | None = None,
    fsync: bool = True,
    new: bool = False,
) -> Path:
    """Write a limits file atomically (temp file, rename); an identical file with the right
    mode (and owner) is left alone. Written by root (``root_owned``: chown 0:0, or
    ``owner=(0, gid)``: root and the slice's group) with a mode no group or other can
    write, it is the authoritative source the workload cannot loosen. ``fsync=False``
    suits writers that can rebuild the file from their own durable state (the node agent
    rewrites every limits file from its ledger when it starts).

    ``new``: the file must not exist yet (FileExistsError if it does) and nobody reads it
    before the caller says where it is (a slice directory just made): it is made in place,
    without a temporary file and a rename; a failed write removes it, so it is still whole
    or absent."""
    text = render_limits(limits)
    if root_owned and owner is None:
        owner = (0, 0)
    if new:
        fd = os.open(path, _NEW_FILE, 0o600 if owner is not None else mode)
        try:
            _fill(fd, text, fsync, owner, mode)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return Path(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.lstat()
        if (
            (st.st_mode & 0o777) == mode
            and stat.S_ISREG(st.st_mode)
            and (owner is None or (st.st_uid, st.st_gid) == owner)
            and path.read_text() == text
        ):
            return path
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _fill(fd, text, fsync, owner, mode, chmod=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _fill(
    fd: int,
    text: str,
    fsync: bool,
    owner: tuple[int, int] | None,
    mode: int,
    chmod: bool = False,
) -> None:
    """Write `text` whole to a new file, then give it its owner and mode; closes `fd`."""
    try:
        data = memoryview(text.encode())
        while data:  # a nearly full disk may take part of a write: never keep half a file
            data = data[os.write(fd, data) :]
        if fsync:
            os.fsync(fd)
        if owner is not None:
            os.fchown(fd, *owner)
        if chmod or owner is not None or mode & process_umask():
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


@functools.cache
def process_umask() -> int:
    """This process's umask (read once, from ``/proc/self/status``; where it cannot be read,
    0o777, so that every mode is set explicitly). The agent never changes its umask while
    it makes files (the socket's umask is set and restored before any)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777


def read_limits_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """KEY=VALUE lines of a limits file (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise RuleViolation("QGPU_LIMITS_FILE", f"{path}:{number}", "lines must be KEY=VALUE")
        key, value = line.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def is_trusted_limits_file(path: str | os.PathLike[str]) -> bool:
    """The interposer's rule: owned by root, not writable by group or other."""
    st = Path(path).stat()
    return st.st_uid == 0 and not st.st_mode & 0o022
