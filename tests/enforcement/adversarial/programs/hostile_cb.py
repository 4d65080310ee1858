"""Shared by the hostile Python programs: NVIDIA's cuda-bindings, as a framework uses it
(every driver function is resolved through cuGetProcAddress), plus the report protocol of
the corpus (``key value`` lines, ``ready 0``, hold until stdin closes)."""

from __future__ import annotations

import sys
from typing import Any

from cuda.bindings import driver as cuda

GIB = 1 << 30
MIB = 1 << 20
SIZE_MAX = (1 << 64) - 1


def say(key: str, value: object) -> None:
    print(f"{key} {int(value)}", flush=True)  # type: ignore[call-overload]


def code(result: Any) -> int:
    """The CUresult of a cuda-bindings call (its first element when it returns a tuple)."""
    first = result[0] if isinstance(result, tuple) else result
    return int(first)


def setup() -> Any:
    """cuInit, then the primary context of device 0, made current."""
    assert code(cuda.cuInit(0)) == 0
    _, dev = cuda.cuDeviceGet(0)
    err, ctx = cuda.cuDevicePrimaryCtxRetain(dev)
    assert int(err) == 0, err
    cuda.cuCtxSetCurrent(ctx)
    return ctx


def alloc(size: int, key: str = "grab") -> int:
    """cuMemAlloc; reports its CUresult under `key`; returns the pointer or 0."""
    err, ptr = cuda.cuMemAlloc(size)
    say(key, int(err))
    return int(ptr) if int(err) == 0 else 0


def hold() -> None:
    say("ready", 0)
    sys.stdin.read()


def busy_kernel() -> Any:
    """The simulated device's `qgpu_sim_busy` kernel (runs as many ns as its parameter)."""
    err, mod = cuda.cuModuleLoadData(b"qgpu-sim-module\0")
    assert int(err) == 0, err
    err, fn = cuda.cuModuleGetFunction(mod, b"qgpu_sim_busy")
    assert int(err) == 0, err
    return fn


def launch_busy(fn: Any, ns: int, stream: Any) -> int:
    import ctypes

    return code(
        cuda.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, ((ns,), (ctypes.c_uint64,)), 0)
    )
