"""Placement engine: binpack/spread at node and GPU level, whole GPUs, constraints."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from qgpu.errors import NoFit
from qgpu.model import GpuHealth, NodeInventory, SliceRequest
from qgpu.placement import ClusterState, Engine, make_policy
from tests.helpers import make_gpu, make_node


def share(core=30, mem=8, **kw):
    return SliceRequest(core=core, memory=mem, **kw)


def place_all(nodes, policy, reqs, gpu_policy=None):
    state = ClusterState(nodes)
    engine = Engine(state, policy, gpu_policy)
    out = [engine.place(f"s{i}", r) for i, r in enumerate(reqs)]
    state.check_invariants()
    return state, out


def test_binpack_puts_three_30_slices_on_one_gpu(two_nodes):
    _, ds = place_all(two_nodes, "binpack", [share()] * 3)
    assert len({d.gpu_uuids for d in ds}) == 1


def test_spread_puts_three_30_slices_on_three_gpus(two_nodes):
    _, ds = place_all(two_nodes, "spread", [share()] * 3)
    assert len({d.gpu_uuids for d in ds}) == 3


def test_gpu_level_spread_inside_binpacked_node(two_nodes):
    _, ds = place_all(two_nodes, "binpack", [share()] * 3, gpu_policy="spread")
    assert len({d.node for d in ds}) == 1
    assert len({d.gpu_uuids for d in ds}) == 3


def test_node_level_spread_with_gpu_binpack(two_nodes):
    _, ds = place_all(two_nodes, "spread", [share()] * 4, gpu_policy="binpack")
    assert [d.node for d in ds] == ["n0", "n1", "n0", "n1"]
    assert ds[0].gpu_uuids == ds[2].gpu_uuids


def test_fourth_slice_never_overcommits():
    nodes = [make_node("n0", gpus=1)]
    state, ds = place_all(nodes, "binpack", [share()] * 3)
    with pytest.raises(NoFit) as info:
        Engine(state, "binpack").decide(share(core=30))
    assert "core" in info.value.reasons
    # 10% core still fits, memory too
    d = Engine(state, "binpack").decide(share(core=10, mem=8))
    assert d.gpu_uuids == ds[0].gpu_uuids


def test_memory_dimension_blocks_too():
    state, _ = place_all([make_node("n0", gpus=1)], "binpack", [share(core=10, mem=70)])
    with pytest.raises(NoFit) as info:
        Engine(state).decide(share(core=10, mem=20))
    assert info.value.reasons == {"memory": 1}


def test_whole_gpu_takes_an_empty_gpu(two_nodes):
    state, ds = place_all(two_nodes, "binpack", [share(), SliceRequest(core=100)])
    assert ds[1].gpu_uuids != ds[0].gpu_uuids
    assert ds[1].memory_gib_per_gpu == (80,)
    i = state.uuid_index[ds[1].gpu_uuids[0]]
    assert state.free_core[i] == 0 and state.free_mem[i] == 0


def test_two_hundred_takes_two_empty_gpus_of_one_node(two_nodes):
    _, ds = place_all(two_nodes, "binpack", [share(), SliceRequest(core=200)])
    d = ds[1]
    assert len(d.gpu_uuids) == 2
    assert all(u.startswith(f"GPU-{d.node}-") for u in d.gpu_uuids)
    assert ds[0].gpu_uuids[0] not in d.gpu_uuids


def test_multi_gpu_prefers_one_numa_node():
    # n0: GPUs 0,1 on NUMA 0 and 2,3 on NUMA 1; occupy GPU 0 so only NUMA 1 has 2 empty.
    _state, ds = place_all([make_node("n0")], "binpack", [share(), SliceRequest(core=200)])
    assert set(ds[1].gpu_uuids) == {"GPU-n0-2", "GPU-n0-3"}


def test_whole_gpus_never_split_across_nodes():
    nodes = [make_node("a", gpus=1), make_node("b", gpus=1)]
    state = ClusterState(nodes)
    with pytest.raises(NoFit) as info:
        Engine(state).decide(SliceRequest(core=200))
    assert "fewer than 2 fitting GPUs on one node" in str(info.value)


def test_model_constraint():
    nodes = [make_node("a", model="T4", gib=15), make_node("b", model="V100M32", gib=32)]
    _, ds = place_all(nodes, "binpack", [share(mem=4, model="V100M32")] * 2)
    assert all(d.node == "b" for d in ds)
    with pytest.raises(NoFit) as info:
        Engine(ClusterState(nodes)).decide(share(mem=4, model="A100"))
    assert info.value.reasons["model"] == 8


def test_include_and_exclude_uuids(two_nodes):
    _, ds = place_all(two_nodes, "binpack", [share(include_uuids=["GPU-n1-3"])])
    assert ds[0].gpu_uuids == ("GPU-n1-3",)
    _, ds = place_all(two_nodes, "binpack", [share(exclude_uuids=["GPU-n0-0"])])
    assert ds[0].gpu_uuids != ("GPU-n0-0",)


def test_unhealthy_gpus_are_skipped():
    gpus = [make_gpu("n", 0), make_gpu("n", 1).model_copy(update={"health": GpuHealth.UNHEALTHY})]
    state = ClusterState([NodeInventory(name="n", gpus=gpus)])
    engine = Engine(state, "spread")
    assert {engine.place(f"s{i}", share(core=10, mem=4)).gpu_uuids for i in range(2)} == {
        ("GPU-n-0",)
    }


def test_max_slices_per_gpu_limit():
    node = make_node("n", gpus=1, gib=16)  # floor(16/4) = 4 slices
    state = ClusterState([node])
    engine = Engine(state)
    for i in range(4):
        engine.place(f"s{i}", share(core=5, mem=1))
    with pytest.raises(NoFit) as info:
        engine.decide(share(core=5, mem=1))
    assert info.value.reasons == {"slice limit": 1}


def test_configured_max_slices_per_node():
    state = ClusterState([make_node("n", gpus=1, max_slices_per_gpu=2)])
    engine = Engine(state)
    engine.place("a", share(core=5, mem=1))
    engine.place("b", share(core=5, mem=1))
    with pytest.raises(NoFit):
        engine.decide(share(core=5, mem=1))


def test_host_cpu_and_memory_fit():
    nodes = [make_node("a", gpus=1, cpu_milli=4000), make_node("b", gpus=1, cpu_milli=16000)]
    _, ds = place_all(nodes, "binpack", [share(cpu_milli=8000)])
    assert ds[0].node == "b"


def test_release_restores_capacity_and_is_idempotent(two_nodes):
    state = ClusterState(two_nodes)
    engine = Engine(state)
    engine.place("x", SliceRequest(core=200))
    assert state.release("x") is True
    assert state.release("x") is False
    state.check_invariants()
    assert int(state.free_core.sum()) == 800


def test_shortfall_names_the_first_rule_a_node_fails():
    state = ClusterState([make_node("n0", 2), make_node("n1", 2)])
    engine = Engine(state)
    state.apply("a", [0], 90, [4])  # node 0: GPU 0 has 10% left
    state.apply("b", [1], 10, [78])  # node 0: GPU 1 has 2 GiB left
    nodes = np.asarray([0, 1])
    assert engine.shortfall(SliceRequest(core=30, memory_gib=4), nodes) == ["memory", None]
    assert engine.shortfall(SliceRequest(core=95, memory_gib=1), nodes) == ["core", None]
    assert engine.shortfall(SliceRequest(core=100), nodes)[0] == "not empty (whole GPU)"
    assert engine.shortfall(SliceRequest(core=30, memory_gib=1, model="A100"), nodes) == [
        "model",
        "model",
    ]


def test_shortfall_agrees_with_candidates_on_random_clusters():
    rng = np.random.default_rng(7)
    nodes = [make_node(f"n{i}", int(rng.integers(0, 5))) for i in range(12)]
    state = ClusterState(nodes)
    engine = Engine(state)
    for i in range(40):
        core = int(rng.choice([10, 30, 50, 100, 200]))
        req = SliceRequest(core=core, memory_gib=None if core >= 100 else int(rng.integers(1, 40)))
        with contextlib.suppress(NoFit):
            engine.place(f"s{i}", req)
    everyone = np.arange(len(nodes))
    for core, mem in ((30, 8), (60, 40), (100, None), (200, None), (90, 1)):
        req = SliceRequest(core=core, memory_gib=mem)
        mask, _, reasons = engine.candidates(req, explain=False)
        assert reasons == {}
        fits = np.bincount(state.gpu_node[mask], minlength=len(nodes)) >= req.gpu_count
        rules = engine.shortfall(req, everyone)
        assert [r is None for r in rules] == fits.tolist()
        few = state.node_gpu_count < req.gpu_count
        assert [r == "GPU count" for r in rules] == few.tolist()
        explained = engine.candidates(req)[2]
        assert all(r in explained for r in rules if r not in (None, "GPU count"))


def test_apply_refuses_overcommit(two_nodes):
    state = ClusterState(two_nodes)
    state.apply("a", [0], 70, [10])
    with pytest.raises(ValueError, match="over-commit"):
        state.apply("b", [0], 40, [10])
    with pytest.raises(ValueError, match="one node"):
        state.apply("c", [0, 4], 10, [1, 1])
    state.check_invariants()


def test_per_request_policy_override(two_nodes):
    state = ClusterState(two_nodes)
    engine = Engine(state, "binpack")
    a = engine.place("a", share())
    b = engine.place("b", share(placement="spread"))
    assert a.node != b.node


def test_decisions_are_deterministic(two_nodes):
    reqs = [share(core=c, mem=m) for c, m in [(30, 8), (50, 20), (10, 4), (70, 30), (20, 8)]]
    first = place_all(two_nodes, "spread", reqs)[1]
    second = place_all(two_nodes, "spread", reqs)[1]
    assert first == second


def test_unknown_policy_name_rejected():
    from qgpu.errors import RuleViolation

    with pytest.raises(RuleViolation) as info:
        make_policy("roundrobin")
    assert info.value.field == "placement"


def test_empty_cluster_no_fit():
    with pytest.raises(NoFit, match="no GPUs"):
        Engine(ClusterState([])).decide(share())


def test_every_change_of_the_state_bumps_its_version(two_nodes):
    state = ClusterState(two_nodes)
    engine = Engine(state)
    seen = [state.version]
    engine.place("a", share())
    seen.append(state.version)
    state.apply_host("h", 0, 100, 10)
    seen.append(state.version)
    state.release("a")
    seen.append(state.version)
    state.release("a")  # nothing held: nothing changed
    seen.append(state.version)
    state.touch()  # a writer of the vectors says so
    seen.append(state.version)
    assert seen == sorted(seen) and len(set(seen)) == 5 and seen[3] == seen[4]
    with contextlib.suppress(NoFit):
        engine.decide(SliceRequest(core=900))  # deciding changes nothing
    assert state.version == seen[-1]


def test_place_can_leave_counting_to_the_caller(two_nodes, monkeypatch):
    monkeypatch.setenv("QGPU_MIX_PRIOR", "none")  # only what is counted here
    state = ClusterState(two_nodes)
    engine = Engine(state, "frag")
    engine.observe(share(50))
    engine.place("a", share(50), observe=False)
    engine.place("b", share(30))
    assert engine.node_policy.mix() == {(50, 1, 0, 0): 0.5, (30, 1, 0, 0): 0.5}
