"""SliceCluster on this machine's real NVIDIA GPUs (NVML backend of the agent it starts).

Skipped cleanly without a GPU (NVML). Not run on the build machines (no GPU): written to
run the same checks as the simulated tests where a GPU is present.
"""

from __future__ import annotations

import pytest

from enforcement.discovery import nvml_available

pytestmark = pytest.mark.gpu

if not nvml_available():
    pytest.skip("needs a real NVIDIA GPU (NVML)", allow_module_level=True)

from distributed import Client  # noqa: E402

from enforcement import simcuda  # noqa: E402
from qgpu_dask import SliceCluster  # noqa: E402
from tests.dask import workloads  # noqa: E402

GIB = 1 << 30


def test_a_slice_worker_on_a_real_gpu_sees_its_cap():
    with (
        SliceCluster([{"core": 30, "memory": 4}], sim="real") as cluster,
        Client(cluster) as client,
    ):
        res = cluster.slice_of("slice-0")
        out = client.submit(workloads.cuda_probe, resources={"qgpu-core": 30}).result(120)
        assert out["CUDA_VISIBLE_DEVICES"] == res.device_uuid
        assert out["QGPU_SLICE_ID"] == res.slice_id
        assert out["preloaded"] is True
        assert out["count"] == 1
        assert out["total"] == 4 * GIB
        assert out["over_cap"] == simcuda.CUDA_ERROR_OUT_OF_MEMORY
        assert out["half"] == simcuda.CUDA_SUCCESS
