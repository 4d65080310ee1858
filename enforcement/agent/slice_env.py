"""Per-slice limits files and the environment a workload applies to run in its slice.

The contract with the interposer (enforcement/native, read at ``cuInit``):
``QGPU_SLICE_ID``, ``QGPU_DEVICE_UUID``, ``QGPU_MEMORY_LIMIT`` (bytes), ``QGPU_CORE_LIMIT``
(1..100), ``QGPU_ISOLATION``, ``QGPU_STATE_DIR`` (the shared per-slice ledgers),
``QGPU_LIMITS_FILE``, ``QGPU_REAL_LIBCUDA`` and ``QGPU_SIM_CONFIG`` (simulation), plus
``CUDA_VISIBLE_DEVICES=<uuid>`` and ``LD_PRELOAD=<hook>``. The limits file holds the same
keys as ``KEY=VALUE`` lines (`enforcement.limits` renders and validates them); it is
written atomically (temp file, rename), mode 0444 and owned by root in production, so a
workload can read but not loosen its caps (the interposer trusts only such a file).

The MPS backend hands out ``CUDA_MPS_*`` variables and the interposer too, its limits naming
the GPU's MPS daemon (``QGPU_MPS_PIPE_DIRECTORY``): MPS takes a client's caps from its own
environment, so the interposer sets them from the trusted limits at ``cuInit``.
Whole-GPU slices need no cap: they get the device and the slice id only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from enforcement.limits import (
    SliceLimits,
    allocation_env,
    limits_for_allocation,
)
from qgpu.model import Allocation

LIMITS_SUFFIX = ".limits"


def slice_limits(
    alloc: Allocation,
    *,
    state_dir: Path,
    real_libcuda: Path | None = None,
    sim_config: str | None = None,
    mps_pipe_directory: Path | None = None,
) -> SliceLimits:
    """The interposer's limits for a share slice (`enforcement.limits` owns the rules)."""
    limits = limits_for_allocation(alloc, state_dir=str(state_dir))
    return replace(
        limits,
        real_libcuda=str(real_libcuda) if real_libcuda is not None else None,
        sim_config=sim_config,
        mps_pipe_directory=str(mps_pipe_directory) if mps_pipe_directory is not None else None,
    )


def limits_values(
    alloc: Allocation,
    *,
    state_dir: Path,
    limits_file: Path,
    real_libcuda: Path | None = None,
    extra: Mapping[str, str] | None = None,
    mps_pipe_directory: Path | None = None,
) -> dict[str, str]:
    """The QGPU_* limits of one share slice (what goes in its limits file)."""
    sim_config = (extra or {}).get("QGPU_SIM_CONFIG")
    values = slice_limits(
        alloc,
        state_dir=state_dir,
        real_libcuda=real_libcuda,
        sim_config=sim_config,
        mps_pipe_directory=mps_pipe_directory,
    ).to_env()
    values["QGPU_LIMITS_FILE"] = str(limits_file)
    return values


def remove_limits_file(path: Path) -> None:
    path.unlink(missing_ok=True)


def interposer_env(
    alloc: Allocation,
    limits: Mapping[str, str],
    *,
    hook_path: Path | None,
    workload_env: Mapping[str, str],
) -> dict[str, str]:
    """Environment of a share slice enforced by the interposer."""
    env = dict(workload_env)
    env.update(limits)
    env["CUDA_VISIBLE_DEVICES"] = alloc.gpu_uuids[0]
    if hook_path is not None:
        env["LD_PRELOAD"] = str(hook_path)
    return env


def whole_gpu_env(alloc: Allocation, workload_env: Mapping[str, str]) -> dict[str, str]:
    """Environment of whole GPUs: the devices and the slice id, no caps."""
    env = dict(workload_env)
    env.update(allocation_env(alloc))
    return env
