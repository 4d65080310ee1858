"""MPS on a real GPU: the agent's MPS manager starts, reuses and stops the control daemons.

Skipped unless a real NVIDIA GPU (NVML) and ``nvidia-cuda-mps-control`` are present.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from enforcement.discovery import NvmlBackend, nvml_available

pytestmark = pytest.mark.gpu

if not nvml_available() or shutil.which("nvidia-cuda-mps-control") is None:
    pytest.skip("needs a real NVIDIA GPU and nvidia-cuda-mps-control", allow_module_level=True)


def test_mps_daemon_per_gpu_lifecycle() -> None:
    from enforcement.agent.mps import MpsManager

    backend = NvmlBackend(kind="nvml", watch_xid=False)
    root = Path(tempfile.mkdtemp(prefix="qm", dir="/tmp"))
    try:
        uuid = backend.devices()[0].uuid
        mps = MpsManager("nvidia-cuda-mps-control", root)
        mps.start([uuid])
        assert mps.answers(uuid)
        again = MpsManager("nvidia-cuda-mps-control", root)
        again.start([uuid])
        assert again.started == []  # the running daemon was reused
        mps.stop([uuid])
        assert not mps.answers(uuid)
    finally:
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
