"""Locations of the native libraries built by ``pip install`` (see setup.py).

- ``libqgpu_hook.so``: the CUDA driver interposer (LD_PRELOAD or /etc/ld.so.preload).
- ``sim/libcuda.so.1`` and ``sim/libnvidia-ml.so.1``: the simulated driver and NVML.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
HOOK_LIBRARY = NATIVE_DIR / "libqgpu_hook.so"
SIM_DIR = NATIVE_DIR / "sim"
SIM_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


class NativeLibraryMissing(RuntimeError):
    """A native library of qgpu was not built."""


def _require(path: Path) -> Path:
    if not path.is_file():
        raise NativeLibraryMissing(
            f"{path} is missing: the native libraries are built by `pip install .` or "
            "`pip install -e .` (needs a C compiler, `cc`)"
        )
    return path


def hook_library_path() -> Path:
    """Path of ``libqgpu_hook.so``; raises NativeLibraryMissing when it was not built."""
    return _require(HOOK_LIBRARY)


def sim_library_dir() -> Path:
    """Directory holding the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1`` (put it on
    LD_LIBRARY_PATH); raises NativeLibraryMissing when they were not built."""
    for name in SIM_LIBRARIES:
        _require(SIM_DIR / name)
    return SIM_DIR
