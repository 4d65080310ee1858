"""A process laid out like the container kubelet would start from an Allocate answer.

No container runtime runs here: the command runs in a private mount namespace (``unshare
-m``, needs root) in which, of the node's state tree, it sees exactly what the device plugin
mounted under its ``QGPU_STATE_DIR`` (over an empty tmpfs), each mount read-only or writable
as the answer says, parents before what is mounted inside them (as runtimes order mounts).
The host paths may lie under the hidden directory, so they go through a stage first. The
interposer is loaded with ``LD_PRELOAD`` naming the file the mounted ``/etc/ld.so.preload``
names, and the limits file is reached at its host path: the ``/etc`` bind mounts themselves
need a container runtime.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from tests.fakes.runtime import ask, piped

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "enforcement" / "worker.py"


class MountLike(Protocol):
    container_path: str
    host_path: str
    read_only: bool


def container_env(envs: dict[str, str], mounts: Iterable[MountLike]) -> dict[str, str]:
    """The environment of the container's process (see the module docstring)."""
    by_path = {m.container_path: m.host_path for m in mounts}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("QGPU_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
    }
    env.update(envs)
    env["PYTHONPATH"] = str(ROOT)
    env["LD_PRELOAD"] = by_path["/usr/local/qgpu/lib/libqgpu_hook.so"]
    env["QGPU_LIMITS_FILE"] = by_path[envs["QGPU_LIMITS_FILE"]]
    return env


def container_argv(
    envs: dict[str, str], mounts: Iterable[MountLike], argv: list[str], stage: Path
) -> list[str]:
    """``unshare`` ... `argv`: the mount namespace of the container around the command."""
    state = envs["QGPU_STATE_DIR"].rstrip("/") + "/"
    binds = sorted(
        (m for m in mounts if m.container_path.startswith(state)),
        key=lambda m: m.container_path.count("/"),
    )
    assert binds, "no mount under QGPU_STATE_DIR"
    script = ""
    args: list[str] = []

    def arg(value: str) -> str:
        args.append(value)
        return f'"${{{len(args)}}}"'

    for i, m in enumerate(binds):
        staged = stage / str(i)
        staged.mkdir() if Path(m.host_path).is_dir() else staged.touch()
        script += f"mount --bind {arg(m.host_path)} {arg(str(staged))} && "
    if state.startswith("/run/"):
        script += "mount -t tmpfs none /run && "
    inside = arg(state)
    script += f"mkdir -p {inside} && mount -t tmpfs none {inside} && "
    for i, m in enumerate(binds):
        s, c = arg(str(stage / str(i))), arg(m.container_path)
        if Path(m.host_path).is_dir():
            make = f"mkdir -p {c}"
        else:  # a file inside a directory mounted before it exists already
            make = f'{{ [ -e {c} ] || {{ mkdir -p "$(dirname {c})" && touch {c}; }}; }}'
        script += f"{make} && mount --bind {s} {c} && "
        if m.read_only:
            script += f"mount -o remount,bind,ro {c} && "
    first = len(args) + 1
    args += argv
    script += f'shift {first - 1} && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *args]


class Container:
    """A command in the container's layout; `stdin`/`stdout` are text pipes."""

    def __init__(
        self, envs: dict[str, str], mounts: Iterable[MountLike], argv: list[str] | None = None
    ) -> None:
        mounts = list(mounts)
        self.stage = Path(tempfile.mkdtemp(prefix="qs", dir="/tmp"))
        command = argv or [sys.executable, str(WORKER), "serve"]
        self.proc = piped(
            container_argv(envs, mounts, command, self.stage), container_env(envs, mounts)
        )

    def ask(self, line: str) -> list[str]:
        return ask(self.proc, line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask("quit")
            assert self.proc.stdin
            self.proc.stdin.close()
            self.proc.wait(30)
        shutil.rmtree(self.stage, ignore_errors=True)
