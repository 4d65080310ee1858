"""NVIDIA MPS backend: one MPS control daemon per GPU and the per-slice MPS environment.

Used when the node is configured for it (``qgpu agent --enforcement mps``) and
``nvidia-cuda-mps-control`` is on PATH (or given as a path); otherwise `MpsError` says what
is missing. Per GPU ``<uuid>``, with ``CUDA_VISIBLE_DEVICES=<uuid>``,
``CUDA_MPS_PIPE_DIRECTORY=<state>/mps/<uuid>/pipe`` and
``CUDA_MPS_LOG_DIRECTORY=<state>/mps/<uuid>/log``, the exact command sequence is:

1. ``echo get_default_active_thread_percentage | nvidia-cuda-mps-control`` — is a daemon
   already serving this GPU (an agent restart)? If it answers, it is reused.
2. otherwise ``nvidia-cuda-mps-control -d`` (start the daemon), then the query of step 1
   again to confirm it answers.

A slice's environment: the same device and directories, plus
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<core>`` (100 for best-effort, which has no compute cap)
and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` (device 0 is the slice's only visible GPU).
Daemons are left running when the agent exits, so running clients keep their limits;
`MpsManager.stop` (``echo quit | nvidia-cuda-mps-control``) tears them down explicitly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from qgpu.errors import QgpuError
from qgpu.model import Allocation, IsolationPolicy
from qgpu.units import MIB_PER_GIB

QUERY = "get_default_active_thread_percentage\n"
Runner = Callable[..., subprocess.CompletedProcess[str]]


class MpsError(QgpuError):
    """MPS was asked for but cannot be used (binary missing, daemon does not answer)."""


class MpsManager:
    """Runs and talks to the per-GPU MPS control daemons."""

    def __init__(
        self, control: str, root: Path, runner: Runner = subprocess.run, timeout_s: float = 20.0
    ) -> None:
        found = shutil.which(control)
        if found is None:
            raise MpsError(
                f"the node is configured for MPS (--enforcement mps) but {control!r} was not "
                "found; install the NVIDIA driver utilities or use --enforcement interposer"
            )
        self.control = found
        self.root = root
        self._run = runner
        self.timeout_s = timeout_s
        self.started: list[str] = []

    def dirs(self, uuid: str) -> tuple[Path, Path]:
        base = self.root / uuid
        return base / "pipe", base / "log"

    def daemon_env(self, uuid: str) -> dict[str, str]:
        pipe, logs = self.dirs(uuid)
        return {
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(logs),
        }

    def _call(self, uuid: str, args: list[str], stdin: str | None) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.update(self.daemon_env(uuid))
        return self._run(
            [self.control, *args],
            input=stdin,
            env=env,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
        )

    def answers(self, uuid: str) -> bool:
        return self._call(uuid, [], QUERY).returncode == 0

    def start(self, uuids: Iterable[str]) -> None:
        """Make sure a control daemon serves every GPU (reusing one that already runs)."""
        for uuid in uuids:
            pipe, logs = self.dirs(uuid)
            pipe.mkdir(parents=True, exist_ok=True)
            logs.mkdir(parents=True, exist_ok=True)
            os.chmod(pipe, 0o755)
            if self.answers(uuid):
                continue
            done = self._call(uuid, ["-d"], None)
            if done.returncode != 0:
                raise MpsError(
                    f"nvidia-cuda-mps-control -d failed for GPU {uuid} "
                    f"(exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
                )
            if not self.answers(uuid):
                raise MpsError(f"the MPS control daemon for GPU {uuid} started but does not answer")
            self.started.append(uuid)

    def stop(self, uuids: Iterable[str] | None = None) -> None:
        for uuid in list(uuids if uuids is not None else self.started):
            self._call(uuid, [], "quit\n")
            if uuid in self.started:
                self.started.remove(uuid)

    def slice_env(self, alloc: Allocation) -> dict[str, str]:
        uuid = alloc.gpu_uuids[0]
        env = self.daemon_env(uuid)
        share = 100 if alloc.isolation is IsolationPolicy.BEST_EFFORT else alloc.core
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={alloc.memory_gib * MIB_PER_GIB}M"
        env["QGPU_SLICE_ID"] = alloc.slice_id
        return env


__all__ = ["MpsError", "MpsManager"]
