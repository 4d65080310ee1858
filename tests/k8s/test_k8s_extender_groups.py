"""frag's score cache in the extender (`qgpu.frag`, "the score cache"): prioritize scores one
node per group of identical nodes (`qgpu.node_groups`) from loss rows kept across pods, and
the hold at assume takes its GPU from the same rows. On streams of pods -- shares, whole
GPUs (one and two), memory percentages, model constraints, include/exclude lists, per-pod
policy overrides, two-container pods, releases, a node whose inventory changes (a GPU turns
unhealthy, then healthy again), a direct write to the state announced with `touch`, a
request mix that drifts from small shares to large ones, and the mix repriced on every
change as well as at frag's own drift -- every score, every chosen node and every GPU
assignment is the same as a policy without the cache gives, which scores every node the
vectorised way."""

from __future__ import annotations

import random

import numpy as np
import pytest

from k8s_bridge.extender.state import ExtenderState
from k8s_bridge.protocol import PublishedInventory
from k8s_bridge.resources import parse_pod
from qgpu import frag as frag_module
from qgpu import node_groups
from qgpu.model import GpuDevice, GpuHealth
from tests.fakes.apiserver import node_object
from tests.k8s.helpers import NAMES, U

# (GPU count, GiB per GPU, model, slices per GPU): a pool where many nodes are alike
KINDS = [(4, 16, "T4", 16), (4, 16, "T4", 4), (2, 40, "A100-40GB", 16), (8, 24, "A10", 16)]
# shapes that share a core and differ in memory (a percentage, or GiB) are other shapes
SMALL: list[dict[str, str]] = [
    {"core": "10", "mem": "2"},
    {"core": "25", "mem": "4"},
    {"core": "25", "mem": "11"},
    {"core": "20", "pct": "25"},
    {"core": "20", "pct": "60"},
    {"core": "30", "mem": "8"},
]
LARGE: list[dict[str, str]] = [
    {"core": "50", "mem": "8"},
    {"core": "50", "mem": "15"},
    {"core": "100"},
    {"core": "200"},
    {"core": "45", "mem": "12"},
    {"core": "70", "mem": "10"},
]


def _node(name: str, kind: int, unhealthy: int | None = None) -> dict:
    count, gib, model, slices = KINDS[kind]
    gpus = [
        GpuDevice(
            uuid=U(name, g),
            index=g,
            model=model,
            memory_mib=gib * 1024,
            health=GpuHealth.UNHEALTHY if g == unhealthy else GpuHealth.HEALTHY,
        )
        for g in range(count)
    ]
    inv = PublishedInventory(gpus=gpus, max_slices_per_gpu=slices, published_at=0)
    return node_object(name, None, **{NAMES.inventory_annotation: inv.model_dump_json()})


def _shape(i: int, pods: int, rng: random.Random) -> dict[str, str]:
    """The mix drifts: small shares first, large ones and whole GPUs by the end."""
    pool = LARGE if rng.random() < i / pods else SMALL
    return pool[rng.randrange(len(pool))]


def _pod(i: int, pods: int, rng: random.Random) -> dict:
    containers = []
    for c in range(2 if rng.random() < 0.15 else 1):
        shape = _shape(i, pods, rng)
        limits = {NAMES.core: shape["core"]}
        if "mem" in shape:
            limits[NAMES.memory] = shape["mem"]
        if "pct" in shape:
            limits[NAMES.memory_percent] = shape["pct"]
        containers.append({"name": f"c{c}", "resources": {"limits": limits}})
    ann: dict[str, str] = {}
    roll = rng.random()
    if roll < 0.1:
        ann[NAMES.model_annotation] = "T4"
    elif roll < 0.15:
        ann[NAMES.include_annotation] = ",".join(U(f"node-{n:02d}", 0) for n in range(0, 24, 3))
    elif roll < 0.2:
        ann[NAMES.exclude_annotation] = U("node-00", 0)
    elif roll < 0.25:
        ann[NAMES.placement_annotation] = "binpack"
    return {
        "metadata": {
            "name": f"p{i}",
            "namespace": "default",
            "uid": f"uid-{i}",
            "resourceVersion": "1",
            "annotations": ann,
        },
        "spec": {"containers": containers, "schedulerName": "qgpu-scheduler"},
    }


def _run(
    seed: int, cache: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple], dict[str, int]]:
    """The stream for `seed`; and what the cache did: calls that scored fewer nodes than
    they were given (its grouping), candidate rows it scored, loss rows it had to compute
    (all 0 without the cache)."""
    monkeypatch.setattr(frag_module, "CACHE_SCORES", cache)
    counts = {"grouped": 0, "scored": 0, "computed": 0}
    one_per_group = frag_module._one_per_group
    scored = frag_module.FragPolicy._row_scores
    computed = frag_module.FragPolicy._loss_rows

    def grouping(slots, nodes, capacity):  # type: ignore[no-untyped-def]
        reps, at = one_per_group(slots, nodes, capacity)
        counts["grouped"] += len(reps) < len(nodes)
        return reps, at

    def scoring(self, view, cache, idx, gap_of):  # type: ignore[no-untyped-def]
        counts["scored"] += len(idx)
        return scored(self, view, cache, idx, gap_of)

    def computing(self, view, gpus, mode):  # type: ignore[no-untyped-def]
        counts["computed"] += len(gpus)
        return computed(self, view, gpus, mode)

    monkeypatch.setattr(frag_module, "_one_per_group", grouping)
    monkeypatch.setattr(frag_module.FragPolicy, "_row_scores", scoring)
    monkeypatch.setattr(frag_module.FragPolicy, "_loss_rows", computing)
    rng = random.Random(seed)
    kinds = [rng.randrange(len(KINDS)) for _ in range(24)]
    state = ExtenderState(NAMES, "frag")
    state.load_nodes([_node(f"node-{n:02d}", kinds[n]) for n in range(24)])
    names = [f"node-{n:02d}" for n in range(24)] + ["not-a-qgpu-node"]
    trace: list[tuple] = []
    bound: list[str] = []
    pods = 220
    for i in range(pods):
        roll = rng.random()
        if bound and roll < 0.2:
            state.release_pod(bound.pop(rng.randrange(len(bound))))
            continue
        if roll < 0.23:  # a node's inventory changes: a GPU turns unhealthy, or back
            n = rng.randrange(24)
            sick = rng.choice([None, 0, 1])
            trace.append((i, "node", n, state.update_node(_node(names[n], kinds[n], sick))))
            continue
        if roll < 0.25:  # a direct write to a free GPU's health, announced with touch()
            s = state.state
            free = np.flatnonzero(s.slices == 0)
            if len(free):
                g = int(free[rng.randrange(len(free))])
                s.healthy[g] = not s.healthy[g]
                s.touch()
                trace.append((i, "touch", g))
            continue
        pod = parse_pod(_pod(i, pods, rng))
        reqs = state.requests(pod)
        state.observe(reqs)
        ok = state.filter_nodes(reqs, names, pod.metadata.uid).nodes
        if not ok:
            trace.append((i, "unschedulable"))
            continue
        rng.shuffle(ok)  # kube-scheduler's order is its own
        scores = state.score_nodes(reqs, ok)
        best = ok[int(np.argmax(scores))]
        state.assume(pod.metadata.uid, reqs, best)
        assignment = state.reserve(pod.metadata.uid, "default", pod.metadata.name, reqs, best)
        bound.append(pod.metadata.uid)
        gpus = tuple((c, tuple(a.gpus)) for c, a in sorted(assignment.containers.items()))
        trace.append((i, tuple(ok), tuple(scores.tolist()), best, gpus))
        state.state.check_invariants()
    return trace, counts


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("variant", ["default", "reprice always", "reuse slots"])
def test_cached_scores_and_decisions_are_the_same(
    seed: int, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With "reprice always" the mix is priced on every change; with "reuse slots" a group
    whose nodes all left is forgotten as soon as 3 are idle, so its slot is soon handed to
    another state under a new generation (rows kept for the old one must not be used)."""
    if variant == "reprice always":
        monkeypatch.setattr(frag_module, "reprice_threshold", lambda arrived: 0.0)
    if variant == "reuse slots":
        monkeypatch.setattr(node_groups, "_KEEP_IDLE", 2 - 24)
    cached, counts = _run(seed, True, monkeypatch)
    # the groups did cut the work, and most candidates' rows were kept ones (else this
    # test compares nothing)
    assert counts["grouped"] > 20
    assert 0 < counts["computed"] < counts["scored"] / 2
    plain, none = _run(seed, False, monkeypatch)
    assert none == {"grouped": 0, "scored": 0, "computed": 0}
    assert len(cached) == len(plain)
    assert any(step[1] == "node" and step[3] for step in cached)  # a node did change
    for a, b in zip(cached, plain, strict=True):
        assert a == b
