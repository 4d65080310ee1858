"""`make demo`: fractional GPUs on a local Ray cluster, placed and enforced end to end.

1. Starts a local Ray cluster of two qgpu nodes, each with its own node agent: this
   machine's GPUs when NVML is available, else simulated GPUs (2 x H100-80GB per node).
2. Places a mix of inference actors with ``binpack``, then with ``spread`` (the SDK,
   ``qgpu_ray.options``) next to one unchanged Ray actor that asks for ``num_gpus=0.25``
   (capped at 25 % and 20 GiB of the GPU Ray gave it: fixed-share from the job's
   ``runtime_env``, as a Ray user sets it), plus one actor through plain
   ``resources=``. Every actor starts
   CUDA through the interposer, loads its "weights" into GPU memory and runs inference
   kernels for a few seconds.
3. Prints where each actor landed and the per-slice memory and core use reported by the
   node agents while the work runs.
4. Shows an over-cap allocation refused by the interposer, then shuts everything down.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import ray
from rich.console import Console
from rich.table import Table

import qgpu_ray

console = Console(width=None if sys.stdout.isatty() else 120)
GIB = 1 << 30


@dataclass(frozen=True)
class Model:
    name: str
    core: int
    memory: int
    isolation: str
    num_gpus: float | None = None  # unchanged Ray code: .options(num_gpus=...) only


MIX = [
    Model("embedder-a", 20, 8, "fixed-share"),
    Model("embedder-b", 20, 8, "fixed-share"),
    Model("llm-a", 40, 24, "burst-share"),
    Model("llm-b", 40, 24, "fixed-share"),
    Model("reranker", 10, 4, "best-effort"),
    # floor(0.25 x 80 GiB) = 20 GiB, round(0.25 x 100) = 25 %; isolation from the job's
    # runtime_env (QGPU_ISOLATION), the actor's code and options otherwise unchanged
    Model("ray-app num_gpus=0.25", 25, 20, "fixed-share", num_gpus=0.25),
]


@ray.remote
class InferenceActor:
    """Loads weights into its slice's GPU memory and runs batches of kernels."""

    def __init__(self, weights_fraction: float = 0.6) -> None:
        from enforcement import simcuda

        self.driver = simcuda.Driver()
        self.driver.init()  # first CUDA call: the interposer applies the slice's caps here
        self.driver.context(0)
        _free, total = self.driver.mem_get_info()
        self.total = total
        self.weights = self.driver.mem_alloc(int(total * weights_fraction))
        self.simulated = bool(os.environ.get("QGPU_SIM_CONFIG"))
        self.stream = self.driver.stream()

    def where(self) -> dict[str, str]:
        return {
            "device": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "slice": os.environ.get("QGPU_SLICE_ID", ""),
        }

    def serve(self, seconds: float) -> int:
        """Run 2 ms inference kernels back to back for `seconds`; returns batches done."""
        if not self.simulated:
            time.sleep(seconds)  # real GPUs: the demo only shows memory caps
            return 0
        batches = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(5):
                self.driver.launch_busy(2_000_000, self.stream)
            self.driver.stream_synchronize(self.stream)
            batches += 5
        return batches

    def try_allocate(self, nbytes: int) -> dict[str, object]:
        from enforcement import simcuda

        code, alloc = self.driver.try_mem_alloc(nbytes)
        if alloc is not None:
            self.driver.mem_free(alloc)
        free, total = self.driver.mem_get_info()
        return {
            "code": code,
            "name": simcuda.ERROR_NAMES.get(code, str(code)),
            "free": free,
            "total": total,
        }


def slice_usage(cluster: qgpu_ray.LocalCluster) -> dict[str, object]:
    out = {}
    for node in cluster.nodes:
        for s in node.agent.client.slices().slices:
            out[s.slice_id] = s
    return out


def start_mix(policy: str) -> list[tuple[Model, object]]:
    actors = []
    for m in MIX:
        if m.num_gpus is not None:
            env = {"env_vars": {"QGPU_ISOLATION": m.isolation}}
            actor = InferenceActor.options(num_gpus=m.num_gpus, runtime_env=env).remote()
            actors.append((m, actor))
            continue
        opts = qgpu_ray.options(
            core=m.core,
            memory=m.memory,
            isolation=m.isolation,
            policy=policy,
            num_cpus=0,
            name=f"{policy}-{m.name}",
        )
        actors.append((m, InferenceActor.options(**opts).remote()))
    return actors


def gpu_labels(cluster: qgpu_ray.LocalCluster) -> dict[str, str]:
    """GPU UUID -> the one name the demo uses for it: ``<node> #<index>``."""
    return {g.uuid: f"{n.name} #{g.index}" for n in cluster.nodes for g in n.inventory.gpus}


def compute_cap(m: Model) -> str:
    """What holds the slice's compute back (memory is always capped)."""
    if m.isolation == "fixed-share":
        return f"{m.core} %"
    if m.isolation == "burst-share":
        return f"{m.core} % if busy"
    return "none"


def show(cluster: qgpu_ray.LocalCluster, title: str, actors: list) -> None:
    wheres = ray.get([a.where.remote() for _, a in actors], timeout=120)
    work = [a.serve.remote(4.5) for _, a in actors]
    time.sleep(1.0)
    slice_usage(cluster)  # the agents measure core use between two samples
    time.sleep(2.5)
    usage = slice_usage(cluster)
    ray.get(work, timeout=120)
    gpu_label = gpu_labels(cluster)
    table = Table(title=title)
    for col in (
        "actor",
        "node / GPU",
        "slice",
        "isolation",
        "qgpu-core",
        "compute cap",
        "core used",
        "memory cap",
        "memory used",
    ):
        table.add_column(col)
    notes: list[str] = []
    for (m, _), where in zip(actors, wheres, strict=True):
        s = usage.get(where["slice"])
        used = (
            "-"
            if s is None or s.usage.memory_used_bytes is None
            else (f"{s.usage.memory_used_bytes / GIB:.1f} GiB")
        )
        if m.isolation == "best-effort":
            core = "not measured"  # the interposer times the kernels of capped slices only
        elif s is None or s.usage.core_used_percent is None:
            core = "-"
        else:
            measured = s.usage.core_used_percent
            core = f"{measured:.0f} %"
            if m.isolation == "burst-share" and measured > m.core + 5:
                notes.append(
                    f"{m.name} (burst-share) used {measured:.0f} % of its GPU, more than its "
                    f"{m.core} %: no other slice on that GPU was busy, so it borrowed the idle "
                    "compute; it is held to its share again as soon as a neighbour works."
                )
            elif measured < m.core - 5:
                notes.append(
                    f"{m.name} used {measured:.0f} % of its {m.core} %: a cap is a ceiling, not "
                    "a guarantee; its GPU was saturated (the best-effort neighbour takes all "
                    "that is left), so its kernels waited in the GPU's queue."
                )
        table.add_row(
            m.name,
            gpu_label.get(where["device"], where["device"]),
            where["slice"],
            m.isolation,
            f"{m.core} %",
            compute_cap(m),
            core,
            f"{m.memory} GiB",
            used,
        )
    console.print(table)
    per_gpu: dict[str, int] = {}
    for (m, _), where in zip(actors, wheres, strict=True):
        per_gpu[where["device"]] = per_gpu.get(where["device"], 0) + m.core
    console.print(
        "GPUs used: "
        + ", ".join(
            f"{gpu_label.get(u, u)} ({c} % committed)"
            for u, c in sorted(per_gpu.items(), key=lambda kv: gpu_label.get(kv[0], kv[0]))
        )
    )
    for note in notes:
        console.print(f"[dim]- {note}[/]")


LEGEND = """\
How to read the tables:
- node / GPU: the Ray node and the index of the GPU on it (qgpu-node-0 #1 is GPU 1 of node 0).
- slice: the slice's id; r-... slices were placed by qgpu_ray.options (qgpu chose the GPU
  before Ray scheduled the actor), p-... slices by plain resources={"qgpu-core": ...} (the
  actor's worker chose its GPU when Ray started it, before the actor's code ran), n-... slices
  by unchanged num_gpus=... (the GPU Ray gave the worker, bound when Ray started it).
- qgpu-core: the share of the GPU the actor asked for; placement never commits more than
  100 % of a GPU. compute cap: what the interposer holds the actor to, by isolation:
    fixed-share  never more than its qgpu-core;
    burst-share  its qgpu-core while another slice on its GPU is busy, idle compute otherwise;
    best-effort  no compute cap: qgpu-core only reserves room; its kernels are not timed, so
                 its use is not measured here.
- core used: measured device time per second of the slice's kernels, percent of the GPU,
  while every actor runs 2 ms kernels back to back for 4 s.
- memory cap: a hard limit for every isolation (the actor sees a card of that size);
  memory used: the actor's "weights", 60 % of its cap.
"""


def main() -> int:
    own_tmp = None
    if "RAY_TMPDIR" not in os.environ:  # Ray's session files: private, removed at the end
        own_tmp = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="qgpu-demo-ray-", dir="/tmp")
    from enforcement.agent.local import REAL_GPUS, default_gpus

    real = default_gpus() == REAL_GPUS
    specs = ["real"] if real else ["2xH100-80GB", "2xH100-80GB"]
    what = (
        "this machine's GPUs"
        if real
        else "simulated GPUs (2 nodes x 2 H100-80GB; no NVIDIA driver found)"
    )
    t0 = time.monotonic()
    with console.status(f"Starting a local Ray cluster on {what}..."):
        cluster = qgpu_ray.LocalCluster(
            specs,
            cpus_per_node=2,
            ray_init_kwargs={"logging_level": "ERROR", "log_to_driver": False},
        )
    console.print(
        f"[green]cluster up[/] in {time.monotonic() - t0:.1f} s: "
        + ", ".join(
            f"{n.name} ({len(n.inventory.gpus)} GPUs, agent {n.agent.socket})"
            for n in cluster.nodes
        )
    )
    try:
        for policy in ("binpack", "spread"):
            with console.status(f"Placing {len(MIX)} inference actors with {policy}..."):
                actors = start_mix(policy)
                ray.get([a.where.remote() for _, a in actors], timeout=180)
            with console.status("Running inference through the interposer (4 s)..."):
                show(
                    cluster,
                    f"{policy}: placements and per-slice use (from the node agents)",
                    actors,
                )
            if policy == "binpack":
                console.print(LEGEND, highlight=False, markup=False)
            for _, a in actors:
                ray.kill(a)
            time.sleep(1.0)
            qgpu_ray.view.PENDING.clear()

        console.rule("plain resources= and an over-cap allocation")
        with console.status(
            "Starting an actor with resources={'qgpu-core': 30, 'qgpu-memory': 8}..."
        ):
            plain = InferenceActor.options(
                num_cpus=0, resources={"qgpu-core": 30, "qgpu-memory": 8}
            ).remote()
            where = ray.get(plain.where.remote(), timeout=180)
        label = gpu_labels(cluster).get(where["device"], where["device"])
        console.print(
            f"bound when Ray started it to {label} ({where['device']}) as slice "
            f"{where['slice']}"
        )
        result = ray.get(plain.try_allocate.remote(12 * GIB), timeout=60)
        console.print(
            f"cuMemGetInfo inside the slice: total {result['total'] / GIB:.0f} GiB, "
            f"free {result['free'] / GIB:.1f} GiB"
        )
        console.print(
            f"cuMemAlloc(12 GiB) in an 8 GiB slice -> [bold red]{result['name']}[/] "
            "(refused by the interposer; the process lives on)"
        )
        ok = result["code"] == 2
    finally:
        with console.status("Shutting down..."):
            cluster.shutdown()
            if own_tmp:
                shutil.rmtree(own_tmp, ignore_errors=True)
    console.print(f"[green]done[/] in {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
