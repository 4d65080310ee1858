"""Time to place and start N fractional actors: qgpu vs Ray's fractional ``num_gpus``.

Side by side on one local Ray cluster, in one run, alternating rounds. The cluster has a
qgpu node (simulated GPUs) and a plain Ray node with as many GPUs (``ray.cluster_utils``
``num_gpus``, no qgpu environment): the baseline runs there.

- ``ray num_gpus``: ``Actor.options(num_gpus=0.3)`` on the plain node — Ray places
  fractions, isolates nothing;
- ``qgpu num_gpus``: the same unchanged call on the qgpu node — the worker binds to a capped
  slice of the GPU Ray chose (holder group + caps);
- ``qgpu sdk``: ``Actor.options(**qgpu_ray.options(core=30, memory=8))`` — placement by the
  core engine, per-GPU accounting; the default ``via="auto"`` is the resource form on qgpu
  nodes (no runtime_env; the worker binds when Ray starts it, to the GPU named by its
  per-GPU resources);
- ``qgpu sdk/runtime_env``: the same with ``via="runtime_env"`` (interposer and caps in the
  worker's environment: a dedicated worker process per slice);
- ``qgpu plain``: ``Actor.options(resources={"qgpu-core": 30, "qgpu-memory": 8})``; the
  worker binds to a GPU when Ray starts it (placement + holder group + caps).

One untimed warm-up round per path comes first (Ray's worker pool, imports).

Each round creates N actors, waits until every one answered a call that starts CUDA (on
the qgpu paths that binds and caps the slice; on Ray's path it is the same driver call with
nothing to enforce), then kills them and waits until the resources are back. Prints
seconds per round, the median per path and the ratio to Ray's.
Run: ``.venv/bin/python bench/ray_overhead.py [--actors 40] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import ray

import qgpu_ray
from enforcement.sim import sim_environment
from qgpu_ray.resources import LABEL_NODE

PLAIN = {"bench.qgpu.io/node": "plain"}  # the plain Ray node of the baseline
QGPU = {LABEL_NODE: "qgpu-node-0"}


@ray.remote
class Replica:
    def ready(self, start_cuda: bool) -> str:
        if start_cuda:
            from enforcement import simcuda

            drv = simcuda.Driver()
            drv.init()
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def _wait_free(total_core: float) -> None:
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        avail = available_resources_per_node().values()
        if sum(v.get("qgpu-core", 0.0) for v in avail) >= total_core and not any(
            v["name"].startswith("qgpu-hold:") and v["state"] != "REMOVED"
            for v in ray.util.placement_group_table().values()
        ):
            return
        time.sleep(0.1)
    raise RuntimeError("resources did not come back within 60 s")


def run_round(path: str, n: int, total_core: float) -> float:
    t0 = time.perf_counter()
    if path.endswith("num_gpus"):
        where = {"label_selector": PLAIN if path.startswith("ray") else QGPU}
        actors = [Replica.options(num_gpus=0.3, num_cpus=0, **where).remote() for _ in range(n)]
        ray.get([a.ready.remote(True) for a in actors], timeout=600)
    elif path.startswith("qgpu sdk"):
        via = "runtime_env" if path.endswith("runtime_env") else "auto"
        actors = [
            Replica.options(**qgpu_ray.options(core=30, memory=8, num_cpus=0, via=via)).remote()
            for _ in range(n)
        ]
        ray.get([a.ready.remote(True) for a in actors], timeout=600)
    else:
        res = {"qgpu-core": 30, "qgpu-memory": 8}
        actors = [Replica.options(resources=res, num_cpus=0).remote() for _ in range(n)]
        ray.get([a.ready.remote(True) for a in actors], timeout=600)
    elapsed = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    _wait_free(total_core)
    qgpu_ray.view.PENDING.clear()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--actors", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=14, help="simulated 80 GiB GPUs on the node")
    args = ap.parse_args()
    own_tmp = None
    if "RAY_TMPDIR" not in os.environ:
        own_tmp = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="qgpu-raytmp-", dir="/tmp")
    spec = f"{args.gpus}xH100-80GB"
    cluster = qgpu_ray.LocalCluster([spec], cpus_per_node=2)
    # the same simulated driver, without interposer or worker hook: nothing to enforce
    sim = sim_environment(cluster.nodes[0].sim_config)
    cluster.cluster.add_node(num_cpus=2, num_gpus=args.gpus, labels=PLAIN, env_vars=sim)
    cluster.cluster.wait_for_nodes()
    paths = ["ray num_gpus", "qgpu num_gpus", "qgpu sdk", "qgpu sdk/runtime_env", "qgpu plain"]
    times: dict[str, list[float]] = {p: [] for p in paths}
    try:
        total_core = 100.0 * args.gpus
        for path in paths:
            run_round(path, args.actors, total_core)  # warm-up, not counted
        for r in range(args.rounds):
            for path in paths:
                t = run_round(path, args.actors, total_core)
                times[path].append(t)
                print(f"round {r + 1} {path:<20} {args.actors} actors in {t:6.2f} s", flush=True)
    finally:
        cluster.shutdown()
        if own_tmp:
            shutil.rmtree(own_tmp, ignore_errors=True)
    base = statistics.median(times["ray num_gpus"])
    print(f"\n{'path':<21}{'median s':>10}{'per actor ms':>14}{'ratio vs Ray':>14}")
    for path in paths:
        med = statistics.median(times[path])
        print(f"{path:<21}{med:>10.2f}{1000 * med / args.actors:>14.1f}{med / base:>14.2f}")


if __name__ == "__main__":
    main()
