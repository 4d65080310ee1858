"""``qgpu agent`` (run the node agent) and ``qgpu status`` (devices and slices as tables).

Quick start without a GPU::

    qgpu agent --sim 2xH100-80GB --state-dir /tmp/qgpu --test-mode &
    qgpu status --state-dir /tmp/qgpu --wait 30

Both are registered as ``qgpu.commands`` entry points (see pyproject.toml).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import stat
import sys
import time
from pathlib import Path

from pydantic import ValidationError
from rich.table import Table

from enforcement.agent.client import AgentClient, AgentUnavailable, default_socket
from enforcement.agent.config import DEFAULT_STATE_DIR, SOCKET_ENV, AgentConfig
from enforcement.agent.models import Health
from enforcement.discovery import node_slice_policy
from qgpu.cli_common import (
    DEFAULT_PLACEMENT_HELP,
    ISOLATION_HELP,
    add_isolation_option,
    add_placement_options,
    choice,
    flag_violation,
    stdout_console,
)
from qgpu.errors import QgpuError, RuleViolation, first_violation
from qgpu.mix_prior import add_prior_option, use_prior

EXIT_OK = 0
EXIT_FAILURE = 1


def read_token_file(path: str) -> str:
    """The bearer token; the file must not be readable by group or others."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        token = p.read_text().strip()
    except OSError as exc:
        raise RuleViolation("--token-file", path, f"cannot be read: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuleViolation(
            "--token-file", path, "must not be accessible by group or others (chmod 600)"
        )
    if len(token) < 16:
        raise RuleViolation("--token-file", path, "must hold a token of at least 16 characters")
    return token


def _socket_for(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    if os.environ.get(SOCKET_ENV):
        return Path(os.environ[SOCKET_ENV])
    if args.state_dir:
        return Path(args.state_dir) / "agent.sock"
    return default_socket()


# AgentConfig's fields -> the flags that set them (errors name what the user typed)
CONFIG_FLAGS = {
    "state_dir": "--state-dir",
    "socket_path": "--socket",
    "socket": "--socket",
    "tcp_host": "--tcp-host",
    "tcp_port": "--tcp-port",
    "token": "--token-file",
    "backend": "--backend",
    "sim_spec": "--sim",
    "node_name": "--node-name",
    "max_slices_per_gpu": "--max-slices-per-gpu",
    "default_isolation": "--isolation",
    "placement": "--placement",
    "gpu_placement": "--gpu-placement",
    "reconcile_interval_s": "--reconcile-interval",
    "watchdog_interval_s": "--watchdog-interval",
    "watchdog_core_margin": "--watchdog-core-margin",
    "watchdog_unowned": "--watchdog-unowned",
    "slice_cgroups": "--slice-cgroups",
    "enforcement": "--enforcement",
    "mps_control": "--mps-control",
    "hook_path": "--hook-path",
    "real_libcuda": "--real-libcuda",
}


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    use_prior(args.mix_prior)
    raw: dict[str, object] = {
        "state_dir": args.state_dir or DEFAULT_STATE_DIR,
        "socket_path": _socket_for(args),
        "tcp_host": args.tcp_host,
        "tcp_port": args.tcp_port,
        "backend": args.backend or ("sim" if args.sim else os.environ.get("QGPU_BACKEND", "auto")),
        "sim_spec": args.sim,
        "max_slices_per_gpu": args.max_slices_per_gpu,
        "metrics_host": args.metrics_host,
        "metrics_port": args.metrics_port,
        "default_isolation": args.isolation,
        "reconcile_interval_s": args.reconcile_interval,
        "watchdog_interval_s": args.watchdog_interval,
        "watchdog_kill": args.watchdog_kill,
        "watchdog_grace_s": args.watchdog_grace,
        "watchdog_core_margin": args.watchdog_core_margin,
        "watchdog_unowned": args.watchdog_unowned,
        "slice_cgroups": args.slice_cgroups,
        "enforcement": args.enforcement,
        "mps_control": args.mps_control,
        "test_mode": args.test_mode,
        "workload_gid": args.workload_gid,
        "max_body_bytes": args.max_body_bytes,
        "head_timeout_s": args.head_timeout,
        "body_timeout_s": args.body_timeout,
    }
    for key, value in (
        ("node_name", args.node_name),
        ("placement", args.placement),
        ("gpu_placement", args.gpu_placement),
        ("hook_path", args.hook_path),
        ("real_libcuda", args.real_libcuda),
    ):
        if value is not None:
            raw[key] = value
    if args.slices_per_gpu is not None or args.slices_per_gpu_file is not None:
        raw["slices_per_gpu"] = node_slice_policy(
            args.slices_per_gpu, args.slices_per_gpu_file, args.max_slices_per_gpu
        )
    if args.token_file:
        raw["token"] = read_token_file(args.token_file)
    elif args.tcp_port is not None:
        raise RuleViolation("--token-file", None, "is required with --tcp-port")
    try:
        return AgentConfig.model_validate(raw)
    except ValidationError as exc:
        raise flag_violation(first_violation(exc), CONFIG_FLAGS) from exc


_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when `parent` (this process's parent) dies.

    Done here, in the agent, not in a preexec_fn of whoever starts it: a forked child of a
    threaded process (gRPC's threads in a Ray driver) may crash before it reaches exec."""
    if parent <= 0:
        raise RuleViolation("--exit-with-parent", parent, "must be a process id (> 0)")
    if not sys.platform.startswith("linux"):
        raise RuleViolation("--exit-with-parent", parent, "needs Linux (prctl PDEATHSIG)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise QgpuError(f"--exit-with-parent: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # it died (or never was the parent) before prctl took effect
        raise RuleViolation(
            "--exit-with-parent", parent, "must be this agent's parent, and still running"
        )


def cmd_agent(args: argparse.Namespace) -> int:
    from enforcement.agent.server import serve

    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config = config_from_args(args)
    try:
        return serve(config)
    except RuleViolation as exc:  # named as the flag the operator typed (--state-dir)
        raise flag_violation(exc, CONFIG_FLAGS) from None
    except PermissionError as exc:
        raise QgpuError(
            f"{exc.filename or exc}: permission denied; run the agent as root or point "
            "--state-dir and --socket at directories you own"
        ) from exc


AGENT_DESCRIPTION = """\
Run the node agent: it discovers this node's GPUs (NVML, or simulated ones with --sim),
places each slice with the core placement engine, records it in a SQLite ledger, writes
the slice's limits for the interposer, releases slices whose owner died, watches for
processes over their memory cap and serves all of it over a unix socket (JSON over HTTP,
metrics at /metrics). Ray, Dask and Kubernetes talk to it.

Without a GPU:

    qgpu agent --sim 2xH100-80GB --state-dir /tmp/qgpu --test-mode &
    qgpu status --state-dir /tmp/qgpu --wait 30
"""


def register_agent(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run the node agent (GPU discovery, slices, metrics)",
        description=AGENT_DESCRIPTION,
    )
    p.add_argument(
        "--sim",
        metavar="SPEC",
        help="simulated GPUs, e.g. 2xH100-80GB or H100-80GB,A10-24GB (implies --backend sim) "
        "(default: $QGPU_SIM_SPEC)",
    )
    p.add_argument(
        "--backend",
        type=choice(["auto", "nvml", "sim"], "--backend"),
        metavar="auto|nvml|sim",
        help="where GPUs come from: nvml, sim, or auto (the simulator when --sim or "
        "$QGPU_SIM_SPEC is given, else NVML if it loads, else an error) "
        "(default: auto, or $QGPU_BACKEND)",
    )
    p.add_argument(
        "--state-dir",
        help=f"ledger, limits files, interposer state (default: {DEFAULT_STATE_DIR})",
    )
    p.add_argument(
        "--socket",
        help="unix socket (default: $QGPU_AGENT_SOCKET, else <state-dir>/agent.sock when "
        "--state-dir is given, else /run/qgpu/agent.sock)",
    )
    p.add_argument(
        "--tcp-port", type=int, help="also listen on loopback TCP (needs --token-file)"
    )
    p.add_argument("--tcp-host", default="127.0.0.1", help="loopback address for --tcp-port")
    p.add_argument("--token-file", help="bearer token for TCP clients (file mode 600)")
    p.add_argument("--node-name", help="node name (default: the hostname)")
    add_isolation_option(
        p, default="best-effort", help="the node's default isolation: " + ISOLATION_HELP
    )
    add_placement_options(
        p,
        help="GPU choice of the core engine for slices that name none: frag, binpack or "
        "spread " + DEFAULT_PLACEMENT_HELP,
    )
    add_prior_option(p)
    p.add_argument(
        "--max-slices-per-gpu",
        type=int,
        default=16,
        help="cap of the floor-gib rule (see --slices-per-gpu)",
    )
    p.add_argument(
        "--slices-per-gpu",
        help="slices one GPU may hold: floor-gib (floor(GiB/4), at most 16; the default) "
        "or a fixed count 1..16",
    )
    p.add_argument(
        "--slices-per-gpu-file",
        help="a file whose text, when the file exists, overrides --slices-per-gpu (the chart "
        "writes the node label's value there)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="also serve GET /metrics, and nothing else, on this TCP port (for Prometheus; "
        "read-only, no token)",
    )
    p.add_argument(
        "--metrics-host", default="0.0.0.0", help="address for --metrics-port (default all)"
    )
    p.add_argument(
        "--reconcile-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often slices whose owner died are released",
    )
    p.add_argument(
        "--watchdog-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often GPU processes are checked against their slice's memory cap",
    )
    p.add_argument(
        "--watchdog-kill",
        nargs="?",
        const="all",
        default="all",
        choices=("off", "share", "all"),
        help="what the watchdog kills: all (the default and the bare flag: every share "
        "slice over its memory cap, memory being a hard cap whatever the isolation, and any "
        "slice over its compute allowance beside busy neighbours), share (only fixed- and "
        "burst-share slices over their memory cap; best-effort ones are reported) or off "
        "(report only)",
    )
    p.add_argument(
        "--watchdog-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long a slice may stay over its cap before the watchdog kills",
    )
    p.add_argument(
        "--watchdog-core-margin",
        type=int,
        default=15,
        metavar="POINTS",
        help="percentage points a slice's measured SM use (NVML) may exceed its compute "
        "allowance before it counts as over (a bypass of the compute gate, or one very long "
        "kernel); 1..100",
    )
    p.add_argument(
        "--watchdog-unowned",
        type=choice(["kill", "report"], "--watchdog-unowned"),
        default="kill",
        metavar="kill|report",
        help="GPU processes that belong to no slice, on a GPU holding a slice --watchdog-kill "
        "covers: kill them after the grace (the default) or only report them "
        "(NVIDIA's MPS server is never either)",
    )
    p.add_argument(
        "--slice-cgroups",
        type=choice(["auto", "on", "off"], "--slice-cgroups"),
        default="auto",
        metavar="auto|on|off",
        help="make a cgroup per slice owned by a process (Ray, Dask, local) and move the "
        "owner into it, so that its processes are attributed by what they cannot change: "
        "auto (when the agent is root, not --test-mode, and cgroup v2 is writable), on "
        "(refuse to start without), off (attribute by descent from the owner)",
    )
    p.add_argument(
        "--enforcement",
        type=choice(["interposer", "mps"], "--enforcement"),
        default="interposer",
        metavar="interposer|mps",
        help="how share slices are capped: the CUDA interposer or NVIDIA MPS (caps set by "
        "the interposer in the clients' environment: a process around the interposer sets its "
        "own, see docs/agent.md)",
    )
    p.add_argument(
        "--mps-control", default="nvidia-cuda-mps-control", help="the MPS control program"
    )
    p.add_argument("--hook-path", help="the interposer library (default: the installed one)")
    p.add_argument(
        "--real-libcuda", help="the CUDA driver the interposer forwards to (QGPU_REAL_LIBCUDA)"
    )
    p.add_argument(
        "--test-mode",
        action="store_true",
        help="limits files need not be root-owned (tests, laptops)",
    )
    p.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="stop (SIGTERM) when the process PID, which must be the agent's parent, exits "
        "(private agents of the Ray and Dask SDKs)",
    )
    p.add_argument(
        "--workload-gid",
        type=int,
        default=0,
        help="group that may read the GPUs' shared state, slices/.gpu-<uuid>/ (default 0: "
        "root only)",
    )
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024, help="request body limit")
    p.add_argument(
        "--head-timeout", type=float, default=10.0, metavar="SECONDS", help="request head deadline"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, metavar="SECONDS", help="request body deadline"
    )
    p.add_argument(
        "--log-level",
        type=choice(["debug", "info", "warning", "error"], "--log-level"),
        default="info",
        metavar="debug|info|warning|error",
        help="the agent's log level (stderr)",
    )
    p.set_defaults(func=cmd_agent)


def _client(args: argparse.Namespace) -> AgentClient:
    if args.url:
        token = read_token_file(args.token_file) if args.token_file else None
        return AgentClient(url=args.url, token=token)
    return AgentClient(_socket_for(args))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.1f}"


def _health(client: AgentClient, wait: float) -> Health:
    """The agent's health, retrying for up to `wait` seconds while it cannot be reached
    (an agent started a moment ago creates its socket once its imports are done)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return client.health()
        except AgentUnavailable as exc:
            if time.monotonic() >= deadline:
                if wait > 0:
                    raise AgentUnavailable(f"{exc} (waited {wait:g} s)") from exc
                raise
            time.sleep(0.2)


def cmd_status(args: argparse.Namespace) -> int:
    if args.wait < 0:
        raise RuleViolation("--wait", args.wait, "must be 0 or more seconds")
    with _client(args) as client:
        health = _health(client, args.wait)
        devices = client.devices()
        slices = client.slices()
    if args.json:
        print(
            json.dumps(
                {
                    "health": health.model_dump(mode="json"),
                    "devices": devices.model_dump(mode="json"),
                    "slices": slices.model_dump(mode="json"),
                },
                indent=2,
            )
        )
        return EXIT_OK
    console = stdout_console()
    colour = "green" if health.status == "ok" else "yellow"
    console.print(
        f"node [bold]{health.node}[/] · backend {health.backend} · enforcement "
        f"{health.enforcement} · [{colour}]{health.status}[/] · {health.slices} slices"
    )
    for problem in health.problems:
        console.print(f"  [yellow]![/] {problem}")
    dev = Table(title="Devices")
    for col in (
        "#",
        "UUID",
        "model",
        "health",
        "core committed",
        "memory committed",
        "memory used GiB",
        "util %",
        "slices",
    ):
        dev.add_column(col)
    for d in devices.devices:
        dev.add_row(
            str(d.index),
            d.uuid,
            d.model,
            d.health.value if d.health_reason is None else f"{d.health.value}: {d.health_reason}",
            f"{d.core_committed}/100",
            f"{d.memory_committed_gib}/{d.memory_mib // 1024} GiB",
            _gib(d.memory_used_bytes),
            "-" if d.utilization_percent is None else str(d.utilization_percent),
            f"{d.slices}/{d.max_slices}",
        )
    console.print(dev)
    sl = Table(title="Slices")
    for col in (
        "slice",
        "GPU",
        "core",
        "memory GiB",
        "used GiB",
        "core used %",
        "isolation",
        "owner",
        "pids",
    ):
        sl.add_column(col)
    index = {d.uuid: d.index for d in devices.devices}
    for s in slices.slices:
        u = s.usage
        sl.add_row(
            s.slice_id,
            ",".join(f"#{index.get(x, '?')}" for x in s.device_uuids),
            str(s.core),
            str(s.memory_gib),
            _gib(u.memory_used_bytes),
            "-" if u.core_used_percent is None else f"{u.core_used_percent:.0f}",
            s.isolation.value,
            f"{s.owner.kind.value}:{s.owner.id}",
            ",".join(str(p) for p in u.pids) or "-",
        )
    console.print(sl)
    return EXIT_OK


def register_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="devices and slices of the local agent",
        description="Show the node agent's GPUs and slices as tables (or JSON). With --wait, "
        "wait for an agent that is still starting: scripts start the agent in the "
        "background and then run 'qgpu status --wait 30'.",
    )
    p.add_argument(
        "--socket", help=f"agent socket (default: ${SOCKET_ENV}, else /run/qgpu/agent.sock)"
    )
    p.add_argument("--state-dir", help="use <state-dir>/agent.sock (as 'qgpu agent' does)")
    p.add_argument(
        "--url", help="loopback TCP URL instead of the socket, e.g. http://127.0.0.1:7070"
    )
    p.add_argument("--token-file", help="bearer token for --url (file mode 600)")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the agent to answer (0: fail at once if it does not)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_status)


__all__ = ["cmd_agent", "cmd_status", "config_from_args", "register_agent", "register_status"]
