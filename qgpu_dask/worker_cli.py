"""``qgpu-dask-worker``: one Dask worker inside one GPU slice, joining any scheduler.

    qgpu-dask-worker tcp://scheduler:8786 --core 30 --memory 8 [--isolation fs]
                     [--placement binpack] [--agent-socket /run/qgpu/agent.sock]

Reserves the slice from this node's qgpu agent (owner: a ``dask-worker`` whose ``meta.pid``
is this process; with ``--name`` under a slice id derived from the node, the scheduler and
the name, so a worker restarted under its name gets back the slice it held, see
`qgpu_dask.agent.worker_slice_id`), runs a `SliceNanny` whose worker process starts inside
the slice and advertises ``qgpu-core`` / ``qgpu-memory``, installs `NoFitPlugin` on the
scheduler (once, idempotently), and releases the slice when it stops: on SIGTERM/SIGINT or
when the nanny ends. After a SIGKILL nothing runs here; the worker process exits with its
nanny and the agent's reconcile releases the slice because its owner process is gone — or a
restart under the same ``--name`` takes it over first.

Exit codes: 0 after a clean stop; 2 for an invalid request or option (the message names the
field, the value and the rule, from the core model or the agent); 1 when the agent cannot be
reached, the slice does not fit, or the worker failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from enforcement.agent.client import AgentClient, AgentError, AgentUnavailable, default_socket
from enforcement.agent.models import Reservation
from qgpu.cli_common import (
    ISOLATION_HELP,
    REQUEST_FLAGS,
    Parser,
    add_isolation_option,
    add_placement_options,
    add_version,
    describe,
    exit_code_of,
    flag_violation,
    request_from_args,
)
from qgpu.errors import QgpuError, RuleViolation, first_violation
from qgpu.model import SliceRequest
from qgpu_dask.agent import worker_owner, worker_slice_id
from qgpu_dask.nanny import SliceNanny, check_spawn_method
from qgpu_dask.nofit import PLUGIN_NAME, NoFitPlugin
from qgpu_dask.resources import slice_resources

log = logging.getLogger("qgpu.dask.worker")


class WorkerOptions(BaseModel):
    """The command line, checked once it crosses into the program."""

    model_config = ConfigDict(extra="forbid")

    scheduler: str = Field(min_length=1)
    agent_socket: str | None = None
    name: str | None = Field(default=None, min_length=1, max_length=200)
    nthreads: int = Field(default=1, ge=1)
    host: str | None = None
    no_fit_grace: float = Field(default=30.0, ge=0)
    death_timeout: float = Field(default=60.0, gt=0)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="qgpu-dask-worker",
        description="Run one Dask worker inside a GPU slice reserved from this node's qgpu "
        "agent; the slice is released when the worker stops.",
    )
    add_version(p)
    p.add_argument("scheduler", help="scheduler address, e.g. tcp://10.0.0.1:8786")
    p.add_argument(
        "--core", required=True, help="qgpu-core: 1..99 = percent of one GPU, or 100, 200, ..."
    )
    p.add_argument("--memory", help="qgpu-memory: GiB (8, 8Gi, 8192Mi); required for a share")
    add_isolation_option(p, help=ISOLATION_HELP + " (default: the agent's)")
    add_placement_options(
        p,
        help="where the slice lands on this node's GPUs: binpack, spread or frag "
        "(default: the agent's)",
    )
    p.add_argument("--model", help="allowed GPU models, e.g. 'H100|A100'")
    p.add_argument(
        "--agent-socket",
        help="the agent's socket (default: $QGPU_AGENT_SOCKET, else /run/qgpu/agent.sock)",
    )
    p.add_argument("--name", help="worker name (default: qgpu-<host>-<pid>)")
    p.add_argument("--nthreads", type=int, default=1, help="worker threads")
    p.add_argument("--host", help="address the worker and nanny listen on (default: Dask's)")
    p.add_argument(
        "--no-fit-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="time before the scheduler fails a task no slice worker can run",
    )
    p.add_argument(
        "--death-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="time allowed to reach the scheduler",
    )
    return p


def _request(args: argparse.Namespace) -> SliceRequest:
    return request_from_args(args)


def _options(args: argparse.Namespace) -> WorkerOptions:
    try:
        return WorkerOptions(
            scheduler=args.scheduler,
            agent_socket=args.agent_socket,
            name=args.name,
            nthreads=args.nthreads,
            host=args.host,
            no_fit_grace=args.no_fit_grace,
            death_timeout=args.death_timeout,
        )
    except ValidationError as exc:
        v = first_violation(exc)
        flag = "" if v.field == "scheduler" else "--" + v.field.replace("_", "-")
        raise v.renamed(flag or "SCHEDULER_ADDRESS") from exc


async def _install_no_fit(nanny: SliceNanny, grace: float) -> None:
    from distributed.protocol import pickle

    try:
        await nanny.scheduler.register_scheduler_plugin(
            plugin=pickle.dumps(NoFitPlugin(grace=grace)), name=PLUGIN_NAME, idempotent=True
        )
    except Exception as exc:  # the scheduler may lack qgpu_dask; the worker still serves
        log.warning("could not install the qgpu no-fit plugin on the scheduler: %s", exc)


async def serve(options: WorkerOptions, reservation: Reservation, name: str) -> int:
    """Run the nanny until a signal or its end; 0 on a signal-initiated stop."""
    nanny = SliceNanny(
        options.scheduler,
        name=name,
        nthreads=options.nthreads,
        host=options.host,
        resources=slice_resources(reservation),
        slice_env=reservation.env,
        death_timeout=options.death_timeout,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await nanny
        except Exception as exc:
            cause = exc.__cause__ or exc
            raise QgpuError(
                f"the Dask worker could not start against {options.scheduler}: "
                f"{type(cause).__name__}: {cause}"
            ) from exc
        await _install_no_fit(nanny, options.no_fit_grace)
        print(
            f"qgpu-dask-worker: {name} serving {options.scheduler} in slice {reservation.slice_id}",
            file=sys.stderr,
            flush=True,
        )
        finished = asyncio.ensure_future(nanny.finished())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({finished, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for fut in (finished, stopped):
            fut.cancel()
        by_signal = stop.is_set()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await nanny.close(timeout=20, reason="qgpu-dask-worker-stop")
    return 0 if by_signal else 1


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = _options(args)
    request = _request(args)
    check_spawn_method()
    name = options.name or f"qgpu-{socket.gethostname()}-{os.getpid()}"
    slice_id = worker_slice_id(options.scheduler, name) if options.name else None
    with AgentClient(options.agent_socket or default_socket(), timeout=30.0) as agent:
        reservation = _reserve(agent, request, name, slice_id)
        print(
            f"qgpu-dask-worker: slice {reservation.slice_id} on {reservation.device_uuid} "
            f"(qgpu-core={reservation.core}, qgpu-memory={reservation.memory_gib})",
            file=sys.stderr,
            flush=True,
        )
        try:
            return asyncio.run(serve(options, reservation, name))
        finally:
            _release(agent, reservation.slice_id)


def _reserve(
    agent: AgentClient, request: SliceRequest, name: str, slice_id: str | None
) -> Reservation:
    """The worker's slice: a new one, or (a restart under the same name) the one its
    previous process held — released and placed again if the request changed since."""
    try:
        reservation = agent.reserve(request, owner=worker_owner(name), slice_id=slice_id)
        if slice_id is not None and not _same_size(reservation, request):
            print(
                f"qgpu-dask-worker: slice {slice_id} of {name} was reserved with "
                f"qgpu-core={reservation.core}, qgpu-memory={reservation.memory_gib}; "
                "releasing it to reserve the new request",
                file=sys.stderr,
                flush=True,
            )
            agent.release(slice_id)
            reservation = agent.reserve(request, owner=worker_owner(name), slice_id=slice_id)
    except AgentError as exc:
        if exc.is_no_fit:
            raise QgpuError(f"the slice does not fit on this node's GPUs: {exc}") from exc
        if exc.status == 422 and exc.field == "slice_id":
            rule = f"another worker of this name still holds its slice: {exc.rule}"
            raise RuleViolation("--name", name, rule) from exc
        if exc.status == 422:
            raise flag_violation(exc.as_violation(), REQUEST_FLAGS) from exc
        raise
    return reservation


def _same_size(reservation: Reservation, request: SliceRequest) -> bool:
    return (
        reservation.core == request.core_per_gpu
        and len(reservation.device_uuids) == request.gpu_count
        and (request.memory_gib is None or reservation.memory_gib == request.memory_gib)
    )


def _release(agent: AgentClient, slice_id: str, attempts: int = 3) -> None:
    """Release the slice; if the agent is away, its reconcile releases it after we exit."""
    for attempt in range(attempts):
        try:
            result = agent.release(slice_id)
        except AgentUnavailable as exc:
            if attempt + 1 < attempts:
                time.sleep(0.5)
                continue
            print(
                f"qgpu-dask-worker: could not release slice {slice_id} ({exc}); the agent's "
                "reconcile releases it once this process has exited",
                file=sys.stderr,
                flush=True,
            )
            return
        print(
            f"qgpu-dask-worker: released slice {slice_id}"
            + ("" if result.released else " (already gone)"),
            file=sys.stderr,
            flush=True,
        )
        return


def main(argv: Sequence[str] | None = None) -> int:
    return exit_code_of(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(argv)
    except RuleViolation as exc:
        print(f"qgpu-dask-worker: invalid {describe(exc)}", file=sys.stderr)
        return 2
    except AgentUnavailable as exc:
        print(
            f"qgpu-dask-worker: {exc}; start it with `qgpu agent` or pass --agent-socket",
            file=sys.stderr,
        )
        return 1
    except QgpuError as exc:
        print(f"qgpu-dask-worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
