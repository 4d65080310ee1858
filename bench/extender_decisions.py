"""The extender's decisions alone, in one process: what each policy costs per pod.

`bench/extender_throughput.py` measures the whole extender over HTTP; this takes its
placement work apart. One `ExtenderState` per policy over the same cluster (1,000 nodes x 8
GPUs by default) and the same 1,000 pods of the throughput bench's 8 shapes, and per pod what
kube-scheduler's calls make the extender do: count the pod in the request mix, filter all
nodes, score the survivors (prioritize), hold the GPUs of the first of the highest (assume),
and bind there (reserve). Prints ms per pod for each step and the ratio to binpack, side by
side in one run: binpack, frag with its score cache (the default: one node per group of
identical nodes, loss rows kept across pods; `qgpu.frag`, "the score cache") and frag
without it (every node scored the vectorised way); and whether the two frag runs chose the
same node and GPUs for every pod (they must). No assertions.

    .venv/bin/python bench/extender_decisions.py [--nodes 1000] [--gpus 8] [--pods 1000]
        [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.extender_throughput import SHAPES, cluster_nodes  # noqa: E402

STEPS = ("filter", "prioritize", "assume", "reserve")


def _run(
    policy: str,
    cache: bool,
    nodes: list[dict],
    pods: list,
    names: list[str],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple:
    from k8s_bridge.extender.state import ExtenderState
    from k8s_bridge.resources import Names
    from qgpu import frag

    frag.CACHE_SCORES = cache  # read by the policy the engine makes
    state = ExtenderState(Names(), policy)
    state.load_nodes(nodes)
    frag.CACHE_SCORES = True
    spent = dict.fromkeys(STEPS, 0.0)
    chosen = []
    for pod in pods:
        uid = pod.metadata.uid
        t0 = clock()
        reqs = state.requests(pod)
        state.observe(reqs)
        ok = state.filter_nodes(reqs, names, uid).nodes
        t1 = clock()
        scores = state.score_nodes(reqs, ok)
        best = ok[int(np.argmax(scores))]
        t2 = clock()
        state.assume(uid, reqs, best)
        t3 = clock()
        placed = state.reserve(uid, "default", pod.metadata.name, reqs, best)
        t4 = clock()
        for step, dt in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[step] += dt
        chosen.append((best, tuple(tuple(c.gpus) for c in placed.containers.values())))
    return spent, chosen


def main(argv: list[str] | None = None) -> int:
    from k8s_bridge.resources import parse_pod
    from tests.k8s.helpers import pod_object

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time; cpu: this thread's CPU time (less sensitive to other work "
        "on a shared machine)",
    )
    args = ap.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    nodes = cluster_nodes(args.nodes, args.gpus)
    names = [f"node-{n:04d}" for n in range(args.nodes)]
    pods = []
    for i in range(args.pods):
        raw = pod_object(f"pod-{i:05d}", [SHAPES[i % len(SHAPES)]])
        raw["metadata"].update(uid=f"uid-{i:05d}", resourceVersion="1")
        pods.append(parse_pod(raw))

    runs = [
        ("binpack", "binpack", True),
        ("frag", "frag", True),
        ("frag, no cache", "frag", False),
    ]
    results = {
        label: _run(policy, cache, nodes, pods, names, clock) for label, policy, cache in runs
    }
    base = sum(results["binpack"][0].values())
    print(
        f"extender decisions: {args.pods} pods, {args.nodes} nodes x {args.gpus} GPUs, "
        f"ms per pod of {args.clock} time (in one process, no HTTP)"
    )
    print(
        f"  {'policy':<18}" + "".join(f"{s:>12}" for s in STEPS) + f"{'total':>10}{'x binpack':>11}"
    )
    for label, (spent, _) in results.items():
        total = sum(spent.values())
        cells = "".join(f"{spent[s] / args.pods * 1e3:12.3f}" for s in STEPS)
        print(f"  {label:<18}{cells}{total / args.pods * 1e3:10.3f}{total / base:11.2f}")
    same = results["frag"][1] == results["frag, no cache"][1]
    print(f"  frag chose the same node and GPUs for every pod either way: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
