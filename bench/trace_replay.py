"""Replay a GPU-sharing trace (Alibaba cluster-trace-gpu-v2023 format) through qgpu's engine.

Owns the trace replay benchmark: reading the node and pod CSVs, the published FGD
methodology (inflation to 130% by sampling with replacement, shuffled arrivals, randomised
node order, seeds 42..51, no departures, CPU + memory + GPU count/share + gpu_spec must fit,
scheduling carries on after a failure), the mapping of trace pods to qgpu slice requests,
the reference heuristics (best-fit and random, reimplemented from their published
descriptions, and ``fgd``: qgpu's frag policy run with the paper's own fragmentation measure;
these exist only inside this script), and the report: a markdown table and
a PNG plot of the GPU allocation ratio against the arrived workload.

Placement is done by qgpu itself (`qgpu.placement.Engine` with `qgpu.frag`), not a copy.

Mapping of a trace pod to qgpu:
- ``num_gpu == 1`` and ``gpu_milli < 1000``: a share, qgpu-core = gpu_milli / 10 (rounded
  up to a whole percent if a trace ever has a gpu_milli that is not a multiple of 10, so a
  share is never smaller than asked; both shipped traces only use multiples of 10).
- ``num_gpu >= 1`` otherwise: whole GPUs, qgpu-core = 100 x num_gpu.
- ``num_gpu == 0``: a CPU-only pod, placed with `Engine.place_host` (it takes node CPU and
  memory like in the published simulator, but no GPU).
- ``gpu_spec``: the model constraint (``T4|V100M32``).
- GPU memory (the trace has none): ``--memory-mode fraction`` asks for the same fraction of
  the card, rounded up to whole GiB, of the smallest card the pod may run on (so the slice
  fits every card it is allowed on); ``--memory-mode ignore`` asks for 1 GiB, the smallest
  legal qgpu-memory, so memory never binds. qgpu's own rules still apply in both modes (at
  most floor(card GiB / 4) slices per GPU).

Usage: ``python bench/trace_replay.py [--pods ...] [--policies binpack,spread,frag,...]``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    # the policies multiply small matrices; BLAS threads only contend with --jobs
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a clean clone
    sys.path.insert(0, str(REPO))

from qgpu.errors import NoFit  # noqa: E402
from qgpu.frag import FragPolicy  # noqa: E402
from qgpu.model import GpuDevice, NodeInventory, SliceRequest  # noqa: E402
from qgpu.placement import (  # noqa: E402
    CandidateView,
    ClusterState,
    Engine,
    HostView,
    Policy,
    make_policy,
)

TRACES = REPO / "bench" / "traces"  # shipped with the repository; see its README
DEFAULT_NODES = TRACES / "openb_node_list_gpu_node.csv"
DEFAULT_PODS = TRACES / "openb_pod_list_default.csv"
DEFAULT_SEEDS = tuple(range(42, 52))
DEFAULT_POLICIES = ("binpack", "spread", "frag", "fgd", "bestfit", "random")
INFLATION = 1.3
MILLI_PER_GPU = 1000
CHECKPOINTS = (100, 130)

# GPU memory per model used by the FGD simulator (MiB); the trace itself has no memory column.
GPU_MEMORY_MIB = {
    "T4": 15109,
    "V100M16": 16160,
    "P100": 16280,
    "A10": 22731,
    "V100M32": 32510,
    "G2": 20000,
    "G3": 30000,
}


# -- the trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """One pod of the trace (only the columns placement needs)."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: str

    @property
    def gpu_request_milli(self) -> int:
        """GPU milli the pod asks for (whole GPUs count 1000 each)."""
        if self.num_gpu == 0:
            return 0
        if self.num_gpu == 1 and self.gpu_milli < MILLI_PER_GPU:
            return self.gpu_milli
        return self.num_gpu * MILLI_PER_GPU


def load_nodes(path: str | Path, memory_mib: dict[str, int] | None = None) -> list[NodeInventory]:
    """Node CSV (``sn,cpu_milli,memory_mib,gpu,model``) -> qgpu node inventories."""
    table = memory_mib or GPU_MEMORY_MIB
    nodes = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            model = row["model"].strip()
            count = int(row["gpu"])
            if count and model not in table:
                raise ValueError(f"{path}: GPU model {model!r} has no memory size in the table")
            gpus = [
                GpuDevice(uuid=f"{row['sn']}-gpu{i}", index=i, model=model, memory_mib=table[model])
                for i in range(count)
            ]
            nodes.append(
                NodeInventory(
                    name=row["sn"],
                    gpus=gpus,
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                )
            )
    return nodes


def load_pods(path: str | Path) -> list[Pod]:
    """Pod CSV (``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,...``)."""
    with open(path, newline="") as fh:
        return [
            Pod(
                name=row["name"],
                cpu_milli=int(row["cpu_milli"]),
                memory_mib=int(row["memory_mib"]),
                num_gpu=int(row["num_gpu"]),
                gpu_milli=int(row["gpu_milli"]),
                gpu_spec=(row.get("gpu_spec") or "").strip(),
            )
            for row in csv.DictReader(fh)
        ]


def gpu_core(pod: Pod) -> int:
    """qgpu-core for a pod: gpu_milli / 10 for a share (rounded up), 100 x num_gpu otherwise."""
    if pod.num_gpu == 1 and pod.gpu_milli < MILLI_PER_GPU:
        return min(99, max(1, math.ceil(pod.gpu_milli / 10)))
    return 100 * pod.num_gpu


def to_request(pod: Pod, memory_mode: str, card_gib: dict[str, int]) -> SliceRequest:
    """The qgpu slice request for a GPU pod (see the module docstring for the mapping)."""
    core = gpu_core(pod)
    memory: int | None = None
    if core < 100:
        if memory_mode == "fraction":
            allowed = pod.gpu_spec.split("|") if pod.gpu_spec else list(card_gib)
            sizes = [card_gib[m] for m in allowed if m in card_gib]
            # no allowed model in the cluster: the model filter refuses it anyway
            smallest = min(sizes) if sizes else 1
            memory = max(1, math.ceil(core * smallest / 100))
        else:
            memory = 1
    return SliceRequest(
        core=core,
        memory_gib=memory,
        model=pod.gpu_spec or None,
        cpu_milli=pod.cpu_milli,
        host_memory_mib=pod.memory_mib,
    )


def workload(pods: Sequence[Pod], capacity_milli: int, rng: np.random.Generator) -> list[Pod]:
    """The published inflation: the trace plus pods sampled with replacement until the
    total GPU request would pass 130% of capacity, in shuffled arrival order.

    When the trace alone asks for more than 130% of the cluster (a slice of the nodes, as in
    the tests), the workload is the longest prefix of the shuffled trace that stays within
    130%; for the shipped traces on their own cluster (98% and 79%) this is the whole trace.
    """
    target = INFLATION * capacity_milli
    out: list[Pod] = []
    total = 0
    for i in rng.permutation(len(pods)):
        pod = pods[int(i)]
        if total + pod.gpu_request_milli > target:
            return out
        out.append(pod)
        total += pod.gpu_request_milli
    if any(p.gpu_request_milli for p in pods):
        while True:
            pod = pods[int(rng.integers(len(pods)))]
            if total + pod.gpu_request_milli > target:
                break
            out.append(pod)
            total += pod.gpu_request_milli
    return [out[int(i)] for i in rng.permutation(len(out))]


# -- reference heuristics (bench only) ---------------------------------------------------


class BestFitPolicy(Policy):
    """Best fit as described in the FGD paper's baselines: the node whose remaining CPU and
    GPU (normalised, equal weight) after placement is smallest; on it, the fitting GPU with
    the least free core left."""

    name = "bestfit"

    @staticmethod
    def _remaining(state: ClusterState, ids: np.ndarray, cpu: int, gpu_core: int) -> np.ndarray:
        cpu_left = (state.node_free_cpu[ids] - cpu) / np.maximum(state.node_cap_cpu[ids], 1)
        cap_core = np.maximum(state.node_cap_core[ids], 1)
        gpu_left = (state.node_free_core[ids] - gpu_core) / cap_core
        return cpu_left + gpu_left

    def node_scores(self, view: CandidateView) -> np.ndarray:
        req = view.request
        return -self._remaining(view.state, view.node_ids, req.cpu_milli, req.core)

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        return -(view.state.free_core[gpu_ids] - view.core).astype(np.float64)

    def host_scores(self, view: HostView) -> np.ndarray:
        return -self._remaining(view.state, view.node_ids, view.cpu_milli, 0)


class RandomPolicy(Policy):
    """Random: any node that fits, any fitting GPU on it, uniformly (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def node_scores(self, view: CandidateView) -> np.ndarray:
        return self.rng.random(len(view.node_ids))

    def gpu_scores(self, view: CandidateView, gpu_ids: np.ndarray) -> np.ndarray:
        return self.rng.random(len(gpu_ids))

    def host_scores(self, view: HostView) -> np.ndarray:
        return self.rng.random(len(view.node_ids))


def policy_for(name: str, seed: int) -> Policy:
    """A qgpu policy by name, or a bench-only one: bestfit, random, and fgd (qgpu's frag
    with the paper's fragmentation measure and popularity weights, i.e. FGD as published)."""
    if name == "bestfit":
        return BestFitPolicy()
    if name == "random":
        return RandomPolicy(seed)
    if name == "fgd":
        return FragPolicy(measure="fgd", weight="count")
    return make_policy(name)


# -- one run -----------------------------------------------------------------------------


@dataclass
class RunResult:
    policy: str
    seed: int
    pods: int
    gpu_pods: int
    placed: int
    failed_gpu: int
    failed_cpu_only: int
    capacity_milli: int
    allocated_milli: int
    ratio_at: dict[int, float]
    curve: list[float]  # allocation ratio at arrived 1%, 2%, ..., 130%
    wall_s: float
    state: ClusterState | None = field(default=None, repr=False)

    @property
    def unallocated_gpus(self) -> float:
        return (self.capacity_milli - self.allocated_milli) / MILLI_PER_GPU


def replay(
    nodes: Sequence[NodeInventory],
    pods: Sequence[Pod],
    policy: str,
    seed: int,
    memory_mode: str = "fraction",
    keep_state: bool = False,
    observer: Callable[[int, SliceRequest, bool, ClusterState], None] | None = None,
) -> RunResult:
    """Replay one seed with one policy; returns the allocation ratio at each checkpoint.
    `observer`, if given, is called after every GPU pod's decision with its arrival index,
    its request, whether it was placed, and the state."""
    rng = np.random.default_rng(seed)
    capacity = sum(len(n.gpus) for n in nodes) * MILLI_PER_GPU
    arrivals = workload(pods, capacity, rng)
    order = rng.permutation(len(nodes))
    state = ClusterState([nodes[i] for i in order])
    engine = Engine(state, policy_for(policy, seed))
    card_gib: dict[str, int] = {}
    for node in nodes:
        for gpu in node.gpus:
            card_gib[gpu.model] = min(card_gib.get(gpu.model, gpu.memory_gib), gpu.memory_gib)
    requests: dict[Pod, SliceRequest] = {}
    started = time.perf_counter()
    arrived = allocated = placed = failed_gpu = failed_cpu = gpu_pods = 0
    ratio_at: dict[int, float] = {}
    curve: list[float] = []
    next_mark = 1
    for i, pod in enumerate(arrivals):
        slice_id = f"{pod.name}#{i}"
        demand = pod.gpu_request_milli
        if demand == 0:
            try:
                engine.place_host(slice_id, pod.cpu_milli, pod.memory_mib)
                placed += 1
            except NoFit:
                failed_cpu += 1
        else:
            gpu_pods += 1
            req = requests.get(pod)
            if req is None:
                req = requests[pod] = to_request(pod, memory_mode, card_gib)
            try:
                engine.place(slice_id, req)
            except NoFit:
                failed_gpu += 1
                ok = False
            else:
                placed += 1
                allocated += req.core_per_gpu * req.gpu_count * 10
                ok = True
            if observer is not None:
                observer(i, req, ok, state)
            arrived += demand
        while next_mark <= 130 and arrived * 100 >= next_mark * capacity:
            curve.append(allocated / capacity)
            if next_mark in CHECKPOINTS:
                ratio_at[next_mark] = allocated / capacity
            next_mark += 1
    wall = time.perf_counter() - started
    while next_mark <= 130:  # the workload stopped just short of the last mark
        curve.append(allocated / capacity)
        if next_mark in CHECKPOINTS:
            ratio_at[next_mark] = allocated / capacity
        next_mark += 1
    return RunResult(
        policy=policy,
        seed=seed,
        pods=len(arrivals),
        gpu_pods=gpu_pods,
        placed=placed,
        failed_gpu=failed_gpu,
        failed_cpu_only=failed_cpu,
        capacity_milli=capacity,
        allocated_milli=allocated,
        ratio_at=ratio_at,
        curve=curve,
        wall_s=wall,
        state=state if keep_state else None,
    )


def _run_job(job: tuple[str, str, str, int, str]) -> RunResult:
    nodes_path, pods_path, policy, seed, memory_mode = job
    return replay(load_nodes(nodes_path), load_pods(pods_path), policy, seed, memory_mode)


# -- report ------------------------------------------------------------------------------


def _mean_sd(values: Sequence[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {sd:.2f}"


def markdown_table(results: Sequence[RunResult], title: str) -> str:
    """One row per policy: allocation % at 100% and 130% arrived, unallocated GPUs, time."""
    lines = [
        f"### {title}",
        "",
        "| policy | alloc % @100% | alloc % @130% | unallocated GPUs @130% | failed GPU pods "
        "| wall s / run | seeds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy in dict.fromkeys(r.policy for r in results):
        runs = [r for r in results if r.policy == policy]
        lines.append(
            f"| {policy} | {_mean_sd([100 * r.ratio_at[100] for r in runs])} "
            f"| {_mean_sd([100 * r.ratio_at[130] for r in runs])} "
            f"| {_mean_sd([r.unallocated_gpus for r in runs])} "
            f"| {statistics.fmean(r.failed_gpu for r in runs):.0f} "
            f"| {statistics.fmean(r.wall_s for r in runs):.1f} | {len(runs)} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[RunResult], path: Path, title: str) -> None:
    """Allocation ratio vs arrived workload, mean over seeds, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.arange(1, 131)
    for policy in dict.fromkeys(r.policy for r in results):
        curves = np.asarray([r.curve for r in results if r.policy == policy]) * 100
        ax.plot(x, curves.mean(axis=0), label=policy)
    ax.plot(x, np.minimum(x, 100), color="grey", linestyle=":", label="ideal")
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("GPU allocation ratio (%)")
    ax.set_xlim(60, 130)
    ax.set_ylim(55, 101)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nodes", default=str(DEFAULT_NODES), help="node list CSV")
    p.add_argument("--pods", default=str(DEFAULT_PODS), help="pod list CSV")
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated: qgpu policies (binpack, spread, frag) and fgd, bestfit, random",
    )
    p.add_argument(
        "--seeds",
        default=f"{DEFAULT_SEEDS[0]}..{DEFAULT_SEEDS[-1]}",
        help="seeds: '42..51' or '42,43'",
    )
    p.add_argument(
        "--memory-mode",
        choices=("fraction", "ignore"),
        default="fraction",
        help="GPU memory of a pod (the trace has none): 'fraction' = its compute's fraction "
        "of the smallest card it may run on, rounded up to whole GiB; 'ignore' = 1 GiB, so "
        "memory never binds, as in FGD's simulator",
    )
    p.add_argument("--out", default=str(REPO / "bench" / "out"), help="output directory")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    return p.parse_args(argv)


def parse_seeds(text: str) -> list[int]:
    if ".." in text:
        lo, hi = text.split("..", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        policy_for(name, 0)  # fail fast on an unknown name
    seeds = parse_seeds(args.seeds)
    jobs = [(args.nodes, args.pods, p, s, args.memory_mode) for p in policies for s in seeds]
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(_run_job, jobs))
    else:
        nodes, pods = load_nodes(args.nodes), load_pods(args.pods)
        results = [replay(nodes, pods, p, s, args.memory_mode) for _, _, p, s, _ in jobs]
    trace = Path(args.pods).stem.removeprefix("openb_pod_list_")
    title = f"{trace}, GPU memory {args.memory_mode}, seeds {args.seeds}"
    table = markdown_table(results, title)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"replay-{trace}-{args.memory_mode}"
    (out / f"{stem}.md").write_text(table)
    print(table)
    wrote = f"{out / stem}.md"
    try:
        plot(results, out / f"{stem}.png", title)
        wrote += "/.png"
    except ModuleNotFoundError as exc:  # matplotlib comes with `make test` (the dev extra)
        print(f"no plot: {exc.name} is not installed (make test installs it)", file=sys.stderr)
    print(f"total wall {time.perf_counter() - started:.1f} s; wrote {wrote}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.exit(main())
