"""Unit tests for the slice model: one test per rule and per rejection (DESIGN.md §1)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qgpu.errors import RuleViolation, first_violation, violations_from_pydantic
from qgpu.model import (
    GpuDevice,
    IsolationPolicy,
    NodeInventory,
    PlacementPolicy,
    SliceRequest,
)
from tests.helpers import make_gpu


def violation(**kw) -> RuleViolation:
    with pytest.raises(ValidationError) as info:
        SliceRequest(**kw)
    return first_violation(info.value)


@pytest.mark.parametrize("core", [0, 250, 201, 299, 350, -5])
def test_core_out_of_rule_rejected(core):
    v = violation(core=core, memory=8)
    assert v.field == "qgpu-core"
    assert v.value == core
    assert "1..99" in v.rule and "101..199" in v.rule and "multiple of 100" in v.rule


@pytest.mark.parametrize("core", [1, 30, 99, 100, 200, 800])
def test_core_in_rule_accepted(core):
    req = SliceRequest(core=core, memory=8)
    assert req.core == core
    assert req.is_whole_gpu == (core >= 100)
    assert req.gpu_count == max(1, core // 100)


@pytest.mark.parametrize("memory", [0, -1, "abc", "0.5Gi"])
def test_memory_rejected(memory):
    v = violation(core=30, memory=memory)
    assert v.field == "qgpu-memory"
    assert v.value == memory


def test_memory_required_for_a_share():
    v = violation(core=30)
    assert v.field == "qgpu-memory"
    assert "required for a share" in v.rule


def test_whole_gpu_needs_no_memory():
    assert SliceRequest(core=200).memory_gib is None


def test_memory_above_the_card_rejected():
    req = SliceRequest(core=30, memory=90)
    with pytest.raises(RuleViolation) as info:
        req.check_against(make_gpu("n", 0, gib=80))
    assert info.value.field == "qgpu-memory"
    assert info.value.value == 90
    assert "must not exceed the card" in info.value.rule and "80 GiB" in info.value.rule


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("be", IsolationPolicy.BEST_EFFORT),
        ("fs", IsolationPolicy.FIXED_SHARE),
        ("bs", IsolationPolicy.BURST_SHARE),
        ("Fixed-Share", IsolationPolicy.FIXED_SHARE),
        ("burst-share", IsolationPolicy.BURST_SHARE),
    ],
)
def test_isolation_abbreviations_accepted(given, expected):
    assert SliceRequest(core=30, memory=8, isolation=given).isolation is expected


def test_unknown_isolation_rejected():
    v = violation(core=30, memory=8, isolation="hard")
    assert v.field == "isolation" and v.value == "hard"
    assert "best-effort (be)" in v.rule


def test_unknown_placement_policy_rejected():
    v = violation(core=30, memory=8, placement="roundrobin")
    assert v.field == "placement" and v.value == "roundrobin"
    assert "binpack" in v.rule and "spread" in v.rule


def test_placement_policy_names():
    assert PlacementPolicy.parse("BINPACK") is PlacementPolicy.BINPACK
    assert SliceRequest(core=30, memory=8, gpu_placement="spread").gpu_placement == "spread"


def test_resource_names_as_aliases():
    req = SliceRequest.model_validate({"qgpu-core": 30, "qgpu-memory": "8Gi"})
    assert (req.core, req.memory_gib) == (30, 8)
    assert req.to_resources() == {"qgpu-core": 30, "qgpu-memory": 8}


def test_unknown_field_rejected():
    with pytest.raises(ValidationError) as info:
        SliceRequest.model_validate({"core": 30, "memory": 8, "colour": "red"})
    v = violations_from_pydantic(info.value)[0]
    assert v.field == "colour" and v.rule == "unknown field"


def test_model_constraint_and_uuid_lists():
    req = SliceRequest(core=30, memory=8, model="T4|V100M32", include_uuids="GPU-a,GPU-b")
    assert req.model_names == ("T4", "V100M32")
    assert req.include_uuids == ["GPU-a", "GPU-b"]
    v = violation(core=30, memory=8, model="T4||")
    assert v.field == "model"
    v = violation(core=30, memory=8, include_uuids=["GPU-a"], exclude_uuids=["GPU-a"])
    assert v.field == "exclude_uuids"


@pytest.mark.parametrize(("gib", "slices"), [(80, 16), (40, 10), (16, 4), (15, 3), (4, 1), (2, 1)])
def test_max_slices_per_gpu(gib, slices):
    gpu = make_gpu("n", 0, gib=gib)
    assert gpu.max_slices() == slices


def test_max_slices_configurable():
    assert make_gpu("n", 0, gib=80).max_slices(configured=4) == 4


def test_model_matching():
    gpu = GpuDevice(uuid="g", index=0, model="V100M32", memory_mib=32 * 1024)
    assert gpu.matches_model(("T4", "V100M32"))
    assert not gpu.matches_model(("T4",))
    assert gpu.matches_model(())


def test_node_rejects_duplicate_gpu_uuid():
    with pytest.raises(ValidationError) as info:
        NodeInventory(name="n", gpus=[make_gpu("n", 0), make_gpu("n", 0)])
    v = first_violation(info.value)
    assert v.field == "gpus.uuid" and "unique" in v.rule


def test_node_default_isolation_abbreviation():
    assert NodeInventory(name="n", default_isolation="bs").default_isolation == "burst-share"
    req = SliceRequest(core=10, memory=4)
    assert req.effective_isolation(IsolationPolicy.BURST_SHARE) is IsolationPolicy.BURST_SHARE
    assert req.effective_isolation() is IsolationPolicy.BEST_EFFORT
