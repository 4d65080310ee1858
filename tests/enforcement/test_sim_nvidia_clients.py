"""NVIDIA's own clients over the interposer and the simulated driver (issue 16, "What to
build" 4): NVIDIA's ``cuda-bindings`` (PyPI), which resolves every driver function through
cuGetProcAddress and creates contexts with the CUDA 13 ``cuCtxCreate_v4``; and NVIDIA's
runtime ``libcudart``, which stops at the driver's private export tables (what it asks for
and why we stop there: docs/enforcement.md, "NVIDIA's clients over the simulator")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.sim import write_sim_config

from .conftest import CTX, GIB, Sim, run_json

SLICE = 4 * GIB

CUDA_BINDINGS = """
import json
from cuda.bindings import driver as cu
def code(r):
    return int(r[0] if isinstance(r, tuple) else r)
out = {"init": code(cu.cuInit(0))}
err, out["version"] = cu.cuDriverGetVersion()
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuCtxCreate(None, 0, dev)  # cuda-bindings 13 asks for cuCtxCreate_v4
out["ctx"] = int(err)
err, free, total = cu.cuMemGetInfo()
out["meminfo"] = [int(err), free, total]
err, total_mem = cu.cuDeviceTotalMem(dev)
out["total_mem"] = total_mem
err, p = cu.cuMemAlloc(1 << 30)
out["alloc"] = int(err)
err, q = cu.cuMemAlloc(8 << 30)
out["over_cap"] = int(err)
err, free2, _ = cu.cuMemGetInfo()
out["free_after"] = free2
out["free"] = code(cu.cuMemFree(p))
err, s = cu.cuStreamCreate(0)
out["stream"] = int(err)
err, e1 = cu.cuEventCreate(0)
err, e2 = cu.cuEventCreate(0)
out["record"] = [code(cu.cuEventRecord(e1, s)), code(cu.cuEventRecord(e2, s))]
out["sync"] = [code(cu.cuEventSynchronize(e2)), code(cu.cuStreamSynchronize(s)),
               code(cu.cuEventQuery(e2)), code(cu.cuStreamQuery(s))]
err, ms = cu.cuEventElapsedTime(e1, e2)
out["elapsed"] = [int(err), ms]
out["destroy"] = [code(cu.cuEventDestroy(e1)), code(cu.cuEventDestroy(e2)),
                  code(cu.cuStreamDestroy(s)), code(cu.cuCtxDestroy(ctx))]
print(json.dumps(out))
"""


def test_sim_cuda_bindings_through_the_interposer(sim: Sim) -> None:
    """A 4 GiB slice seen through NVIDIA's Python bindings: the slice's size, allocations
    charged, CUDA_ERROR_OUT_OF_MEMORY over the cap, and a kernel-free stream/event path."""
    import cuda.bindings.driver  # noqa: F401  (the dev extra installs it: a failure if not)

    out = run_json(sim.slice_env("nv-bindings", memory=SLICE), CUDA_BINDINGS)
    assert out["init"] == 0 and out["version"] == 13000 and out["ctx"] == 0
    assert out["meminfo"] == [0, SLICE - CTX, SLICE]  # its context is charged to the slice
    assert out["total_mem"] == SLICE
    assert out["alloc"] == 0
    assert out["over_cap"] == 2  # CUDA_ERROR_OUT_OF_MEMORY, not a crash
    assert out["free_after"] == SLICE - CTX - GIB
    assert out["free"] == 0 and out["stream"] == 0
    assert out["record"] == [0, 0] and out["sync"] == [0, 0, 0, 0]
    assert out["elapsed"][0] == 0 and 0 <= out["elapsed"][1] < 1.0
    assert out["destroy"] == [0, 0, 0, 0]


def find_libcudart() -> Path | None:
    """NVIDIA's runtime from an installed toolkit or the nvidia-cuda-runtime wheel, if any."""
    dirs = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(str(Path(nvcc).resolve().parent.parent))
        # a wrapper script on PATH (as on these machines) names the toolkit it runs
        text = Path(nvcc).read_text(errors="ignore")[:4096] if Path(nvcc).is_file() else ""
        dirs += [str(Path(w).parent.parent) for w in text.split() if w.endswith("/bin/nvcc")]
    found = [Path(d) / "lib64" / "libcudart.so.13" for d in dirs if d]
    wheels = Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/*/lib/libcudart.so.13")
    found += sorted(wheels)
    return next((p for p in found if p.is_file()), None)


RUNTIME = """
import ctypes, json, sys
rt = ctypes.CDLL(sys.argv[1])
rt.cudaGetErrorName.restype = ctypes.c_char_p
v, n, p = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_void_p()
out = {"driver": [rt.cudaDriverGetVersion(ctypes.byref(v)), v.value]}
out["count"] = rt.cudaGetDeviceCount(ctypes.byref(n))
out["malloc"] = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1 << 20))
f, t = ctypes.c_size_t(), ctypes.c_size_t()
out["meminfo"] = rt.cudaMemGetInfo(ctypes.byref(f), ctypes.byref(t))
out["names"] = [rt.cudaGetErrorName(out[k]).decode() for k in ("count", "malloc", "meminfo")]
print(json.dumps(out))
"""

# the tables NVIDIA's 13.0 runtime asks the driver for, in order (the first it accepts as
# missing; without the second it cannot start)
EXPORT_TABLES = ["f8cff95121468b4eb9e2fb469e7c0dd9", "6bd5fb6c5bf4e74a8987d93912fd9df9"]
SYMBOL_NOT_FOUND, INSUFFICIENT_DRIVER = 500, 35


@pytest.mark.parametrize("version", [13000, 12080])
def test_sim_nvidia_runtime_stops_at_the_private_export_tables(
    short_tmp: Path, version: int
) -> None:
    """Records where NVIDIA's runtime stops over the simulated driver (and the interposer):
    every driver entry point it looks up resolves (all but an empty name), it asks
    cuDriverGetVersion before cuInit and refuses a driver older than itself
    (cudaErrorInsufficientDriver), and on a 13.0 driver it then needs a private export table
    the simulator does not have, so every device call fails with cudaErrorSymbolNotFound. If
    this test starts failing, the runtime changed: re-read what it asks for."""
    lib = find_libcudart()
    if lib is None:
        pytest.fail(
            "no NVIDIA runtime (libcudart.so.13): neither the CUDA toolkit nor its wheel is here"
        )
    cfg = write_sim_config(short_tmp / "rt.conf", "H100-80GB", node="rt", cuda_version=version)
    env = Sim(cfg, short_tmp / "l").slice_env("nv-runtime", memory=SLICE)
    env.update(QGPU_SIM_TRACE_EXPORT_TABLES="1", QGPU_SIM_TRACE_PROCADDR="1")
    run = subprocess.run(
        [sys.executable, "-c", RUNTIME, str(lib)], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    trace = run.stderr.splitlines()
    asked = [line.split()[2].rstrip(":") for line in trace if "cuGetExportTable" in line[:40]]
    lookups = [line.split() for line in trace if line.startswith("qgpu-sim: cuGetProcAddress ")]
    assert out["driver"] == [0, version]  # answered before cuInit, as configured
    assert len(lookups) > 400  # it resolves the driver API through cuGetProcAddress ...
    unresolved = [w for w in lookups if w[-1] in ("SYMBOL_NOT_FOUND", "VERSION_NOT_SUFFICIENT")]
    # the runtime's empty name aside, only entry points newer than the driver are missing
    # (a 12.8 driver does not know CUDA 12.9's cuLogs* or 13.0's batch prefetch)
    assert ["qgpu-sim:", "cuGetProcAddress", "0", "0", "->", "SYMBOL_NOT_FOUND"] in unresolved
    newer = [w for w in unresolved if w[2] != "0"]
    assert all(int(w[3]) > version and w[-1] == "SYMBOL_NOT_FOUND" for w in newer), newer
    assert (version < 13000) == bool(newer)
    if version < 13000:
        # ... asks for the first private table, then refuses a driver older than itself
        assert asked == EXPORT_TABLES[:1]
        assert out["count"] == out["malloc"] == INSUFFICIENT_DRIVER, out
        return
    assert asked == EXPORT_TABLES  # ... then asks for NVIDIA's private tables
    assert out["count"] == out["malloc"] == out["meminfo"] == SYMBOL_NOT_FOUND, out
    assert out["names"] == ["cudaErrorSymbolNotFound"] * 3
