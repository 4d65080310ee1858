"""Workload for the real-GPU enforcement tests (run as a script with PyTorch or CuPy).

gpu_worker.py hold BYTES        allocate and hold, print "ready", sleep until killed
gpu_worker.py try BYTES         print "ok" or "oom"
gpu_worker.py meminfo           print "FREE TOTAL" as the CUDA runtime reports them
gpu_worker.py burn SECONDS      saturating matmuls; print iterations per second
"""

from __future__ import annotations

import sys
import time


def _framework():
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", torch
    except ImportError:
        pass
    import cupy

    return "cupy", cupy


def main() -> int:
    name, fw = _framework()
    mode, arg = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0"
    if mode in ("hold", "try"):
        n = int(arg)
        try:
            if name == "torch":
                x = fw.empty(n, dtype=fw.uint8, device="cuda")
                fw.cuda.synchronize()
            else:
                x = fw.empty(n, dtype=fw.uint8)
                fw.cuda.Device().synchronize()
        except (RuntimeError, MemoryError) as exc:  # torch OutOfMemoryError is a RuntimeError
            if "out of memory" in str(exc).lower() or "OutOfMemory" in type(exc).__name__:
                print("oom", flush=True)
                return 0
            raise
        print("ready" if mode == "hold" else "ok", flush=True)
        if mode == "hold":
            time.sleep(3600)
        del x
    elif mode == "meminfo":
        free, total = fw.cuda.mem_get_info() if name == "torch" else fw.cuda.runtime.memGetInfo()
        print(free, total)
    elif mode == "burn":
        seconds = float(arg)
        if name == "torch":
            a = fw.randn(4096, 4096, device="cuda")
            sync = fw.cuda.synchronize
        else:
            a = fw.random.randn(4096, 4096, dtype=fw.float32)
            sync = fw.cuda.Device().synchronize
        for _ in range(5):  # warm-up
            a @ a
        sync()
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            for _ in range(10):
                a @ a
            sync()
            n += 10
        print(n / (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
