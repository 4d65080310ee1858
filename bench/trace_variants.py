"""Variants of the Alibaba GPU-sharing traces, to check that a placement policy generalises.

Owns making other members of the trace family from the shipped files (`bench/traces/`), so
that a policy tuned on the default and gpushare60 traces can be replayed on cases it was not
tuned on (docs/placement.md, "Hold-out"):

- ``share<P>``: 8,152 pods drawn with replacement from the pods of both shipped traces, with
  P% of the GPU pods partial-GPU (the family's gpushare20..100 are made the same way: the
  same pod population, another share fraction); CPU-only pods keep the default trace's
  proportion;
- ``boot<K>``: a bootstrap resample of the default trace (K is the resampling seed);
- ``shift<D>``: the default trace with every share moved D qgpu-core (a 47% share becomes
  47 + D), clipped to 5..95, so the share sizes the gap values were seen pricing change;
- ``multi<P>``: the default trace with P% of its whole-GPU pods asking for 2, 4 or 8 GPUs
  (in the proportions of the trace's own multi-GPU pods);
- node lists: ``no-<MODEL>`` (the cluster without one GPU model's nodes) and ``half``
  (every other node).

Usage: ``python bench/trace_variants.py --out DIR share20 boot1 shift-5 no-G2 ...``; each
pod variant is written as ``openb_pod_list_<name>.csv`` and each node variant as
``openb_node_list_<name>.csv``, in the shipped files' columns, for ``trace_replay.py``.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parent / "traces"
POD_FILES = ("openb_pod_list_default.csv", "openb_pod_list_gpushare60.csv")
NODE_FILE = "openb_node_list_gpu_node.csv"
SEED = 2026  # variants are fixed files: the same name always gives the same rows
Row = dict[str, str]


def read(path: Path) -> list[Row]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write(path: Path, rows: Sequence[Row]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _kind(row: Row) -> str:
    gpus, milli = int(row["num_gpu"]), int(row["gpu_milli"])
    if gpus == 0:
        return "cpu"
    return "share" if gpus == 1 and milli < 1000 else "whole"


def _renamed(rows: Sequence[Row]) -> list[Row]:
    return [{**r, "name": f"variant-pod-{i:05d}"} for i, r in enumerate(rows)]


def share_mix(pool: Sequence[Row], default: Sequence[Row], percent: int) -> list[Row]:
    """As many pods as the default trace, drawn from `pool`, `percent`% of GPU pods shares."""
    rng = np.random.default_rng(SEED + percent)
    by_kind = {k: [r for r in pool if _kind(r) == k] for k in ("cpu", "share", "whole")}
    n_cpu = sum(_kind(r) == "cpu" for r in default)
    n_gpu = len(default) - n_cpu
    n_share = round(n_gpu * percent / 100)
    counts = {"cpu": n_cpu, "share": n_share, "whole": n_gpu - n_share}
    rows = [
        by_kind[k][int(i)]
        for k, n in counts.items()
        if n
        for i in rng.integers(len(by_kind[k]), size=n)
    ]
    return _renamed(rows)


def bootstrap(default: Sequence[Row], seed: int) -> list[Row]:
    rng = np.random.default_rng(SEED * 1000 + seed)
    return _renamed([default[int(i)] for i in rng.integers(len(default), size=len(default))])


def shift(default: Sequence[Row], delta: int) -> list[Row]:
    out = []
    for r in default:
        if _kind(r) == "share":
            core = min(95, max(5, int(r["gpu_milli"]) // 10 + delta))
            r = {**r, "gpu_milli": str(core * 10)}
        out.append(r)
    return _renamed(out)


def multi(default: Sequence[Row], percent: int) -> list[Row]:
    rng = np.random.default_rng(SEED + 7 * percent)
    counts = [int(r["num_gpu"]) for r in default if _kind(r) == "whole" and int(r["num_gpu"]) > 1]
    out = []
    for r in default:
        if _kind(r) == "whole" and rng.random() < percent / 100:
            r = {**r, "num_gpu": str(counts[int(rng.integers(len(counts)))])}
        out.append(r)
    return _renamed(out)


def pods_variant(name: str, traces: Path) -> list[Row] | None:
    """The pod rows of a variant name, or None when the name is not a pod variant."""
    default = read(traces / POD_FILES[0])
    makers: dict[str, Callable[[int], list[Row]]] = {
        "share": lambda n: share_mix(default + read(traces / POD_FILES[1]), default, n),
        "boot": lambda n: bootstrap(default, n),
        "shift": lambda n: shift(default, n),
        "multi": lambda n: multi(default, n),
    }
    m = re.fullmatch(r"(share|boot|shift|multi)(-?\d+)", name)
    if m is None:
        return None
    value = int(m.group(2))
    if m.group(1) in ("share", "multi") and not 0 <= value <= 100:
        raise SystemExit(f"variant {name}: the percentage must be 0..100, got {value}")
    return makers[m.group(1)](value)


def nodes_variant(name: str, traces: Path) -> list[Row] | None:
    """The node rows of a variant name, or None when the name is not a node variant."""
    nodes = read(traces / NODE_FILE)
    if name == "half":
        return nodes[::2]
    if name.startswith("no-"):
        model = name.removeprefix("no-")
        kept = [r for r in nodes if r["model"] != model]
        if len(kept) == len(nodes):
            known = sorted({r["model"] for r in nodes})
            raise SystemExit(f"variant {name}: no node has model {model!r} (models: {known})")
        return kept
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("names", nargs="+", help="shareP, bootK, shiftD, multiP, no-MODEL, half")
    p.add_argument("--traces", default=str(TRACES), help="folder of the shipped CSVs")
    p.add_argument("--out", required=True, help="folder to write the variants to")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = Path(args.traces)
    for name in args.names:
        pods = pods_variant(name, traces)
        if pods is not None:
            write(out / f"openb_pod_list_{name}.csv", pods)
            continue
        nodes = nodes_variant(name, traces)
        if nodes is None:
            raise SystemExit(f"variant {name!r}: not shareP, bootK, shiftD, multiP, no-MODEL, half")
        write(out / f"openb_node_list_{name}.csv", nodes)
    print(f"wrote {len(args.names)} variant(s) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
