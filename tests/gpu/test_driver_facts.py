"""What NVIDIA's driver does that the caps depend on and the simulator models, checked on a
real GPU (skipped without one). Each test is an attack or a model the CPU suite takes on
trust:

* allocations just over a page: the hook charges what `cuMemAlloc` asks for; a driver that
  backs allocations in whole large pages would hold more than that, so a slice allocating
  2 MiB + 4 KiB at a time (or 1 MiB + 4 KiB, or 64 KiB + 4 bytes) until refused must still
  hold no more than its cap in NVML's per-process view;
* managed memory: NVML's per-process lists leave it out and the driver's own allocations
  evict it to the host (the simulator's model since 2026-12-03; `test_strict_managed.py`);
* what a neighbour leaves in device memory: a process that fills 16 GiB with a pattern and
  exits, then another that allocates 16 GiB and reads it unwritten, must see none of the
  pattern (qgpu relies on the driver clearing memory between processes; the simulator has
  no memory contents to show it).

Results are printed (run with -s) for docs/gpu-validation.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu_env import gpu_uuid, slice_env

pytestmark = pytest.mark.gpu

GIB, MIB = 1 << 30, 1 << 20
PROBE = Path(__file__).with_name("driver_probe.py")


if gpu_uuid() is None:
    pytest.skip("needs a real NVIDIA GPU and its driver", allow_module_level=True)

pynvml = pytest.importorskip("pynvml")

from enforcement.native import NativeLibraryMissing, hook_library_path  # noqa: E402

try:
    hook_library_path()
except NativeLibraryMissing as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)
UUID = gpu_uuid()


def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QGPU_")}
    env.pop("LD_PRELOAD", None)
    env["CUDA_VISIBLE_DEVICES"] = str(UUID)
    return env


def start(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A probe that holds what it took; returns it and the lines it printed up to ready."""
    proc = subprocess.Popen(
        [sys.executable, str(PROBE), *args], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline().strip()) != "ready":
        assert line, f"probe ended early: {lines}"
        lines.append(line)
    return proc, lines


def nvml_used(pid: int) -> int:
    """What NVML's per-process list says `pid` holds on the GPU."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(str(UUID))
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)
    finally:
        pynvml.nvmlShutdown()


def device_used() -> int:
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(str(UUID))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("size", [2 * MIB + 4096, MIB + 4096, 64 * 1024 + 4])
def test_allocations_just_over_a_page_hold_no_more_than_the_cap(tmp_path: Path, size: int) -> None:
    cap = 4 * GIB
    proc, lines = start(slice_env(tmp_path, f"gran-{size}", memory=cap), "grab", str(size))
    try:
        count = int(lines[-1].split()[1])
        held = nvml_used(proc.pid)
    finally:
        proc.communicate(timeout=60)
    print(f"\n{size} B allocations: {count} taken, NVML shows {held / GIB:.3f} GiB (cap 4 GiB)")
    assert held <= cap + 64 * MIB, f"{held / GIB:.2f} GiB held under a 4 GiB cap"


def test_managed_memory_is_not_listed_and_the_driver_s_allocations_evict_it(
    tmp_path: Path,
) -> None:
    managed = 16 * GIB
    before = device_used()
    holder, _ = start(plain_env(), "managed", str(managed))
    try:
        listed = nvml_used(holder.pid)
        grew = device_used() - before
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(str(UUID))
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            free, total = int(mem.free), int(mem.total)
        finally:
            pynvml.nvmlShutdown()
        want = free + 8 * GIB  # only fits if 8 GiB of the managed memory leave the GPU
        out = subprocess.run(
            [sys.executable, str(PROBE), "alloc", str(want)], env=plain_env(),
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        holder.communicate(timeout=120)
    print(
        f"\nmanaged {managed / GIB:.0f} GiB prefetched: NVML lists {listed / GIB:.2f} GiB for "
        f"its process, the device's used memory grew {grew / GIB:.2f} GiB; a cuMemAlloc of "
        f"{want / GIB:.2f} GiB (free {free / GIB:.2f} of {total / GIB:.2f}) returned "
        f"{out.stdout.strip()}"
    )
    assert grew >= managed - GIB  # it is on the GPU
    assert listed < managed // 2  # but not in the per-process list
    assert out.stdout.strip() == "0"  # and the driver's allocation evicted what it needed


def test_memory_a_neighbour_left_is_not_readable() -> None:
    size = 16 * GIB  # the freed pages are likely handed out again (not certain: a probe)
    paint = subprocess.run(
        [sys.executable, str(PROBE), "paint", str(size)], env=plain_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert paint.stdout.strip() == "0", paint.stdout + paint.stderr
    peek = subprocess.run(
        [sys.executable, str(PROBE), "peek", str(size)], env=plain_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    painted, nonzero = map(int, peek.stdout.split())
    print(
        f"\na new 16 GiB allocation after a neighbour's: {painted} bytes of its pattern, "
        f"{nonzero} non-zero"
    )
    assert painted == 0
