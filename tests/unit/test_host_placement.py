"""Host-only placement (CPU and memory, no GPU) in the one engine: `ClusterState.apply_host`
and `Engine.place_host`, as the trace replay uses them for CPU-only pods."""

from __future__ import annotations

import random

import pytest

from qgpu.errors import NoFit
from qgpu.model import GpuDevice, NodeInventory, PlacementPolicy, SliceRequest
from qgpu.placement import ClusterState, Engine


def node(name: str, cpu: int, mem: int, gpus: int = 1) -> NodeInventory:
    return NodeInventory(
        name=name,
        gpus=[
            GpuDevice(uuid=f"{name}-g{i}", index=i, model="T4", memory_mib=16384)
            for i in range(gpus)
        ],
        cpu_milli=cpu,
        memory_mib=mem,
    )


def test_apply_and_release_host_only():
    state = ClusterState([node("a", 8000, 32768)])
    state.apply_host("cpu-1", "a", 3000, 4096)
    assert state.node_free_cpu[0] == 5000
    assert state.node_free_hostmem[0] == 28672
    assert state.free_core[0] == 100  # no GPU taken
    state.check_invariants()
    assert state.release("cpu-1") is True
    assert state.node_free_cpu[0] == 8000 and state.node_free_hostmem[0] == 32768
    assert state.release("cpu-1") is False
    state.check_invariants()


def test_host_only_never_over_commits():
    state = ClusterState([node("a", 8000, 32768)])
    state.apply_host("cpu-1", 0, 6000, 1024)
    with pytest.raises(ValueError, match="over-commit"):
        state.apply_host("cpu-2", 0, 3000, 1024)
    with pytest.raises(ValueError, match="already placed"):
        state.apply_host("cpu-1", 0, 1, 1)
    # a GPU slice needing more CPU than is left is refused too
    with pytest.raises(ValueError, match="over-commit"):
        state.apply("gpu-1", [0], 30, [4], cpu_milli=3000)
    state.check_invariants()


def test_place_host_takes_capacity_gpu_requests_then_miss():
    engine = Engine(ClusterState([node("a", 8000, 32768)]), "binpack")
    assert engine.place_host("cpu-1", 6000, 1024) == "a"
    with pytest.raises(NoFit, match="host CPU or memory"):
        engine.place("gpu-1", SliceRequest(core=30, memory_gib=4, cpu_milli=4000))
    with pytest.raises(NoFit, match="6000 mCPU"):
        engine.place_host("cpu-2", 6000, 1024)


def test_binpack_and_spread_host_scores():
    nodes = [node("a", 8000, 32768), node("b", 8000, 32768), node("c", 16000, 65536)]
    binpack = Engine(ClusterState(nodes), "binpack")
    spread = Engine(ClusterState(nodes), "spread")
    for engine in (binpack, spread):
        engine.state.apply_host("pre", "b", 4000, 16384)
    assert binpack.decide_host(1000, 1024) == "b"  # fullest
    assert spread.decide_host(1000, 1024) == "a"  # emptiest (a and c tie; lower index)
    assert binpack.decide_host(1000, 1024, placement=PlacementPolicy.SPREAD) == "a"


def test_mixed_host_and_gpu_work_keeps_invariants():
    rng = random.Random(11)
    nodes = [node(f"n{i}", rng.choice([8000, 16000]), 65536, rng.choice([1, 2])) for i in range(5)]
    for policy in ("binpack", "spread", "frag"):
        engine = Engine(ClusterState(nodes), policy)
        live: list[str] = []
        for i in range(200):
            if live and rng.random() < 0.3:
                engine.state.release(live.pop(rng.randrange(len(live))))
                continue
            try:
                if rng.random() < 0.4:
                    engine.place_host(f"h{i}", rng.choice([500, 2000, 4000]), 2048)
                else:
                    core = rng.choice([10, 30, 50, 100])
                    req = SliceRequest(
                        core=core, memory_gib=None if core == 100 else 4, cpu_milli=1000
                    )
                    engine.place(f"g{i}", req)
            except NoFit:
                continue
            live.append(f"h{i}" if f"h{i}" in engine.state.held else f"g{i}")
            engine.state.check_invariants()
        assert (engine.state.node_free_cpu >= 0).all()
