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
With ``--breakdown`` every actor also reports where its start-up went (wall-clock marks
and CPU seconds of its worker process, `qgpu_ray.hook.MARKS` and `qgpu_ray.bind.PHASES`),
and the script prints, per path, the median over all actors of the timed rounds of:

- ``spawn``: ``.remote()`` to the start of the actor's worker process (Ray's scheduling
  and process start; 0 when Ray gave the actor an already started worker);
- ``up``: process start to the actor's first method call (everything the worker does
  before user code: ``boot``, ``hook``, ``imp`` and binding below), for new workers only;
- ``boot``: process start to the worker hook (Python, ``import ray``, connecting to Ray);
- ``hook``: the worker hook itself (registering the bind callback, wrapping Ray's lookup);
- ``imp``: importing `qgpu_ray.bind` (the core model, placement engine, agent client);
- the steps of binding: ``node`` (this worker's node and rule), ``choose`` (Ray's live
  per-GPU availability and the choice of GPU), ``hold`` (the holder placement group's
  GCS round trip), ``record`` (the node agent's record), ``env`` (device and caps);
- ``cuinit``: the first CUDA call in the actor (the interposer reads its limits);
- ``cpu``: CPU seconds the worker process used up to that point (user + system);
- ``new``: the share of actors that got a worker process started for them;

and, per round, the CPU seconds of the cluster's long-lived processes (GCS, raylets, Ray's
agents, the qgpu node agents, this driver) next to the sum over the round's workers: on a
machine with few cores the round's wall time follows the CPU it needs.

``--sequential`` starts the actors one after the other (each waits for the one before):
the latency of one start on an otherwise idle node instead of the throughput of many.

Run: ``.venv/bin/python bench/ray_overhead.py [--actors 40] [--rounds 3] [--breakdown]
[--sequential]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import ray

import qgpu_ray
from enforcement.sim import sim_environment
from qgpu_ray.resources import LABEL_NODE

PLAIN = {"bench.qgpu.io/node": "plain"}  # the plain Ray node of the baseline
QGPU = {LABEL_NODE: "qgpu-node-0"}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _system_processes(cluster: qgpu_ray.LocalCluster) -> dict[str, list[int]]:
    """The cluster's long-lived processes by kind (Ray's process types, qgpu agent, driver)."""
    out: dict[str, list[int]] = {"driver": [os.getpid()]}
    nodes = [cluster.cluster.head_node, *cluster.cluster.worker_nodes]
    for node in nodes:
        for kind, proc in node.live_processes():
            out.setdefault(kind, []).append(proc.pid)
    out["qgpu agent"] = [n.agent.process.pid for n in cluster.nodes if n.agent is not None]
    return out


def _process_start(pid: int) -> float:
    """Wall-clock start of a process (seconds since the epoch, 10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    # the kernel counts start times from boot; /proc/stat's btime is whole seconds only
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@ray.remote
class Replica:
    def ready(self, start_cuda: bool) -> str:
        if start_cuda:
            from enforcement import simcuda

            drv = simcuda.Driver()
            drv.init()
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def profile(self) -> dict[str, float]:
        """Where this worker's start-up went (see the module docstring), then start CUDA."""
        import resource
        import sys

        from enforcement import simcuda

        out: dict[str, float] = {"entered": time.time(), "start": _process_start(os.getpid())}
        hook = sys.modules.get("qgpu_ray.hook")
        bind = sys.modules.get("qgpu_ray.bind")
        marks = dict(getattr(hook, "MARKS", {}))
        if "install_start" in marks:
            out["boot"] = marks["install_start"] - out["start"]
            out["hook"] = marks["install_end"] - marks["install_start"]
        if "import_bind_start" in marks:
            out["imp"] = marks["import_bind_end"] - marks["import_bind_start"]
            out["imp_cpu"] = marks["import_bind_end_cpu"] - marks["import_bind_start_cpu"]
        out.update(getattr(bind, "PHASES", {}))
        out.update({f"{k}_cpu": v for k, v in getattr(bind, "PHASES_CPU", {}).items()})
        t = time.perf_counter()
        simcuda.Driver().init()
        out["cuinit"] = time.perf_counter() - t
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu"] = usage.ru_utime + usage.ru_stime
        return out


def _wait_free(total_core: float, agents: list) -> None:
    """Until Ray has every resource back, no holder group is left and the node agents have
    released the records of the killed workers (each round starts on an idle node)."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        avail = available_resources_per_node().values()
        if (
            sum(v.get("qgpu-core", 0.0) for v in avail) >= total_core
            and not any(
                v["name"].startswith("qgpu-hold:") and v["state"] != "REMOVED"
                for v in ray.util.placement_group_table().values()
            )
            and not any(a.client.slices().slices for a in agents)
        ):
            return
        time.sleep(0.1)
    raise RuntimeError("resources did not come back within 60 s")


def _actor(path: str) -> tuple[object, float]:
    """One actor of `path`, and the wall-clock time it was asked for."""
    asked = time.time()
    if path.endswith("num_gpus"):
        where = {"label_selector": PLAIN if path.startswith("ray") else QGPU}
        return Replica.options(num_gpus=0.3, num_cpus=0, **where).remote(), asked
    if path.startswith("qgpu sdk"):
        via = "runtime_env" if path.endswith("runtime_env") else "auto"
        opts = qgpu_ray.options(core=30, memory=8, num_cpus=0, via=via)
        return Replica.options(**opts).remote(), asked
    res = {"qgpu-core": 30, "qgpu-memory": 8}
    return Replica.options(resources=res, num_cpus=0).remote(), asked


def run_round(
    path: str,
    n: int,
    total_core: float,
    agents: list,
    breakdown: bool = False,
    system: dict[str, list[int]] | None = None,
    sequential: bool = False,
) -> tuple[float, list[dict[str, float]], dict[str, float]]:
    system = system or {}
    before = {k: sum(map(_cpu_seconds, pids)) for k, pids in system.items()}

    def call(actor: Any) -> Any:
        return actor.profile.remote() if breakdown else actor.ready.remote(True)

    t0 = time.perf_counter()
    if sequential:  # one actor at a time: the latency of one start on an idle node
        made, answers = [], []
        for _ in range(n):
            made.append(_actor(path))
            answers.append(ray.get(call(made[-1][0]), timeout=600))
    else:
        made = [_actor(path) for _ in range(n)]
        answers = ray.get([call(a) for a, _ in made], timeout=600)
    actors = [a for a, _ in made]
    profiles = answers if breakdown else []
    elapsed = time.perf_counter() - t0
    used = {k: sum(map(_cpu_seconds, pids)) - before[k] for k, pids in system.items()}
    if profiles:
        used["workers"] = sum(p["cpu"] for p in profiles)
    for p, (_, asked) in zip(profiles, made, strict=False):  # none without breakdown
        p["spawn"] = max(0.0, p["start"] - asked)
        p["new"] = 1.0 if p["start"] >= asked - 0.01 else 0.0
        if p["new"]:
            p["up"] = p["entered"] - p["start"]
    for a in actors:
        ray.kill(a)
    _wait_free(total_core, agents)
    qgpu_ray.view.PENDING.clear()
    return elapsed, profiles, used


COLUMNS = ["spawn", "up", "boot", "hook", "imp"]
COLUMNS += ["node", "choose", "hold", "record", "env", "cuinit"]


def print_breakdown(paths: list[str], profiles: dict[str, list[dict[str, float]]]) -> None:
    """Median (and 10th-90th percentile spread) of each component per path, ms."""
    print("\nper actor, median ms [p10-p90] over all actors of the timed rounds")
    _table(paths, profiles, [*COLUMNS, "cpu"], "")
    print("\nthe same steps in CPU ms of the worker's binding thread (cpu: the whole process)")
    _table(paths, profiles, [*CPU_COLUMNS, "cpu"], "_cpu")


def print_system(paths: list[str], cpu: dict[str, list[dict[str, float]]]) -> None:
    """Median CPU seconds per round, by process kind, per path."""
    kinds = sorted({k for rounds in cpu.values() for r in rounds for k in r if k != "workers"})
    kinds = [k for k in kinds if any(r.get(k, 0) >= 0.05 for v in cpu.values() for r in v)]
    cols = ["workers", *kinds, "total"]
    print("\nCPU seconds per round (median), by process kind")
    print(f"{'path':<21}" + "".join(f"{c[:14]:>15}" for c in cols))
    for path in paths:
        rounds = [{**r, "total": sum(r.values())} for r in cpu[path]]
        cells = [statistics.median(r.get(c, 0.0) for r in rounds) for c in cols]
        print(f"{path:<21}" + "".join(f"{v:>15.2f}" for v in cells))


CPU_COLUMNS = ["imp", "node", "choose", "hold", "record", "env"]


def _table(
    paths: list[str], profiles: dict[str, list[dict[str, float]]], cols: list[str], suffix: str
) -> None:
    print(f"{'path':<21}" + "".join(f"{c:>16}" for c in cols) + f"{'new':>6}")
    for path in paths:
        rows = profiles[path]
        cells = []
        for col in cols:
            key = col + suffix if col != "cpu" else col
            values = sorted(1000 * r[key] for r in rows if key in r)
            if not values:
                cells.append(f"{'-':>16}")
                continue
            lo, hi = values[len(values) // 10], values[(9 * len(values)) // 10]
            cells.append(f"{statistics.median(values):>7.0f} [{lo:.0f}-{hi:.0f}]".rjust(16))
        new = statistics.mean(r["new"] for r in rows)
        print(f"{path:<21}" + "".join(cells) + f"{new:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--actors", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=14, help="simulated 80 GiB GPUs on the node")
    ap.add_argument("--breakdown", action="store_true", help="per-actor start-up components")
    ap.add_argument(
        "--sequential", action="store_true", help="start the actors one after the other"
    )
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
    profiles: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    cpu: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    try:
        total_core = 100.0 * args.gpus
        agents = [n.agent for n in cluster.nodes if n.agent is not None]
        system = _system_processes(cluster) if args.breakdown else {}
        for path in paths:
            run_round(path, args.actors, total_core, agents)  # warm-up, not counted
        for r in range(args.rounds):
            for path in paths:
                t, prof, used = run_round(
                    path, args.actors, total_core, agents, args.breakdown, system, args.sequential
                )
                times[path].append(t)
                profiles[path].extend(prof)
                cpu[path].append(used)
                print(f"round {r + 1} {path:<20} {args.actors} actors in {t:6.2f} s", flush=True)
    finally:
        cluster.shutdown()
        if own_tmp:
            shutil.rmtree(own_tmp, ignore_errors=True)
    base = statistics.median(times["ray num_gpus"])
    print(f"\n{'path':<21}{'median s':>10}{'min-max s':>14}{'per actor ms':>14}{'ratio':>8}")
    for path in paths:
        med = statistics.median(times[path])
        spread = f"{min(times[path]):.2f}-{max(times[path]):.2f}"
        print(
            f"{path:<21}{med:>10.2f}{spread:>14}{1000 * med / args.actors:>14.1f}{med / base:>8.2f}"
        )
    if args.breakdown:
        print_breakdown(paths, profiles)
        print_system(paths, cpu)


if __name__ == "__main__":
    main()
