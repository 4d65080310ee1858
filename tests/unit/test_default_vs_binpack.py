"""The default policy against binpack on random small clusters and request lists.

Issue 22: the default policy (frag, with its mix prior and its keep-empty rule) must place
at least as many requests as binpack in the large majority of cases, and never fail a
request binpack places while the cluster is less than half full. Both are checked here:
the first as a rate over a fixed sample, the second as a property (hypothesis).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qgpu.errors import NoFit
from qgpu.model import GpuDevice, NodeInventory, SliceRequest
from qgpu.placement import DEFAULT_PLACEMENT, ClusterState, Engine

SHARES = (10, 20, 25, 30, 40, 50, 60, 70, 75)


def _cluster(shape: list[tuple[int, int]]) -> list[NodeInventory]:
    return [
        NodeInventory(
            name=f"n{n}",
            gpus=[
                GpuDevice(uuid=f"n{n}-g{i}", index=i, model="M", memory_mib=gib * 1024)
                for i in range(gpus)
            ],
        )
        for n, (gpus, gib) in enumerate(shape)
    ]


def _replay(nodes: list[NodeInventory], requests: list[SliceRequest], policy: str):
    """Place the requests in order; per request whether it was placed, and the cluster's
    GPU core fill just before it."""
    engine = Engine(ClusterState(nodes), policy)
    cap = 100 * sum(len(n.gpus) for n in nodes)
    placed, fill = [], []
    for i, req in enumerate(requests):
        fill.append(1 - int(engine.state.free_core.sum()) / cap)
        try:
            engine.place(f"s{i}", req)
        except NoFit:
            placed.append(False)
        else:
            placed.append(True)
        engine.state.check_invariants()
    return placed, fill


node_shapes = st.lists(
    st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([16, 24, 80])), min_size=1, max_size=3
)
slice_requests = st.one_of(
    st.builds(
        lambda c, m: SliceRequest(core=c, memory_gib=m),
        st.sampled_from(SHARES),
        st.integers(1, 8),
    ),
    st.builds(lambda n: SliceRequest(core=100 * n), st.sampled_from([1, 1, 2, 4])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=node_shapes, requests=st.lists(slice_requests, min_size=1, max_size=24))
def test_below_half_full_the_default_fails_nothing_binpack_places(shape, requests):
    nodes = _cluster(shape)
    mine, fill = _replay(nodes, requests, DEFAULT_PLACEMENT.value)
    theirs, _ = _replay(nodes, requests, "binpack")
    for i, ok in enumerate(mine):
        if fill[i] >= 0.5:
            break
        assert ok or not theirs[i], f"request {i} {requests[i]} failed at fill {fill[i]:.2f}"


def test_the_default_places_at_least_as_many_as_binpack_in_most_cases():
    # 200 random clusters of 1-3 nodes and request lists of 50-130% of their GPU core
    rng = random.Random(22)
    at_least = 0
    for _ in range(200):
        count = rng.randint(1, 3)
        shape = [(rng.choice([1, 2, 4]), rng.choice([16, 24, 80])) for _ in range(count)]
        nodes = _cluster(shape)
        total = 100 * sum(g for g, _ in shape)
        requests: list[SliceRequest] = []
        asked, goal = 0, total * rng.uniform(0.5, 1.3)
        while asked < goal:
            if rng.random() < 0.3:
                requests.append(SliceRequest(core=100 * rng.choice([1, 1, 1, 2])))
            else:
                requests.append(SliceRequest(core=rng.choice(SHARES), memory_gib=rng.randint(1, 8)))
            asked += requests[-1].core
        mine, _ = _replay(nodes, requests, DEFAULT_PLACEMENT.value)
        theirs, _ = _replay(nodes, requests, "binpack")
        at_least += sum(mine) >= sum(theirs)
    # measured: 193 of 200 (96.5%; 194 before empty GPUs were ranked by their node's empty
    # GPUs); each of the 7 others places one request fewer, and the two runs first differ
    # at 69-96% fill. 95% is the floor this test holds it to.
    assert at_least >= 190, at_least
