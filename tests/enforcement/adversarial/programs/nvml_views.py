"""What else NVML tells a tenant about its neighbours, read as a monitoring tool would, with
NVIDIA's own client (nvidia-ml-py's pynvml, so the ABI is someone else's code): on every GPU
of the node, the detail process list (every mode), per-process utilisation in its versioned
form, accounting mode's pids and per-process stats (also of pids named on the command line,
found the way a tenant would, with ps), device utilisation and its sample history, BAR1 and
memory. The tenant holds 1 GiB and runs nothing.

Reports ``pid <pid>`` for every process any of them names, ``stats <pid>`` for every pid
whose accounting stats it got, and per GPU i: ``util<i>``, ``umem<i>`` (utilisation rates),
``sample<i>`` (the largest GPU utilisation sample), ``bar1<i>`` (BAR1 used, or ``bar1err<i>``),
``used<i>`` / ``used2_<i>`` / ``total<i>`` (memory v1, v2; or ``memerr<i>``), and ``err_<what><i>``
for each call NVML refused (its NVML_ERROR code)."""

from __future__ import annotations

import sys

import pynvml as nv
from hostile_cb import GIB, alloc, hold, say, setup


def refused(what: str, i: int, e: nv.NVMLError) -> None:
    say(f"err_{what}{i}", e.value)


def processes(h: object, i: int) -> None:
    for mode in (
        nv.NVML_PROCESS_MODE_COMPUTE,
        nv.NVML_PROCESS_MODE_GRAPHICS,
        nv.NVML_PROCESS_MODE_MPS,
    ):
        try:
            for p in nv.nvmlDeviceGetRunningProcessDetailList(h, nv.nvmlProcessDetailList_v1, mode):
                say("pid", p.pid)
        except nv.NVMLError as e:
            refused("detail", i, e)
    try:
        for s in nv.nvmlDeviceGetProcessesUtilizationInfo(h, 0):
            say("pid", s.pid)
    except nv.NVMLError as e:
        refused("putil", i, e)


def accounting(h: object, i: int, probe: list[int]) -> None:
    try:
        pids = nv.nvmlDeviceGetAccountingPids(h)
    except nv.NVMLError as e:
        refused("acct", i, e)
        pids = []
    for pid in pids:
        say("pid", pid)
    for pid in sorted(set(pids) | set(probe)):
        try:
            nv.nvmlDeviceGetAccountingStats(h, pid)
            say("stats", pid)
        except nv.NVMLError as e:
            refused("stats", i, e)


def activity(h: object, i: int) -> None:
    rates = nv.nvmlDeviceGetUtilizationRates(h)
    say(f"util{i}", rates.gpu)
    say(f"umem{i}", rates.memory)
    try:
        _, samples = nv.nvmlDeviceGetSamples(h, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)
        say(f"sample{i}", max(s.sampleValue.uiVal for s in samples))
    except nv.NVMLError as e:
        refused("sample", i, e)


def memory(h: object, i: int) -> None:
    try:
        say(f"bar1{i}", nv.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used)
    except nv.NVMLError as e:
        say(f"bar1err{i}", e.value)
    try:
        m = nv.nvmlDeviceGetMemoryInfo(h)
        m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
        say(f"total{i}", m.total)
        say(f"used{i}", m.used)
        say(f"used2_{i}", m2.used)
    except nv.NVMLError as e:
        say(f"memerr{i}", e.value)


def main() -> None:
    setup()
    alloc(GIB)
    probe = [int(a) for a in sys.argv[1:]]
    nv.nvmlInit()
    count = nv.nvmlDeviceGetCount()
    say("devices", count)
    for i in range(count):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        processes(h, i)
        accounting(h, i, probe)
        activity(h, i)
        memory(h, i)
    hold()


main()
