"""The simulated driver and NVML on their own: specs, UUIDs, CUDA_VISIBLE_DEVICES, memory
accounting shared across processes, the shared device timeline, events, and pynvml on top
of the simulated libnvidia-ml.so.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.sim import (
    SimSpecError,
    gpu_uuid,
    load_sim_config,
    parse_spec,
    read_gpu_state,
    write_sim_config,
)

from .conftest import CTX, GIB, Sim, finish, measure_shares, start_burn, wait_ready


def py(env: dict[str, str], script: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_spec_parsing() -> None:
    assert [m.key for m in parse_spec("2xH100-80GB, A10-24GB")] == [
        "H100-80GB",
        "H100-80GB",
        "A10-24GB",
    ]
    assert parse_spec("t4")[0].memory_gib == 16
    for bad in ("3xB9000", "x", "0xT4", ""):
        with pytest.raises(SimSpecError):
            parse_spec(bad)


def test_uuids_are_deterministic_per_node_and_index(short_tmp: Path) -> None:
    a = write_sim_config(short_tmp / "a.conf", "2xT4", node="n1")
    b = write_sim_config(short_tmp / "b.conf", "2xT4", node="n1")
    c = write_sim_config(short_tmp / "c.conf", "2xT4", node="n2")
    assert [g.uuid for g in a.gpus] == [g.uuid for g in b.gpus]
    assert a.gpus[0].uuid != a.gpus[1].uuid != c.gpus[1].uuid
    assert a.gpus[1].uuid == gpu_uuid("n1", 1)
    assert load_sim_config(a.path) == a


DEVICES = """
from enforcement.simcuda import Driver
d = Driver(); d.init()
print([(d.device_uuid(i), d.device_name(i), d.device_total_mem(i), d.device_attribute(16, i))
       for i in range(d.device_count())])
"""


def test_visible_devices_by_index_and_uuid(short_tmp: Path) -> None:
    cfg = write_sim_config(short_tmp / "s.conf", "H100-80GB,A10-24GB,T4", node="vis")
    sim = Sim(cfg, short_tmp / "l")
    env = sim.base_env()
    env["CUDA_VISIBLE_DEVICES"] = "2,0"
    devices = eval(py(env, DEVICES))  # a printed Python literal
    assert devices == [
        (cfg.gpus[2].uuid, "Tesla T4", 16 * GIB, 40),
        (cfg.gpus[0].uuid, "NVIDIA H100 80GB HBM3", 80 * GIB, 132),
    ]
    env["CUDA_VISIBLE_DEVICES"] = f"{cfg.gpus[1].uuid},bogus,0"  # stops at the bad entry
    assert [d[0] for d in eval(py(env, DEVICES))] == [cfg.gpus[1].uuid]
    env.pop("CUDA_VISIBLE_DEVICES")
    assert len(eval(py(env, DEVICES))) == 3


HOLD = """
import sys, time
from enforcement.simcuda import open_driver
d = open_driver()
d.mem_alloc(int(sys.argv[1]))
print(d.mem_get_info(), flush=True)
time.sleep(60)
"""


def test_device_memory_is_shared_and_freed_with_the_process(sim: Sim) -> None:
    env = sim.base_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(n * GIB)], env=env, stdout=subprocess.PIPE, text=True
        )
        for n in (30, 40)
    ]
    try:
        for p in procs:
            assert p.stdout and p.stdout.readline()
        state = read_gpu_state(sim.config, 0)
        assert state.mem_used == 70 * GIB + 2 * CTX  # a context costs memory too
        assert sorted(p.mem_used for p in state.processes) == [30 * GIB + CTX, 40 * GIB + CTX]
        third = py(
            env,
            "from enforcement.simcuda import open_driver\n"
            "d = open_driver(); print(d.try_mem_alloc(20 << 30)[0], d.mem_get_info())",
        )
        assert third.split()[0] == "2"  # 80 GiB card: 70 + 20 does not fit
        procs[0].kill()
        procs[0].wait()
        again = py(
            env,
            "from enforcement.simcuda import open_driver\n"
            "d = open_driver(); print(d.try_mem_alloc(20 << 30)[0])",
        )
        assert again.strip() == "0"  # the killed process's 30 GiB came back
    finally:
        for p in procs:
            p.kill()
            p.wait()


TIMELINE = """
import time
from enforcement.simcuda import open_driver
d = open_driver()
s, e = d.event(), d.event()
t0 = time.monotonic()
d.launch_busy(500_000_000)  # the device is busy for 0.5 s from here
d.event_record(s)
for _ in range(5):
    d.launch_busy(20_000_000)
d.event_record(e)
pending = d.event_query(e)
d.event_synchronize(e)
print(pending, time.monotonic() - t0, d.event_elapsed_ms(s, e))
"""


def test_kernels_occupy_the_timeline_and_sync_waits(sim: Sim) -> None:
    pending, synced, elapsed_ms = py(sim.base_env(), TIMELINE).split()
    assert pending == "600"  # CUDA_ERROR_NOT_READY: launches are asynchronous
    assert float(synced) >= 0.6  # synchronize waits for 0.5 s + 5 x 20 ms of device time
    assert float(elapsed_ms) == pytest.approx(100.0, abs=0.001)  # events measure the timeline


def test_processes_share_one_timeline(sim: Sim) -> None:
    env = sim.base_env(0)
    procs = [start_burn(env, depth=20), start_burn(env, depth=20)]
    wait_ready(procs)
    a, b = measure_shares(sim, [(0, procs[0]), (0, procs[1])])
    finish(procs)
    assert a + b <= 100.5  # one engine: the two never add up to more than the device
    assert a > 35 and b > 35  # and it is shared (FIFO: about evenly at equal queue depth)


NVML = """
import json, sys, time
from enforcement.sim import load_sim_nvml
load_sim_nvml(sys.argv[1])
import pynvml
pynvml.nvmlInit()
out = {"driver": pynvml.nvmlSystemGetDriverVersion(), "count": pynvml.nvmlDeviceGetCount()}
h = pynvml.nvmlDeviceGetHandleByIndex(0)
assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(h))) == 0
m = pynvml.nvmlDeviceGetMemoryInfo(h)
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
out.update(
    uuid=pynvml.nvmlDeviceGetUUID(h), name=pynvml.nvmlDeviceGetName(h),
    mem=[m.total, m.used, m.free], mem2=[m2.total, m2.used, m2.free],
    procs=[[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
    procs2=len(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)),
    sms=pynvml.nvmlDeviceGetAttributes(h).multiprocessorCount,
    numa=pynvml.nvmlDeviceGetNumaNodeId(h),
    ecc=pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 1),
    bus=pynvml.nvmlDeviceGetPciInfo(h).busId,
)
pynvml.nvmlDeviceGetUtilizationRates(h)
time.sleep(0.6)
out["util"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def test_pynvml_uses_the_simulated_nvml(sim: Sim) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(5 * GIB)],
        env=sim.base_env(0),
        stdout=subprocess.PIPE,
        text=True,
    )
    burn = start_burn(sim.base_env(0), depth=20)
    try:
        assert holder.stdout and holder.stdout.readline()
        wait_ready([burn])
        env = {k: v for k, v in sim.base_env().items() if k != "LD_LIBRARY_PATH"}
        nvml = subprocess.run(
            [sys.executable, "-c", NVML, str(sim.config.path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert nvml.returncode == 0, nvml.stderr
        out = json.loads(nvml.stdout)
    finally:
        holder.kill()
        holder.wait()
        burn.kill()
        burn.wait()
    assert out["count"] == 5
    assert out["uuid"] == sim.uuid(0)
    assert out["name"] == "NVIDIA H100 80GB HBM3"
    assert out["mem"] == [80 * GIB, 5 * GIB + 2 * CTX, 75 * GIB - 2 * CTX]  # two contexts
    assert out["mem2"] == out["mem"]
    assert [holder.pid, 5 * GIB + CTX] in out["procs"]
    assert burn.pid in [p[0] for p in out["procs"]]
    assert out["procs2"] == len(out["procs"])
    assert out["sms"] == 132
    assert out["numa"] == 0 and out["ecc"] == 0
    assert out["bus"].startswith("00000000:")
    assert out["util"] > 50  # busy (an idle GPU reports 0)
