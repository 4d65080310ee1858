"""The time-sliced device model (issue 16, "What to build" 3): processes take turns on the
simulated GPU in time slices of a configurable length, while one process's work runs in
stream order; an event pair around a kernel then spans the other processes' slices, as on a
real GPU. Per-process busy time and utilisation are exposed the way NVML exposes them
(nvmlDeviceGetProcessUtilization, the v1/v2/v3 process lists, nvmlDeviceGetUtilizationRates)
and through enforcement.sim's reader. Each test here failed on the simulator before
commit 4b11bae (one FIFO queue, no per-process utilisation)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from enforcement.sim import busy_share, read_gpu_state, write_sim_config

from .conftest import CTX, Sim, finish, run_json, start_burn, wait_ready

# Times a 10 ms kernel between two events, `rounds` times (argv[1]); prints the elapsed ms.
EVENT_PAIRS = """
import json, sys
from enforcement.simcuda import open_driver
d = open_driver()
s, e = d.event(), d.event()
out = []
for _ in range(int(sys.argv[1])):
    d.event_record(s)
    d.launch_busy(10_000_000)
    d.event_record(e)
    d.event_synchronize(e)
    out.append(d.event_elapsed_ms(s, e))
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("scheduler", "slice_us", "expected_ms"),
    [
        # 10 ms of own work in slices of t, the neighbour's slice between each two:
        # 10 + (ceil(10 / t) - 1) * t
        ("timesliced", 2000, 18.0),
        ("timesliced", 5000, 15.0),
        ("fifo", 2000, 10.0),  # one queue: the pair spans only the kernel
    ],
)
def test_sim_timesliced_event_pair_spans_the_other_process_slices(
    short_tmp: Path, scheduler: str, slice_us: int, expected_ms: float
) -> None:
    cfg = write_sim_config(
        short_tmp / "t.conf", "H100-80GB", node=f"ts-{scheduler}-{slice_us}",
        scheduler=scheduler, timeslice_us=slice_us,
    )  # fmt: skip
    sim = Sim(cfg, short_tmp / "l")
    alone = run_json(sim.base_env(), EVENT_PAIRS, "3")
    # own work alone: stream order, 10 ms (plus the CPU's gap between the start event and
    # the launch, when the device was idle at the start event)
    assert statistics.median(alone) == pytest.approx(10.0, abs=0.3), alone
    neighbour = start_burn(sim.base_env(), ns=5_000_000, depth=8)  # always has work queued
    wait_ready([neighbour])
    shared = run_json(sim.base_env(), EVENT_PAIRS, "7")
    finish([neighbour])
    assert statistics.median(shared) == pytest.approx(expected_ms, abs=0.3), shared


# NVML's views of the GPU's processes, through the simulated libnvidia-ml.so.1 with ctypes
# (struct layouts of nvml.h): per-process utilisation, device utilisation, and the three
# versions of the compute process list.
NVML_VIEW = """
import ctypes, json, time
from ctypes import POINTER, Structure, byref, c_uint, c_ulonglong, c_void_p
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
dev = c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, byref(dev)) == 0
class Sample(Structure):
    _fields_ = [("pid", c_uint), ("timeStamp", c_ulonglong), ("smUtil", c_uint),
                ("memUtil", c_uint), ("encUtil", c_uint), ("decUtil", c_uint)]
class InfoV1(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]
class InfoV2(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong),
                ("gpuInstanceId", c_uint), ("computeInstanceId", c_uint)]
out = {}
count = c_uint(0)
out["util_probe"] = nvml.nvmlDeviceGetProcessUtilization(dev, None, byref(count), c_ulonglong(0))
samples = (Sample * 64)()
count = c_uint(64)
out["util"] = nvml.nvmlDeviceGetProcessUtilization(dev, samples, byref(count), c_ulonglong(0))
out["samples"] = {s.pid: s.smUtil for s in samples[: count.value]}
newest = max(s.timeStamp for s in samples[: count.value])
count = c_uint(64)
out["none_newer"] = nvml.nvmlDeviceGetProcessUtilization(dev, samples, byref(count),
                                                         c_ulonglong(newest))
class Rates(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]
rates = Rates()
out["rates"] = [nvml.nvmlDeviceGetUtilizationRates(dev, byref(rates)), rates.gpu]
for name, cls in (("v1", InfoV1), ("v2", InfoV2), ("v3", InfoV2)):
    suffix = "" if name == "v1" else "_" + name
    fn = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses" + suffix)
    n = c_uint(0)
    probe = fn(dev, byref(n), None)
    infos = (cls * 8)()
    n = c_uint(8)
    r = fn(dev, byref(n), infos)
    out[name] = [probe, r, sorted([i.pid, i.usedGpuMemory] for i in infos[: n.value])]
    if name != "v1":
        ids = {(i.gpuInstanceId, i.computeInstanceId) for i in infos[: n.value]}
        out[name + "_ids"] = sorted(ids)
print(json.dumps(out))
"""

NVML_SUCCESS, NVML_INSUFFICIENT_SIZE, NVML_NOT_FOUND = 0, 7, 6


def test_sim_timesliced_shares_evenly_and_nvml_sees_each_process(sim: Sim) -> None:
    """Two saturating processes, one with 2 kernels queued and one with 20: the device gives
    each half (a FIFO queue would give the deep one 10 times more), and NVML and the reader
    say so per process."""
    assert sim.config.scheduler == "timesliced"  # the default device model
    shallow = start_burn(sim.base_env(), ns=5_000_000, depth=2)
    deep = start_burn(sim.base_env(), ns=5_000_000, depth=20)
    wait_ready([shallow, deep])
    time.sleep(1.2)  # NVML's device utilisation looks back about a second
    before = read_gpu_state(sim.config, 0)
    time.sleep(1.0)
    after = read_gpu_state(sim.config, 0)
    view = run_json(sim.base_env(), NVML_VIEW)
    finish([shallow, deep])
    a = 100 * busy_share(before, after, shallow.pid)
    b = 100 * busy_share(before, after, deep.pid)
    assert abs(a - 50) <= 5 and abs(b - 50) <= 5, (a, b)
    assert after.scheduler == "timesliced" and after.timeslice_ns == 2_000_000
    for p in (after.process(shallow.pid), after.process(deep.pid)):
        assert p is not None and abs(p.sm_util - 50) <= 10, p  # NVML's per-process sample
    assert view["util_probe"] == NVML_INSUFFICIENT_SIZE
    assert view["util"] == NVML_SUCCESS
    assert abs(view["samples"][str(shallow.pid)] - 50) <= 10, view["samples"]
    assert abs(view["samples"][str(deep.pid)] - 50) <= 10, view["samples"]
    assert view["none_newer"] == NVML_NOT_FOUND
    assert view["rates"][0] == NVML_SUCCESS and view["rates"][1] >= 95
    procs = sorted([[shallow.pid, CTX], [deep.pid, CTX]])
    for name in ("v1", "v2", "v3"):
        assert view[name] == [NVML_INSUFFICIENT_SIZE, NVML_SUCCESS, procs], name
    not_available = 0xFFFFFFFF  # no MIG: the instance ids are NVML_VALUE_NOT_AVAILABLE
    assert view["v2_ids"] == view["v3_ids"] == [[not_available, not_available]]


def test_sim_timesliced_a_process_alone_is_not_slowed(sim: Sim) -> None:
    """Slicing costs nothing without a neighbour: a lone saturating process has the whole
    device, and its NVML sample says so."""
    burn = start_burn(sim.base_env(), ns=5_000_000, depth=4)
    wait_ready([burn])
    time.sleep(0.3)
    before = read_gpu_state(sim.config, 0)
    time.sleep(0.8)
    after = read_gpu_state(sim.config, 0)
    finish([burn])
    assert 100 * busy_share(before, after, burn.pid) > 97
    p = after.process(burn.pid)
    assert p is not None and p.sm_util >= 95
