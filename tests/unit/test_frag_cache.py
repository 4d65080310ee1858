"""frag's score cache (`qgpu.frag`, "the score cache") answers every question the way the
vectorised scoring does, bit for bit: many different requests -- shares of one core with
other memory, model constraints, include/exclude lists, whole GPUs, multi-GPU shares, host
CPU and memory -- scored one after another on one unchanged state and mix (as the node
agent's ledger does, which never observes), over every node (those that cannot take the
request too: a caller may pass any list) and over single nodes (the extender's hold), then
again after placements, releases and new arrivals."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qgpu import frag as frag_module
from qgpu.errors import NoFit
from qgpu.frag import FragPolicy
from qgpu.model import GpuDevice, NodeInventory, SliceRequest
from qgpu.placement import CandidateView, ClusterState, Engine

MODELS = [("H100-80GB", 80), ("A100-40GB", 40), ("T4", 16)]


def _cluster(rng: random.Random) -> ClusterState:
    kinds = [(rng.choice(MODELS), rng.choice([2, 4, 8])) for _ in range(3)]
    nodes = []
    for n in range(30):  # few kinds: many nodes alike
        (model, gib), count = kinds[n % len(kinds)]
        gpus = [
            GpuDevice(uuid=f"GPU-{n}-{i}", index=i, model=model, memory_mib=gib * 1024)
            for i in range(count)
        ]
        nodes.append(
            NodeInventory(
                name=f"n{n}",
                gpus=gpus,
                cpu_milli=[None, 16000, 64000][n % 3],
                memory_mib=[None, 262144][n % 2],
            )
        )
    return ClusterState(nodes)


def _requests(state: ClusterState, rng: random.Random) -> list[SliceRequest]:
    some = [state.gpus[rng.randrange(state.gpu_total)].uuid for _ in range(6)]
    reqs = [
        SliceRequest(core=25, memory=2),
        SliceRequest(core=25, memory=9),  # the same core, more memory: another shape
        SliceRequest(core=25, memory_percent=30),
        SliceRequest(core=25, memory=2, model="T4"),
        SliceRequest(core=25, memory=2, model="H100-80GB|A100-40GB"),
        SliceRequest(core=25, memory=2, include_uuids=some),
        SliceRequest(core=25, memory=2, exclude_uuids=some[:2]),
        SliceRequest(core=40, memory=6, cpu_milli=2000),
        SliceRequest(core=40, memory=6, cpu_milli=6000, host_memory_mib=16384),
        SliceRequest(core=20, memory=3, cpu_milli=6000),
        SliceRequest(core=100),
        SliceRequest(core=200),
        SliceRequest(core=100, model="T4"),
        SliceRequest(core=150, memory=4),
        SliceRequest(core=10, memory=1),
    ]
    rng.shuffle(reqs)
    return reqs


def _compare(cached: FragPolicy, plain: FragPolicy, engine: Engine, req: SliceRequest) -> int:
    """Node scores over every node and GPU scores on single nodes, both policies; returns
    how many nodes could take `req`."""
    s = engine.state
    mask, memory, _ = engine.candidates(req)
    every = np.arange(len(s.nodes), dtype=np.int64)
    view = CandidateView(s, req, mask, req.core_per_gpu, memory, every)
    a, b = cached.node_scores(view), plain.node_scores(view)
    assert a.tobytes() == b.tobytes(), req
    fitting = np.flatnonzero(np.bincount(s.gpu_node[mask], minlength=len(s.nodes)) > 0)
    for node in fitting[:4].tolist():
        one = CandidateView(s, req, mask, req.core_per_gpu, memory, np.asarray([node]))
        start = int(s.node_start[node])
        local = np.flatnonzero(mask[start : start + int(s.node_gpu_count[node])]) + start
        a, b = cached.gpu_scores(one, local), plain.gpu_scores(one, local)
        assert a.tobytes() == b.tobytes(), (req, node)
    return len(fitting)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("room", ["default", "starts over often"])
def test_many_requests_on_one_state_score_as_without_the_cache(
    seed: int, room: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "starts over often": the cache forgets everything once it holds 8 rows, 8 group
    entries or 2 tables' entries."""
    if room != "default":
        monkeypatch.setattr(frag_module, "_CACHE_ROWS", 8)
        monkeypatch.setattr(frag_module, "_CACHE_TABLES", 2 * 64 * 9)
    rng = random.Random(seed)
    state = ClusterState(_cluster(rng).nodes)
    cached, plain = FragPolicy(cache=True), FragPolicy(cache=False)
    engine = Engine(state, cached)
    reference = Engine(state, plain)
    live: list[str] = []
    seen = 0
    for step in range(12):
        # the same arrivals for both; placed by the cached engine (the same decisions)
        for i in range(rng.randint(1, 6)):
            req = rng.choice(_requests(state, rng))
            cached.observe(req)
            plain.observe(req)
            try:
                d = engine.decide(req)
            except NoFit:
                continue
            assert d == reference.decide(req)
            state.apply_decision(f"s{step}-{i}", d, req)
            live.append(f"s{step}-{i}")
        if live and rng.random() < 0.5:
            state.release(live.pop(rng.randrange(len(live))))
        for req in _requests(state, rng):  # one state, one mix: only the request changes
            seen += _compare(cached, plain, engine, req) > 0
    assert seen > 100
    assert cached._score_cache is not None and cached._score_cache.count > 0
