"""The fragmentation-aware policy `frag`: hand-worked cases where it and binpack differ, the
optimality of its choice under its documented measure, and that every entry point knows it."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random

import numpy as np
import pytest
import yaml

from qgpu import frag as frag_module
from qgpu import placement as placement_module
from qgpu.cli import main as cli_main
from qgpu.errors import NoFit
from qgpu.frag import FragPolicy
from qgpu.model import WHOLE_GPU_CORE, GpuDevice, NodeInventory, PlacementPolicy, SliceRequest
from qgpu.placement import CandidateView, ClusterState, Engine, make_policy

CARD_MIB = 16 * 1024  # 16 GiB cards: at most 4 slices per GPU


def node(name: str, gpus: int, cpu_milli: int | None = None, model: str = "T4") -> NodeInventory:
    return NodeInventory(
        name=name,
        gpus=[
            GpuDevice(uuid=f"{name}-g{i}", index=i, model=model, memory_mib=CARD_MIB)
            for i in range(gpus)
        ],
        cpu_milli=cpu_milli,
        memory_mib=None if cpu_milli is None else 1 << 20,
    )


def share(core: int, cpu: int = 0) -> SliceRequest:
    return SliceRequest(core=core, memory_gib=max(1, core * 16 // 100), cpu_milli=cpu)


WHOLE = SliceRequest(core=100)


def gpu_of(state: ClusterState, uuid: str) -> int:
    return state.uuid_index[uuid]


# -- registration -------------------------------------------------------------------------


def test_frag_is_a_placement_policy_everywhere():
    assert PlacementPolicy.parse("frag") is PlacementPolicy.FRAG
    assert isinstance(make_policy("frag"), FragPolicy)
    assert isinstance(make_policy(PlacementPolicy.FRAG), FragPolicy)
    assert SliceRequest(core=30, memory_gib=4, placement="frag").placement is PlacementPolicy.FRAG


def test_cli_plan_accepts_frag(tmp_path, capsys):
    nodes = tmp_path / "nodes.yaml"
    requests = tmp_path / "requests.yaml"
    nodes.write_text(
        yaml.safe_dump(
            {
                "nodes": [
                    {
                        "name": "n1",
                        "gpus": [{"uuid": "GPU-1", "index": 0, "model": "T4", "memory": "16Gi"}],
                    }
                ]
            }
        )
    )
    requests.write_text(
        yaml.safe_dump({"requests": [{"name": "a", "core": 30, "memory": 4, "count": 2}]})
    )
    rc = cli_main(
        [
            *("plan", "--nodes", str(nodes), "--requests", str(requests)),
            *("--placement", "frag", "--json"),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["gpus"] for p in out["placed"]] == [["GPU-1"], ["GPU-1"]]
    assert out["unplaced"] == []


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="measure"):
        FragPolicy(measure="best")  # type: ignore[arg-type]


# -- hand-worked cases where frag and binpack differ ---------------------------------------


def _two_engines(nodes: list[NodeInventory]) -> tuple[Engine, Engine]:
    return Engine(ClusterState(nodes), "binpack"), Engine(ClusterState(nodes), "frag")


def test_keeps_the_last_whole_gpu_for_the_whole_gpu_requests_it_has_seen():
    # x: one GPU taken whole, one empty (node 50% used); y: two GPUs with a 30% slice each
    # (30% used). binpack fills the fuller node x and breaks its last whole GPU for a 30%
    # slice. frag has seen whole-GPU requests: on x the slice destroys a whole-GPU copy (100)
    # and a 30% copy (30); on y only a 30% copy (70 free -> 40 free): it picks y.
    binpack, frag = _two_engines([node("x", 2), node("y", 2)])
    for engine in (binpack, frag):
        s = engine.state
        s.apply("x-full", [gpu_of(s, "x-g0")], 100, [16])
        s.apply("y-0", [gpu_of(s, "y-g0")], 30, [4])
        s.apply("y-1", [gpu_of(s, "y-g1")], 30, [4])
        engine.observe(WHOLE)
    assert binpack.place("new", share(30)).gpu_uuids == ("x-g1",)
    assert frag.place("new", share(30)).node == "y"
    # so the next whole-GPU request still fits with frag, and no longer with binpack
    assert frag.place("whole", WHOLE).gpu_uuids == ("x-g1",)
    with pytest.raises(NoFit):
        binpack.place("whole", WHOLE)
    frag.state.check_invariants()


def test_avoids_leaving_a_gap_that_the_requests_it_has_seen_cannot_use():
    # GPU a has 70% free, GPU b is empty. The mix is 60% and 30% slices. binpack puts a 30%
    # slice on a (least left over) and leaves a 40% gap no 60% slice fits; frag puts it on b:
    # both GPUs then still take a 60% slice (a: 70 free, b: 70 free). (The measure alone:
    # below half fill the keep-empty rule keeps b empty, as binpack does; test_mix_prior.)
    binpack, _ = _two_engines([node("n", 2)])
    frag = Engine(ClusterState([node("n", 2)]), FragPolicy(keep_empty=0))
    for engine in (binpack, frag):
        s = engine.state
        s.apply("pre", [gpu_of(s, "n-g0")], 30, [4])
        for _ in range(3):
            engine.observe(share(60))
    assert binpack.place("new", share(30)).gpu_uuids == ("n-g0",)
    assert frag.place("new", share(30)).gpu_uuids == ("n-g1",)
    frag.place("big-1", share(60))
    frag.place("big-2", share(60))
    binpack.place("big-1", share(60))
    with pytest.raises(NoFit):
        binpack.place("big-2", share(60))


def test_keeps_room_for_the_common_request_size():
    # a has 55% free, b 70%; the mix is 50% slices. A 16% slice on a leaves 39% (no 50%
    # slice fits there any more), on b 54% (one still does). binpack takes a (least left
    # over), frag takes b.
    binpack, frag = _two_engines([node("n", 2)])
    for engine in (binpack, frag):
        s = engine.state
        s.apply("pre-a", [gpu_of(s, "n-g0")], 45, [7])
        s.apply("pre-b", [gpu_of(s, "n-g1")], 30, [4])
        for _ in range(3):
            engine.observe(share(50))
    assert binpack.place("new", share(16)).gpu_uuids == ("n-g0",)
    assert frag.place("new", share(16)).gpu_uuids == ("n-g1",)
    frag.place("half-1", share(50))
    frag.place("half-2", share(50))
    binpack.place("half-1", share(50))
    with pytest.raises(NoFit):
        binpack.place("half-2", share(50))


def test_cpu_only_work_goes_where_it_strands_no_gpu():
    # small has 8 cores, big 64; the GPU requests seen need 6 cores each. binpack's host
    # scoring ties the two empty nodes and takes the first; a 4-core CPU-only pod there would
    # leave 4 cores, too few for any GPU request: small's GPU is stranded. frag goes to big.
    nodes = [node("small", 1, cpu_milli=8000), node("big", 1, cpu_milli=64000)]
    binpack, frag = _two_engines(nodes)
    for engine in (binpack, frag):
        engine.observe(share(30, cpu=6000))
    assert binpack.place_host("cpu-pod", 4000, 1024) == "small"
    assert frag.place_host("cpu-pod", 4000, 1024) == "big"
    # small's GPU still takes the GPU request (binpack's small node no longer can)
    assert frag.place("gpu-pod", share(30, cpu=6000)).node == "small"
    assert binpack.place("gpu-pod", share(30, cpu=6000)).node == "big"


def test_gpu_work_goes_where_it_strands_no_gpu_behind_the_host():
    # poor: 2 GPUs, 16 cores; rich: 2 GPUs, 64 cores; both empty. The mix: whole GPUs with
    # 4 cores and 50% slices with 8 cores (each seen once). For a 50%/8-core slice the
    # per-type measure ties: on either node each type loses one copy (the whole type 100,
    # the 50% type 50), so without the host term frag takes the first node, poor. The mix
    # needs 12 cores per 150 core = 80 milli-cores per qgpu-core on average: poor's 16
    # cores feed exactly its 200 free core, and after the slice 8 cores feed only 100 of its
    # 150 free core -- 50 core stranded behind the host. On rich 56 cores feed all 150. So
    # frag takes rich.
    def whole(cpu: int) -> SliceRequest:
        return SliceRequest(core=100, cpu_milli=cpu)

    class _NoRule(FragPolicy):  # each type's host bound counted everywhere (as before)
        def _feeds_mix(self, s, nodes, core, cpu, hostmem):  # type: ignore[no-untyped-def]
            return np.zeros(len(nodes), dtype=bool)

    placed = {}
    for rule, host_weight in itertools.product((_NoRule, FragPolicy), (0.0, None)):
        nodes = [node("poor", 2, cpu_milli=16000), node("rich", 2, cpu_milli=64000)]
        policy = rule(host_weight=host_weight, prior=None, keep_empty=0)
        engine = Engine(ClusterState(nodes), policy)
        engine.observe(whole(4000))
        first = engine.place("first", share(50, cpu=8000)).node
        later = [whole(4000), whole(4000), whole(4000), share(50, cpu=8000)]
        count = 0
        for i, req in enumerate(later):
            try:
                engine.place(f"later-{i}", req)
                count += 1
            except NoFit:
                pass
        engine.state.check_invariants()
        placed[rule.__name__, host_weight] = (first, count)
    # without the host term (and with each type's host bound counted everywhere) the last
    # 50% slice finds a GPU (poor's) but not the 8 cores
    assert placed["_NoRule", 0.0] == ("poor", 3)
    assert placed["_NoRule", None] == ("rich", 4)
    # poor feeds the mix (16 cores for its 200 free core at 80 milli-cores per qgpu-core)
    # before the slice and not after it: there every type's host bound counts again, and
    # the 50% type's copies fall from 4 to 1 -- the measure alone now sees the stranding
    assert placed["FragPolicy", 0.0] == ("rich", 4)
    assert placed["FragPolicy", None] == ("rich", 4)


def test_an_empty_node_is_not_broken_for_a_host_limit_of_one_type_alone():
    # Two 8-GPU nodes with 128 cores: "used" holds 6 whole GPUs (3 cores each), "empty"
    # nothing. The mix: 47% shares with 11 cores (10 seen), whole GPUs with 11 cores and
    # 8-GPU pods with 88 cores (1 each). Judged alone, the 47% type could use only 11 of
    # empty's 16 copies (128 / 11 cores), so a whole GPU there seems to cost it nothing,
    # while on used it takes 2 of its 4 copies: frag without the rule breaks empty (cost
    # 100 + 800 against 100 + 2 x 47 x 10), and the 8-GPU pod that follows fails. Yet both
    # hosts feed the mix on all their free GPU core at its average 0.15 cores per qgpu-core,
    # so the host limits no type there: empty's GPUs are worth all 16 copies, and frag keeps
    # empty whole for the 8-GPU pod.
    class _NoRule(FragPolicy):
        def _feeds_mix(self, s, nodes, core, cpu, hostmem):  # type: ignore[no-untyped-def]
            return np.zeros(len(nodes), dtype=bool)

    placed = {}
    for policy in (_NoRule(prior=None, keep_empty=0), FragPolicy(prior=None, keep_empty=0)):
        nodes = [node("used", 8, cpu_milli=128_000), node("empty", 8, cpu_milli=128_000)]
        engine = Engine(ClusterState(nodes), policy)
        s = engine.state
        for i in range(6):
            s.apply(f"pre-{i}", [gpu_of(s, f"used-g{i}")], 100, [16], 3000, 0)
        for _ in range(10):
            engine.observe(share(47, cpu=11_000))
        engine.observe(SliceRequest(core=100, cpu_milli=11_000))
        engine.observe(SliceRequest(core=800, cpu_milli=88_000))
        first = engine.place("whole", SliceRequest(core=100, cpu_milli=3000)).node
        try:
            engine.place("eight", SliceRequest(core=800, cpu_milli=88_000), observe=False)
            eight = True
        except NoFit:
            eight = False
        s.check_invariants()
        placed[type(policy).__name__] = (first, eight)
    assert placed == {"_NoRule": ("empty", False), "FragPolicy": ("used", True)}


def test_host_and_gap_terms_are_frag_only_and_validated():
    assert FragPolicy().host_weight > 0 and FragPolicy().gap_weight > 0
    fgd = FragPolicy(measure="fgd")  # the paper's measure stays as published
    assert fgd.host_weight == 0 and fgd.gap_weight == 0
    assert FragPolicy(measure="fgd", host_weight=2).host_weight == 2
    with pytest.raises(ValueError, match="host_weight"):
        FragPolicy(host_weight=-1)
    with pytest.raises(ValueError, match="gap_weight"):
        FragPolicy(gap_weight=-1)


def test_gap_values_keep_the_gap_a_larger_share_closes():
    # Mix: 65%, 32% and 81% slices, one each (memory never binds: 1 GiB each). g1 holds a
    # 32% slice (68 free), g0 is empty, and a 32% slice arrives.
    # Per-type copies alone: on g1 (68 -> 36) the 65 type loses its copy and the 32 type one
    # of two (97 lost); on g0 (100 -> 68) the 81 type loses its copy and the 32 type one of
    # three (113 lost). So without gap values frag pairs the two 32s (like binpack).
    # Gap values: packing the mix into GPUs that run short, the LP fills GPUs with 65 + 32
    # and leaves the 81s out (a lone 81 fills least), so a GPU is worth 81, a 65 is worth 65
    # and a 32 only 16 (65 + 16 = 81; 32 + 32 + 32 would be 48). V(68) = 65, V(36) = 16,
    # V(100) = 81: g1 loses 65 - 16 = 49 of gap value, g0 only 81 - 65 = 16. With the gap
    # term (x 30 x the total weight 3) frag opens g0 and keeps g1's gap for a 65.
    def slice_of(core: int) -> SliceRequest:
        return SliceRequest(core=core, memory_gib=1)

    chosen = {}
    for gap_weight in (0.0, None):
        state = ClusterState([node("n", 2)])
        state.apply("pre", [gpu_of(state, "n-g1")], 32, [1])
        policy = FragPolicy(gap_weight=gap_weight, prior=None, keep_empty=0)
        engine = Engine(state, policy)
        for core in (65, 32, 81):
            engine.observe(slice_of(core))
        chosen[gap_weight] = engine.decide(slice_of(32)).gpu_uuids
        if gap_weight is None:
            values = policy.gap_values(state)
            assert policy.prices is not None
            assert policy.prices.reduced == {32: 16.0, 65: 65.0, 81: 81.0}
            assert (values[100], values[68], values[36]) == (81.0, 65.0, 16.0)
    assert chosen == {0.0: ("n-g1",), None: ("n-g0",)}


def test_the_mix_is_priced_again_only_when_it_has_moved():
    state = ClusterState([node("n", 2)])
    policy = FragPolicy()
    engine = Engine(state, policy)
    for _ in range(10):
        engine.observe(share(30))
        engine.observe(share(60))
    policy.gap_values(state)
    early = policy.prices
    # 20 arrivals: the proportions are still noisy. Four more 30s move them by 4/24 (L1),
    # less than 1 / sqrt(24): the same prices; two more, 6/26 > 1 / sqrt(26): priced again
    for _ in range(4):
        engine.observe(share(30))
    policy.gap_values(state)
    assert policy.prices is early
    for _ in range(2):
        engine.observe(share(30))
    policy.gap_values(state)
    assert policy.prices is not early
    for _ in range(236):
        engine.observe(share(30))
    for _ in range(242):
        engine.observe(share(60))
    policy.gap_values(state)  # 252 + 252 arrivals: past 400, the drift rule is 0.05 (L1)
    first = policy.prices
    engine.observe(share(30))  # the mix moved by 0.002: the same prices
    policy.gap_values(state)
    assert policy.prices is first
    engine.observe(share(45))  # a new size: priced again
    policy.gap_values(state)
    second = policy.prices
    assert second is not first and 45 in second.reduced
    for _ in range(26):  # L1 0.049 from the 30s' share growing: not yet
        engine.observe(share(30))
    policy.gap_values(state)
    assert policy.prices is second
    engine.observe(share(30))  # L1 0.051
    policy.gap_values(state)
    assert policy.prices is not second
    # another cluster of 16 GiB cards (4 slices each): the same prices; one of 32 GiB cards
    # (8 slices each): priced again, with patterns of up to 8 shares
    third = policy.prices
    policy.gap_values(ClusterState([node("m", 1)]))
    assert policy.prices is third
    big = NodeInventory(
        name="big", gpus=[GpuDevice(uuid="big-g0", index=0, model="V100M32", memory_mib=32768)]
    )
    values = policy.gap_values(ClusterState([big]))
    assert policy.prices is not third
    # (30, 45 and 60 never fit more than 3 to a GPU, so the values come out the same)
    assert values.tolist() == third.values.tolist()


def test_a_mix_that_cannot_be_priced_places_without_gap_values(monkeypatch, caplog):
    def give_up(*args, **kwargs):
        raise RuntimeError("iteration limit reached")

    state = ClusterState([node("n", 2)])
    state.apply("pre", [gpu_of(state, "n-g1")], 32, [1])
    policy = FragPolicy()
    engine = Engine(state, policy)
    for core in (65, 32, 81):
        engine.observe(SliceRequest(core=core, memory_gib=1))
    monkeypatch.setattr(frag_module, "price_gaps", give_up)
    with caplog.at_level("WARNING", logger="qgpu.frag"):
        # as with gap_weight=0 in the hand-worked case above: the two 32s pair up
        assert engine.decide(SliceRequest(core=32, memory_gib=1)).gpu_uuids == ("n-g1",)
        engine.observe(SliceRequest(core=47, memory_gib=1))  # a new size: tried again
        engine.decide(SliceRequest(core=32, memory_gib=1))
    assert policy.gap_values(state).tolist() == [0.0] * 101
    failures = [r for r in caplog.records if "pricing the request mix failed" in r.message]
    assert len(failures) == 1 and "iteration limit reached" in failures[0].message
    monkeypatch.undo()
    engine.observe(SliceRequest(core=23, memory_gib=1))  # the next pricing succeeds
    assert policy.gap_values(state)[100] > 0


def test_in_an_empty_cluster_with_nothing_observed_frag_chooses_like_binpack(monkeypatch):
    monkeypatch.setenv("QGPU_MIX_PRIOR", "none")  # nothing observed, no prior either
    rng = random.Random(3)
    for _ in range(20):
        nodes = [node(f"n{i}", rng.choice([1, 2, 4])) for i in range(4)]
        req = share(rng.choice([10, 30, 60])) if rng.random() < 0.7 else WHOLE
        expected = Engine(ClusterState(nodes), "binpack").decide(req)
        assert Engine(ClusterState(nodes), "frag").decide(req) == expected


def test_a_fresh_engine_learns_the_mix_from_the_live_slices():
    # the ledger and the Ray SDK make an engine per decision and never call observe():
    # frag then takes the placed slices as the mix. Same layout as the whole-GPU case above,
    # but nothing observed: the live whole-GPU slice on x is enough to keep x's last GPU whole.
    state = ClusterState([node("x", 2), node("y", 2)])
    state.apply("x-full", [gpu_of(state, "x-g0")], 100, [16])
    state.apply("y-0", [gpu_of(state, "y-g0")], 30, [4])
    state.apply("y-1", [gpu_of(state, "y-g1")], 30, [4])
    assert Engine(state, "binpack").decide(share(30)).node == "x"
    policy = FragPolicy(prior=None)
    assert Engine(state, policy).decide(share(30)).node == "y"
    assert policy.mix() == {(100, 1, 0, 0): 1 / 3, (30, 1, 0, 0): 2 / 3}


# -- frag's choice is optimal under its measure (brute force on small clusters) ------------


def _naive_usable(state: ClusterState, policy: FragPolicy) -> float:
    """Expected usable qgpu-core over all nodes, by the documented measure, with loops: a
    node whose host feeds the mix on all its free GPU core (`_naive_aggregate`) limits no
    type's copies."""
    feeds = [
        _naive_aggregate(state, policy, n) >= int(state.node_free_core[n])
        for n in range(len(state.nodes))
    ]
    total = 0.0
    for t, k in enumerate(policy._t_class):
        core, mem, count = policy._k_core[k], policy._k_mem[k], policy._k_count[k]
        weight = policy._t_weight[t]
        cpu, hostmem = policy._t_cpu[t], policy._t_hostmem[t]
        for n in range(len(state.nodes)):
            start = int(state.node_start[n])
            gpus = range(start, start + int(state.node_gpu_count[n]))
            if core >= WHOLE_GPU_CORE:
                free = sum(1 for g in gpus if state.slices[g] == 0 and state.free_core[g] == 100)
                gpu_copies = free // count
                unit = WHOLE_GPU_CORE * count
            else:
                gpu_copies = sum(
                    min(
                        int(state.free_core[g]) // core,
                        int(state.free_mem[g]) // mem,
                        int(state.max_slices[g] - state.slices[g]),
                    )
                    for g in gpus
                )
                unit = core
            host = math.inf
            if cpu and not feeds[n]:
                host = min(host, int(state.node_free_cpu[n]) // cpu)
            if hostmem and not feeds[n]:
                host = min(host, int(state.node_free_hostmem[n]) // hostmem)
            total += weight * min(gpu_copies, host) * unit
    return total


def _naive_gap_values(
    policy: FragPolicy, state: ClusterState, slots: int | None = None
) -> list[float]:
    """V[x]: the best sum of the priced shares' reduced values, at most `slots` of them
    (default the typical slice limit), whose core fits into x -- by enumerating every
    multiset."""
    policy.gap_values(state)
    assert policy.prices is not None
    reduced = policy.prices.reduced
    if slots is None:
        slots = int(np.median(state.max_slices))
    values = [0.0] * 101
    for n in range(1, slots + 1):
        for combo in itertools.combinations_with_replacement(sorted(reduced), n):
            used = sum(combo)
            if used <= 100:
                worth = sum(reduced[c] for c in combo)
                for x in range(used, 101):
                    values[x] = max(values[x], worth)
    return values


def _naive_aggregate(state: ClusterState, policy: FragPolicy, n: int) -> float:
    """Node n's free core, capped by its free host CPU and memory at the mix's average
    host CPU and memory per qgpu-core."""
    weight = core = cpu = hostmem = 0.0
    for t, k in enumerate(policy._t_class):
        w = policy._t_weight[t]
        unit = policy._k_core[k] * (policy._k_count[k] if policy._k_core[k] >= 100 else 1)
        weight += w
        core += w * unit
        cpu += w * policy._t_cpu[t]
        hostmem += w * policy._t_hostmem[t]
    usable = float(state.node_free_core[n])
    if cpu:
        usable = min(usable, int(state.node_free_cpu[n]) / (cpu / core))
    if hostmem:
        usable = min(usable, int(state.node_free_hostmem[n]) / (hostmem / core))
    return usable


def _naive_objective(state: ClusterState, policy: FragPolicy) -> float:
    """The documented objective: expected usable core, plus host_weight x total weight x the
    aggregate usable core of every node (free core capped by free host CPU and memory at
    the mix's average rates per qgpu-core), plus gap_weight x total weight x the gap value
    V of every GPU's free core, with loops."""
    weight = float(sum(policy._t_weight))
    aggregate = sum(_naive_aggregate(state, policy, n) for n in range(len(state.nodes)))
    # a GPU's gap holds at most as many more shares as it has slices left (and at most the
    # typical slice limit the mix was priced for)
    typical = int(np.median(state.max_slices))
    by_room = {r: _naive_gap_values(policy, state, r) for r in range(typical + 1)}
    gap_value = sum(
        by_room[min(int(state.max_slices[g] - state.slices[g]), typical)][int(f)]
        for g, f in enumerate(state.free_core)
    )
    return (
        _naive_usable(state, policy)
        + policy.host_weight * weight * aggregate
        + policy.gap_weight * weight * gap_value
    )


@pytest.mark.parametrize("seed", range(8))
def test_choice_maximises_expected_usable_capacity(seed):
    rng = random.Random(seed)
    nodes = [
        node(f"n{i}", rng.choice([1, 2, 4]), cpu_milli=rng.choice([8000, 16000, 32000]))
        for i in range(5)
    ]
    state = ClusterState(nodes)
    policy = FragPolicy(keep_empty=0)  # its own rule, tested below
    engine = Engine(state, policy)
    pool = [share(c, cpu=rng.choice([0, 2000, 4000])) for c in (10, 25, 30, 45, 60, 80)]
    pool += [WHOLE, SliceRequest(core=200, cpu_milli=4000)]
    for step in range(25):
        req = rng.choice(pool)
        engine.observe(req)
        try:
            decision = engine.decide(req)
        except NoFit:
            continue
        # brute force every feasible (node, GPU set) the engine would allow
        mask, memory, _ = engine.candidates(req)
        base = _naive_objective(state, policy)
        best = -math.inf
        for n in range(len(nodes)):
            if state.node_free_cpu[n] < req.cpu_milli:
                continue
            start = int(state.node_start[n])
            fitting = [g for g in range(start, start + len(nodes[n].gpus)) if mask[g]]
            if len(fitting) < req.gpu_count:
                continue
            for g in fitting:  # GPUs on one node are interchangeable for whole requests here
                ids = [g] if req.gpu_count == 1 else fitting[: req.gpu_count]
                state.apply(
                    "probe", ids, req.core_per_gpu, [int(memory[i]) for i in ids], req.cpu_milli, 0
                )
                best = max(best, _naive_objective(state, policy) - base)
                state.release("probe")
        ids = [state.uuid_index[u] for u in decision.gpu_uuids]
        state.apply_decision(f"s{step}", decision, req)
        got = _naive_objective(state, policy) - base
        assert got == pytest.approx(best), f"step {step}: {req} -> {decision}"
        state.check_invariants()
        assert all(state.free_core[i] >= 0 for i in ids)


def test_fgd_measure_counts_all_free_core_once_one_request_fits():
    # 19% free beside an 81% slice: FGD's measure calls all 19 usable by a 16% type; the
    # fill measure only the 16 one copy fills. A 16% slice there leaves 3% that nothing
    # seen can use, so its score (change of expected usable core, x4 observations) is -19
    # x 4 with FGD's measure and -16 x 4 with fill (gap values, a separate term, left out).
    state = ClusterState([node("n", 2)])
    state.apply("pre", [0], 81, [13])
    req = share(16)
    for measure, expected in (("fgd", 19), ("fill", 16)):
        policy = FragPolicy(measure=measure, gap_weight=0)
        engine = Engine(state, policy)
        for _ in range(4):
            engine.observe(req)
        mask, memory, _ = engine.candidates(req)
        view = CandidateView(state, req, mask, req.core, memory, np.array([0]))
        scores = policy._score(view)
        assert scores[0] == pytest.approx(-expected * 4)


def test_one_policy_object_across_cluster_states():
    # caches are tied to the state object: a second, different cluster gets fresh counts
    policy = FragPolicy()
    first = Engine(ClusterState([node("a", 2)]), policy)
    first.place("s1", share(30))
    first.place("s2", share(60))
    nodes = [node("x", 4), node("y", 1), node("z", 2)]
    state = ClusterState(nodes)
    state.apply("pre", [gpu_of(state, "x-g0")], 70, [11])
    fresh = FragPolicy()
    for req in (share(30), share(60)):
        fresh.observe(req)
    req = share(30)
    got = Engine(state, policy).decide(req)
    assert got == Engine(state, fresh).decide(req)
    assert got.gpu_uuids == ("x-g0",)  # the 30% gap beside the 70% slice fits it exactly


def test_a_view_of_gpus_already_scored_reuses_the_scores_until_something_changes(monkeypatch):
    """Scoring all nodes and then the chosen node alone (the extender's prioritize and
    assume) gives the same scores as a policy that computes them afresh; a placement or a
    new arrival makes it compute again. (Both price the mix on every change here.) The
    memo of the vectorised scoring, so without the score cache (tested below)."""
    monkeypatch.setattr(frag_module, "reprice_threshold", lambda arrived: 0.0)
    nodes = [node("x", 4), node("y", 2), node("z", 3)]
    state = ClusterState(nodes)
    state.apply("pre", [gpu_of(state, "x-g0")], 70, [11])
    arrivals = [share(30), share(60), WHOLE]
    policy = FragPolicy(cache=False)
    for a in arrivals:
        policy.observe(a)
    engine = Engine(state, policy)
    req = share(30)

    def scores(p: FragPolicy, names: list[str]) -> np.ndarray:
        mask, memory, _ = engine.candidates(req)
        ids = np.asarray([state.node_index[n] for n in names], dtype=np.int64)
        return p.node_scores(CandidateView(state, req, mask, req.core, memory, ids))

    def afresh(names: list[str]) -> np.ndarray:
        p = FragPolicy()
        for a in arrivals:
            p.observe(a)
        return scores(p, names)

    assert np.array_equal(scores(policy, ["x", "y", "z"]), afresh(["x", "y", "z"]))
    memo = policy._score_memo
    assert np.array_equal(scores(policy, ["y"]), afresh(["y"]))
    assert policy._score_memo is memo  # the one-node view was answered from the last scores
    state.apply("more", [gpu_of(state, "y-g0")], 60, [9])
    assert np.array_equal(scores(policy, ["y"]), afresh(["y"]))
    assert policy._score_memo is not memo  # the state changed: computed again
    memo = policy._score_memo
    arrivals.append(share(60))
    policy.observe(share(60))
    assert np.array_equal(scores(policy, ["y"]), afresh(["y"]))
    assert policy._score_memo is not memo  # the mix changed: computed again


def _host_work(engine: Engine, name: str) -> None:
    """Host-only work placed by the engine (when some node has room)."""
    with contextlib.suppress(NoFit, ValueError):
        engine.place_host(name, 1000, 1024)


def _direct_write(state: ClusterState, rng: random.Random) -> None:
    """A direct writer (qgpu_ray's view) frees an idle GPU's core, and says so (`touch`)."""
    g = rng.randrange(state.gpu_total)
    if state.slices[g] == 0:
        state.free_core[g] = 100
        state.touch()


@pytest.mark.parametrize("seed", range(6))
def test_what_frag_keeps_between_calls_gives_the_scores_of_a_fresh_policy(seed, monkeypatch):
    """A policy that has followed the cluster through placements, releases, host-only work,
    new arrivals and a direct write (`touch`) scores exactly as one that computes everything
    afresh: the per-GPU copies and state keys it updates only for changed nodes, and the mix
    tables it rebuilds only for new request types, are never stale. 30 nodes of up to 4
    GPUs: more GPUs than the small-set shortcut covers, and single nodes that it does.
    (Both price the mix on every change here; by default a long-lived policy keeps its
    prices until the mix has moved, see the test above.)"""
    monkeypatch.setattr(frag_module, "reprice_threshold", lambda arrived: 0.0)
    rng = random.Random(seed)
    nodes = [
        node(f"n{i}", rng.choice([1, 2, 4]), cpu_milli=rng.choice([8000, 16000])) for i in range(30)
    ]
    state = ClusterState(nodes)
    kept = FragPolicy()
    engine = Engine(state, kept)
    arrivals: list[SliceRequest] = []
    kinds = [share(10), share(25), share(30, cpu=2000), share(50), share(60), WHOLE]
    for step in range(40):
        roll = rng.random()
        if roll < 0.15 and state.held:
            state.release(rng.choice(sorted(state.held)))
        elif roll < 0.2:
            _host_work(engine, f"h{step}")
        elif roll < 0.23:
            _direct_write(state, rng)
        else:
            req = rng.choice(kinds)
            arrivals.append(req)
            with contextlib.suppress(NoFit):
                engine.place(f"s{step}", req)
        req = rng.choice(kinds)
        fresh = FragPolicy()
        for a in arrivals:
            fresh.observe(a)
        mask, memory, _ = engine.candidates(req)
        for ids in (np.arange(len(nodes)), np.asarray([rng.randrange(len(nodes))])):
            view = CandidateView(state, req, mask, req.core_per_gpu, memory, ids)
            assert np.array_equal(kept.node_scores(view), fresh.node_scores(view))
        if kept._k_core:
            assert kept.gap_values(state).tolist() == fresh.gap_values(state).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_policy_that_observes_nothing_follows_the_live_slices(seed, monkeypatch):
    """The node agent's ledger keeps one engine with its state and never observes: its frag
    policy's mix follows the live slices (placed, released, released and placed again
    under the same id, host-only work, a direct write) and it scores exactly as a fresh
    policy seeded from the same live slices -- also once more changes happened between two
    decisions than the state's change log keeps."""
    monkeypatch.setattr(frag_module, "reprice_threshold", lambda arrived: 0.0)
    monkeypatch.setattr(placement_module, "HELD_LOG", 6)
    rng = random.Random(seed)
    nodes = [node(f"n{i}", rng.choice([1, 2, 4]), cpu_milli=16000) for i in range(20)]
    state = ClusterState(nodes)
    kept = FragPolicy()
    engine = Engine(state, kept)
    kinds = [share(10), share(25), share(30, cpu=2000), share(50), WHOLE]
    for step in range(60):
        for _ in range(rng.choice([1, 1, 1, 3, 9])):  # 9 > the log: compared in full
            roll = rng.random()
            if roll < 0.3 and state.held:
                sid = rng.choice(sorted(state.held))
                state.release(sid)
                if rng.random() < 0.7:  # the same id placed again elsewhere (no decision:
                    # a recorded slice), maybe with another shape
                    free = np.flatnonzero(state.free_core >= 40)
                    if len(free):
                        core = rng.choice([10, 20, 40])
                        state.apply(sid, [int(rng.choice(free))], core, [1 + core // 10])
            elif roll < 0.35:
                _host_work(engine, f"h{step}-{roll}")
            elif roll < 0.38:
                _direct_write(state, rng)
            else:
                with contextlib.suppress(NoFit):
                    engine.place(f"s{step}-{roll}", rng.choice(kinds), observe=False)
        req = rng.choice(kinds)
        fresh = FragPolicy()
        mask, memory, _ = engine.candidates(req)
        view = CandidateView(state, req, mask, req.core_per_gpu, memory, np.arange(len(nodes)))
        assert np.array_equal(kept.node_scores(view), fresh.node_scores(view))
        if not mask.any():
            continue  # no GPU can take it: nothing is scored, a fresh policy never starts
        assert kept.mix() == pytest.approx(fresh.mix())
        if kept._k_core:
            assert kept.gap_values(state).tolist() == fresh.gap_values(state).tolist()
