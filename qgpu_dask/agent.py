"""The node agent as the Dask adapter uses it: a private agent for a local cluster, the
slice owner a Dask worker is recorded under, and slice requests checked by the core model.

`LocalAgent` starts ``qgpu agent`` on simulated GPUs (``sim="2xH100-80GB"``) or on this
machine's GPUs (``sim="real"``, NVML) in a private state directory. The agent is a child
process that the kernel terminates when this process dies (``PR_SET_PDEATHSIG``), so a
crashed cluster does not leave an agent behind.

`worker_owner` builds the ``dask-worker`` owner of a slice: its ``meta.pid`` is the process
that runs the worker's nanny (the worker process is its child and dies with it). The agent
pins that pid's start time, and its reconcile releases the slice once that process is gone,
so a SIGKILLed worker does not keep its slice.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from enforcement.agent.client import AgentClient
from enforcement.agent.models import NodeInfo
from qgpu.errors import QgpuError, RuleViolation, first_violation
from qgpu.model import Owner, OwnerKind, PlacementPolicy, SliceRequest

REAL_GPUS = "real"


def parse_request(value: SliceRequest | Mapping[str, Any], where: str = "slice") -> SliceRequest:
    """A slice request validated by the core model; a broken rule raises `RuleViolation`."""
    if isinstance(value, SliceRequest):
        return value
    if not isinstance(value, Mapping):
        raise RuleViolation(where, value, "must be a mapping such as {'core': 30, 'memory': 8}")
    try:
        return SliceRequest.model_validate(dict(value))
    except ValidationError as exc:
        raise first_violation(exc) from exc


def with_policy(request: SliceRequest, policy: PlacementPolicy | None) -> SliceRequest:
    """The request with the cluster's placement policy, unless it names its own."""
    if policy is None or request.placement is not None or request.gpu_placement is not None:
        return request
    return request.model_copy(update={"placement": policy})


def worker_owner(worker_id: str, pid: int | None = None) -> Owner:
    """The owner recorded for the slice of a Dask worker whose nanny runs in ``pid``."""
    return Owner(
        kind=OwnerKind.DASK_WORKER,
        id=worker_id[:256],
        meta={"pid": str(pid if pid is not None else os.getpid())},
    )


def default_gpus() -> str:
    """This machine's GPUs when NVML works (and QGPU_BACKEND is not ``sim``), else two
    simulated H100s."""
    from enforcement.discovery import nvml_available

    if os.environ.get("QGPU_BACKEND") != "sim" and nvml_available():
        return REAL_GPUS
    return "2xH100-80GB"


_PR_SET_PDEATHSIG = 1
# resolved here, not in the forked child: a child of a threaded process must not dlopen
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent_of(parent: int) -> Callable[[], None]:
    """preexec_fn: the kernel sends SIGTERM to the agent when its parent dies."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class LocalAgent:
    """A `qgpu agent` process serving this machine's (simulated or real) GPUs."""

    def __init__(
        self,
        root: Path,
        *,
        gpus: str,
        policy: PlacementPolicy = PlacementPolicy.FRAG,
        node_name: str = "dask-local",
        reconcile_interval: float = 1.0,
        start_timeout: float = 60.0,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.socket = root / "agent.sock"
        self.log_path = root / "agent.log"
        backend = ["--backend", "nvml"] if gpus == REAL_GPUS else ["--sim", gpus]
        test_mode = gpus != REAL_GPUS or os.geteuid() != 0
        command = [
            sys.executable,
            "-m",
            "qgpu.cli",
            "agent",
            *backend,
            "--node-name",
            node_name,
            "--state-dir",
            str(root),
            "--socket",
            str(self.socket),
            "--placement",
            policy.value,
            "--reconcile-interval",
            str(reconcile_interval),
            "--log-level",
            "warning",
            *(["--test-mode"] if test_mode else []),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "QGPU_SLICE_ID")}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the agent
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent_of(os.getpid()),
        )
        self.client = AgentClient(self.socket, timeout=30.0)
        self.node: NodeInfo = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> NodeInfo:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                self._log.close()
                raise QgpuError(
                    f"the qgpu agent exited with code {self.process.returncode}: "
                    + self.log_path.read_text()[-2000:]
                )
            if self.socket.exists():
                try:
                    return self.client.node()
                except QgpuError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise QgpuError(f"the qgpu agent did not answer within {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()


__all__ = [
    "REAL_GPUS",
    "LocalAgent",
    "default_gpus",
    "parse_request",
    "with_policy",
    "worker_owner",
]
