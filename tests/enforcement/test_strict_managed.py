"""Managed memory where NVIDIA's Unified Memory driver puts it (the simulator alone, no
interposer). cuMemAllocManaged memory lives on a GPU or on the host and counts in the used
memory of the GPU it is on; cuMemPrefetchAsync (every ABI form) and the CUDA 13 batch
prefetches move it, a prefetch with SET_READ_MOSTLY adds a read-only copy, advice records
policy without moving anything, and a kernel launch handles a block that lives elsewhere as
cuda.h says a fault does (it stays at its preferred location or where an ACCESSED_BY GPU
maps it, otherwise it migrates to the launching GPU). Before this work the simulator charged
managed memory to its context's GPU for good and had none of these entry points."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.sim import MODELS, process_memory, write_sim_config

from .conftest import GIB, Sim, run_json

MIB = 1 << 20
SUCCESS, INVALID_VALUE, INVALID_DEVICE = 0, 1, 101

PRELUDE = """
import ctypes, json, os, sys
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint, c_uint64, c_void_p
from enforcement.sim import process_memory
class Loc(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]
DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT = 1, 2, 3, 4
CPU = -1
lib = ctypes.CDLL("libcuda.so.1")
P = POINTER
SIG = {
    "cuMemAllocManaged": [P(c_uint64), c_size_t, c_uint], "cuMemFree_v2": [c_uint64],
    "cuMemAlloc_v2": [P(c_uint64), c_size_t],
    "cuMemPrefetchAsync": [c_uint64, c_size_t, c_int, c_void_p],
    "cuMemPrefetchAsync_ptsz": [c_uint64, c_size_t, c_int, c_void_p],
    "cuMemPrefetchAsync_v2": [c_uint64, c_size_t, Loc, c_uint, c_void_p],
    "cuMemPrefetchAsync_v2_ptsz": [c_uint64, c_size_t, Loc, c_uint, c_void_p],
    "cuMemPrefetchBatchAsync": [P(c_uint64), P(c_size_t), c_size_t, P(Loc), P(c_size_t),
                                c_size_t, c_uint64, c_void_p],
    "cuMemDiscardAndPrefetchBatchAsync": [P(c_uint64), P(c_size_t), c_size_t, P(Loc),
                                          P(c_size_t), c_size_t, c_uint64, c_void_p],
    "cuMemDiscardBatchAsync": [P(c_uint64), P(c_size_t), c_size_t, c_uint64, c_void_p],
    "cuMemAdvise": [c_uint64, c_size_t, c_int, c_int],
    "cuMemAdvise_v2": [c_uint64, c_size_t, c_int, Loc],
    "cuMemRangeGetAttribute": [c_void_p, c_size_t, c_int, c_uint64, c_size_t],
    "cuLaunchKernel": [c_void_p] + [c_uint] * 7 + [c_void_p] * 3,
    "cuCtxCreate_v2": [P(c_void_p), c_uint, c_int], "cuCtxDestroy_v2": [c_void_p],
    "cuStreamCreate": [P(c_void_p), c_uint],
}
for name, args in SIG.items():
    getattr(lib, name).argtypes = args
assert lib.cuInit(0) == 0
ctx = c_void_p()
assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
stream = c_void_p()
assert lib.cuStreamCreate(byref(stream), 0) == 0
CONFIG = os.environ["QGPU_SIM_CONFIG"]
def held(gpu):
    return process_memory(CONFIG, gpu).get(os.getpid(), 0)
def where():
    return [held(0), held(1)]
def managed(size):
    p = c_uint64()
    assert lib.cuMemAllocManaged(byref(p), size, 1) == 0
    return p.value
def dev(i):
    return Loc(DEVICE, i)
def attr(a, ptr, size):
    v = c_int(-99)
    r = lib.cuMemRangeGetAttribute(byref(v), 4, a, ptr, size)
    return v.value if r == 0 else ("error", r)
mod, kern = c_void_p(), c_void_p()
lib.cuModuleLoadData(byref(mod), b"qgpu-sim-module")
lib.cuModuleGetFunction(byref(kern), mod, b"k")
def launch():
    assert lib.cuLaunchKernel(kern, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
out = {}
"""

# a context on the T4s these tests run on (the H100 fixture's costs more)
CTX = MODELS["t4-16gb"].context_memory


@pytest.fixture
def two(short_tmp: Path) -> Sim:
    cfg = write_sim_config(short_tmp / "two.conf", "2xT4-16GB", node=f"um-{short_tmp.name}")
    return Sim(cfg, short_tmp / "ledgers")


def env_all(sim: Sim) -> dict[str, str]:
    env = sim.base_env()
    env.pop("CUDA_VISIBLE_DEVICES")  # both GPUs
    return env


def run(sim: Sim, body: str) -> dict[str, object]:
    out: dict[str, object] = run_json(env_all(sim), PRELUDE + body + "\nprint(json.dumps(out))")
    return out


def test_prefetch_moves_managed_memory_between_gpus_and_the_host(two: Sim) -> None:
    size = 1 * GIB
    out = run(
        two,
        f"""
size = {size}
p = managed(size)
out["allocated"] = where()
out["to1"] = lib.cuMemPrefetchAsync_v2(p, size, dev(1), 0, stream)
out["on1"] = where()
out["last"] = attr(4, p, size)
out["host"] = lib.cuMemPrefetchAsync_v2(p, size, Loc(HOST, 0), 0, stream)
out["on_host"] = where()
out["v1_to1"] = lib.cuMemPrefetchAsync(p, size, 1, stream)
out["v1_on1"] = where()
out["v1_cpu"] = lib.cuMemPrefetchAsync_ptsz(p, size, CPU, None)
out["numa"] = lib.cuMemPrefetchAsync_v2_ptsz(p, size, Loc(HOST_NUMA_CURRENT, 0), 0, None)
out["half_to0"] = lib.cuMemPrefetchAsync_v2(p, size // 2, dev(0), 0, stream)
out["half"] = where()
out["free"] = lib.cuMemFree_v2(p)
out["freed"] = where()
""",
    )
    assert out["allocated"] == [CTX + GIB, 0]  # populated on its context's GPU
    assert out["to1"] == SUCCESS and out["on1"] == [CTX, GIB]
    assert out["last"] == 1  # CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION
    assert out["host"] == SUCCESS and out["on_host"] == [CTX, 0]
    assert out["v1_to1"] == SUCCESS and out["v1_on1"] == [CTX, GIB]
    assert out["v1_cpu"] == SUCCESS and out["numa"] == SUCCESS
    assert out["half_to0"] == SUCCESS and out["half"] == [CTX + GIB // 2, 0]
    assert out["free"] == SUCCESS and out["freed"] == [CTX, 0]


def test_batch_prefetches_move_each_range_to_its_location(two: Sim) -> None:
    out = run(
        two,
        """
a, b = managed(256 << 20), managed(512 << 20)
ptrs = (c_uint64 * 2)(a, b)
sizes = (c_size_t * 2)(256 << 20, 512 << 20)
locs = (Loc * 2)(dev(1), Loc(HOST, 0))
idxs = (c_size_t * 2)(0, 1)
out["batch"] = lib.cuMemPrefetchBatchAsync(ptrs, sizes, 2, locs, idxs, 2, 0, stream)
out["after_batch"] = where()
one = (Loc * 1)(dev(1))
first = (c_size_t * 1)(0)
out["discard_prefetch"] = lib.cuMemDiscardAndPrefetchBatchAsync(ptrs, sizes, 2, one, first, 1,
                                                                0, stream)
out["after_discard_prefetch"] = where()
out["discard"] = lib.cuMemDiscardBatchAsync(ptrs, sizes, 2, 0, stream)
out["after_discard"] = where()
out["legacy_stream"] = lib.cuMemPrefetchBatchAsync(ptrs, sizes, 2, locs, idxs, 2, 0, None)
bad = (c_size_t * 2)(1, 0)
out["bad_idxs"] = lib.cuMemPrefetchBatchAsync(ptrs, sizes, 2, locs, bad, 2, 0, stream)
out["flags"] = lib.cuMemPrefetchBatchAsync(ptrs, sizes, 2, locs, idxs, 2, 1, stream)
""",
    )
    assert out["batch"] == SUCCESS and out["after_batch"] == [CTX, 256 * MIB]
    assert out["discard_prefetch"] == SUCCESS
    assert out["after_discard_prefetch"] == [CTX, 768 * MIB]
    assert out["discard"] == SUCCESS and out["after_discard"] == [CTX, 768 * MIB]  # kept
    assert out["legacy_stream"] == INVALID_VALUE  # "must not be legacy NULL stream"
    assert out["bad_idxs"] == INVALID_VALUE and out["flags"] == INVALID_VALUE


def test_read_mostly_prefetch_adds_a_copy_until_unset(two: Sim) -> None:
    out = run(
        two,
        """
size = 256 << 20
p = managed(size)
out["advise"] = lib.cuMemAdvise_v2(p, size, 1, Loc(0, 0))  # SET_READ_MOSTLY: location ignored
out["read_mostly"] = attr(1, p, size)
out["copy"] = lib.cuMemPrefetchAsync_v2(p, size, dev(1), 0, stream)
out["both"] = where()
out["unset"] = lib.cuMemAdvise_v2(p, size, 2, Loc(0, 0))
out["collapsed"] = where()
""",
    )
    assert out["advise"] == SUCCESS and out["read_mostly"] == 1
    assert out["copy"] == SUCCESS and out["both"] == [CTX + 256 * MIB, 256 * MIB]
    assert out["unset"] == SUCCESS and out["collapsed"] == [CTX + 256 * MIB, 0]


def test_advice_moves_nothing_and_a_launch_follows_cuda_h(two: Sim) -> None:
    """SET_PREFERRED_LOCATION and SET_ACCESSED_BY record policy ("does not cause data to
    migrate"). A kernel on GPU 0 touching memory on GPU 1 migrates it back, unless GPU 1 is
    its preferred location or GPU 0 maps it there (ACCESSED_BY)."""
    out = run(
        two,
        """
size = 256 << 20
p, q, r = managed(size), managed(size), managed(size)
out["pref"] = lib.cuMemAdvise_v2(p, size, 3, dev(1))
out["pref_v1"] = lib.cuMemAdvise(q, size, 3, 1)
out["by"] = lib.cuMemAdvise_v2(r, size, 5, dev(1))
out["advised"] = where()
out["pref_attr"] = [attr(2, p, size), attr(5, p, size), attr(6, p, size)]
acc = (c_int * 3)()
lib.cuMemRangeGetAttribute(acc, 12, 3, r, size)
out["accessed_by"] = list(acc)
for x in (p, q, r):
    assert lib.cuMemPrefetchAsync_v2(x, size, dev(1), 0, stream) == 0
out["prefetched"] = where()
out["by0"] = lib.cuMemAdvise_v2(r, size, 5, dev(0))  # GPU 0 maps it where it is
out["unset_q"] = lib.cuMemAdvise(q, size, 4, 0)  # q loses its preference
launch()
out["after_launch"] = where()
out["p_last"] = attr(4, p, size)
""",
    )
    assert out["pref"] == out["pref_v1"] == out["by"] == SUCCESS
    assert out["advised"] == [CTX + 3 * 256 * MIB, 0]  # nothing moved
    assert out["pref_attr"] == [1, 1, 1]  # device 1, CU_MEM_LOCATION_TYPE_DEVICE, id 1
    assert out["accessed_by"] == [1, -2, -2]
    assert out["prefetched"] == [CTX, 3 * 256 * MIB]
    assert out["by0"] == out["unset_q"] == SUCCESS
    # p stays at its preferred GPU 1, r stays where GPU 0 maps it, q migrates to GPU 0
    assert out["after_launch"] == [CTX + 256 * MIB, 2 * 256 * MIB]
    assert out["p_last"] == 1


def test_what_the_driver_refuses(two: Sim) -> None:
    out = run(
        two,
        """
size = 64 << 20
p = managed(size)
d = c_uint64()
assert lib.cuMemAlloc_v2(byref(d), size) == 0
out["not_managed"] = lib.cuMemPrefetchAsync_v2(d.value, size, dev(1), 0, stream)
out["past_the_end"] = lib.cuMemPrefetchAsync_v2(p, size + 1, dev(1), 0, stream)
out["empty"] = lib.cuMemPrefetchAsync_v2(p, 0, dev(1), 0, stream)
out["bad_device"] = lib.cuMemPrefetchAsync_v2(p, size, dev(7), 0, stream)
out["bad_device_v1"] = lib.cuMemPrefetchAsync(p, size, 7, stream)
out["flags"] = lib.cuMemPrefetchAsync_v2(p, size, dev(1), 1, stream)
out["bad_type"] = lib.cuMemPrefetchAsync_v2(p, size, Loc(9, 0), 0, stream)
out["numa_node"] = lib.cuMemPrefetchAsync_v2(p, size, Loc(HOST_NUMA, 3), 0, stream)
out["by_numa"] = lib.cuMemAdvise_v2(p, size, 5, Loc(HOST_NUMA, 0))
out["advice"] = lib.cuMemAdvise_v2(p, size, 7, dev(0))
out["advise_not_managed"] = lib.cuMemAdvise_v2(d.value, size, 3, dev(1))
out["attr_size"] = lib.cuMemRangeGetAttribute(byref(c_int()), 8, 1, p, size)
out["where"] = where()
""",
    )
    assert out["not_managed"] == INVALID_VALUE and out["past_the_end"] == INVALID_VALUE
    assert out["empty"] == INVALID_VALUE
    assert out["bad_device"] == INVALID_DEVICE and out["bad_device_v1"] == INVALID_DEVICE
    assert out["flags"] == INVALID_VALUE and out["bad_type"] == INVALID_VALUE
    assert out["numa_node"] == INVALID_VALUE and out["by_numa"] == INVALID_VALUE
    assert out["advice"] == INVALID_VALUE and out["advise_not_managed"] == INVALID_VALUE
    assert out["attr_size"] == INVALID_VALUE
    assert out["where"] == [CTX + 2 * 64 * MIB, 0]


FILL = """
import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
lib.cuInit(0); lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0); lib.cuCtxSetCurrent(ctx)
lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
print(lib.cuMemAlloc_v2(ctypes.byref(p), int(sys.argv[1])), flush=True)
sys.stdin.read()
"""


def test_blocks_that_do_not_fit_stay_where_they_are(two: Sim) -> None:
    """A prefetch is a hint: GPU 1 has 256 MiB left, so half of a 512 MiB prefetch moves and
    the blocks that do not fit stay where they are (the real driver may evict other managed
    memory to make room; the simulator does not)."""
    env = env_all(two)
    env["CUDA_VISIBLE_DEVICES"] = two.uuid(1)  # another process fills GPU 1
    hold = subprocess.Popen(
        [sys.executable, "-c", FILL, str((15 << 30) + (256 << 20))],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout is not None and hold.stdout.readline().strip() == "0"
        out = run(
            two,
            """
size = 512 << 20
p = managed(size)
out["prefetch"] = lib.cuMemPrefetchAsync_v2(p, size, dev(1), 0, stream)
out["where"] = where()
""",
        )
    finally:
        hold.communicate(timeout=30)
    assert out["prefetch"] == SUCCESS
    assert out["where"] == [CTX + 256 * MIB, 256 * MIB]


def test_managed_memory_on_another_gpu_goes_with_its_context_and_its_process(two: Sim) -> None:
    env = env_all(two)
    script = (
        PRELUDE
        + """
size = 1 << 30
c2 = c_void_p()
assert lib.cuCtxCreate_v2(byref(c2), 0, 0) == 0
p = managed(size)
assert lib.cuMemPrefetchAsync_v2(p, size // 2, dev(1), 0, None) == 0
on_both = where()
assert lib.cuCtxDestroy_v2(c2) == 0
gone = where()
assert lib.cuCtxSetCurrent(ctx) == 0
q = managed(size)
assert lib.cuMemPrefetchAsync_v2(q, size, dev(1), 0, stream) == 0
print(json.dumps({"on_both": on_both, "gone": gone, "kept": where()}), flush=True)
sys.stdin.read()
"""
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        out = json.loads(proc.stdout.readline())
        assert out["on_both"] == [2 * CTX + GIB // 2, GIB // 2]
        assert out["gone"] == [CTX, 0]  # destroyed with its context, wherever it lived
        assert out["kept"] == [CTX, GIB]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for gpu in (0, 1):  # reading a GPU's state reclaims a dead process's memory there
        assert proc.pid not in process_memory(two.config, gpu)


HOLDER = (
    PRELUDE
    + """
import pynvml
pynvml.nvmlInit()
nvml_dev = pynvml.nvmlDeviceGetHandleByIndex(0)
def report():
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)
    listed = {p.pid: p.usedGpuMemory for p in procs}.get(os.getpid())
    used = pynvml.nvmlDeviceGetMemoryInfo(nvml_dev).used
    print(json.dumps({"held": held(0), "listed": listed, "used": used}), flush=True)
p = managed(int(sys.argv[1]))
report()
for line in sys.stdin:
    launch()  # a kernel may touch any managed memory: what fits comes back to the GPU
    report()
"""
)


def test_the_driver_s_own_allocations_evict_managed_memory_to_the_host(two: Sim) -> None:
    """NVIDIA's physical allocator serves the driver's own allocations by evicting managed
    memory to the host (the Unified Memory driver registers eviction callbacks with it), and
    NVML's per-process lists leave managed memory out (nvtop #213, rmm #2259): so 12 GiB of
    managed memory on a 16 GiB GPU keep nobody from 12 GiB of cuMemAlloc, and a process's
    listed memory is its context alone. A kernel brings back only what fits."""
    env = env_all(two)
    env["CUDA_VISIBLE_DEVICES"] = two.uuid(0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(12 * GIB)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    taker = None
    try:
        assert holder.stdout is not None and holder.stdin is not None

        def touch() -> dict[str, int]:
            holder.stdin.write("launch\n")
            holder.stdin.flush()
            return json.loads(holder.stdout.readline())

        first = json.loads(holder.stdout.readline())
        assert first["held"] == CTX + 12 * GIB  # populated at once, as a cap must expect
        assert first["listed"] == CTX  # NVML lists its context, not its managed memory
        assert first["used"] == CTX + 12 * GIB  # the device's used memory counts it
        big = 12 * GIB
        taker = subprocess.Popen(
            [sys.executable, "-c", FILL, str(big)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert taker.stdout is not None and taker.stdout.readline().strip() == "0"
        room = 16 * GIB - (CTX + big)  # what is left beside the taker and its context
        evicted = touch()
        assert evicted["held"] <= room  # the rest moved to the host, and a kernel
        assert evicted["held"] >= CTX  # cannot take back what the taker holds
        assert process_memory(two.config, 0)[taker.pid] == CTX + big
        taker.communicate(timeout=30)
        taker = None
        back = touch()  # the room is free again: the next kernel brings it all back
        assert back["held"] == CTX + 12 * GIB and back["listed"] == CTX
    finally:
        for proc in (taker, holder):
            if proc is not None:
                proc.communicate(timeout=30)
