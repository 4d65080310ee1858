"""The packing-headroom check of the trace replay (bench/packing_bound.py): the fewest GPUs
for a set of shares respects core and the slice limit, and on a 50-node slice of the real
trace the replay it runs is the replay's own, with re-packing never needing more GPUs."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

# a bench script, run from bench/ (it imports trace_replay from there too)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import packing_bound as pb

tr = pb.tr


@pytest.mark.parametrize(
    ("shares", "slots", "fewest"),
    [
        ({81: 2, 16: 2}, 4, 2),  # 81 + 16 twice
        ({47: 2, 65: 1, 32: 1}, 4, 2),  # 47 + 47 and 65 + 32, not 65 + 32 beside a 47
        ({47: 3}, 4, 2),
        ({20: 5}, 4, 2),  # core fits one GPU, the slice limit does not
        ({20: 5}, 5, 1),
        ({}, 4, 0),
    ],
)
def test_fewest_gpus(shares, slots, fewest):
    assert pb.fewest_gpus(Counter(shares), slots) == fewest


def test_patterns_fit_one_gpu():
    pats = pb.patterns([16, 32, 47, 65, 81], 3)
    assert all(sum(p) <= 100 and 1 <= len(p) <= 3 for p in pats)
    assert (32, 32, 32) in pats and (16, 81) in pats and (47, 65) not in pats
    assert len(set(pats)) == len(pats)


def test_headroom_on_a_slice_of_the_trace():
    nodes = tr.load_nodes(tr.DEFAULT_NODES)
    nodes = nodes[:: len(nodes) // 50][:50]
    pods = tr.load_pods(tr.DEFAULT_PODS)
    calls = []
    run = tr.replay(nodes, pods, "frag", 42, "ignore", observer=lambda *a: calls.append(a[2]))
    assert len(calls) == run.gpu_pods and calls.count(False) == run.failed_gpu
    h = pb.headroom(nodes, pods, "frag", 42, "ignore")
    assert h.allocation == pytest.approx(100 * run.ratio_at[130])
    assert h.unallocated == pytest.approx(run.unallocated_gpus)
    assert 0 < h.fewest_share_gpus <= h.share_gpus <= h.gpus
    assert 0 <= h.early_multi <= run.failed_gpu
    assert h.last_empty_at < run.pods
    assert "| mean |" in pb.table([h], "slice")
