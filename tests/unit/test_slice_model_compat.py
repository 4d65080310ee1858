"""The slice model's TKE/HAMi/MetaX-compatible rules (DESIGN.md §1): multi-GPU shares with
TKE's even split, memory as a percentage of the card, and the slices-per-GPU policy; and the
placement engine placing them (each GPU's part checked and held on its own GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from qgpu.errors import NoFit, RuleViolation
from qgpu.model import NodeInventory, SliceRequest, SlicesPerGpu
from qgpu.placement import ClusterState, Engine
from tests.helpers import make_gpu


@pytest.mark.parametrize(
    ("core", "memory", "per_core", "per_memory"),
    [(160, 60, 80, 30), (121, 31, 60, 15), (101, 2, 50, 1), (199, 79, 99, 39), (150, 8, 75, 4)],
)
def test_multi_gpu_share_splits_evenly_over_two_gpus_rounding_down(
    core: int, memory: int, per_core: int, per_memory: int
) -> None:
    req = SliceRequest(core=core, memory=memory)
    assert req.is_multi_gpu_share and not req.is_whole_gpu
    assert (req.gpu_count, req.core_per_gpu, req.memory_gib_per_gpu) == (2, per_core, per_memory)


def test_whole_gpu_multiples_are_unchanged() -> None:
    req = SliceRequest(core=200)
    assert (req.is_whole_gpu, req.is_multi_gpu_share, req.gpu_count, req.core_per_gpu) == (
        True,
        False,
        2,
        100,
    )


def test_multi_gpu_share_needs_a_gib_per_gpu() -> None:
    with pytest.raises(ValueError, match="at least 2 GiB for a share split over 2 GPUs"):
        SliceRequest(core=150, memory=1)


def test_multi_gpu_share_checked_per_gpu_against_the_card() -> None:
    card = make_gpu("n", 0, gib=16)
    SliceRequest(core=160, memory=32).check_against(card)  # 2 x 16 GiB: each part fits
    with pytest.raises(RuleViolation, match="must not exceed the card per GPU"):
        SliceRequest(core=160, memory=34).check_against(card)


def test_adapters_refuse_multi_gpu_shares_they_cannot_enforce() -> None:
    with pytest.raises(RuleViolation) as info:
        SliceRequest.parse({"core": 160, "memory": 60}, where="the Ray SDK")
    v = info.value
    assert (v.field, v.value) == ("qgpu-core", 160)
    assert "the Ray SDK cannot enforce" in v.rule and "multiple of 100" in v.rule
    ok = SliceRequest.parse({"core": 160, "memory": 60}, multi_gpu_shares=True)
    assert ok.gpu_count == 2


@pytest.mark.parametrize(("pct", "card", "cap"), [(50, 80, 40), (25, 15, 3), (100, 15, 15)])
def test_memory_percentage_of_the_card(pct: int, card: int, cap: int) -> None:
    req = SliceRequest.model_validate({"qgpu-core": 30, "qgpu-memory-percentage": pct})
    assert req.memory_percent == pct and req.memory_gib is None
    assert req.memory_on(card) == cap
    assert req.to_resources() == {"qgpu-core": 30, "qgpu-memory-percentage": pct}


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({"core": 30, "memory_percent": 0}, "qgpu-memory-percentage", "1..100"),
        ({"core": 30, "memory_percent": 101}, "qgpu-memory-percentage", "1..100"),
        ({"core": 30, "memory_percent": "half"}, "qgpu-memory-percentage", "integer percent"),
        ({"core": 30, "memory_percent": 50, "memory": 8}, "qgpu-memory-percentage", "one memory"),
        ({"core": 100, "memory_percent": 50}, "qgpu-memory-percentage", "shares only"),
        ({"core": 30}, "qgpu-memory", "qgpu-memory-percentage"),
    ],
)
def test_memory_percentage_rules(raw: dict, field: str, words: str) -> None:
    with pytest.raises(RuleViolation) as info:
        SliceRequest.parse(raw)
    assert info.value.field == field and words in info.value.rule


def test_a_percentage_below_one_gib_never_fits_a_small_card() -> None:
    with pytest.raises(RuleViolation, match="less than 1 GiB"):
        SliceRequest(core=10, memory_percent=5).check_against(make_gpu("n", 0, gib=15))


@pytest.mark.parametrize(
    ("text", "limit", "fixed", "on_16_gib"),
    [("floor-gib", 16, False, 4), ("16", 16, True, 16), (" 8 ", 8, True, 8), (1, 1, True, 1)],
)
def test_slices_per_gpu_policy(text: object, limit: int, fixed: bool, on_16_gib: int) -> None:
    policy = SlicesPerGpu.parse(text)
    assert (policy.limit, policy.fixed) == (limit, fixed)
    assert make_gpu("n", 0, gib=16).max_slices(policy.limit, policy.fixed) == on_16_gib
    assert SlicesPerGpu.parse(str(policy)) == policy


@pytest.mark.parametrize("bad", ["0", "17", "bogus", "", True, -1, "4.5"])
def test_slices_per_gpu_policy_refuses_other_values(bad: object) -> None:
    with pytest.raises(RuleViolation, match=r"floor-gib .* or a fixed count 1\.\.16"):
        SlicesPerGpu.parse(bad, "label")


def _state(*cards: int, fixed: int | None = None) -> ClusterState:
    gpus = [make_gpu("n1", i, gib=g) for i, g in enumerate(cards)]
    inv = NodeInventory(
        name="n1",
        gpus=gpus,
        max_slices_per_gpu=fixed or 16,
        fixed_slices=fixed is not None,
    )
    return ClusterState([inv])


def test_engine_places_a_multi_gpu_share_on_two_gpus_of_one_node() -> None:
    s = _state(80, 80, 80)
    e = Engine(s, "binpack")
    e.place("busy", SliceRequest(core=50, memory=10))  # GPU 0 has 50 core left
    d = e.place("multi", SliceRequest(core=160, memory=60))
    assert len(d.gpu_uuids) == 2 and d.core_per_gpu == 80 and d.memory_gib_per_gpu == (30, 30)
    idx = [s.uuid_index[u] for u in d.gpu_uuids]
    assert 0 not in idx  # GPU 0 cannot take an 80-core part
    assert s.free_core[idx].tolist() == [20, 20] and s.free_mem[idx].tolist() == [50, 50]
    s.check_invariants()
    with pytest.raises(NoFit):  # one GPU with 50 core and two with 20 left: no two fit 80
        e.decide(SliceRequest(core=160, memory=2))
    assert s.release("multi")
    s.check_invariants()


def test_engine_places_a_memory_percentage_per_card() -> None:
    s = _state(16, 80)
    e = Engine(s, "binpack")
    d = e.place("pct", SliceRequest(core=10, memory_percent=50))
    assert d.memory_gib_per_gpu in ((8,), (40,))
    held = s.held["pct"]
    assert int(held.memory[0]) == s.cap_mem[held.gpus[0]] // 2
    s.check_invariants()


def test_fixed_slice_count_allows_sixteen_slices_on_a_16_gib_card() -> None:
    for fixed, expect in ((None, 4), (16, 16)):
        s = _state(16, fixed=fixed)
        e = Engine(s, "binpack")
        placed = 0
        with pytest.raises(NoFit, match="slice limit"):
            for i in range(20):
                e.place(f"s{i}", SliceRequest(core=1, memory=1))
                placed += 1
        assert placed == expect
        assert int(np.max(s.slices)) == expect
