"""Memory the way a real driver keeps it (issue 16, "What to build" 2): VMM physical memory
lives until its last unmap and release, stream-ordered frees take effect when the stream
reaches them, pools keep freed memory up to their release threshold until trimmed, contexts
cost memory (configurable per GPU), and every size check refuses instead of wrapping. Each
test here failed on the simulator before commit 4b11bae (the device runtime's limits came
later). The simulator alone, no interposer: what it does is what the interposer's accounting
must match; test_device_runtime_limits_are_charged_to_the_slice runs the same calls under it."""

from __future__ import annotations

from pathlib import Path

import pytest

from enforcement.sim import write_sim_config

from .conftest import CTX, GIB, Sim, run_json

MIB = 1 << 20
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, UNSUPPORTED_LIMIT = 0, 1, 2, 215

# Common prelude: the driver with typed entry points, a primary context, used().
PRELUDE = """
import ctypes, json, sys, time
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_uint64, c_void_p
from enforcement.simcuda import MemAllocationProp, MemPoolProps
lib = ctypes.CDLL("libcuda.so.1")
P = POINTER
SIG = {
    "cuMemCreate": [P(c_uint64), c_size_t, c_void_p, c_uint64],
    "cuMemAddressReserve": [P(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemAddressFree": [c_uint64, c_size_t],
    "cuMemMap": [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64],
    "cuMemUnmap": [c_uint64, c_size_t], "cuMemRelease": [c_uint64],
    "cuMemRetainAllocationHandle": [P(c_uint64), c_void_p],
    "cuMemAlloc_v2": [P(c_uint64), c_size_t], "cuMemFree_v2": [c_uint64],
    "cuMemAllocPitch_v2": [P(c_uint64), P(c_size_t), c_size_t, c_size_t, c_uint],
    "cuMemAllocAsync": [P(c_uint64), c_size_t, c_void_p],
    "cuMemAllocFromPoolAsync": [P(c_uint64), c_size_t, c_void_p, c_void_p],
    "cuMemFreeAsync": [c_uint64, c_void_p],
    "cuMemPoolCreate": [P(c_void_p), c_void_p], "cuMemPoolTrimTo": [c_void_p, c_size_t],
    "cuMemPoolSetAttribute": [c_void_p, c_int, c_void_p],
    "cuMemPoolGetAttribute": [c_void_p, c_int, c_void_p],
    "cuCtxSetLimit": [c_int, c_size_t], "cuCtxCreate_v2": [P(c_void_p), c_uint, c_int],
    "cuCtxGetLimit": [P(c_size_t), c_int],
    "cuLaunchKernel": [c_void_p] + [c_uint] * 7 + [c_void_p] * 3,
}
for name, args in SIG.items():
    getattr(lib, name).argtypes = args
assert lib.cuInit(0) == 0
ctx = c_void_p()
assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
def used():
    f, t = c_size_t(), c_size_t()
    assert lib.cuMemGetInfo_v2(byref(f), byref(t)) == 0
    return t.value - f.value
def prop():
    p = MemAllocationProp()
    p.type, p.location.type, p.location.id = 1, 1, 0
    return p
mod, busy = c_void_p(), c_void_p()
lib.cuModuleLoadData(byref(mod), b"qgpu-sim-module")
lib.cuModuleGetFunction(byref(busy), mod, b"qgpu_sim_busy")
def launch(ns, stream=None):
    arg = c_uint64(ns)
    params = (c_void_p * 1)(ctypes.cast(byref(arg), c_void_p))
    assert lib.cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, stream, params, None) == 0
out = {}
"""

VMM = (
    PRELUDE
    + """
size = 64 << 20
h, va = c_uint64(), c_uint64()
assert lib.cuMemCreate(byref(h), size, byref(prop()), 0) == 0
assert lib.cuMemAddressReserve(byref(va), 2 * size, 0, 0, 0) == 0
out["created"] = used()
out["map"] = lib.cuMemMap(va.value, size, 0, h.value, 0)
out["map_outside"] = lib.cuMemMap(va.value + 2 * size, size, 0, h.value, 0)
out["release"] = lib.cuMemRelease(h.value)  # NVIDIA's vectorAddMMAP releases right here
out["after_release"] = used()
out["map_released"] = lib.cuMemMap(va.value + size, size, 0, h.value, 0)
again = c_uint64()
out["retain"] = lib.cuMemRetainAllocationHandle(byref(again), c_void_p(va.value + 4096))
out["unmap"] = lib.cuMemUnmap(va.value, size)
out["after_unmap_retained"] = used()
out["release_retained"] = lib.cuMemRelease(again.value)
out["after_last_release"] = used()
out["double_release"] = lib.cuMemRelease(h.value)
out["free_va"] = lib.cuMemAddressFree(va.value, 2 * size)
print(json.dumps(out))
"""
)


def test_strict_vmm_memory_lives_until_last_unmap_and_release(sim: Sim) -> None:
    out = run_json(sim.base_env(), VMM)
    size = 64 * MIB
    assert out["created"] == CTX + size
    assert out["map"] == SUCCESS and out["map_outside"] != SUCCESS  # not reserved there
    assert out["release"] == SUCCESS
    assert out["after_release"] == CTX + size  # still mapped: still held
    assert out["map_released"] != SUCCESS  # a released handle cannot be mapped again
    assert out["retain"] == SUCCESS and out["unmap"] == SUCCESS
    assert out["after_unmap_retained"] == CTX + size  # unmapped, but retained again
    assert out["release_retained"] == SUCCESS
    assert out["after_last_release"] == CTX
    assert out["double_release"] == INVALID_VALUE and out["free_va"] == SUCCESS


ASYNC_FREE = (
    PRELUDE
    + """
stream = c_void_p()
assert lib.cuStreamCreate(byref(stream), 0) == 0
p = c_uint64()
assert lib.cuMemAllocAsync(byref(p), 256 << 20, stream) == 0
out["allocated"] = used()
launch(300_000_000, stream)  # the stream reaches the free 0.3 s from now
assert lib.cuMemFreeAsync(p.value, stream) == 0
out["after_free_call"] = used()
time.sleep(0.45)
out["reached_not_synced"] = used()  # the free ran; the pool keeps it until a sync
assert lib.cuStreamSynchronize(stream) == 0
out["after_sync"] = used()
print(json.dumps(out))
"""
)


def test_strict_async_free_takes_effect_in_stream_order(sim: Sim) -> None:
    out = run_json(sim.base_env(), ASYNC_FREE)
    assert out["allocated"] == CTX + 256 * MIB
    assert out["after_free_call"] == CTX + 256 * MIB  # the stream has not reached it
    assert out["reached_not_synced"] == CTX + 256 * MIB
    assert out["after_sync"] == CTX  # release threshold 0: given back at the sync


POOL = (
    PRELUDE
    + """
props = MemPoolProps()
props.allocType, props.location.type, props.location.id = 1, 1, 0
pool = c_void_p()
assert lib.cuMemPoolCreate(byref(pool), byref(props)) == 0
RELEASE_THRESHOLD, RESERVED_CURRENT, USED_CURRENT = 4, 5, 7
def attr(a):
    v = c_uint64()
    assert lib.cuMemPoolGetAttribute(pool, a, byref(v)) == 0
    return v.value
keep = c_uint64(256 << 20)
out["set"] = lib.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, byref(keep))
p = c_uint64()
assert lib.cuMemAllocFromPoolAsync(byref(p), 1 << 30, pool, None) == 0
out["allocated"] = [used(), attr(RESERVED_CURRENT), attr(USED_CURRENT)]
assert lib.cuMemFreeAsync(p.value, None) == 0
assert lib.cuCtxSynchronize() == 0
out["after_sync"] = [used(), attr(RESERVED_CURRENT), attr(USED_CURRENT)]
q = c_uint64()
assert lib.cuMemAllocFromPoolAsync(byref(q), 128 << 20, pool, None) == 0
out["reused"] = used()  # from what the pool kept: no new device memory
assert lib.cuMemFreeAsync(q.value, None) == 0
assert lib.cuCtxSynchronize() == 0
out["trim"] = lib.cuMemPoolTrimTo(pool, 0)
out["after_trim"] = [used(), attr(RESERVED_CURRENT)]
print(json.dumps(out))
"""
)


def test_strict_pools_keep_memory_up_to_their_release_threshold(sim: Sim) -> None:
    out = run_json(sim.base_env(), POOL)
    assert out["set"] == SUCCESS
    assert out["allocated"] == [CTX + GIB, GIB, GIB]
    assert out["after_sync"] == [CTX + 256 * MIB, 256 * MIB, 0]  # kept up to the threshold
    assert out["reused"] == CTX + 256 * MIB
    assert out["trim"] == SUCCESS
    assert out["after_trim"] == [CTX, 0]


CONTEXTS = (
    PRELUDE
    + """
out["primary"] = used()
c2 = c_void_p()
assert lib.cuCtxCreate_v2(byref(c2), 0, 0) == 0
out["two"] = used()
p = c_uint64()
assert lib.cuMemAlloc_v2(byref(p), 100 << 20) == 0
STACK = 0
out["limit"] = lib.cuCtxSetLimit(STACK, 1024 + 64)  # 64 more bytes for every resident thread
out["with_limit"] = used()
assert lib.cuCtxDestroy_v2(c2) == 0  # takes its allocation and its limit's memory with it
out["destroyed"] = used()
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("gpu", [0, 1])
def test_strict_contexts_cost_memory_per_gpu_model(short_tmp: Path, gpu: int) -> None:
    """A context costs its GPU's `context_memory` (the model's, unless the config says
    otherwise); so do the context's limits; destroying it gives all of it back."""
    cfg = write_sim_config(
        short_tmp / "c.conf", "H100-80GB,T4", node="ctxmem", context_memory={"T4": 300 * MIB}
    )
    assert cfg.gpus[0].context_memory == CTX  # Hopper's default: more than 512 MiB
    assert CTX > 512 * MIB
    cost = cfg.gpus[gpu].context_memory
    assert cost == (CTX, 300 * MIB)[gpu]
    env = Sim(cfg, short_tmp / "l").base_env(gpu)
    out = run_json(env, CONTEXTS)
    threads = (132 * 2048, 40 * 1024)[gpu]  # SMs x resident threads per SM (H100, T4)
    assert out["primary"] == cost
    assert out["two"] == 2 * cost
    assert out["limit"] == SUCCESS
    assert out["with_limit"] == 2 * cost + 100 * MIB + 64 * threads
    assert out["destroyed"] == cost


DEVRT = (
    PRELUDE
    + """
SYNC_DEPTH, PENDING = 3, 4
v = c_size_t()
base = used()
out["pending_default"] = [lib.cuCtxGetLimit(byref(v), PENDING), v.value]
out["pending"] = lib.cuCtxSetLimit(PENDING, 2048 + 1024)
out["pending_used"] = used() - base
out["pending_read"] = [lib.cuCtxGetLimit(byref(v), PENDING), v.value]
out["pending_huge"] = lib.cuCtxSetLimit(PENDING, 2048 + (1 << 30))  # 8 TiB: no card holds it
out["pending_back"] = lib.cuCtxSetLimit(PENDING, 2048)
out["pending_gone"] = used() - base
v.value = 0
out["sync_default"] = [lib.cuCtxGetLimit(byref(v), SYNC_DEPTH), v.value]
out["sync"] = lib.cuCtxSetLimit(SYNC_DEPTH, 4)
out["sync_used"] = used() - base
out["sync_deep"] = lib.cuCtxSetLimit(SYNC_DEPTH, 25)  # the maximum launch depth is 24
out["sync_back"] = lib.cuCtxSetLimit(SYNC_DEPTH, 2)
out["sync_gone"] = used() - base
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("gpu", [0, 1])
def test_strict_device_runtime_limits_reserve_memory(short_tmp: Path, gpu: int) -> None:
    """cuCtxSetLimit's device runtime limits reserve device memory (cuda.h): pending
    launches on every model, the sync depth only below compute capability 9.0
    (CUDA_ERROR_UNSUPPORTED_LIMIT on an H100) and at most 24; what the card cannot hold is
    refused; lowering gives it back."""
    cfg = write_sim_config(short_tmp / "d.conf", "H100-80GB,T4", node="devrt")
    out = run_json(Sim(cfg, short_tmp / "l").base_env(gpu), DEVRT)
    assert out["pending_default"] == [SUCCESS, 2048]
    assert out["pending"] == SUCCESS and out["pending_used"] == 1024 * 8 * 1024
    assert out["pending_read"] == [SUCCESS, 2048 + 1024]
    assert out["pending_huge"] == OUT_OF_MEMORY
    assert out["pending_back"] == SUCCESS and out["pending_gone"] == 0
    if gpu == 0:  # H100: compute capability 9.0
        assert out["sync_default"][0] == UNSUPPORTED_LIMIT
        assert out["sync"] == UNSUPPORTED_LIMIT and out["sync_used"] == 0
    else:  # T4: 40 SMs x 1024 threads, 4 KiB each per level above 2
        assert out["sync_default"] == [SUCCESS, 2]
        assert out["sync"] == SUCCESS and out["sync_used"] == 2 * 40 * 1024 * 4096
        assert out["sync_deep"] == INVALID_VALUE
        assert out["sync_back"] == SUCCESS and out["sync_gone"] == 0


@pytest.mark.parametrize("gpu", [0, 1])
def test_device_runtime_limits_are_charged_to_the_slice(short_tmp: Path, gpu: int) -> None:
    """The same calls in a 4 GiB slice: each raise is charged the hook's bound (16 KiB per
    pending launch, 8 KiB per resident thread per sync level; more than this driver takes),
    lowering gives it back, and the sync depth an H100 does not have is refused as the
    driver refuses it, before anything is charged."""
    cfg = write_sim_config(short_tmp / "d.conf", "H100-80GB,T4", node="devrt-hooked")
    env = Sim(cfg, short_tmp / "l").slice_env("devrt", gpu=gpu, memory=4 * GIB)
    out = run_json(env, DEVRT)
    assert out["pending"] == SUCCESS and out["pending_used"] == 1024 * 16 * 1024
    assert out["pending_huge"] == OUT_OF_MEMORY
    assert out["pending_back"] == SUCCESS and out["pending_gone"] == 0
    if gpu == 0:
        assert out["sync"] == UNSUPPORTED_LIMIT and out["sync_used"] == 0
    else:
        assert out["sync"] == SUCCESS and out["sync_used"] == 2 * 40 * 1024 * 8192
        assert out["sync_deep"] in (INVALID_VALUE, OUT_OF_MEMORY)  # 24 levels do not fit
        assert out["sync_back"] == SUCCESS and out["sync_gone"] == 0


OVERFLOW = (
    PRELUDE
    + """
from enforcement.simcuda import Array3DDescriptor
big = c_uint64()
assert lib.cuMemAlloc_v2(byref(big), 1 << 30) == 0
base = used()
M = 2**64
p, pitch, h, va, arr = c_uint64(), c_size_t(), c_uint64(), c_uint64(), c_void_p()
props = MemPoolProps()
props.allocType, props.location.type, props.location.id = 1, 1, 0
pool = c_void_p()
assert lib.cuMemPoolCreate(byref(pool), byref(props)) == 0
tries = {
    # used + bytes would wrap past 2**64 and look small
    "alloc": lib.cuMemAlloc_v2(byref(p), M - (256 << 20)),
    "alloc_max": lib.cuMemAlloc_v2(byref(p), M - 1),
    # pitch x height overflows 64 bits
    "pitch": lib.cuMemAllocPitch_v2(byref(p), byref(pitch), 1 << 33, 1 << 33, 4),
    "pitch_round": lib.cuMemAllocPitch_v2(byref(p), byref(pitch), M - 1, 1, 4),
    "create": lib.cuMemCreate(byref(h), M - (2 << 20), byref(prop()), 0),
    "async": lib.cuMemAllocAsync(byref(p), M - 1, None),
    "pool": lib.cuMemAllocFromPoolAsync(byref(p), M - (2 << 20) + 1, pool, None),
    "array3d": lib.cuArray3DCreate_v2(
        byref(arr), byref(Array3DDescriptor(1 << 22, 1 << 22, 1 << 22, 0x20, 4, 0))),
    "stack": lib.cuCtxSetLimit(0, M - 1),
    "reserve": lib.cuMemAddressReserve(byref(va), M - (2 << 20), 0, 0, 0),
}
tries["used_unchanged"] = used() == base
print(json.dumps(tries))
"""
)


def test_strict_every_size_check_is_overflow_safe(sim: Sim) -> None:
    out = run_json(sim.base_env(), OVERFLOW)
    assert out.pop("used_unchanged"), out
    for api, code in out.items():
        assert code in (OUT_OF_MEMORY, INVALID_VALUE), f"{api}: {code}"
