"""Placement latency: one decision over 1,000 nodes x 8 GPUs, 50% randomly filled.

Prints median, p99 and max microseconds per decision for every registered placement policy,
side by side in one run, with the ratio to the 5 ms p99 target, and the first decision's
time (an engine's first decision must not stall: it is also in the max). No assertions: this
is a measurement, run it with `python bench/placement_latency.py [--nodes N] [--decisions K]`.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import numpy as np

from qgpu.errors import NoFit
from qgpu.model import GpuDevice, NodeInventory, PlacementPolicy, SliceRequest
from qgpu.placement import ClusterState, Engine

TARGET_P99_US = 5000.0
MODELS = [("H100-80GB", 80, 132), ("A100-40GB", 40, 108), ("T4", 15, 40), ("A10", 22, 72)]


def build_cluster(n_nodes: int, gpus_per_node: int, seed: int) -> list[NodeInventory]:
    rng = random.Random(seed)
    nodes = []
    for n in range(n_nodes):
        model, gib, sms = rng.choice(MODELS)
        gpus = [
            GpuDevice(
                uuid=f"GPU-{n:04d}-{i}",
                index=i,
                model=model,
                memory_mib=gib * 1024,
                sm_count=sms,
                numa_node=i // 4,
            )
            for i in range(gpus_per_node)
        ]
        nodes.append(
            NodeInventory(name=f"node-{n:04d}", gpus=gpus, cpu_milli=96000, memory_mib=1 << 20)
        )
    return nodes


def random_request(rng: random.Random) -> SliceRequest:
    if rng.random() < 0.15:
        return SliceRequest(core=100 * rng.choice([1, 1, 2, 4]))
    return SliceRequest(core=rng.choice([10, 20, 25, 30, 50, 70]), memory=rng.randint(1, 12))


def fill(state: ClusterState, target: float, seed: int) -> None:
    """Place random slices with spread until `target` of all core is used."""
    rng = random.Random(seed)
    engine = Engine(state, "spread")
    i = 0
    total = state.cap_core.sum()
    while 1.0 - state.free_core.sum() / total < target:
        with contextlib.suppress(NoFit):
            engine.place(f"fill-{i}", random_request(rng))
        i += 1


def measure(nodes: list[NodeInventory], policy: str, decisions: int, seed: int) -> list[float]:
    state = ClusterState(nodes)
    fill(state, 0.5, seed)
    engine = Engine(state, policy)
    rng = random.Random(seed + 1)
    reqs = [random_request(rng) for _ in range(decisions)]
    timings = []
    for i, req in enumerate(reqs):
        t0 = time.perf_counter_ns()
        try:
            engine.observe(req)
            d = engine.decide(req)
        except NoFit:
            d = None
        timings.append((time.perf_counter_ns() - t0) / 1000.0)
        if d is not None:  # keep the load steady: apply, then release
            state.apply_decision(f"probe-{i}", d, req)
            state.release(f"probe-{i}")
    return timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    nodes = build_cluster(args.nodes, args.gpus, args.seed)
    print(f"{args.nodes} nodes x {args.gpus} GPUs, 50% filled, {args.decisions} decisions each")
    print(
        f"{'policy':<10}{'median us':>12}{'p99 us':>12}{'max us':>12}{'first us':>12}"
        f"{'p99/target':>12}"
    )
    for policy in PlacementPolicy:
        t = measure(nodes, policy.value, args.decisions, args.seed)
        p99 = float(np.percentile(t, 99))
        print(
            f"{policy.value:<10}{statistics.median(t):>12.1f}{p99:>12.1f}{max(t):>12.1f}"
            f"{t[0]:>12.1f}{p99 / TARGET_P99_US:>12.3f}"
        )


if __name__ == "__main__":
    main()
