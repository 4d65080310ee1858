"""Owner liveness: a pluggable registry of checkers, and the reconcile pass that uses it.

A slice records its owner (`qgpu.model.Owner`: kind + id + meta). Reconcile asks the
checker registered for the owner's kind whether the owner lives: ``alive`` and ``unknown``
keep the slice, only ``dead`` releases it — a slice is never taken from a live owner, and
an owner nobody can vouch for is kept (the adapter that made it releases it).

Checkers registered here are the ones that can be answered on the node itself:
- ``pid``: /proc/<pid>/stat exists, is not a zombie and has the start time recorded at
  reservation (so a reused pid is not mistaken for the owner); only answered inside the
  pid namespace the slice was reserved from.
- ``pod``: the kubelet keeps ``/var/lib/kubelet/pods/<uid>`` while a pod exists on the node.
- ``dask-worker``: the worker process's pid (``meta.pid`` + ``meta.start_time``).
Others (``ray-actor``, ``ray-task``) are registered by their adapters through the
entry-point group ``qgpu.owner_checkers`` (a callable ``register(registry)``), or in
process with `OwnerRegistry.register`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from enum import StrEnum
from importlib.metadata import entry_points
from pathlib import Path

from qgpu.model import Owner, OwnerKind

log = logging.getLogger("qgpu.agent.reconcile")

ENTRY_POINT_GROUP = "qgpu.owner_checkers"


class Liveness(StrEnum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


Checker = Callable[[Owner], Liveness]


class OwnerRegistry:
    """Owner kind -> liveness checker. Thread-safe; a kind without a checker is unknown."""

    def __init__(self) -> None:
        self._checkers: dict[OwnerKind, Checker] = {}
        self._lock = threading.Lock()

    def register(self, kind: OwnerKind | str, checker: Checker) -> None:
        with self._lock:
            self._checkers[OwnerKind(kind)] = checker

    def kinds(self) -> list[str]:
        with self._lock:
            return sorted(k.value for k in self._checkers)

    def check(self, owner: Owner) -> Liveness:
        with self._lock:
            checker = self._checkers.get(owner.kind)
        if checker is None:
            return Liveness.UNKNOWN
        try:
            return Liveness(checker(owner))
        except Exception as exc:  # a broken checker must never release a slice
            log.warning("owner checker for %s failed on %r: %s", owner.kind, owner.id, exc)
            return Liveness.UNKNOWN


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def proc_start_time(pid: int) -> int | None:
    """Start time of a live, non-zombie process (clock ticks since boot), else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _pid_liveness(pid_text: str, start_time: str | None, pidns: str | None) -> Liveness:
    try:
        pid = int(pid_text)
    except ValueError:
        return Liveness.UNKNOWN
    if pid <= 0:
        return Liveness.UNKNOWN
    if pidns is not None and pidns != pid_namespace():
        return Liveness.UNKNOWN
    started = proc_start_time(pid)
    if started is None:
        return Liveness.DEAD
    if start_time is not None and start_time.isdigit() and int(start_time) != started:
        return Liveness.DEAD  # the pid was reused by another process
    return Liveness.ALIVE


def check_pid(owner: Owner) -> Liveness:
    return _pid_liveness(owner.id, owner.meta.get("start_time"), owner.meta.get("pidns"))


def check_dask_worker(owner: Owner) -> Liveness:
    pid = owner.meta.get("pid")
    if pid is None:
        return Liveness.UNKNOWN
    return _pid_liveness(pid, owner.meta.get("start_time"), owner.meta.get("pidns"))


def pod_checker(pods_dir: Path) -> Checker:
    def check(owner: Owner) -> Liveness:
        if not owner.id or "/" in owner.id or owner.id in (".", ".."):
            return Liveness.UNKNOWN
        if not pods_dir.is_dir():
            return Liveness.UNKNOWN
        return Liveness.ALIVE if (pods_dir / owner.id).exists() else Liveness.DEAD

    return check


def default_registry(kubelet_pods_dir: Path = Path("/var/lib/kubelet/pods")) -> OwnerRegistry:
    """The node-local checkers plus those adapters declare as entry points."""
    registry = OwnerRegistry()
    registry.register(OwnerKind.PID, check_pid)
    registry.register(OwnerKind.DASK_WORKER, check_dask_worker)
    registry.register(OwnerKind.POD, pod_checker(kubelet_pods_dir))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()(registry)
        except Exception as exc:
            log.warning("owner checker plugin %s could not be loaded: %s", ep.name, exc)
    return registry


__all__ = [
    "ENTRY_POINT_GROUP",
    "Liveness",
    "OwnerRegistry",
    "check_pid",
    "default_registry",
    "pid_namespace",
    "proc_start_time",
]
