"""Why a node cannot take a request (`Engine.shortfall`), the per-shape answers kept between
requests (`Engine.node_fit`) and the fitting-GPU mask (`Engine.candidates`): always what
asking every node afresh gives."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qgpu.errors import NoFit
from qgpu.model import GpuDevice, GpuHealth, NodeInventory, SliceRequest
from qgpu.placement import ClusterState, Engine
from tests.helpers import make_node

MODELS = ("H100-80GB", "A100-40GB")


def reference_shortfall(engine: Engine, req: SliceRequest, node: int) -> str | None:
    """Node by node, rule by rule: the first rule after which too few of its GPUs pass."""
    s = engine.state
    need = req.gpu_count
    mine = np.flatnonzero(s.gpu_node == node)
    if len(mine) < need:
        return "GPU count"
    passing = np.ones(s.gpu_total, dtype=bool)
    for name, keep in engine._checks(req):
        passing &= keep
        if int(np.count_nonzero(passing[mine])) < need:
            return name
    return None


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeInventory]:
    nodes = []
    for n in range(draw(st.integers(1, 6))):
        gpus = []
        for g in range(draw(st.integers(0, 5))):
            model = draw(st.sampled_from(MODELS))
            healthy = draw(st.booleans()) or draw(st.booleans())
            gpus.append(
                GpuDevice(
                    uuid=f"GPU-n{n}-{g}",
                    index=g,
                    model=model,
                    memory_mib=(80 if model.startswith("H100") else 40) * 1024,
                    health=GpuHealth.HEALTHY if healthy else GpuHealth.UNHEALTHY,
                )
            )
        nodes.append(
            NodeInventory(
                name=f"n{n}", gpus=gpus, max_slices_per_gpu=draw(st.sampled_from([2, 4, 16]))
            )
        )
    return nodes


@st.composite
def requests(draw: st.DrawFn, uuids: list[str]) -> SliceRequest:
    whole = draw(st.booleans())
    core = draw(st.sampled_from([100, 200, 300])) if whole else draw(st.integers(1, 99))
    memory = None if whole else draw(st.integers(1, 80))
    model = draw(st.sampled_from([None, MODELS[0], MODELS[1], "|".join(MODELS)]))
    include = draw(st.lists(st.sampled_from(uuids), unique=True, max_size=4)) if uuids else []
    pool = [u for u in uuids if u not in include]
    exclude = draw(st.lists(st.sampled_from(pool), unique=True, max_size=3)) if pool else []
    return SliceRequest(
        core=core,
        memory_gib=memory,
        model=model,
        include_uuids=include if draw(st.booleans()) else [],
        exclude_uuids=exclude if draw(st.booleans()) else [],
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_shortfall_and_node_fit_agree_with_asking_every_node(data: st.DataObject) -> None:
    nodes = data.draw(clusters())
    state = ClusterState(nodes)
    engine = Engine(state, "binpack")
    uuids = [g.uuid for g in state.gpus]
    everyone = np.arange(len(nodes))
    for step in range(data.draw(st.integers(1, 12))):
        if state.held and data.draw(st.booleans()):
            state.release(data.draw(st.sampled_from(sorted(state.held))))
        else:
            with contextlib.suppress(NoFit):
                engine.place(f"s{step}", data.draw(requests(uuids)))
        req = data.draw(requests(uuids))
        expected = [reference_shortfall(engine, req, n) for n in range(len(nodes))]
        assert engine.shortfall(req, everyone) == expected
        picked = data.draw(st.lists(st.sampled_from(everyone.tolist()), max_size=4))
        assert engine.shortfall(req, np.asarray(picked, dtype=np.int64)) == [
            expected[n] for n in picked
        ]
        fit = engine.node_fit(req)
        assert fit.rules.tolist() == expected
        assert fit.fits.tolist() == [r is None for r in expected]
        # the mask alone (a request pinned to a few GPUs looks at those only) is the
        # mask the explained, cluster-wide pass finds
        fast, _, _ = engine.candidates(req, explain=False)
        full, _, _ = engine.candidates(req)
        assert fast.tolist() == full.tolist()


def test_node_fit_asks_again_only_the_nodes_that_changed() -> None:
    state = ClusterState([make_node(f"n{i}", 2) for i in range(4)])
    engine = Engine(state, "binpack")
    req = SliceRequest(core=60, memory_gib=8)
    asked: list[list[int]] = []
    shortfall = engine.shortfall

    def counting(r: SliceRequest, nodes: np.ndarray) -> list[str | None]:
        asked.append(sorted(np.asarray(nodes).tolist()))
        return shortfall(r, nodes)

    engine.shortfall = counting  # type: ignore[method-assign]
    engine._node_fit.shortfall = counting
    assert engine.node_fit(req).fits.all()
    assert asked == [[0, 1, 2, 3]]
    state.apply("a", [2], 60, [8])  # node 1, GPU 0
    state.apply("b", [3], 60, [8])  # node 1, GPU 1: node 1 is now short of core
    fit = engine.node_fit(req)
    assert asked[1:] == [[1]]
    assert fit.fits.tolist() == [True, False, True, True] and fit.rules[1] == "core"
    assert engine.node_fit(req) is fit or engine.node_fit(req).rules.tolist() == fit.rules.tolist()
    assert asked[2:] == []  # nothing changed: nobody asked
    state.release("a")
    assert engine.node_fit(req).fits.tolist() == [True, True, True, True]
    assert asked[2:] == [[1]]
    state.touch()  # a direct write to the vectors: every node is asked again
    engine.node_fit(req)
    assert asked[3:] == [[0, 1, 2, 3]]


def test_an_answer_already_handed_out_is_not_changed_later() -> None:
    state = ClusterState([make_node("n0", 1), make_node("n1", 1)])
    engine = Engine(state, "binpack")
    req = SliceRequest(core=100)
    before = engine.node_fit(req)
    state.apply("a", [0], 50, [8])
    after = engine.node_fit(req)
    assert before.fits.tolist() == [True, True]
    assert after.fits.tolist() == [False, True] and after.rules[0] == "not empty (whole GPU)"
    assert not before.fits.flags.writeable and not after.rules.flags.writeable
