"""The environment a Ray worker needs to run inside one slice.

Shares get the interposer (``LD_PRELOAD``), the device (``CUDA_VISIBLE_DEVICES=<uuid>``)
and the caps as the interposer's ``QGPU_*`` limits; whole GPUs get the device(s) only. The
node-level variables (``QGPU_STATE_DIR``, and ``QGPU_SIM_CONFIG``/``LD_LIBRARY_PATH`` on
simulated GPUs) come from the raylet's environment, set by ``qgpu-ray start`` or
`qgpu_ray.local`. The limits themselves are produced by `enforcement.limits`, the one
writer of the interposer's contract.
"""

from __future__ import annotations

from enforcement.limits import allocation_env
from qgpu.model import Allocation


def slice_env(alloc: Allocation) -> dict[str, str]:
    """Environment variables that put a worker process in `alloc` (before CUDA starts)."""
    return allocation_env(alloc)
