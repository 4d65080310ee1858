"""The ``qgpu`` command line: ``validate`` and ``plan`` here, more from adapters.

Adapters add subcommands (``run``, ``agent``, ``status``...) through the entry-point group
``qgpu.commands``: each entry point is a callable ``register(subparsers)`` that adds a
subparser and sets ``func=handler`` with ``handler(args) -> int``. The core therefore never
imports an adapter. Exit codes: 0 success, 2 invalid input (the message names the field,
the value and the rule), 1 any other failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from qgpu.errors import QgpuError, RuleViolation, first_violation
from qgpu.mix_prior import add_prior_option, use_prior
from qgpu.model import GpuDevice, IsolationPolicy, PlacementPolicy, SliceRequest
from qgpu.plan import PlanResult, load_nodes, load_requests, plan
from qgpu.units import MIB_PER_GIB, parse_memory_gib

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2

COMMAND_GROUP = "qgpu.commands"


def _err(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {message}")


def request_from_args(args: argparse.Namespace) -> SliceRequest:
    """Build a SliceRequest from --core/--memory/... options (shared by subcommands)."""
    raw: dict[str, object] = {"core": args.core}
    if getattr(args, "memory", None) is not None:
        raw["memory"] = args.memory
    for key in ("isolation", "placement", "model"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    return SliceRequest.parse(raw, "the qgpu CLI")


def add_request_options(parser: argparse.ArgumentParser, memory_required: bool = False) -> None:
    """The --core/--memory/--isolation/--placement/--model options, for every subcommand."""
    parser.add_argument("--core", required=True, help="qgpu-core: 1..99 or 100, 200, ...")
    parser.add_argument(
        "--memory", required=memory_required, help="qgpu-memory: GiB, e.g. 8, 8Gi, 8192Mi"
    )
    iso = ", ".join(f"{p.value}/{p.abbreviation}" for p in IsolationPolicy)
    parser.add_argument("--isolation", "--policy", dest="isolation", help=f"one of {iso}")
    parser.add_argument("--placement", help="one of " + ", ".join(p.value for p in PlacementPolicy))
    parser.add_argument("--model", help="allowed GPU models, e.g. 'T4|V100M32'")


def cmd_validate(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    if args.card_memory is not None:
        card_gib = parse_memory_gib(args.card_memory, "--card-memory")
        card = GpuDevice(
            uuid="from-card-memory",
            index=0,
            model=args.card_model or "card",
            memory_mib=card_gib * MIB_PER_GIB,
        )
        req.check_against(card)
    print(json.dumps(req.model_dump(mode="json", exclude_defaults=True), sort_keys=True))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    use_prior(args.mix_prior)
    nodes = load_nodes(args.nodes)
    requests = load_requests(args.requests)
    result = plan(nodes, requests, args.policy, args.gpu_policy)
    if args.json:
        print(json.dumps(plan_to_json(result), indent=2))
    else:
        render_plan(result, Console(), title=f"policy {args.policy or 'default'}")
    return EXIT_OK if not result.unplaced else args.unplaced_exit


def plan_to_json(result: PlanResult) -> dict[str, object]:
    return {
        "placed": [
            {
                "name": n,
                "node": d.node,
                "gpus": list(d.gpu_uuids),
                "core": d.core_per_gpu,
                "memory_gib": list(d.memory_gib_per_gpu),
            }
            for n, _, d in result.placed
        ],
        "unplaced": [{"name": n, "reason": why} for n, _, why in result.unplaced],
    }


def render_plan(result: PlanResult, console: Console, title: str = "") -> None:
    """Rich tables: placements, per-GPU use, and what did not fit with the reason."""
    state = result.state
    assert state is not None
    placed = Table(title=f"Placements ({title})" if title else "Placements")
    for col in ("slice", "node", "GPU", "core %", "memory GiB"):
        placed.add_column(col)
    for name, _req, d in result.placed:
        gpus = ", ".join(_gpu_label(state.gpus[state.uuid_index[u]]) for u in d.gpu_uuids)
        placed.add_row(
            name, d.node, gpus, str(d.core_per_gpu), "/".join(str(m) for m in d.memory_gib_per_gpu)
        )
    console.print(placed)

    usage = Table(title="Per-GPU use")
    for col in ("node", "GPU", "model", "core used", "memory used", "slices"):
        usage.add_column(col)
    for i, gpu in enumerate(state.gpus):
        node = state.nodes[int(state.gpu_node[i])].name
        core_used = int(state.cap_core[i] - state.free_core[i])
        mem_used = int(state.cap_mem[i] - state.free_mem[i])
        usage.add_row(
            node,
            _gpu_label(gpu),
            gpu.model,
            f"{core_used}/100",
            f"{mem_used}/{int(state.cap_mem[i])} GiB",
            f"{int(state.slices[i])}/{int(state.max_slices[i])}",
        )
    console.print(usage)

    if result.unplaced:
        missed = Table(title="Did not fit")
        for col in ("slice", "request", "why"):
            missed.add_column(col)
        for name, req, why in result.unplaced:
            missed.add_row(name, f"core={req.core} memory={req.memory_gib}", why)
        console.print(missed)
    else:
        console.print("[green]every request fits[/]")


def _gpu_label(gpu: GpuDevice) -> str:
    short = gpu.uuid if len(gpu.uuid) <= 14 else "…" + gpu.uuid[-8:]
    return f"#{gpu.index} {short}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qgpu", description="Fractional GPU slices: validate, plan, run, serve."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = sub.add_parser("validate", help="check one slice request (exit 0 or 2)")
    add_request_options(validate)
    validate.add_argument("--card-memory", help="check against a card of this many GiB")
    validate.add_argument("--card-model", help="name of that card (for the message)")
    validate.set_defaults(func=cmd_validate)

    plan_p = sub.add_parser("plan", help="place requests on nodes offline and show the result")
    plan_p.add_argument("--nodes", required=True, help="YAML/JSON list of node inventories")
    plan_p.add_argument("--requests", required=True, help="YAML/JSON list of requests")
    names = [p.value for p in PlacementPolicy]
    plan_p.add_argument("--policy", choices=names, help="node-level (and GPU-level) policy")
    plan_p.add_argument("--gpu-policy", choices=names, help="GPU-level policy, if different")
    add_prior_option(plan_p)
    plan_p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan_p.add_argument(
        "--unplaced-exit",
        type=int,
        default=EXIT_OK,
        help="exit code when some requests do not fit (default 0)",
    )
    plan_p.set_defaults(func=cmd_plan)

    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # an adapter whose extra is not installed
            missing = exc.name or str(exc)
            stub = sub.add_parser(ep.name, help=f"(unavailable: needs {missing})")
            stub.set_defaults(func=_unavailable(ep.name, missing))
            continue
        register(sub)
    return parser


def _unavailable(name: str, missing: str):
    def handler(_args: argparse.Namespace) -> int:
        _err(f"'qgpu {name}' needs the module {missing!r}; install qgpu with its extra")
        return EXIT_FAILURE

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except RuleViolation as exc:
        _err(str(exc))
        return EXIT_INVALID
    except ValidationError as exc:
        _err(str(first_violation(exc)))
        return EXIT_INVALID
    except QgpuError as exc:
        _err(str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_request_options", "main", "render_plan", "request_from_args"]
