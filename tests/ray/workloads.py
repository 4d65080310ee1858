"""Actors used by the Ray tests: they report their slice and do "GPU work" through the
simulated driver (and therefore through the interposer preloaded in their worker)."""

from __future__ import annotations

import os

import ray


@ray.remote
class SliceProbe:
    """Reports the slice environment and exercises the driver from inside the worker."""

    def env(self) -> dict[str, str]:
        return slice_env()

    def gpu_ids(self) -> dict[str, list[str]]:
        return gpu_ids()

    def hooks(self) -> dict[str, object]:
        """What this worker shows of each Ray internal qgpu relies on (qgpu_ray.compat)."""
        from qgpu_ray import hook

        worker = ray._private.worker.global_worker
        lookup = worker.get_accelerator_ids_for_accelerator_resource
        return {
            "setup_hook_ran": hook.installed(),
            "ld_preload": self.preloaded(),
            "ld_preload_env": os.environ.get("LD_PRELOAD", ""),
            "lookup_patched": bool(getattr(lookup, "__qgpu__", False)),
            "original_ids": list(worker.original_visible_accelerator_ids.get("GPU") or []),
        }

    def preloaded(self) -> bool:
        with open("/proc/self/maps") as f:
            return "libqgpu_hook.so" in f.read()

    def cuda(self, over_by_gib: int = 1) -> dict[str, object]:
        return cuda_report(over_by_gib)

    def pid(self) -> int:
        return os.getpid()


def cuda_report(over_by_gib: int = 1) -> dict[str, object]:
    """cuInit, device identity, cuMemGetInfo, and an allocation above the cap."""
    from enforcement import simcuda

    out: dict[str, object] = {}
    drv = simcuda.Driver()
    code = drv.try_init()
    out["init"] = code
    if code != simcuda.CUDA_SUCCESS:
        from qgpu_ray import bind

        out["bind_error"] = bind.last_error()
        return out
    drv.context(0)
    out["uuid"] = drv.device_uuid(0)
    out["count"] = drv.device_count()
    _free, total = drv.mem_get_info()
    out["total"] = total
    out["env"] = slice_env()
    out["ids"] = gpu_ids()
    code, alloc = drv.try_mem_alloc(total + over_by_gib * (1 << 30))
    out["over_cap"] = code
    code, alloc = drv.try_mem_alloc(total // 2)
    out["half"] = code
    if alloc is not None:
        drv.mem_free(alloc)
    return out


def slice_env() -> dict[str, str]:
    keys = (
        "CUDA_VISIBLE_DEVICES",
        "QGPU_SLICE_ID",
        "QGPU_DEVICE_UUID",
        "QGPU_MEMORY_LIMIT",
        "QGPU_CORE_LIMIT",
        "QGPU_ISOLATION",
    )
    return {k: os.environ.get(k, "") for k in keys}


def gpu_ids() -> dict[str, list[str]]:
    """What Ray says the worker's GPUs are (both public APIs)."""
    return {
        "get_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        "accelerator_ids": ray.get_runtime_context().get_accelerator_ids()["GPU"],
    }
