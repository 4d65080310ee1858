"""`qgpu.node_groups.NodeGroups` names node states exactly: two nodes share a (slot,
generation) exactly when their states are equal, a GPU's rank names its state among its
node's distinct GPU states the same way on every node of the group, and a slot handed to
another state gets a new generation -- through placements, releases, host-only work, a
direct write announced with `touch`, and groups forgotten and their slots used again."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qgpu import node_groups
from qgpu.model import GpuDevice, NodeInventory
from qgpu.placement import ClusterState

KINDS = [(4, 16, "T4"), (2, 40, "A100-40GB"), (8, 24, "A10"), (1, 80, "H100-80GB")]


def _cluster(rng: random.Random, n: int) -> ClusterState:
    nodes = []
    for i in range(n):
        count, gib, model = KINDS[rng.randrange(len(KINDS))]
        gpus = [
            GpuDevice(uuid=f"GPU-{i}-{g}", index=g, model=model, memory_mib=gib * 1024)
            for g in range(count)
        ]
        nodes.append(NodeInventory(name=f"n{i}", gpus=gpus, cpu_milli=rng.choice([8000, None])))
    return ClusterState(nodes)


def _gpu_state(s: ClusterState, g: int) -> tuple:
    return tuple(int(getattr(s, f)[g]) for f in node_groups._GPU_FIELDS)


def _node_state(s: ClusterState, n: int) -> tuple:
    start, count = int(s.node_start[n]), int(s.node_gpu_count[n])
    return (
        tuple(sorted(_gpu_state(s, g) for g in range(start, start + count))),
        *(int(getattr(s, name)[n]) for name in node_groups._NODE_FIELDS),
    )


def _check(s: ClusterState, groups: node_groups.NodeGroups, names: dict[tuple, tuple]) -> None:
    slots = groups.current()
    key = [(int(slots[n]), int(groups.gen[slots[n]])) for n in range(len(s.nodes))]
    states = [_node_state(s, n) for n in range(len(s.nodes))]
    for a in range(len(states)):
        for b in range(a + 1, len(states)):
            assert (key[a] == key[b]) == (states[a] == states[b]), (a, b)
    for n, (k, state) in enumerate(zip(key, states, strict=True)):
        # a (slot, generation) never names two states, over the whole run
        assert names.setdefault(k, state) == state, n
        start, count = int(s.node_start[n]), int(s.node_gpu_count[n])
        ranks = {}
        for g in range(start, start + count):
            ranks.setdefault(int(groups.rank[g]), set()).add(_gpu_state(s, g))
        assert all(len(v) == 1 for v in ranks.values())  # a rank is one GPU state
        assert sorted(ranks) == list(range(len(ranks)))  # distinct states, ranked 0..
        by_rank = sorted((r, v.pop()) for r, v in ranks.items())
        assert [v for _, v in by_rank] == sorted(v for _, v in by_rank)  # in sorted order


@pytest.mark.parametrize("keep_idle", [64, -20])
def test_groups_name_the_equal_states(keep_idle: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_idle -20 (24 nodes): a group is forgotten once more than 4 are idle, so slots
    are handed to other states often."""
    monkeypatch.setattr(node_groups, "_KEEP_IDLE", keep_idle)
    rng = random.Random(7)
    s = _cluster(rng, 24)
    groups = s.node_groups()
    names: dict[tuple, tuple] = {}
    held: list[str] = []
    for i in range(300):
        roll = rng.random()
        if held and roll < 0.4:
            s.release(held.pop(rng.randrange(len(held))))
        elif roll < 0.45:
            n = rng.randrange(len(s.nodes))
            if s.node_free_cpu[n] >= 500:
                s.apply_host(f"h{i}", n, 500, 0)
                held.append(f"h{i}")
        elif roll < 0.48:  # a direct write, announced (qgpu_ray's view does this)
            g = rng.randrange(s.gpu_total)
            s.healthy[g] = not s.healthy[g]
            s.touch()
        elif roll < 0.5 and s.free_core[0] >= 5:  # one that leaves the node sums behind
            s.free_core[0] -= 5
            s.touch()
        else:
            g = rng.randrange(s.gpu_total)
            core = rng.choice([10, 25, 50])
            if s.free_core[g] >= core and s.free_mem[g] >= 2 and s.slices[g] < s.max_slices[g]:
                s.apply(f"s{i}", [g], core, [2])
                held.append(f"s{i}")
        _check(s, groups, names)
        assert groups.slots <= 2 * len(s.nodes) + max(keep_idle, 0) + 1
    for sid in held:  # back to the empty cluster: nodes of a kind alike again
        s.release(sid)
    _check(s, groups, names)
    slots = groups.current()
    assert len(set(slots.tolist())) < len(s.nodes)
    if keep_idle < 0:
        assert len(names) > groups.slots  # slots did serve several states in turn


def test_a_fresh_grouping_agrees_with_a_kept_one() -> None:
    rng = random.Random(3)
    s = _cluster(rng, 40)
    kept = s.node_groups()
    for i in range(200):
        g = rng.randrange(s.gpu_total)
        if s.free_core[g] >= 30 and s.slices[g] < s.max_slices[g] and s.free_mem[g] >= 1:
            s.apply(f"s{i}", [g], 30, [1])
        kept.current()
    fresh = node_groups.NodeGroups(s)
    a, b = kept.current(), fresh.current()
    same_a = a[:, None] == a[None, :]
    same_b = b[:, None] == b[None, :]
    assert np.array_equal(same_a, same_b)
    assert np.array_equal(kept.rank, fresh.rank)
