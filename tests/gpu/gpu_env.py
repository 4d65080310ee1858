"""What the real-GPU tests share: the GPU's UUID as the driver names it, and the environment
of a slice's process under the interposer on that GPU."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from enforcement.native import hook_library_path

GIB = 1 << 30


@functools.cache
def gpu_uuid() -> str | None:
    """GPU 0's UUID from the real driver; None without a driver or a GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cuda.cuInit(0) != 0:
        return None
    dev = ctypes.c_int()
    raw = (ctypes.c_ubyte * 16)()
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0 or cuda.cuDeviceGetUuid(raw, dev) != 0:
        return None
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def slice_env(
    tmp: Path, slice_id: str, memory: int = 4 * GIB, core: int = 100, policy: str = "best-effort"
) -> dict[str, str]:
    """A slice's process on GPU 0 under the built interposer (NativeLibraryMissing if none)."""
    uuid = str(gpu_uuid())
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGPU_")}
    env.update(
        LD_PRELOAD=str(hook_library_path()),
        CUDA_VISIBLE_DEVICES=uuid,
        QGPU_SLICE_ID=slice_id,
        QGPU_DEVICE_UUID=uuid,
        QGPU_MEMORY_LIMIT=str(memory),
        QGPU_CORE_LIMIT=str(core),
        QGPU_ISOLATION=policy,
        QGPU_STATE_DIR=str(tmp / "ledgers"),
    )
    return env
