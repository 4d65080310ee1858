"""The simulated driver and NVML on their own: specs, UUIDs, CUDA_VISIBLE_DEVICES, memory
accounting shared across processes, the shared device timeline, events, and pynvml on top
of the simulated libnvidia-ml.so.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enforcement.sim import (
    MODELS,
    SimConfig,
    SimSpecError,
    gpu_uuid,
    load_sim_config,
    parse_spec,
    read_gpu_state,
    write_sim_config,
)

from .conftest import CTX, GIB, Sim, finish, measure_shares, run_json, start_burn, wait_ready


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


# NVML's other views of processes and activity, called through ctypes with nvml.h's layouts
# (include/qgpu_nvml.h) so that every return code of the protocol is seen: what NVIDIA's
# driver documents for each, including what it refuses.
NVML_VIEWS = """
import ctypes, json, os, sys, time
from ctypes import POINTER, Structure, Union, byref, c_double, c_int, c_uint, c_ulonglong, c_void_p
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
t4, h100 = c_void_p(), c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, byref(t4)) == 0
assert nvml.nvmlDeviceGetHandleByIndex_v2(1, byref(h100)) == 0
class Detail(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint), ("usedGpuCcProtectedMemory", c_ulonglong)]
class DetailList(Structure):
    _fields_ = [("version", c_uint), ("mode", c_uint), ("numProcArrayEntries", c_uint),
                ("procArray", POINTER(Detail))]
class UtilInfo(Structure):
    _fields_ = [("timeStamp", c_ulonglong), ("pid", c_uint), ("smUtil", c_uint),
                ("memUtil", c_uint), ("encUtil", c_uint), ("decUtil", c_uint), ("jpgUtil", c_uint),
                ("ofaUtil", c_uint)]
class UtilInfos(Structure):
    _fields_ = [("version", c_uint), ("processSamplesCount", c_uint),
                ("lastSeenTimeStamp", c_ulonglong), ("procUtilArray", POINTER(UtilInfo))]
class Value(Union):
    _fields_ = [("dVal", c_double), ("uiVal", c_uint), ("ullVal", c_ulonglong)]
class Sample(Structure):
    _fields_ = [("timeStamp", c_ulonglong), ("sampleValue", Value)]
class Bar1(Structure):
    _fields_ = [("bar1Total", c_ulonglong), ("bar1Free", c_ulonglong), ("bar1Used", c_ulonglong)]
class Stats(Structure):
    _fields_ = [("gpuUtilization", c_uint), ("memoryUtilization", c_uint),
                ("maxMemoryUsage", c_ulonglong), ("time", c_ulonglong), ("startTime", c_ulonglong),
                ("isRunning", c_uint), ("reserved", c_uint * 5)]
out = {}
# the detail list: Hopper and newer; its version and mode are checked
def detail(dev, version=0x1000018, mode=0, room=0):
    arr = (Detail * max(room, 1))()
    l = DetailList(version, mode, room, arr if room else None)
    r = nvml.nvmlDeviceGetRunningProcessDetailList(dev, byref(l))
    got = [[d.pid, d.usedGpuMemory] for d in arr[: l.numProcArrayEntries]] if room else []
    return [r, l.numProcArrayEntries, got]
out["detail_t4"] = detail(t4)
out["detail_probe"] = detail(h100)
out["detail"] = detail(h100, room=16)
out["detail_v2"] = detail(h100, version=0x2000018)
out["detail_mode"] = detail(h100, mode=3)
out["detail_graphics"] = detail(h100, mode=1)
# per-process utilisation, versioned
arr = (UtilInfo * 16)()
u = UtilInfos(0x1000018, 0, 0, None)
r = nvml.nvmlDeviceGetProcessesUtilizationInfo(t4, byref(u))
out["putil_probe"] = [r, u.processSamplesCount]
u = UtilInfos(0x1000018, 16, 0, arr)
r = nvml.nvmlDeviceGetProcessesUtilizationInfo(t4, byref(u))
out["putil"] = [r, sorted(a.pid for a in arr[: u.processSamplesCount])]
newest = max(a.timeStamp for a in arr[: u.processSamplesCount])
u = UtilInfos(0x1000018, 16, newest, arr)
out["putil_newer"] = nvml.nvmlDeviceGetProcessesUtilizationInfo(t4, byref(u))
u = UtilInfos(0x2000018, 16, 0, arr)
out["putil_v2"] = nvml.nvmlDeviceGetProcessesUtilizationInfo(t4, byref(u))
# samples: GPU and memory utilisation are modelled, power and clocks are not
def samples(kind, seen, room, buf):
    n = c_uint(room)
    return nvml.nvmlDeviceGetSamples(t4, kind, c_ulonglong(seen), byref(vt), byref(n), buf), n.value
vt = c_int(-1)
r, n = samples(1, 0, 0, None)
out["samples_probe"] = [r, vt.value, n]
buf = (Sample * 64)()
r, n = samples(1, 0, 64, buf)
out["samples"] = [r, [s.sampleValue.uiVal for s in buf[:n]]]
stamps = [s.timeStamp for s in buf[:n]]
out["samples_ordered"] = stamps == sorted(stamps)
out["samples_two"] = list(samples(1, 0, 2, buf))
out["samples_zero_room"] = samples(1, 0, 0, buf)[0]
out["samples_newer"] = samples(1, max(stamps), 64, buf)[0]
r, n = samples(2, 0, 64, buf)
out["samples_memory"] = [r, max(s.sampleValue.uiVal for s in buf[:n])]
out["samples_power"] = samples(0, 0, 64, buf)[0]
# BAR1: the aperture and what the contexts map
b = Bar1()
out["bar1"] = [nvml.nvmlDeviceGetBAR1MemoryInfo(t4, byref(b)), b.bar1Total, b.bar1Used, b.bar1Free]
# accounting: on (the config), the holder's record while it runs and after it ends
mode, size = c_int(-1), c_uint(0)
out["acct"] = [nvml.nvmlDeviceGetAccountingMode(t4, byref(mode)), mode.value,
               nvml.nvmlDeviceGetAccountingBufferSize(t4, byref(size)), size.value]
def stats(pid):
    s = Stats()
    r = nvml.nvmlDeviceGetAccountingStats(t4, c_uint(pid), byref(s))
    return [r, s.isRunning, s.time, s.maxMemoryUsage, s.gpuUtilization, s.startTime > 0]
holder = int(sys.argv[1])
n = c_uint(0)
pids = (c_uint * 256)()
out["pids_probe"] = [nvml.nvmlDeviceGetAccountingPids(t4, byref(n), None), n.value]
n = c_uint(256)
out["pids"] = [nvml.nvmlDeviceGetAccountingPids(t4, byref(n), pids), list(pids[: n.value])]
out["stats_running"] = stats(holder)
os.kill(holder, 9)
def gone(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except FileNotFoundError:
        return True
while not gone(holder):
    time.sleep(0.01)
out["stats_ended"] = stats(holder)
out["stats_unknown"] = stats(1)
out["set_off"] = nvml.nvmlDeviceSetAccountingMode(t4, 0) if os.geteuid() == 0 else None
n = c_uint(256)
out["pids_off"] = nvml.nvmlDeviceGetAccountingPids(t4, byref(n), pids)
out["stats_off"] = stats(holder)[0]
print(json.dumps(out))
"""

# the same library as another user: changing accounting mode is root's
SET_ACCOUNTING = """
import ctypes, os, sys
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
dev = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
print(nvml.nvmlDeviceSetAccountingMode(dev, 0), nvml.nvmlDeviceClearAccountingPids(dev))
"""

NVML_NOT_SUPPORTED, NVML_NO_PERMISSION, NVML_NOT_FOUND, NVML_INSUFFICIENT_SIZE = 3, 4, 6, 7
NVML_INVALID_ARGUMENT, NVML_VERSION_MISMATCH = 2, 25


def test_simulated_nvml_views_of_processes_and_activity(short_tmp: Path) -> None:
    """The detail list (Hopper only), versioned per-process utilisation, the sample history,
    BAR1 and accounting mode, each with the protocol and refusals nvml.h documents."""
    short_tmp.chmod(0o755)  # the unprivileged client below reads the config
    cfg = write_sim_config(
        short_tmp / "views.conf", "T4-16GB,H100-80GB", node=f"v-{short_tmp.name}", accounting=True
    )
    sim = Sim(cfg, short_tmp / "ledgers")
    env = sim.base_env()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(GIB)], env=env, stdout=subprocess.PIPE, text=True
    )
    on_h100 = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(2 * GIB)],
        env={**env, "CUDA_VISIBLE_DEVICES": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    burn = start_burn(env, depth=4)
    try:
        assert holder.stdout and holder.stdout.readline()
        assert on_h100.stdout and on_h100.stdout.readline()
        wait_ready([burn])
        time.sleep(0.5)  # a few 100 ms samples
        out = run_json(env, NVML_VIEWS, str(holder.pid))
        unprivileged = py(env, SET_ACCOUNTING).split()
    finally:
        for p in (holder, on_h100, burn):
            p.kill()
            p.wait()
    assert out["detail_t4"][0] == NVML_NOT_SUPPORTED
    assert out["detail_probe"] == [NVML_INSUFFICIENT_SIZE, 1, []]
    assert out["detail"] == [0, 1, [[on_h100.pid, 2 * GIB + CTX]]]
    assert out["detail_v2"][0] == NVML_VERSION_MISMATCH
    assert out["detail_mode"][0] == NVML_INVALID_ARGUMENT
    assert out["detail_graphics"] == [0, 0, []]
    assert out["putil_probe"] == [NVML_INSUFFICIENT_SIZE, 2]
    assert out["putil"] == [0, sorted([holder.pid, burn.pid])]
    assert out["putil_newer"] == NVML_NOT_FOUND
    assert out["putil_v2"] == NVML_VERSION_MISMATCH
    r, value_type, count = out["samples_probe"]
    assert (r, value_type) == (0, 1) and count >= 2  # unsigned int values
    assert out["samples"][0] == 0 and len(out["samples"][1]) == count
    assert max(out["samples"][1]) > 50 and out["samples_ordered"]  # the burner runs
    assert out["samples_two"] == [0, 2]  # as many as fit
    assert out["samples_zero_room"] == NVML_INVALID_ARGUMENT
    assert out["samples_newer"] == NVML_NOT_FOUND
    assert out["samples_memory"] == [0, 0]  # no bandwidth model
    assert out["samples_power"] == NVML_NOT_SUPPORTED
    assert out["bar1"] == [0, 256 << 20, 4 << 20, 252 << 20]  # two contexts, 2 MiB each
    assert out["acct"] == [0, 1, 0, 128]
    assert out["pids_probe"] == [NVML_INSUFFICIENT_SIZE, 2]
    assert out["pids"][0] == 0 and sorted(out["pids"][1]) == sorted([holder.pid, burn.pid])
    r, running, ms, max_mem, _util, started = out["stats_running"]
    t4_ctx = MODELS["t4-16gb"].context_memory  # the holder runs on the T4
    assert (r, running, ms, max_mem, started) == (0, 1, 0, GIB + t4_ctx, True)
    r, running, ms, max_mem, _util, started = out["stats_ended"]
    assert (r, running, max_mem, started) == (0, 0, GIB + t4_ctx, True) and ms > 0
    assert out["stats_unknown"][0] == NVML_NOT_FOUND
    if out["set_off"] is not None:  # as root: off, and every record is forgotten
        assert out["set_off"] == 0
        assert (out["pids_off"], out["stats_off"]) == (NVML_NOT_SUPPORTED, NVML_NOT_SUPPORTED)
    assert unprivileged == [str(NVML_NO_PERMISSION), str(NVML_NO_PERMISSION)]


def _driver_init(cfg: SimConfig, short_tmp: Path) -> subprocess.CompletedProcess[str]:
    """A fresh process's cuInit on the simulated driver of `cfg` (which reads it then)."""
    return subprocess.run(
        [sys.executable, "-c", "from enforcement.simcuda import Driver\nDriver().init()"],
        env=Sim(cfg, short_tmp / "l").base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_mps_pipe_directory_is_checked_by_name(short_tmp: Path) -> None:
    with pytest.raises(SimSpecError, match="mps_pipe_directory 'relative/dir': must be an abs"):
        write_sim_config(short_tmp / "m.conf", "T4", mps_pipe_directory="relative/dir")
    cfg = write_sim_config(short_tmp / "m.conf", "T4", mps_pipe_directory=short_tmp / "mps")
    assert load_sim_config(cfg.path).mps_pipe_directory == short_tmp / "mps"
    text = cfg.path.read_text().replace(f"={short_tmp / 'mps'}", "=relative/dir")
    cfg.path.write_text(text)
    out = _driver_init(cfg, short_tmp)
    assert out.returncode != 0
    assert "mps_pipe_directory=relative/dir: must be an absolute path" in out.stderr


def test_graph_node_bytes_is_checked_by_name(short_tmp: Path) -> None:
    with pytest.raises(SimSpecError, match=r"graph_node_bytes -1: must be 0\.\.1073741824 bytes"):
        write_sim_config(short_tmp / "g.conf", "T4", graph_node_bytes=-1)
    cfg = write_sim_config(short_tmp / "g.conf", "T4", graph_node_bytes=1 << 20)
    assert load_sim_config(cfg.path).graph_node_bytes == 1 << 20
    cfg.path.write_text(
        cfg.path.read_text().replace("graph_node_bytes=1048576", "graph_node_bytes=-5")
    )
    out = _driver_init(cfg, short_tmp)
    assert out.returncode != 0
    assert "graph_node_bytes=-5: must be 0..1073741824 bytes" in out.stderr


def test_graph_work_at_is_checked_by_name(short_tmp: Path) -> None:
    with pytest.raises(SimSpecError, match="graph_work_at 'later': must be one of first_use"):
        write_sim_config(short_tmp / "w.conf", "T4", graph_work_at="later")
    cfg = write_sim_config(short_tmp / "w.conf", "T4", graph_work_at="instantiation")
    assert load_sim_config(cfg.path).graph_work_at == "instantiation"
    cfg.path.write_text(cfg.path.read_text().replace("=instantiation", "=later"))
    out = _driver_init(cfg, short_tmp)
    assert out.returncode != 0
    assert "graph_work_at=later: must be first_use or instantiation" in out.stderr
