"""Prioritize scores one node per group of identical nodes (`k8s_bridge.extender.node_groups`):
on a stream of pods -- shares, whole GPUs (one and two), memory percentages, model
constraints, include/exclude lists, per-pod policy overrides, two-container pods, releases --
every score, every chosen node and every GPU assignment is the same as scoring every node."""

from __future__ import annotations

import random

import numpy as np
import pytest

from k8s_bridge.extender.node_groups import NodeGroups
from k8s_bridge.extender.state import ExtenderState
from k8s_bridge.protocol import PublishedInventory
from k8s_bridge.resources import parse_pod
from qgpu.model import GpuDevice
from tests.fakes.apiserver import node_object
from tests.k8s.helpers import NAMES, U

# (GPU count, GiB per GPU, model, slices per GPU): a pool where many nodes are alike
KINDS = [(4, 16, "T4", 16), (4, 16, "T4", 4), (2, 40, "A100-40GB", 16), (8, 24, "A10", 16)]
SHAPES: list[dict[str, str]] = [
    {"core": "10", "mem": "2"},
    {"core": "25", "mem": "4"},
    {"core": "30", "mem": "8"},
    {"core": "50", "mem": "8"},
    {"core": "20", "pct": "25"},
    {"core": "100"},
    {"core": "200"},
    {"core": "45", "mem": "12"},
]


def _nodes(rng: random.Random) -> list[dict]:
    out = []
    for n in range(24):
        count, gib, model, slices = KINDS[rng.randrange(len(KINDS))]
        name = f"node-{n:02d}"
        gpus = [
            GpuDevice(uuid=U(name, g), index=g, model=model, memory_mib=gib * 1024)
            for g in range(count)
        ]
        inv = PublishedInventory(gpus=gpus, max_slices_per_gpu=slices, published_at=0)
        out.append(node_object(name, None, **{NAMES.inventory_annotation: inv.model_dump_json()}))
    return out


def _pod(i: int, rng: random.Random) -> dict:
    containers = []
    for c in range(2 if rng.random() < 0.15 else 1):
        shape = SHAPES[rng.randrange(len(SHAPES))]
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


def _run(seed: int, group: bool) -> tuple[list[tuple], int]:
    rng = random.Random(seed)
    state = ExtenderState(NAMES, "frag")
    state.group_nodes = group
    state.load_nodes(_nodes(rng))
    names = [f"node-{n:02d}" for n in range(24)] + ["not-a-qgpu-node"]
    trace: list[tuple] = []
    bound: list[str] = []
    fewer = 0  # prioritize calls that scored fewer nodes than they were given
    for i in range(160):
        if bound and rng.random() < 0.25:
            state.release_pod(bound.pop(rng.randrange(len(bound))))
            continue
        pod = parse_pod(_pod(i, rng))
        reqs = state.requests(pod)
        state.observe(reqs)
        ok = state.filter_nodes(reqs, names, pod.metadata.uid).nodes
        if not ok:
            trace.append((i, "unschedulable"))
            continue
        rng.shuffle(ok)  # kube-scheduler's order is its own
        if group and state._groups is not None:
            positions = state._positions(ok)
            fewer += len(state._groups.representatives(positions[positions >= 0])[0]) < len(ok)
        scores = state.score_nodes(reqs, ok)
        best = ok[int(np.argmax(scores))]
        state.assume(pod.metadata.uid, reqs, best)
        assignment = state.reserve(pod.metadata.uid, "default", pod.metadata.name, reqs, best)
        bound.append(pod.metadata.uid)
        gpus = tuple((c, tuple(a.gpus)) for c, a in sorted(assignment.containers.items()))
        trace.append((i, tuple(ok), tuple(scores.tolist()), best, gpus))
        state.state.check_invariants()
    return trace, fewer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_scores_and_decisions_are_the_same(seed: int) -> None:
    grouped, fewer = _run(seed, group=True)
    assert fewer > 20  # the groups did cut the work (else this test compares nothing)
    plain, _ = _run(seed, group=False)
    assert len(grouped) == len(plain)
    for a, b in zip(grouped, plain, strict=True):
        assert a == b


def test_groups_are_exactly_the_equal_states() -> None:
    rng = random.Random(7)
    state = ExtenderState(NAMES, "frag")
    state.load_nodes(_nodes(rng))
    s = state.state
    groups = NodeGroups(s)
    held: list[str] = []
    for i in range(300):
        if held and rng.random() < 0.4:
            s.release(held.pop(rng.randrange(len(held))))
        else:
            node = rng.randrange(len(s.nodes))
            start, count = int(s.node_start[node]), int(s.node_gpu_count[node])
            g = start + rng.randrange(count)
            core = rng.choice([10, 25, 50])
            if s.free_core[g] >= core and s.free_mem[g] >= 2 and s.slices[g] < s.max_slices[g]:
                s.apply(f"s{i}", [g], core, [2], cpu_milli=rng.choice([0, 500]))
                held.append(f"s{i}")
        ids = groups.current()
        keys = [
            (
                sorted(
                    (int(s.free_core[g]), int(s.free_mem[g]), int(s.slices[g]), int(s.cap_mem[g]))
                    for g in range(int(s.node_start[n]), int(s.node_start[n] + s.node_gpu_count[n]))
                ),
                int(s.max_slices[int(s.node_start[n])]),
                s.gpus[int(s.node_start[n])].model,
                int(s.node_free_cpu[n]),
            )
            for n in range(len(s.nodes))
        ]
        for a in range(len(keys)):
            for b in range(a + 1, len(keys)):
                assert (ids[a] == ids[b]) == (keys[a] == keys[b]), (i, a, b)
        assert int(ids.max()) < len(s.nodes)  # numbers of emptied groups are used again
    for sid in held:  # all nodes of a kind alike again
        s.release(sid)
    ids = groups.current()
    assert any(ids[n] == ids[0] for n in range(1, len(s.nodes)))
    # a direct write to the vectors, announced with `touch()` (qgpu_ray's view does this)
    s.healthy[0] = False
    s.touch()
    ids = groups.current()
    alike = [n for n in range(1, len(s.nodes)) if ids[n] == ids[0]]
    assert not alike  # node-00 alone has an unhealthy GPU
