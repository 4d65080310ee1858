"""Tasks the Dask tests run on slice workers: they report the slice from inside the worker
process and do "GPU work" through the simulated driver (through the preloaded interposer)."""

from __future__ import annotations

import os
from typing import Any

SLICE_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "QGPU_SLICE_ID",
    "QGPU_DEVICE_UUID",
    "QGPU_MEMORY_LIMIT",
    "QGPU_CORE_LIMIT",
    "QGPU_ISOLATION",
)


def where() -> dict[str, Any]:
    """The worker's name and pid, and its slice environment."""
    from distributed import get_worker

    return {
        "worker": get_worker().name,
        "pid": os.getpid(),
        **{k: os.environ.get(k, "") for k in SLICE_KEYS},
    }


def cuda_probe(over_by_gib: int = 1) -> dict[str, Any]:
    """cuInit, the device, cuMemGetInfo, the interposer in the maps, an allocation above the
    cap and one within it."""
    from enforcement import simcuda

    out = where()
    with open("/proc/self/maps") as f:
        out["preloaded"] = "libqgpu_hook.so" in f.read()
    drv = simcuda.Driver()
    drv.init()
    drv.context(0)
    out["uuid"] = drv.device_uuid(0)
    out["count"] = drv.device_count()
    _free, total = drv.mem_get_info()
    out["total"] = total
    out["over_cap"], _ = drv.try_mem_alloc(total + over_by_gib * (1 << 30))
    code, alloc = drv.try_mem_alloc(total // 2)
    out["half"] = code
    if alloc is not None:
        drv.mem_free(alloc)
    return out
