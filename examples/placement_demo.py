"""The placement demo: place the example requests with binpack and then spread, offline.

This is the placement demo of the foundation: it runs the core engine over
examples/nodes.yaml and examples/requests.yaml and prints where every slice lands, the
per-GPU use, what did not fit and why, and how an invalid request is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from qgpu.cli import main as qgpu_main
from qgpu.cli import render_plan
from qgpu.plan import load_nodes, load_requests, plan

HERE = Path(__file__).resolve().parent


def run() -> int:
    console = Console()
    nodes = load_nodes(HERE / "nodes.yaml")
    requests = load_requests(HERE / "requests.yaml")
    gpus = sum(len(n.gpus) for n in nodes)
    console.print(
        f"[bold]qgpu placement demo[/]: {len(nodes)} nodes, {gpus} GPUs, "
        f"{sum(r.count for r in requests)} slice requests"
    )
    for policy in ("binpack", "spread"):
        console.print(Rule(f"policy: {policy}"))
        render_plan(plan(nodes, requests, policy), console, title=policy)
    console.print(Rule("an invalid request is refused with the field, the value and the rule"))
    console.print("$ qgpu validate --core 150 --memory 8")
    code = qgpu_main(["validate", "--core", "150", "--memory", "8"])
    console.print(f"exit code {code}")
    return 0 if code == 2 else 1


if __name__ == "__main__":
    sys.exit(run())
