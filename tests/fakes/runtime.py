"""A container as kubelet, containerd and runc would lay it out, without a container runtime.

What is modelled (read from their sources, not run against them):
- kubelet puts the device plugin's Allocate answer first and the container's own env and
  volume mounts after it (`GenerateRunContainerOptions`, pkg/kubelet/kubelet_pods.go);
- containerd sorts every CRI mount by the depth of its container path with a stable sort
  (`WithMounts` / `orderedMounts`), so of two mounts at one path the pod's comes last;
- runc mounts in that order, each over what was there, so the last mount at a path wins;
- env entries with one name are both passed on, and a reader that builds a map (Go, the
  NVIDIA container toolkit, Python's ``os.environ``) takes the later one.

The command runs in a private mount namespace (``unshare -m``, needs root) over the host's
root file system: ``/etc`` and ``/usr/local`` are overlays whose writes land in a scratch
directory (the host's files are never touched), ``/run`` is an empty tmpfs; every mount
goes to its container path there, in the runtime's order, read-only where it says so. The
dynamic loader reads the mounted ``/etc/ld.so.preload`` for real (no ``LD_PRELOAD``).
Container paths must lie under those three roots.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("/etc", "/usr/local", "/run")


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


def runtime_order(plugin: Iterable[object], pod: Iterable[object]) -> list[Mount]:
    """The mounts in the order runc applies them: the plugin's, then the pod's, stably
    sorted by the number of parts of the cleaned container path."""
    mounts = [
        Mount(posixpath.normpath(m.container_path), m.host_path, m.read_only)  # type: ignore[attr-defined]
        for m in [*plugin, *pod]
    ]
    return sorted(mounts, key=lambda m: len([p for p in m.container_path.split("/") if p]))


def runtime_env(plugin: dict[str, str], pod: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The environment a map-building reader sees: the pod's entries after the plugin's."""
    env = dict(plugin)
    env.update(dict(pod))
    return env


def piped(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A workload process answering one line per line on text pipes."""
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def ask(proc: subprocess.Popen[str], line: str) -> list[str]:
    """Sends `line` to a worker (tests/enforcement/worker.py serve) and returns its answer."""
    assert proc.stdin and proc.stdout
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline()
    if not reply:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"workload died on {line!r}: {err}")
    return reply.split()


class RuntimeContainer:
    """`argv` in the container; stdin/stdout are text pipes."""

    def __init__(
        self,
        mounts: list[Mount],
        env: dict[str, str],
        argv: list[str],
        base_env: dict[str, str] | None = None,
    ) -> None:
        for m in mounts:
            assert any(m.container_path.startswith(r + "/") for r in ROOTS), m
        self.scratch = Path(tempfile.mkdtemp(prefix="qrt", dir="/tmp"))
        args: list[str] = []

        def arg(value: str) -> str:
            args.append(value)
            return f'"${{{len(args)}}}"'

        script = ""
        for i, m in enumerate(mounts):  # reach the host paths before /run is hidden
            stage = self.scratch / "stage" / str(i)
            stage.parent.mkdir(parents=True, exist_ok=True)
            stage.mkdir() if Path(m.host_path).is_dir() else stage.touch()
            script += f"mount --bind {arg(m.host_path)} {arg(str(stage))} && "
        for root in ("/etc", "/usr/local"):
            upper, work = self.scratch / f"up{root}", self.scratch / f"work{root}"
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            opts = f"lowerdir={root},upperdir={upper},workdir={work}"
            script += f"mount -t overlay overlay -o {arg(opts)} {arg(root)} && "
        script += "mount -t tmpfs none /run && "
        for i, m in enumerate(mounts):
            s, c = arg(str(self.scratch / "stage" / str(i))), arg(m.container_path)
            if Path(m.host_path).is_dir():
                script += f"mkdir -p {c} && "
            else:
                script += f'{{ [ -e {c} ] || {{ mkdir -p "$(dirname {c})" && touch {c}; }}; }} && '
            script += f"mount --bind {s} {c} && "
            if m.read_only:
                script += f"mount -o remount,bind,ro {c} && "
        first = len(args) + 1
        args += argv
        script += f'shift {first - 1} && exec "$@"'
        full_env = {**(base_env if base_env is not None else os.environ), **env}
        full_env.pop("LD_PRELOAD", None)
        self.proc = piped(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *args],
            full_env,
        )

    def ask(self, line: str) -> list[str]:
        return ask(self.proc, line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        shutil.rmtree(self.scratch, ignore_errors=True)
