"""What an executable graph keeps for its own work. The driver builds launch descriptors for
an executable graph's nodes and keeps the kernel parameters for them (CUDA 12.1 allows
32 KiB per kernel), memory no allocation call shows and NVIDIA documents neither where,
when nor how much of. A tenant instantiating a graph of 64 kernel nodes again and again,
using and keeping every executable graph, would take device memory its slice is never
charged for. The simulator keeps `graph_node_bytes` per node (1 MiB here, so that 100
executable graphs hold 6.25 GiB) from the instantiation or from the first upload or launch
(`graph_work_at`); the hook measures the instantiation and the first use as it measures a
module load and charges both until cuGraphExecDestroy. An upload cannot be undone, so the
one that passes the cap is charged past it and refused: at most one graph's work over."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import HOSTILE_CAP, Arena, Programs, make_arena

SUCCESS, OOM = 0, 2
MIB = 1 << 20
NODE = 1 * MIB  # what each node of an executable graph keeps on this arena's GPU
PER_GRAPH = 64 * NODE


@pytest.fixture(params=["first_use", "instantiation"])
def arena(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Arena]:
    yield from make_arena(short_tmp, graph_node_bytes=NODE, graph_work_at=request.param)


@pytest.mark.parametrize(
    "mode, use",
    [("flags", "launch"), ("flags", "upload"), ("v2", "launch"), ("params", "launch"),
     ("params_upload", "none"), ("params_ptsz", "launch")],
)  # fmt: skip
def test_executable_graphs_own_memory_counts_against_the_slice(
    arena: Arena, programs: Programs, mode: str, use: str
) -> None:
    h = arena.start([programs.c("graphwork"), mode, use])
    made = h.one("made")
    assert h.one("last") == OOM and made < 100  # refused at the cap, not at the 100th
    room = HOSTILE_CAP - max(arena.context_cost, 512 * MIB)
    assert made >= room // PER_GRAPH - 1  # a workload's graphs still fit up to the cap
    # an upload cannot be undone: the one that passes the cap is charged past it, no more
    arena.contained(h, cap=HOSTILE_CAP + PER_GRAPH)


def test_a_destroyed_executable_graph_gives_its_memory_back(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("graphwork"), "flags", "launch", "destroy"])
    assert h.one("destroyed") == h.one("made")
    room = HOSTILE_CAP - max(arena.context_cost, 512 * MIB)
    assert h.one("grabbed_mib") == room // (512 * MIB) * 512  # all of it is the slice's again
    arena.contained(h)


def test_the_simulated_driver_keeps_each_executable_graph_s_work(
    arena: Arena, programs: Programs
) -> None:
    """The driver alone (no hook): 100 executable graphs of 64 nodes hold 6.25 GiB, in
    NVML's per-process figure like any driver allocation, and give it back when destroyed."""
    env = arena.sim.base_env()
    kept = arena.start([programs.c("graphwork"), "flags", "launch"], env)
    assert kept.one("made") == 100 and kept.one("last") == SUCCESS
    assert arena.held(kept.pid) == arena.context_cost + 100 * PER_GRAPH
    kept.finish()
    gone = arena.start([programs.c("graphwork"), "flags", "launch", "destroy"], env)
    assert gone.one("destroyed") == 100
    assert arena.held(gone.pid) == arena.context_cost + gone.one("grabbed_mib") * MIB
