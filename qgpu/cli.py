"""The ``qgpu`` command line: ``validate`` and ``plan`` here, more from adapters.

Adapters add subcommands (``run``, ``agent``, ``status``...) through the entry-point group
``qgpu.commands``: each entry point is a callable ``register(subparsers)`` that adds a
subparser and sets ``func=handler`` with ``handler(args) -> int``. The core therefore never
imports an adapter. Exit codes: 0 success, 2 invalid input (one line naming the flag or
field, the value and the rule), 1 any other failure. The conventions every command line
shares (help, ``--version``, the case rule, flag names) live in `qgpu.cli_common`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qgpu.cli_common import (
    DEFAULT_PLACEMENT_HELP,
    REQUEST_FLAGS,
    Parser,
    add_isolation_option,
    add_placement_options,
    add_version,
    describe,
    exit_code_of,
    flag_violation,
    request_from_args,
    stdout_console,
)
from qgpu.errors import QgpuError, RuleViolation, first_violation
from qgpu.mix_prior import add_prior_option, use_prior
from qgpu.model import GpuDevice
from qgpu.plan import PlanResult, load_nodes, load_requests, plan
from qgpu.units import parse_memory_gib

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2

COMMAND_GROUP = "qgpu.commands"


def _err(message: str) -> None:
    # the message is plain text: a field such as nodes[0] must not be read as rich markup
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        Text.assemble(("error:", "bold red"), " ", message)
    )


def add_request_options(parser: argparse.ArgumentParser, memory_required: bool = False) -> None:
    """The --core/--memory/--isolation/--placement/--gpu-placement/--model options."""
    parser.add_argument(
        "--core",
        required=True,
        help="qgpu-core: 1..99 = percent of one GPU, 100, 200, ... = whole GPUs",
    )
    parser.add_argument(
        "--memory",
        required=memory_required,
        help="qgpu-memory: whole GiB of that GPU, e.g. 8, 8Gi, 8192Mi; required for a share",
    )
    add_isolation_option(
        parser, old=["--policy"], help="compute isolation (default: the node's, best-effort)"
    )
    add_placement_options(parser)
    parser.add_argument("--model", help="allowed GPU models, e.g. 'T4|V100M32'")


def cmd_validate(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    if args.card_memory is not None:
        card_gib = parse_memory_gib(args.card_memory, "--card-memory")
        card = f"{args.card_model}: " if args.card_model else ""
        try:
            req.check_card_memory(card_gib, f"{card}{card_gib} GiB, --card-memory")
        except RuleViolation as exc:
            raise flag_violation(exc, REQUEST_FLAGS) from exc
    print(json.dumps(req.model_dump(mode="json", exclude_defaults=True), sort_keys=True))
    return EXIT_OK


def _from_file(load: Callable[[str], Any], path: str, flag: str) -> Any:
    """Read an input file; its errors name the flag, the file and the field in it."""
    try:
        return load(path)
    except RuleViolation as exc:
        if exc.field == str(Path(path)):  # the file itself: missing, unreadable, not YAML
            raise RuleViolation(flag, path, exc.rule) from exc
        raise RuleViolation(f"{flag} {path}: {exc.field}", exc.value, exc.rule) from exc


def cmd_plan(args: argparse.Namespace) -> int:
    use_prior(args.mix_prior)
    nodes = _from_file(load_nodes, args.nodes, "--nodes")
    requests = _from_file(load_requests, args.requests, "--requests")
    result = plan(nodes, requests, args.placement, args.gpu_placement)
    if args.json:
        print(json.dumps(plan_to_json(result), indent=2))
    else:
        title = f"placement {args.placement or 'frag (the default)'}"
        if args.gpu_placement:
            title += f", GPU placement {args.gpu_placement}"
        render_plan(result, stdout_console(), title=title)
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
            missed.add_row(name, _request_label(req), why)
        console.print(missed)
    else:
        console.print("[green]every request fits[/]")


def _request_label(req: Any) -> str:
    """A request as its resource names: ``qgpu-core=30 qgpu-memory=8``."""
    return " ".join(f"{k}={v}" for k, v in req.to_resources().items())


def _gpu_label(gpu: GpuDevice) -> str:
    short = gpu.uuid if len(gpu.uuid) <= 14 else "…" + gpu.uuid[-8:]
    return f"#{gpu.index} {short}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qgpu",
        description="Slices of one physical GPU (qgpu-core: percent of its compute, "
        "qgpu-memory: GiB of its memory): check and plan them offline, run commands inside "
        "them, and run the node agent and the Kubernetes pieces.",
        epilog="Enumerated values (--isolation, --placement, --backend, ...) are accepted in "
        "any case; 'qgpu COMMAND --help' describes a command.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = sub.add_parser(
        "validate",
        help="check one slice request (exit 0 or 2)",
        description="Check one slice request: print it normalised (exit 0), or name the "
        "flag, the value and the rule it breaks (exit 2).",
    )
    add_request_options(validate)
    validate.add_argument("--card-memory", help="also check against a card of this many GiB")
    validate.add_argument("--card-model", help="name of that card (for the message)")
    validate.set_defaults(func=cmd_validate)

    plan_p = sub.add_parser(
        "plan",
        help="place requests on nodes offline and show the result",
        description="Place the requests of a file on the nodes of another, offline, with the "
        "placement engine every qgpu component uses: where each slice lands, per-GPU use, "
        "and what did not fit and why.",
    )
    plan_p.add_argument("--nodes", required=True, help="YAML/JSON list of node inventories")
    plan_p.add_argument("--requests", required=True, help="YAML/JSON list of requests")
    add_placement_options(
        plan_p,
        help="node-level (and GPU-level) placement: frag, binpack or spread "
        + DEFAULT_PLACEMENT_HELP,
        old=["--policy"],
        old_gpu=["--gpu-policy"],
    )
    add_prior_option(plan_p)
    plan_p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan_p.add_argument(
        "--unplaced-exit",
        type=int,
        default=EXIT_OK,
        metavar="CODE",
        help="exit code when some requests do not fit",
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
    return exit_code_of(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except RuleViolation as exc:
        _err(describe(exc))
        return EXIT_INVALID
    except ValidationError as exc:
        _err(describe(first_violation(exc)))
        return EXIT_INVALID
    except QgpuError as exc:
        _err(str(exc))
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_request_options", "main", "render_plan", "request_from_args"]
