"""A private node agent for local clusters (Ray's `LocalCluster`, Dask's `SliceCluster`).

`LocalAgent` starts ``qgpu agent`` on simulated GPUs (``gpus="2xH100-80GB"``) or on this
machine's GPUs (``gpus="real"``, NVML) in a private state directory and waits until it
answers. The agent is a child process that the kernel terminates when its parent dies
(``PR_SET_PDEATHSIG``), so a crashed cluster does not leave an agent behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from enforcement.agent.client import AgentClient
from enforcement.agent.models import NodeInfo
from qgpu.errors import QgpuError
from qgpu.model import PlacementPolicy

REAL_GPUS = "real"


def default_gpus() -> str:
    """This machine's GPUs when NVML works (and QGPU_BACKEND is not ``sim``), else two
    simulated H100s."""
    from enforcement.discovery import nvml_available

    if os.environ.get("QGPU_BACKEND") != "sim" and nvml_available():
        return REAL_GPUS
    return "2xH100-80GB"


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
            # the agent sets PDEATHSIG itself (why not a preexec_fn: cli.exit_with_parent)
            "--exit-with-parent",
            str(os.getpid()),
            *(["--test-mode"] if test_mode else []),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "QGPU_SLICE_ID")}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the agent
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
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


__all__ = ["REAL_GPUS", "LocalAgent", "default_gpus"]
