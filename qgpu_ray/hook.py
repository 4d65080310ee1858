"""The worker-process setup hook of a qgpu node: cheap for every worker, binding for slices.

Every Ray worker of a node started by ``qgpu-ray start`` (or `qgpu_ray.LocalCluster`) runs
`install` before its first task (Ray's ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``). It
imports nothing beyond Ray and the standard library, so workers that never hold a slice
pay next to nothing. It does two things:

1. registers a bind callback with the preloaded interposer: the worker's first CUDA call
   (in practice ``cuInit``) binds the worker if it is not bound yet, or records an SDK
   actor's slice with the node agent (`qgpu_ray.bind`);
2. answers Ray's accelerator-id lookup (``Worker.get_accelerator_ids_for_accelerator_resource``,
   which serves ``ray.get_gpu_ids()``, ``get_runtime_context().get_accelerator_ids()`` and
   the ``CUDA_VISIBLE_DEVICES`` Ray sets when a task starts) with the slice's GPU. Ray asks
   it when a task or actor starts, before user code runs; for work that holds a slice
   (qgpu resources or ``num_gpus``) that is where the worker binds, so device, caps and
   GPU ids agree from the first line of user code.

The heavy part (the core model, the agent client, and for plain resources the placement
engine) is imported only by workers that bind; bench/ray_overhead.py --breakdown measures
it per step (`MARKS` here, ``qgpu_ray.bind.PHASES``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GPU = "GPU"
TOTAL_CORE = "qgpu-core"  # == qgpu.units.CORE_FIELD (kept literal: this module stays light)
_BIND_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)

_callback_ref: object | None = None
_original_lookup: Callable[[str, str], list[Any]] | None = None
_installed = threading.Event()
# wall-clock marks of this worker's start-up (time.time(); ``*_cpu``: thread CPU seconds),
# read by bench/ray_overhead.py --breakdown
MARKS: dict[str, float] = {}


def wants_slice(assigned: dict[str, float]) -> bool:
    """Does work holding these Ray resources run in a qgpu slice?"""
    return bool(assigned.get(TOTAL_CORE) or assigned.get(GPU))


def ray_gpu_ids() -> list[Any]:
    """The GPU ids Ray itself assigned to the current task or actor (uuids on qgpu nodes)."""
    import ray

    worker = ray._private.worker.global_worker
    lookup = _original_lookup or worker.get_accelerator_ids_for_accelerator_resource
    return list(lookup(GPU, f"^{GPU}_group_[0-9A-Za-z]+$"))


def _sdk_devices() -> list[str] | None:
    """The SDK's runtime_env form put the slice in the worker's start-up environment."""
    if not os.environ.get("QGPU_SLICE_ID"):
        return None
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]


def _lookup(resource_name: str, resource_regex: str) -> list[Any]:
    assert _original_lookup is not None
    ids = _original_lookup(resource_name, resource_regex)
    if resource_name != GPU:
        return ids
    import ray

    if not wants_slice(ray.get_runtime_context().get_assigned_resources()):
        return ids
    sdk = _sdk_devices()
    if sdk is not None:
        return sdk
    if "import_bind_start" not in MARKS:
        MARKS["import_bind_start"], MARKS["import_bind_start_cpu"] = time.time(), time.thread_time()
    from qgpu_ray import bind

    if "import_bind_end" not in MARKS:
        MARKS["import_bind_end"], MARKS["import_bind_end_cpu"] = time.time(), time.thread_time()
    binding = bind.bind_quietly(ids)
    return list(binding.allocation.gpu_uuids) if binding is not None else ids


def _on_cuinit() -> int:
    """The interposer's bind callback: 0 = go on with cuInit, non-zero = refuse it."""
    try:
        from qgpu_ray import bind

        return bind.on_cuinit()
    except Exception as exc:  # never let an exception cross the C boundary
        print(f"qgpu: binding this worker failed: {exc!r}", file=sys.stderr, flush=True)
        return 1


def _patch_lookup() -> None:
    global _original_lookup
    import ray

    worker = ray._private.worker.global_worker
    original = worker.get_accelerator_ids_for_accelerator_resource
    if getattr(original, "__qgpu__", False):
        return
    _original_lookup = original

    def lookup(resource_name: str, resource_regex: str) -> list[Any]:
        return _lookup(resource_name, resource_regex)

    lookup.__qgpu__ = True  # type: ignore[attr-defined]
    worker.get_accelerator_ids_for_accelerator_resource = lookup


def _register_callback() -> bool:
    global _callback_ref
    try:
        register = ctypes.CDLL(None).qgpu_hook_set_bind_callback
    except AttributeError:
        return False  # the interposer is not preloaded in this worker
    callback = _BIND_CALLBACK(_on_cuinit)
    _callback_ref = callback  # keep it alive for the life of the process
    register.argtypes = [_BIND_CALLBACK]
    register.restype = ctypes.c_int
    register(callback)
    return True


def install() -> None:
    """Ray worker-process setup hook (see the module docstring)."""
    MARKS["install_start"] = time.time()
    os.environ.setdefault("QGPU_BIND", "ray")
    _register_callback()
    _patch_lookup()
    _installed.set()
    MARKS["install_end"] = time.time()


def installed() -> bool:
    return _installed.is_set()
