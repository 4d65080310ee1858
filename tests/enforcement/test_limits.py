"""enforcement.limits: the Python side of the interposer's contract."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from enforcement.limits import (
    SliceLimits,
    allocation_env,
    is_trusted_limits_file,
    limits_for_request,
    read_limits_file,
    render_limits,
    write_limits_file,
)
from enforcement.native import hook_library_path
from qgpu.errors import RuleViolation
from qgpu.model import Allocation, IsolationPolicy, SliceRequest

UUID = "GPU-5f3c2a1b-0000-4000-8000-00000000abcd"
GIB = 1 << 30


def test_request_to_limits_and_env_round_trip() -> None:
    req = SliceRequest(core=30, memory_gib="8Gi", isolation="bs")
    limits = limits_for_request(req, slice_id="s-1", device_uuid=UUID, state_dir="/run/q")
    env = limits.to_env()
    assert env == {
        "QGPU_SLICE_ID": "s-1",
        "QGPU_DEVICE_UUID": UUID,
        "QGPU_MEMORY_LIMIT": str(8 * GIB),
        "QGPU_CORE_LIMIT": "30",
        "QGPU_ISOLATION": "burst-share",
        "QGPU_STATE_DIR": "/run/q",
    }
    assert SliceLimits.from_mapping(env) == limits


def test_whole_gpu_request_has_no_caps() -> None:
    limits = limits_for_request(SliceRequest(core=100), slice_id="w", device_uuid=UUID)
    assert limits.memory_bytes is None and limits.core == 100
    assert "QGPU_MEMORY_LIMIT" not in limits.to_env()


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"QGPU_SLICE_ID": "a/b", "QGPU_DEVICE_UUID": UUID}, "QGPU_SLICE_ID"),
        ({"QGPU_SLICE_ID": "a", "QGPU_DEVICE_UUID": "x"}, "QGPU_DEVICE_UUID"),
        ({"QGPU_SLICE_ID": "a", "QGPU_DEVICE_UUID": UUID, "QGPU_CORE_LIMIT": "101"},
         "QGPU_CORE_LIMIT"),
        ({"QGPU_SLICE_ID": "a", "QGPU_DEVICE_UUID": UUID, "QGPU_MEMORY_LIMIT": "4G"},
         "QGPU_MEMORY_LIMIT"),
        ({"QGPU_SLICE_ID": "a", "QGPU_DEVICE_UUID": UUID, "QGPU_ISOLATION": "x"},
         "QGPU_ISOLATION"),
        ({"QGPU_SLICE_ID": "a", "QGPU_DEVICE_UUID": UUID, "QGPU_TYPO": "1"}, "QGPU_TYPO"),
    ],
)  # fmt: skip
def test_from_mapping_names_the_key(values: dict[str, str], field: str) -> None:
    with pytest.raises(RuleViolation) as exc:
        SliceLimits.from_mapping(values)
    assert exc.value.field == field


def test_allocation_env_for_share_and_whole_gpu() -> None:
    share = Allocation(slice_id="a1", node="n", gpu_uuids=[UUID], core=40, memory_gib=6,
                       isolation=IsolationPolicy.FIXED_SHARE)  # fmt: skip
    env = allocation_env(share)
    assert env["LD_PRELOAD"] == str(hook_library_path())
    assert env["CUDA_VISIBLE_DEVICES"] == UUID
    assert env["QGPU_MEMORY_LIMIT"] == str(6 * GIB)
    assert env["QGPU_ISOLATION"] == "fixed-share"
    assert "QGPU_STATE_DIR" not in env  # node-level: from the worker's node
    whole = Allocation(slice_id="w1", node="n", gpu_uuids=[UUID, UUID.replace("a", "b")],
                       core=200, memory_gib=80)  # fmt: skip
    assert allocation_env(whole) == {
        "CUDA_VISIBLE_DEVICES": f"{UUID},{UUID.replace('a', 'b')}",
        "QGPU_SLICE_ID": "w1",
    }


def test_limits_file_write_read_and_trust(tmp_path: Path) -> None:
    limits = SliceLimits("f1", UUID, 2 * GIB, 50, IsolationPolicy.BURST_SHARE)
    path = write_limits_file(tmp_path / "limits.conf", limits)
    assert read_limits_file(path) == limits.to_env()
    assert (path.stat().st_mode & 0o777) == 0o444
    assert is_trusted_limits_file(path) == (os.geteuid() == 0)
    path.chmod(0o666)
    assert not is_trusted_limits_file(path)
    with pytest.raises(RuleViolation):
        render_limits({"QGPU_SLICE_ID": "x\ny"})
