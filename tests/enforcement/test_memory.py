"""Memory hard cap per slice, on real processes with the compiled interposer and the
simulated driver: one test per allocation API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from enforcement.agent.slice_stats import read_slice_ledger
from enforcement.simcuda import ALLOC_APIS, CUDA_ERROR_OUT_OF_MEMORY

from .conftest import CTX, GIB, Sim, Worker

MIB = 1 << 20
OOM = CUDA_ERROR_OUT_OF_MEMORY


@pytest.mark.parametrize("api", ALLOC_APIS)
def test_slice_cap_shared_by_processes_and_reclaimed_after_sigkill(
    sim: Sim, workers: list[Worker], api: str
) -> None:
    cap = 4 * GIB + 2 * CTX  # each process's context is charged to the slice too
    env = sim.slice_env(f"mem-{api}", memory=cap)
    a = Worker(env)
    b = Worker(env)
    workers += [a, b]
    a.start()
    b.start()

    status, _ = a.alloc(api, 3 * GIB)
    assert status == "ok"

    # B, same slice: 1 GiB is left, anything above is refused with CUDA_ERROR_OUT_OF_MEMORY
    assert b.alloc(api, GIB + 2 * MIB) == ("err", OOM)
    assert b.meminfo() == (GIB, cap)
    status, one = b.alloc(api, GIB)
    assert status == "ok"
    assert b.alloc(api, 2 * MIB) == ("err", OOM)
    assert b.ask(f"free {one}") == ["ok"]
    # a stream-ordered free returns memory to its pool, which gives it back to the device
    # (and the slice) at the next synchronisation: its release threshold is 0
    assert b.ask("sync") == ["ok"]

    # A dies without freeing: its 3 GiB and its context come back to the slice
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(timeout=30)
    assert b.meminfo() == (cap - CTX, cap)
    status, _ = b.alloc(api, 3 * GIB)
    assert status == "ok"
    assert b.meminfo() == (cap - CTX - 3 * GIB, cap)
    code, err = b.quit()
    assert code == 0, err


def test_cap_refusals_are_counted_in_the_slice_ledger(sim: Sim, workers: list[Worker]) -> None:
    """Every allocation refused at the cap, by any process of the slice and through any
    allocation API, adds one to the ledger's oom_refusals; allocations that fit do not."""
    env = sim.slice_env("mem-oom", memory=2 * GIB + 2 * CTX)
    a, b = Worker(env), Worker(env)
    workers += [a, b]
    a.start()
    b.start()

    def refusals() -> int | None:
        led = read_slice_ledger(sim.state_dir, "mem-oom")
        assert led is not None
        assert led.throttled_ns == 0  # best-effort: never gated
        return led.oom_refusals

    assert refusals() == 0
    assert a.alloc("alloc", 3 * GIB) == ("err", OOM)
    assert refusals() == 1
    assert a.alloc("alloc", GIB)[0] == "ok"
    assert refusals() == 1
    assert b.alloc("async", GIB + MIB) == ("err", OOM)  # the other process, shared count
    assert b.alloc("pitch", 2 * GIB) == ("err", OOM)
    assert refusals() == 3
    assert b.alloc("managed", GIB)[0] == "ok"
    assert b.alloc("array", MIB) == ("err", OOM)
    assert refusals() == 4


def test_free_releases_and_device_total_mem_is_the_cap(sim: Sim, workers: list[Worker]) -> None:
    w = Worker(sim.slice_env("mem-free", memory=4 * GIB))
    workers.append(w)
    w.start()
    assert w.ask("totalmem") == ["ok", str(4 * GIB)]
    for _ in range(3):
        status, handle = w.alloc("alloc", 3 * GIB)
        assert status == "ok"
        assert w.meminfo() == (GIB - CTX, 4 * GIB)
        assert w.ask(f"free {handle}") == ["ok"]
        assert w.meminfo() == (4 * GIB - CTX, 4 * GIB)


def test_cap_holds_through_cu_get_proc_address(sim: Sim, workers: list[Worker]) -> None:
    """A runtime that resolves everything through cuGetProcAddress gets the same caps."""
    w = Worker(sim.slice_env("mem-getproc", memory=2 * GIB + CTX), resolve="getproc")
    workers.append(w)
    w.start()
    assert w.alloc("alloc", 2 * GIB + MIB) == ("err", OOM)
    assert w.alloc("async", 2 * GIB)[0] == "ok"
    assert w.alloc("pool", MIB) == ("err", OOM)
    assert w.meminfo() == (0, 2 * GIB + CTX)


def test_slices_are_independent(sim: Sim, workers: list[Worker]) -> None:
    a = Worker(sim.slice_env("mem-a", memory=4 * GIB + CTX))
    b = Worker(sim.slice_env("mem-b", memory=8 * GIB + CTX))
    workers += [a, b]
    a.start()
    b.start()
    assert a.alloc("alloc", 4 * GIB)[0] == "ok"
    assert b.alloc("alloc", 8 * GIB)[0] == "ok"
    assert a.alloc("alloc", MIB) == ("err", OOM)
    assert b.meminfo() == (0, 8 * GIB + CTX)


def test_without_hook_the_card_is_visible(sim: Sim, workers: list[Worker]) -> None:
    """Control: the same workload without the interposer sees the whole simulated card."""
    w = Worker(sim.slice_env("mem-nohook", memory=4 * GIB, hook=False))
    workers.append(w)
    w.start()
    assert w.alloc("alloc", 10 * GIB)[0] == "ok"
    assert w.meminfo()[1] == 80 * GIB


NVML_SCRIPT = """
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
from enforcement.simcuda import open_driver
drv = open_driver()
drv.mem_alloc(1 << 30)
m = pynvml.nvmlDeviceGetMemoryInfo(h)
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
try:  # another GPU of the node is not the slice's: not its to see
    other = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1)).total
except pynvml.NVMLError_NoPermission:
    other = -1
print(m.total, m.used, m.free, m2.total, m2.used, m2.free, other)
"""


def test_nvml_memory_info_reports_the_slice(sim: Sim) -> None:
    env = sim.slice_env("mem-nvml", gpu=0, memory=4 * GIB)
    out = subprocess.run(
        [sys.executable, "-c", NVML_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    total, used, free, total2, used2, free2, other = map(int, out.stdout.split())
    # used: the allocation and the process's context
    assert (total, used, free) == (4 * GIB, GIB + CTX, 3 * GIB - CTX)
    assert (total2, used2, free2) == (4 * GIB, GIB + CTX, 3 * GIB - CTX)
    assert other == -1  # NVML_ERROR_NO_PERMISSION on a GPU that is not the slice's


FORK_SCRIPT = """
import os
from enforcement.simcuda import open_driver
d = open_driver()
d.mem_alloc(1 << 30)
before = d.mem_get_info()[0]
pid = os.fork()
if pid == 0:  # CUDA is not fork-safe: the child cannot use the parent's context
    code, _ = d.try_mem_alloc(2 << 30)
    os._exit(code)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), before, d.mem_get_info()[0])
"""


def test_forked_child_cannot_use_the_parents_cuda_and_leaves_the_cap_alone(sim: Sim) -> None:
    """A forked child's CUDA calls fail (as on a real driver) and whatever the interposer
    charged for the attempt is given back: the slice's free memory is unchanged."""
    env = sim.slice_env("mem-fork", memory=4 * GIB)
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    child, before, after = map(int, out.stdout.split())
    assert child == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert before == after == 3 * GIB - CTX
