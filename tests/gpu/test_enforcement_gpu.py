"""The interposer on a real NVIDIA GPU, with PyTorch or CuPy: the memory cap (exact, shared
by the processes of a slice, reclaimed after SIGKILL), compute caps at 10..90 % measured as
throughput relative to an uncapped run, and the throughput cost of an uncapped slice.

Skipped cleanly without a GPU, a CUDA build of PyTorch/CuPy, or the built interposer.
Results are also printed (run with -s) for docs/gpu-validation.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu_env import gpu_uuid, slice_env

pytestmark = pytest.mark.gpu

GIB = 1 << 30
WORKER = Path(__file__).with_name("gpu_worker.py")


def _framework_ok() -> bool:
    probe = (
        "import sys\n"
        "try:\n"
        "    import torch; sys.exit(0 if torch.cuda.is_available() else 1)\n"
        "except ImportError:\n"
        "    import cupy; cupy.cuda.runtime.getDeviceCount()\n"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


UUID = gpu_uuid()
if UUID is None or not _framework_ok():
    pytest.skip("needs a real NVIDIA GPU and PyTorch or CuPy with CUDA", allow_module_level=True)

from enforcement.native import NativeLibraryMissing, hook_library_path  # noqa: E402

try:
    hook_library_path()
except NativeLibraryMissing as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)


def worker(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_memory_cap_on_a_real_gpu(tmp_path: Path) -> None:
    env = slice_env(tmp_path, "gpu-mem", memory=4 * GIB)
    free, total = map(int, worker(env, "meminfo").split())
    assert total == 4 * GIB
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), "hold", str(3 * GIB)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout and holder.stdout.readline().strip() == "ready"
        assert worker(env, "try", str(GIB + (64 << 20))) == "oom"
        assert worker(env, "try", str(GIB - (64 << 20))) == "ok"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert worker(env, "try", str(3 * GIB)) == "ok"
    finally:
        holder.kill()
        holder.wait()
    print(f"\nmemory: slice of {4 * GIB} bytes, runtime saw total={total} free={free}")


def test_compute_caps_on_a_real_gpu(tmp_path: Path) -> None:
    plain = {k: v for k, v in os.environ.items() if not k.startswith("QGPU_")}
    plain.pop("LD_PRELOAD", None)
    base = float(worker(plain, "burn", "3"))
    uncapped = float(worker(slice_env(tmp_path, "gpu-unc"), "burn", "3"))
    loss = 100 * (1 - uncapped / base)
    print(
        f"\nthroughput: {base:.1f} it/s plain, {uncapped:.1f} it/s uncapped slice "
        f"({loss:+.2f}% loss)"
    )
    results = []
    for share in (10, 30, 50, 70, 90):
        rate = float(
            worker(
                slice_env(tmp_path, f"gpu-fs{share}", core=share, policy="fixed-share"), "burn", "3"
            )
        )
        results.append((share, 100 * rate / base))
        print(f"fixed-share {share}%: {100 * rate / base:.1f}% of plain throughput")
    assert loss < 5, loss
    for share, achieved in results:
        assert abs(achieved - share) <= 5, (share, achieved)
