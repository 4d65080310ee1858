"""``qgpu-ray``: start Ray on a qgpu node, run the plain-path reaper, show what is advertised.

    qgpu-ray start [--agent-socket PATH] [--placement binpack] [--fraction-memory fraction|N]
                   [--fraction-core fraction|N] [RAY START ARGS...]
    qgpu-ray resources [--agent-socket PATH]
    qgpu-ray reaper --address HOST:PORT [--interval 1]

``start`` checks that the installed Ray still has the hooks qgpu relies on
(`qgpu_ray.compat`), asks the node agent for the node's inventory and workload environment,
then runs ``ray start`` with the GPUs as Ray's ``GPU``, the totals, the per-GPU resources and
labels, and an environment that preloads the interposer in every worker and installs the
worker hook (`qgpu_ray.hook`); ``--fraction-memory``/``--fraction-core`` say what
``num_gpus=f`` means on the node (`qgpu_ray.fraction`). After Ray is up it starts a
detached reaper for the node's slices bound in workers. Exit codes: 0 ok, 2 invalid
input, 1 any other failure (the agent unreachable, ``ray start`` failing...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from qgpu.cli_common import Parser, add_placement_options, add_version, describe, exit_code_of
from qgpu.errors import QgpuError, RuleViolation
from qgpu_ray import compat
from qgpu_ray.fraction import FractionRule
from qgpu_ray.provider import ray_start_arguments, worker_environment
from qgpu_ray.resources import gpu_order, node_labels, node_resources


def _node(args: argparse.Namespace):
    from enforcement.agent.client import AgentClient

    return AgentClient(args.agent_socket).node()


def cmd_resources(args: argparse.Namespace) -> int:
    node = _node(args)
    out = {
        "node": node.inventory.name,
        "num_gpus": len(gpu_order(node.inventory)),
        "resources": node_resources(node.inventory),
        "labels": node_labels(node.inventory),
    }
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _address_from(ray_args: list[str]) -> str | None:
    for i, arg in enumerate(ray_args):
        if arg.startswith("--address="):
            return arg.split("=", 1)[1]
        if arg == "--address" and i + 1 < len(ray_args):
            return ray_args[i + 1]
    return None


def cmd_start(args: argparse.Namespace) -> int:
    beside = Path(sys.executable).parent / "ray"  # the same environment as this command
    ray_bin = str(beside) if beside.exists() else shutil.which("ray")
    if ray_bin is None:
        raise QgpuError("the `ray` command is not installed (pip install 'qgpu[ray]')")
    ray_args = list(args.ray_args)
    if ray_args and ray_args[0] == "--":
        ray_args = ray_args[1:]
    for arg in ray_args:
        if arg.split("=", 1)[0] in ("--num-gpus", "--resources", "--labels"):
            raise RuleViolation(
                arg.split("=", 1)[0],
                arg,
                "is set by qgpu-ray start from the node's GPUs (drop it)",
            )
    compat.check()
    rule = FractionRule.parse(args.fraction_core, args.fraction_memory)
    node = _node(args)
    env = dict(os.environ)
    env.update(node.workload_env)
    env.update(
        worker_environment(
            node.workload_env.get("QGPU_STATE_DIR", args.state_dir),
            inventory=node.inventory,
            fraction=rule,
            policy=args.placement,
        )
    )
    env["QGPU_AGENT_SOCKET"] = str(args.agent_socket or "")
    command = [ray_bin, "start", *ray_args, *ray_start_arguments(node.inventory)]
    print("+ " + " ".join(command), flush=True)
    code = subprocess.call(command, env=env)
    if code != 0 or args.no_reaper:
        return code
    address = _address_from(ray_args) or "auto"
    reaper = [sys.executable, "-m", "qgpu_ray.cli", "reaper", "--address", address, "--local-node"]
    subprocess.Popen(
        reaper,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return 0


def cmd_reaper(args: argparse.Namespace) -> int:
    import ray

    from qgpu_ray.reaper import local_raylet, raylet_alive, reap_once

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    node = ray.get_runtime_context().get_node_id()
    local = {node} if args.local_node else None
    raylet = local_raylet(node) if args.local_node else None
    try:
        while True:
            if raylet is not None and not raylet_alive(raylet):
                print(f"qgpu-ray reaper: node {node}'s raylet has exited; stopping", flush=True)
                os._exit(0)  # Ray's exit handlers would wait for the raylet that is gone
            reap_once(local)
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qgpu-ray",
        description="Start Ray on a qgpu node (its GPUs advertised as qgpu-core / qgpu-memory "
        "resources, the interposer preloaded in every worker), show what a node advertises, "
        "and run the reaper of plain resources= slices.",
    )
    add_version(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def agent_opt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--agent-socket",
            default=None,
            help="the node agent's unix socket (default: $QGPU_AGENT_SOCKET or "
            "/run/qgpu/agent.sock)",
        )

    start = sub.add_parser(
        "start",
        help="run `ray start` advertising this node's GPUs",
        description="Run 'ray start' with this node's GPUs (from its qgpu agent) as "
        "resources and labels, and the workers' environment; options qgpu-ray does not "
        "know are passed to 'ray start'.",
    )
    agent_opt(start)
    add_placement_options(
        start,
        default="binpack",
        help="GPU choice of the plain resources= path on this node: binpack, spread or frag",
        gpu=False,
        old=["--policy"],
    )
    start.add_argument(
        "--state-dir",
        default="/var/lib/qgpu/slices",
        help="interposer state dir when the agent does not name one",
    )
    start.add_argument(
        "--fraction-memory",
        default="fraction",
        help="num_gpus=f gets floor(f x card GiB) ('fraction', the default) or N GiB per 0.1",
    )
    start.add_argument(
        "--fraction-core",
        default="fraction",
        help="num_gpus=f gets round(f x 100) %% ('fraction', the default) or N %% per 0.1",
    )
    start.add_argument("--no-reaper", action="store_true", help="do not start the reaper")
    start.add_argument(
        "ray_args",
        nargs=argparse.REMAINDER,
        help="arguments for ray start (any option qgpu-ray does not know)",
    )
    start.set_defaults(func=cmd_start)

    res = sub.add_parser("resources", help="print the resources and labels start would use")
    agent_opt(res)
    res.set_defaults(func=cmd_resources)

    reaper = sub.add_parser("reaper", help="release worker-bound slices of dead workers/nodes")
    reaper.add_argument("--address", required=True, help="the Ray cluster, e.g. HEAD:6379")
    reaper.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="time between passes"
    )
    reaper.add_argument(
        "--local-node",
        action="store_true",
        help="check worker pids of this node only (one reaper per node)",
    )
    reaper.add_argument("--once", action="store_true", help="one pass, then exit")
    reaper.set_defaults(func=cmd_reaper)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return exit_code_of(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command != "start":
            parser.error("unrecognized arguments: " + " ".join(unknown))
        args.ray_args = [*unknown, *args.ray_args]
    try:
        return int(args.func(args))
    except RuleViolation as exc:
        print(f"qgpu-ray: error: {describe(exc)}", file=sys.stderr)
        return 2
    except QgpuError as exc:
        print(f"qgpu-ray: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
