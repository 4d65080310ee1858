"""How much of a trace replay's unallocated GPU capacity any placement could still win.

Owns the packing-headroom check of the trace replay (docs/placement.md, "Issue 22: how
much is left"): it replays the trace with a policy (`trace_replay.replay`, the published
FGD methodology) and, per seed, compares the end state with what the same pods could have
given if they had been placed with hindsight:

- **re-packing**: the shares the replay placed (single-GPU pods of less than a whole GPU)
  sit on some number of GPUs; an integer program finds the fewest GPUs that could hold
  exactly those shares (core adds up to at most 100 per GPU, at most as many shares per
  GPU as the cluster's most generous slice limit; host CPU and memory, GPU memory and
  model constraints left out, so it is a lower bound on the GPUs needed). The difference
  is the most that placing the same shares differently could free for other pods;
- **multi-GPU pods that failed while empty GPUs were left**: the GPUs they asked for went
  to the arrival stream instead, which leaves the run's average unfilled part of a GPU
  empty; saving them all would win about that much (an estimate, not a bound);
- the arrival at which the last empty GPU was taken: after it, whole-GPU pods (and shares
  too large for every gap) fail whatever the policy does with the shares.

Usage: ``python bench/packing_bound.py [--pods ...] [--seeds 42..51] [--policy frag]``;
prints a markdown table, one row per seed, and the mean; CPU seconds per replay
(`time.process_time`) are in the table too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_replay as tr

from qgpu.model import WHOLE_GPU_CORE, NodeInventory, SliceRequest
from qgpu.placement import ClusterState


@dataclass
class Headroom:
    seed: int
    allocation: float  # % at 130% arrived
    cpu_s: float  # CPU seconds of the replay
    unallocated: float  # GPUs' worth of core
    share_gpus: int  # GPUs holding shares only
    fewest_share_gpus: int  # the fewest that could hold the same shares
    last_empty_at: int  # arrival index at which no empty GPU was left (-1: never)
    early_multi: int  # multi-GPU pods failed while empty GPUs were left
    early_multi_gpus: int  # the GPUs they asked for
    gpus: int

    @property
    def repack_gpus(self) -> int:
        return self.share_gpus - self.fewest_share_gpus

    @property
    def multi_estimate(self) -> float:
        """GPUs' worth of core that saving the early-failed multi-GPU pods would win."""
        return self.early_multi_gpus * self.unallocated / self.gpus

    @property
    def headroom_points(self) -> float:
        return 100 * (self.repack_gpus + self.multi_estimate) / self.gpus


def placed_shares(state: ClusterState) -> tuple[Counter[int], int]:
    """The shares held in `state` (core -> count) and how many GPUs hold only shares."""
    shares: Counter[int] = Counter()
    share_gpus: set[int] = set()
    for held in state.held.values():
        if len(held.gpus) == 1 and held.core < WHOLE_GPU_CORE:
            shares[held.core] += 1
            share_gpus.add(int(held.gpus[0]))
    return shares, len(share_gpus)


def patterns(sizes: Sequence[int], slots: int) -> list[tuple[int, ...]]:
    """Every multiset of `sizes` (non-empty, at most `slots` of them) that fits one GPU."""
    out: list[tuple[int, ...]] = []

    def grow(start: int, chosen: tuple[int, ...], room: int) -> None:
        for i in range(start, len(sizes)):
            if sizes[i] > room:
                break
            pattern = (*chosen, sizes[i])
            out.append(pattern)
            if len(pattern) < slots:
                grow(i, pattern, room - sizes[i])

    grow(0, (), WHOLE_GPU_CORE)
    return out


def fewest_gpus(shares: Counter[int], slots: int) -> int:
    """The fewest GPUs that hold exactly `shares` (an integer program over the patterns)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    if not shares:
        return 0
    sizes = sorted(shares)
    cols = patterns(sizes, slots)
    index = {c: i for i, c in enumerate(sizes)}
    a = np.zeros((len(sizes), len(cols)))
    for j, pattern in enumerate(cols):
        for core in pattern:
            a[index[core], j] += 1
    need = np.array([shares[c] for c in sizes], dtype=float)
    res = milp(
        np.ones(len(cols)),
        constraints=LinearConstraint(a, need, need),
        integrality=np.ones(len(cols)),
        bounds=Bounds(0, np.inf),
        options={"time_limit": 120},
    )
    if res.status != 0 or res.x is None:
        raise RuntimeError(f"the packing program did not solve: {res.message}")
    return round(res.fun)


def headroom(
    nodes: Sequence[NodeInventory],
    pods: Sequence[tr.Pod],
    policy: str,
    seed: int,
    memory_mode: str,
) -> Headroom:
    """Replay one seed and measure what re-packing and the early multi-GPU failures leave."""
    last_empty_at = -1
    early: list[int] = []

    def watch(i: int, req: SliceRequest, placed: bool, state: ClusterState) -> None:
        nonlocal last_empty_at
        if last_empty_at >= 0:
            return
        if not placed and req.gpu_count > 1:
            early.append(req.gpu_count)
        if not (state.slices == 0).any():
            last_empty_at = i

    started = time.process_time()
    run = tr.replay(nodes, pods, policy, seed, memory_mode, keep_state=True, observer=watch)
    cpu = time.process_time() - started
    assert run.state is not None
    shares, share_gpus = placed_shares(run.state)
    slots = int(run.state.max_slices.max())
    return Headroom(
        seed=seed,
        allocation=100 * run.ratio_at[130],
        cpu_s=cpu,
        unallocated=run.unallocated_gpus,
        share_gpus=share_gpus,
        fewest_share_gpus=fewest_gpus(shares, slots),
        last_empty_at=last_empty_at,
        early_multi=len(early),
        early_multi_gpus=sum(early),
        gpus=run.state.gpu_total,
    )


def table(rows: Sequence[Headroom], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| seed | alloc % @130% | CPU s | unallocated GPUs | share GPUs | fewest for the same "
        "shares | multi-GPU pods failed early (GPUs) | last empty GPU at arrival "
        "| headroom (points) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.seed} | {r.allocation:.2f} | {r.cpu_s:.1f} | {r.unallocated:.1f} "
            f"| {r.share_gpus} | {r.fewest_share_gpus} (-{r.repack_gpus}) "
            f"| {r.early_multi} ({r.early_multi_gpus}) | {r.last_empty_at} "
            f"| {r.headroom_points:.3f} |"
        )
    alloc = [r.allocation for r in rows]
    spread = statistics.stdev(alloc) if len(alloc) > 1 else 0.0
    lines.append(
        f"| mean | {statistics.fmean(alloc):.2f} ± {spread:.2f} "
        f"| {statistics.fmean(r.cpu_s for r in rows):.1f} (max {max(r.cpu_s for r in rows):.1f}) "
        f"| {statistics.fmean(r.unallocated for r in rows):.1f} | | "
        f"-{statistics.fmean(r.repack_gpus for r in rows):.1f} "
        f"| {statistics.fmean(r.early_multi for r in rows):.1f} | "
        f"| {statistics.fmean(r.headroom_points for r in rows):.3f} |"
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--nodes", default=str(tr.DEFAULT_NODES), help="node list CSV")
    p.add_argument("--pods", default=str(tr.DEFAULT_PODS), help="pod list CSV")
    p.add_argument("--policy", default="frag", help="a policy trace_replay.py knows")
    p.add_argument("--seeds", default="42..51", help="'42..51' or '42,43'")
    p.add_argument("--memory-mode", choices=("fraction", "ignore"), default="ignore")
    args = p.parse_args(argv)
    tr.policy_for(args.policy, 0)  # fail fast on an unknown name
    nodes, pods = tr.load_nodes(args.nodes), tr.load_pods(args.pods)
    rows = [
        headroom(nodes, pods, args.policy, seed, args.memory_mode)
        for seed in tr.parse_seeds(args.seeds)
    ]
    trace = Path(args.pods).stem.removeprefix("openb_pod_list_")
    print(table(rows, f"{trace}, {args.policy}, GPU memory {args.memory_mode}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
