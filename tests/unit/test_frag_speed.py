"""frag's speed paths decide exactly as its full measure does (issue 22 item 2).

`FragPolicy._score` scores GPUs whose host has room for every type by their dropped copies
alone (`_lost_on_roomy_hosts`) and the rest by the full measure (`_full_scores`); an engine
calls `prepare` when it is made; the gap prices' knapsack stops early and updates in
place. Each is a speed change only: here the fast policy and a reference that runs the
full measure on every GPU and prepares nothing are driven through the same random clusters
and request streams (host CPU and memory that bind on some nodes, whole GPUs, multi-GPU
shares, model constraints, releases), and every score array must be equal bit for bit and
every decision the same; the knapsack is checked against its earlier form, kept here, and
the pricing LP solved through `highspy` against scipy's `linprog`, which solved it before
(the same HiGHS inside; where the optimal prices are not unique, another solver path gives
other prices, so equal prices are not a given).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from scipy.optimize import linprog

from qgpu import gap_prices
from qgpu.errors import NoFit
from qgpu.frag import FragPolicy
from qgpu.model import GpuDevice, NodeInventory, SliceRequest
from qgpu.placement import CandidateView, ClusterState, Engine

MODELS = [("H100-80GB", 80), ("A100-40GB", 40), ("T4", 16)]


class _FullMeasure(FragPolicy):
    """The reference: the full measure on every candidate GPU, nothing prepared, nothing
    kept between calls (no score cache)."""

    def __init__(self) -> None:
        super().__init__(cache=False)

    def _roomy_after(self, s, per_node, cand, cpu, hostmem):  # type: ignore[no-untyped-def]
        return np.zeros(len(cand), dtype=bool)

    def prepare(self, state: ClusterState) -> None:
        pass


def _recording(base: type[FragPolicy]) -> FragPolicy:
    """A `base` policy that remembers the node scores of every decision (`scores`)."""

    class _Recording(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__()
            self.scores: list[np.ndarray] = []

        def node_scores(self, view: CandidateView) -> np.ndarray:
            out = super().node_scores(view)
            self.scores.append(out.copy())
            return out

    return _Recording()


def _cluster(rng: random.Random) -> list[NodeInventory]:
    nodes = []
    for n in range(rng.randint(3, 14)):
        model, gib = rng.choice(MODELS)
        gpus = [
            GpuDevice(uuid=f"GPU-{n}-{i}", index=i, model=model, memory_mib=gib * 1024)
            for i in range(rng.choice([1, 2, 4, 8]))
        ]
        nodes.append(
            NodeInventory(
                name=f"n{n}",
                gpus=gpus,
                cpu_milli=rng.choice([None, 4000, 16000, 64000]),
                memory_mib=rng.choice([None, 32768, 262144]),
            )
        )
    return nodes


def _request(rng: random.Random) -> SliceRequest:
    host = {
        "cpu_milli": rng.choice([0, 0, 500, 2000, 6000]),
        "host_memory_mib": rng.choice([0, 0, 1024, 16384]),
    }
    roll = rng.random()
    if roll < 0.12:
        return SliceRequest(core=100 * rng.choice([1, 1, 2]), **host)
    if roll < 0.17:
        return SliceRequest(core=rng.choice([120, 150]), memory=rng.randint(2, 8), **host)
    model = {"model": "H100-80GB|A100-40GB"} if rng.random() < 0.1 else {}
    return SliceRequest(
        core=rng.choice([5, 10, 20, 25, 30, 50, 70]), memory=rng.randint(1, 10), **model, **host
    )


def _replay(seed: int, policy: FragPolicy) -> list[object]:
    rng = random.Random(seed)
    state = ClusterState(_cluster(rng))
    engine = Engine(state, policy)
    live: list[str] = []
    out: list[object] = []
    for i in range(90):
        if live and rng.random() < 0.3:
            state.release(live.pop(rng.randrange(len(live))))
        req = _request(rng)
        try:
            decision = engine.place(f"s{i}", req)
        except NoFit:
            out.append(None)
            continue
        out.append(decision)
        live.append(f"s{i}")
    return out


@pytest.mark.parametrize("seed", range(24))
def test_fast_paths_decide_and_score_as_the_full_measure(seed: int) -> None:
    fast, full = _recording(FragPolicy), _recording(_FullMeasure)
    assert _replay(seed, fast) == _replay(seed, full)
    assert len(fast.scores) == len(full.scores) > 0  # type: ignore[attr-defined]
    for a, b in zip(fast.scores, full.scores, strict=True):  # type: ignore[attr-defined]
        assert a.tobytes() == b.tobytes()  # bit for bit, the sign of zero included


def test_both_paths_are_taken() -> None:
    """The streams above reach hosts with and without room (else the test proves little)."""
    taken = {"roomy": 0, "tight": 0}

    class _Counting(FragPolicy):
        def _roomy_after(self, s, per_node, cand, cpu, hostmem):  # type: ignore[no-untyped-def]
            roomy = super()._roomy_after(s, per_node, cand, cpu, hostmem)
            taken["roomy"] += int(roomy.sum())
            taken["tight"] += int((~roomy).sum())
            return roomy

    for seed in range(6):
        _replay(seed, _Counting())
    assert taken["roomy"] > 0 and taken["tight"] > 0


def _knapsack_before(
    reduced: np.ndarray, sizes: np.ndarray, max_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """`gap_prices._knapsack` as it was before the speed change (every row, np.where)."""
    width = 101
    value = np.full((max_items + 1, width), -np.inf)
    value[0, 0] = 0.0
    choice = np.full((max_items + 1, width), -1, dtype=np.int64)
    for j in range(1, max_items + 1):
        for i, (c, v) in enumerate(zip(sizes.tolist(), reduced.tolist(), strict=True)):
            if v <= 0:
                continue
            cand = value[j - 1, : width - c] + v
            better = cand > value[j, c:] + 1e-12
            value[j, c:] = np.where(better, cand, value[j, c:])
            choice[j, c:] = np.where(better, i, choice[j, c:])
    return value, choice


def test_knapsack_matches_its_earlier_form() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        sizes = np.sort(rng.choice(np.arange(1, 100), size=rng.integers(1, 9), replace=False))
        reduced = np.round(sizes - rng.random(len(sizes)) * sizes * 1.2, 6)
        if rng.random() < 0.3:  # ties between sums
            reduced = np.round(sizes * rng.choice([0.5, 1.0]), 6)
        items = int(rng.choice([1, 2, 3, 7, 16]))
        new_v, new_c = gap_prices._knapsack(reduced, sizes, items)
        old_v, old_c = _knapsack_before(reduced, sizes, items)
        assert new_v.tobytes() == old_v.tobytes()
        assert np.array_equal(new_c, old_c)


@pytest.mark.parametrize("gpus", [5, 500])  # both of `_copies`'s paths (direct, grouped)
def test_copies_match_integer_division(gpus: int) -> None:
    """`FragPolicy._copies` divides in float64; its earlier form divided integers."""
    rng = np.random.default_rng(gpus)
    policy = FragPolicy()
    for core in (1, 3, 7, 10, 25, 33, 50, 99, 100, 200):
        for memory in (0, 1, 3, 16, 80):
            policy._count(core, memory, max(1, core // 100), (), 0, 0)
    policy._refresh_types()
    core = rng.integers(-3, 101, gpus)
    mem = rng.integers(-3, 90, gpus)
    room = rng.integers(-2, 20, gpus)
    got = policy._copies(core, mem, room)
    c, m = np.clip(core, -1, None)[:, None], np.clip(mem, -1, None)[:, None]
    n = np.minimum(c // policy.k_core[None, :], m // np.maximum(policy.k_mem, 1)[None, :])
    want = np.minimum(n, np.clip(room, 0, 255)[:, None]).astype(np.float64)
    assert got.tobytes() == want.tobytes()


def _solve_by_linprog(*lp: Any) -> tuple[np.ndarray, float, float]:
    """`gap_prices._solve` as it was before highspy: the same LP through scipy's linprog."""
    columns, sizes, demand, counts, whole_demand, gpus = lp
    patterns = np.stack(columns, axis=1)
    n_pat, n_whole = patterns.shape[1], len(counts)
    fill = np.concatenate([sizes @ patterns, 100 * np.asarray(counts, dtype=float)])
    a_ub = np.zeros((len(sizes) + 1, n_pat + n_whole))
    a_ub[: len(sizes), :n_pat] = patterns
    a_ub[-1, :n_pat] = 1.0
    a_ub[-1, n_pat:] = counts
    b_ub = np.concatenate([demand, [gpus]])
    bounds = [(0, None)] * n_pat + [(0, float(w)) for w in whole_demand]
    res = linprog(-fill, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    assert res.status == 0
    duals = -np.asarray(res.ineqlin.marginals)
    return np.maximum(duals[:-1], 0.0), max(float(duals[-1]), 0.0), float(-res.fun)


def _random_mix(rng: np.random.Generator) -> tuple[dict[int, float], dict[int, float], int]:
    """Share sizes (often ones that divide 100 or each other: degenerate LPs), weights (often
    small integers: ties), whole-GPU counts and a slice limit."""
    k = int(rng.integers(1, 9))
    pool = [5, 10, 20, 25, 30, 40, 50, 60, 70, 75, 80] if rng.random() < 0.5 else range(1, 100)
    sizes = rng.choice(np.asarray(pool), size=min(k, len(pool)), replace=False)
    weights = rng.integers(1, 4, len(sizes)) if rng.random() < 0.4 else rng.random(len(sizes))
    whole: dict[int, float] = {}
    if rng.random() < 0.5:
        for g in rng.choice([1, 2, 4, 8], size=int(rng.integers(1, 3)), replace=False):
            whole[int(g)] = float(rng.integers(1, 4) if rng.random() < 0.3 else rng.random())
    shares = {int(c): float(w) for c, w in zip(sizes, weights, strict=True)}
    return shares, whole, int(rng.choice([1, 2, 3, 4, 7, 8, 16]))


@pytest.mark.parametrize("seed", range(4))
def test_highspy_prices_as_linprog_did(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every LP of the column generation: the same prices, GPU value and objective bit for
    bit; and so the same patterns, gap values and everything else `price_gaps` returns."""
    solve = gap_prices._solve
    solved = []

    def both(*lp):  # type: ignore[no-untyped-def]
        got, want = solve(*lp), _solve_by_linprog(*lp)
        assert got[0].tobytes() == want[0].tobytes() and got[1:] == want[1:]
        solved.append(lp)
        return got

    monkeypatch.setattr(gap_prices, "_priced", gap_prices._priced.__wrapped__)  # no memo
    rng = np.random.default_rng(seed)
    for _ in range(40):
        shares, whole, max_items = _random_mix(rng)
        monkeypatch.setattr(gap_prices, "_solve", both)
        got = gap_prices.price_gaps(shares, whole, max_items)
        monkeypatch.setattr(gap_prices, "_solve", _solve_by_linprog)
        want = gap_prices.price_gaps(shares, whole, max_items)
        assert got.by_room.tobytes() == want.by_room.tobytes()
        assert (got.price, got.reduced, got.gpu_value) == (want.price, want.reduced, want.gpu_value)
        assert (got.patterns, got.filled) == (want.patterns, want.filled)
    assert len(solved) > 80  # column generation took more than one round on many mixes
