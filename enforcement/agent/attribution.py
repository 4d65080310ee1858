"""Which slice a GPU process belongs to, from evidence the process cannot forge.

This module owns the node agent's answer to "whose is this GPU process?" (used by the
watchdog, which kills on it, and by the usage in ``GET /v1/slices`` and ``/metrics``), and
the per-slice cgroups the agent makes so that the answer has something to stand on.

A process's environment is its own: a tenant can name any slice in ``QGPU_SLICE_ID`` (and
frame its owner: the watchdog would kill the victim's processes for memory the framer
took) or name none (and hide). So the evidence is, strongest first:

1. the slice's cgroup: for slices owned by a process (a ``pid`` owner, or any owner with
   ``meta.pid``: Ray workers, Dask nannies), the agent makes a cgroup at reservation,
   ``<owner's cgroup>/qgpu-pid-<pid>-<start time>``, and moves the owner and its
   descendants into it; children inherit it, and only root can move a process into (or,
   outside a delegated subtree, out of) a root-owned cgroup. A process in it (or below it)
   is that owner's. The full path is compared, not the name: a cgroup of that name that a
   tenant made in a subtree delegated to it counts for nothing.
2. descent from the slice's owner process (its pid and start time), where no cgroup could
   be made (cgroup v2 not mounted or not writable, the owner in another cgroup namespace,
   ``--slice-cgroups off``): a process cannot make itself another process's descendant.

One owner process can hold several slices (a Dask cluster's client process holds every
worker's; a reused Ray worker its successive ones): they are one tenant, and the process's
``QGPU_SLICE_ID`` picks among them (else the first on its GPU). The same holds for a pod
with several slices.
3. Kubernetes: the pod UID in the process's cgroup path (kubelet's ``kubepods`` tree,
   cgroupfs driver ``.../pod<uid>/<container>`` and systemd driver
   ``...-pod<uid_with_underscores>.slice/...``), matched to the slices owned by that pod
   (``kind: pod``, ``id``: its UID). A pod cgroup directory that exists here and is not
   root-owned (made by a tenant in a delegated subtree) is not believed.
4. ``QGPU_SLICE_ID`` from ``/proc/<pid>/environ``, believed only for a slice with none of
   the above (a ``manual`` owner, a Ray actor without ``meta.pid``) and only from a process
   that is in no pod and no slice's cgroup: a claim that contradicts the process's cgroup is
   never believed.

A process with none of these belongs to no slice ("unowned"), and so does a process on a
GPU that is not its slice's (a bypass of the interposer's device fence). NVIDIA's MPS
server is neither: it holds memory on behalf of MPS clients, which NVML lists themselves;
it is recognised by its executable (``nvidia-cuda-mps-server``) and by its parent, the MPS
control daemon running as root, which a tenant cannot fake.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from enforcement.agent.config import SliceCgroupMode
from enforcement.agent.reconcile import pid_namespace, proc_start_time
from enforcement.discovery import GpuProcess
from qgpu.errors import RuleViolation
from qgpu.model import Allocation, OwnerKind, is_slice_id

log = logging.getLogger("qgpu.agent.attribution")

CGROUP_PREFIX = "qgpu-"
MPS_SERVER = "nvidia-cuda-mps-server"
MPS_CONTROL = "nvidia-cuda-mps-control"
MAX_DEPTH = 64  # ancestors walked per process

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_CGROUPFS_POD = re.compile(rf"pod({_UID})")
_SYSTEMD_POD = re.compile(rf"(?:[a-z0-9]+-)*kubepods(?:-[a-z]+)*-pod({_UID})\.slice")


# -- reading a process ---------------------------------------------------------------------


def cgroup_v2_path(pid: int | str) -> str | None:
    """The process's cgroup v2 path (its ``0::`` line), relative to the reader's cgroup
    namespace; None where the process is gone or the host has no unified hierarchy."""
    for line in _cgroup_lines(pid):
        if line.startswith("0::"):
            return line[3:]
    return None


def _cgroup_lines(pid: int | str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []


def pod_of_path(path: str) -> tuple[str, int] | None:
    """The pod UID a kubelet cgroup path names, and how many components lead to the pod's
    own directory (cgroupfs and systemd drivers, any QoS class, any prefix: nested
    kubelets, a cgroup namespace's ``..``); None for any other path."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        m = _SYSTEMD_POD.fullmatch(part)
        if m is not None:
            return m.group(1).replace("_", "-"), i + 1
        m = _CGROUPFS_POD.fullmatch(part)
        if m is not None and "-" in m.group(1) and _under_kubepods(parts[:i]):
            return m.group(1), i + 1
    return None


def _under_kubepods(parents: list[str]) -> bool:
    """cgroupfs: ``kubepods/[class/]pod<uid>``; a cgroup namespace may hide the top as
    ``..`` (the reader is itself a pod)."""
    tail = [p for p in parents if p]
    if not tail:
        return False
    if tail[-1] in ("besteffort", "burstable"):
        tail = tail[:-1]
    return bool(tail) and (tail[-1].endswith("kubepods") or tail[-1] == "..")


def pod_of_process(pid: int, v2: CgroupMount | None) -> str | None:
    """The pod UID of a process from its cgroups (v2 line first, then any v1 line). Where
    the pod's cgroup directory is visible here it must be root-owned: kubelet makes it as
    root, a tenant in a delegated subtree cannot."""
    lines = _cgroup_lines(pid)
    lines.sort(key=lambda line: not line.startswith("0::"))
    for line in lines:
        path = line.split(":", 2)[2] if line.count(":") >= 2 else ""
        found = pod_of_path(path)
        if found is None:
            continue
        uid, depth = found
        if line.startswith("0::") and v2 is not None:
            where = v2.directory("/".join(path.split("/")[:depth]))
            if where is not None:
                try:
                    owner = where.stat().st_uid
                except OSError:
                    owner = 0  # gone meanwhile: the process is exiting
                if owner != 0:
                    return None
        return uid
    return None


def environ_slice_id(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in data.split(b"\0"):
        if entry.startswith(b"QGPU_SLICE_ID="):
            return entry[len(b"QGPU_SLICE_ID=") :].decode(errors="replace")
    return None


def parent_pid(pid: int | str, proc: str = "/proc") -> int | None:
    data = _read_small(f"{proc}/{pid}/stat")
    if data is None:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def _read_small(path: str) -> bytes | None:
    """A small /proc file's bytes (one read), or None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def ancestry(pid: int) -> list[tuple[int, int | None]]:
    """The process and its ancestors, nearest first: (pid, start time)."""
    out: list[tuple[int, int | None]] = []
    cur: int | None = pid
    while cur and cur > 0 and len(out) < MAX_DEPTH:
        out.append((cur, proc_start_time(cur)))
        if cur == 1:
            break
        cur = parent_pid(cur)
    return out


def _exe_name(pid: int) -> str | None:
    try:
        target = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    return Path(target.removesuffix(" (deleted)")).name


def _real_uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def is_mps_server(pid: int) -> bool:
    """NVIDIA's MPS server: its executable, started by the MPS control daemon that runs as
    root (a tenant can name its own binary anything, not make root's daemon its parent)."""
    if _exe_name(pid) != MPS_SERVER:
        return False
    parent = parent_pid(pid)
    return parent is not None and _exe_name(parent) == MPS_CONTROL and _real_uid(parent) == 0


# -- the cgroup v2 hierarchy ---------------------------------------------------------------


@dataclass(frozen=True)
class CgroupMount:
    """Where the unified hierarchy is mounted here, and which of its paths that is."""

    mount: Path
    root: str = "/"

    def directory(self, path: str) -> Path | None:
        """The directory of a v2 path (as /proc/<pid>/cgroup shows it), None when it lies
        outside this mount (another cgroup namespace's ``..``, another subtree)."""
        if not path.startswith("/") or "/../" in path + "/" or path.startswith("/.."):
            return None
        root = self.root.rstrip("/")
        if root and path != root and not path.startswith(root + "/"):
            return None
        rel = path[len(root) :].lstrip("/")
        return self.mount / rel if rel else self.mount


def find_cgroup_v2() -> CgroupMount | None:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return CgroupMount(Path(fields[4]), fields[3])
    return None


class SliceCgroups:
    """The agent's slice cgroups: ``<owner's cgroup>/qgpu-pid-<pid>-<start time>`` for the
    slices owned by a process (one cgroup for all slices of one owner: a Dask cluster's
    client process owns every worker's slice, a reused Ray worker its successive ones), made
    at reservation, removed when the owner's last slice is released (what still runs there
    goes back to the parent). Each slice's path is kept in ``<records>/<slice>`` so that a
    restarted agent knows them. Nested under the owner's own cgroup, the limits of its
    container or systemd unit keep applying to it."""

    def __init__(self, records: Path, mode: SliceCgroupMode, privileged: bool) -> None:
        self.records = records
        self.v2 = find_cgroup_v2()
        self.enabled = False
        if mode == "off":
            self.reason = "off (--slice-cgroups off)"
        elif self.v2 is None:
            self.reason = "cgroup v2 is not mounted on this node"
        elif mode == "auto" and not privileged:
            self.reason = "the agent is not root, or runs with --test-mode"
        elif not os.access(self.v2.mount, os.W_OK):
            self.reason = f"cgroup v2 at {self.v2.mount} is not writable by the agent"
        else:
            self.enabled, self.reason = True, f"cgroup v2 at {self.v2.mount}"
        if mode == "on" and not self.enabled:
            raise RuleViolation("slice_cgroups", "on", f"cannot be used: {self.reason}")
        self._lock = threading.Lock()  # reservations of different slices run concurrently
        self._paths: dict[str, str] = {}
        if records.is_dir():  # also with cgroups off: an earlier run's are still removed
            self._paths = self._load()
        elif self.enabled:
            records.mkdir(parents=True, exist_ok=True)
            os.chmod(records, 0o700)

    def _load(self) -> dict[str, str]:
        out = {}
        for f in self.records.iterdir():
            if is_slice_id(f.name):
                with contextlib.suppress(OSError):
                    out[f.name] = f.read_text().strip()
        return out

    def path_of(self, slice_id: str) -> str | None:
        with self._lock:
            return self._paths.get(slice_id)

    def paths(self) -> dict[str, str]:
        with self._lock:
            return dict(self._paths)

    def enroll(self, slice_id: str, pid: int, start_time: int | None) -> str | None:
        """Make the slice's cgroup (once) and move the owner and its descendants into it;
        the cgroup's v2 path, or None where none can be made (then ancestry is used)."""
        if not self.enabled or self.v2 is None or pid in (1, os.getpid()):
            return None  # never move init or the agent itself
        if start_time is not None and proc_start_time(pid) != start_time:
            return None  # the owner is gone: reconcile releases the slice
        current = cgroup_v2_path(pid)
        if current is None:
            return None
        path = self.path_of(slice_id)
        if path is None:
            name = f"{CGROUP_PREFIX}pid-{pid}-{start_time or 0}"
            base, ours = current.rstrip("/"), set(self.paths().values())
            if base.rpartition("/")[2] == name:
                path = base  # another slice of the same owner: one cgroup for all of them
            else:
                while base in ours:  # in another owner's cgroup (its child): a sibling
                    base = base.rpartition("/")[0]
                path = f"{base}/{name}"
        target = self.v2.directory(path)
        if target is None:
            log.warning(
                "slice %s: owner %d is in cgroup %s, outside this agent's cgroup mount; "
                "attributing by descent from it instead",
                slice_id, pid, current,
            )  # fmt: skip
            return None
        try:
            target.mkdir(exist_ok=True)
            self._record(slice_id, path)
            self._move_tree(pid, current, target)
        except OSError as exc:
            log.warning("slice %s: cgroup %s: %s; attributing by descent", slice_id, path, exc)
            return None
        return path

    def _record(self, slice_id: str, path: str) -> None:
        if self.path_of(slice_id) == path:
            return
        tmp = self.records / f".{slice_id}.tmp"
        tmp.write_text(path + "\n")
        os.replace(tmp, self.records / slice_id)
        with self._lock:
            self._paths[slice_id] = path

    @staticmethod
    def _move_tree(pid: int, source: str, target: Path) -> None:
        """The owner first (later forks inherit its cgroup), then its descendants still in
        the owner's old cgroup, until none is left there."""
        procs = target / "cgroup.procs"
        procs.write_text(str(pid))
        for _ in range(8):
            moved = 0
            for child in _descendants(pid):
                if cgroup_v2_path(child) == source:
                    with contextlib.suppress(ProcessLookupError, OSError):
                        procs.write_text(str(child))
                        moved += 1
            if not moved:
                return

    def release(self, slice_id: str) -> bool:
        """Forget the slice's cgroup; once no slice of its owner is left, move what still
        runs there to the parent and remove it. True when done (else `sweep` tries again)."""
        path = self.path_of(slice_id)
        if path is None or self.v2 is None:
            return True
        shared = any(p == path for s, p in self.paths().items() if s != slice_id)
        target = None if shared else self.v2.directory(path)
        if target is not None and target.exists() and not _remove_tree(target):
            return False
        with contextlib.suppress(FileNotFoundError):
            (self.records / slice_id).unlink()
        with self._lock:
            self._paths.pop(slice_id, None)
        return True

    def sweep(self, held: Iterable[str]) -> None:
        """Remove the cgroups of slices that are no longer held."""
        keep = set(held)
        for sid in [s for s in self.paths() if s not in keep]:
            if not self.release(sid):
                log.warning("the cgroup of released slice %s is still busy", sid)


def _descendants(pid: int, proc: str = "/proc") -> list[int]:
    """The process's descendants: from its threads' ``children`` lists where the kernel
    keeps them (``CONFIG_PROC_CHILDREN``: as many reads as there are descendants and
    threads), else from every process's parent (a read per process on the node). Both
    miss a process forked meanwhile; `SliceCgroups._move_tree` asks again until none is
    left behind."""
    if _children_lists(proc):
        out: list[int] = []
        todo = [pid]
        while todo:
            kids = _children(todo.pop(), proc)
            out.extend(kids)
            todo.extend(kids)
        return out
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            ppid = parent_pid(entry.name, proc)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        cur = todo.pop()
        out.append(cur)
        todo.extend(children.get(cur, []))
    return out


_CHILDREN_LISTS: dict[str, bool] = {}


def _children_lists(proc: str) -> bool:
    """Whether `proc` has ``task/<tid>/children`` files (asked once per proc root)."""
    found = _CHILDREN_LISTS.get(proc)
    if found is None:
        me = os.getpid()
        found = _CHILDREN_LISTS[proc] = os.path.exists(f"{proc}/{me}/task/{me}/children")
    return found


def _children(pid: int, proc: str) -> list[int]:
    """The children of every thread of `pid` (none when it is gone)."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        data = _read_small(f"{proc}/{pid}/task/{tid}/children")
        if data:
            out.extend(int(c) for c in data.split())
    return out


def _remove_tree(top: Path) -> bool:
    """Move the processes of `top` and everything below it to `top`'s parent, then remove
    the directories, deepest first (a process that is exiting holds its cgroup a moment)."""
    parent = top.parent / "cgroup.procs"
    for attempt in range(20):
        dirs = sorted(
            (Path(d) for d, _s, _f in os.walk(top)), key=lambda p: len(p.parts), reverse=True
        )
        for d in dirs:
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        parent.write_text(pid)
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", d, exc)
        if not top.exists():
            return True
        time.sleep(0.01 * (attempt + 1))
    return False


# -- the rule ------------------------------------------------------------------------------


def owner_anchor(alloc: Allocation) -> tuple[int, int | None] | None:
    """The process that owns a slice (pid, start time), if its owner names one that lives
    in this agent's pid namespace."""
    owner = alloc.owner
    pid = owner.id if owner.kind is OwnerKind.PID else owner.meta.get("pid")
    if not pid or not pid.isdigit() or int(pid) <= 0:
        return None
    ns = owner.meta.get("pidns")
    if ns is not None and ns != pid_namespace():
        return None
    started = owner.meta.get("start_time")
    return int(pid), int(started) if started and started.isdigit() else None


@dataclass(frozen=True)
class Attribution:
    slice_id: str | None
    by: str  # cgroup | descent | pod | environ | none


class Attributor:
    """One pass of attribution over the slices held now (build one per scan)."""

    def __init__(
        self,
        allocs: list[Allocation],
        cgroup_paths: dict[str, str],
        v2: CgroupMount | None,
        claim_of: Callable[[int], str | None],
    ) -> None:
        self.allocs = {a.slice_id: a for a in allocs}
        self.v2 = v2
        self._claim_of = claim_of
        self.cgroups: dict[str, list[str]] = {}
        for sid, path in cgroup_paths.items():
            if sid in self.allocs:
                self.cgroups.setdefault(path, []).append(sid)
        self.anchors: dict[int, list[tuple[int | None, str]]] = {}
        self.pods: dict[str, list[Allocation]] = {}
        for a in allocs:
            anchor = owner_anchor(a)
            if anchor is not None:
                self.anchors.setdefault(anchor[0], []).append((anchor[1], a.slice_id))
            if a.owner.kind is OwnerKind.POD and a.owner.id:
                self.pods.setdefault(a.owner.id, []).append(a)
        anchored = {s for v in self.anchors.values() for _t, s in v}
        pod_slices = {a.slice_id for v in self.pods.values() for a in v}
        # the slices only an environment can name: no process, no pod, no cgroup
        self.claimable = {s for s in self.allocs if s not in anchored and s not in pod_slices} - {
            sid for sids in self.cgroups.values() for sid in sids
        }

    def of(self, proc: GpuProcess) -> Attribution:
        found = self._find(proc)
        if found.slice_id is None:
            return found
        alloc = self.allocs[found.slice_id]
        if proc.device_uuid not in alloc.gpu_uuids:
            return Attribution(None, "another-gpu")  # past the interposer's device fence
        return found

    def _find(self, proc: GpuProcess) -> Attribution:
        pid = proc.pid
        path = cgroup_v2_path(pid)
        if path is not None:
            sids = self._slice_cgroup(path)
            if sids:
                return Attribution(self._pick(pid, proc, sids), "cgroup")
        for apid, started in ancestry(pid):
            if apid == 1 and pid != 1:
                break  # an owner that is its namespace's init would own every process
            sids = [sid for want, sid in self.anchors.get(apid, []) if want in (None, started)]
            if sids:
                return Attribution(self._pick(pid, proc, sids), "descent")
        pod = pod_of_process(pid, self.v2)
        if pod is not None:
            mine = [a.slice_id for a in self.pods.get(pod, [])]
            if not mine:
                return Attribution(None, "pod-without-slice")
            return Attribution(self._pick(pid, proc, mine), "pod")
        claim = self._claim_of(pid)
        if claim in self.claimable:
            return Attribution(claim, "environ")
        return Attribution(None, "none")

    def _pick(self, pid: int, proc: GpuProcess, sids: list[str]) -> str:
        """One tenant's slice for the process: the only one, else (an owner process or pod
        that holds several) those on the process's GPU, and among them the one its
        environment names, else the first. The environment chooses only among slices the
        evidence already gave the process: a tenant can only frame itself."""
        if len(sids) == 1:
            return sids[0]
        here = sorted(s for s in sids if proc.device_uuid in self.allocs[s].gpu_uuids)
        if not here:
            return sorted(sids)[0]  # on none of their GPUs: `of` makes it of no slice
        if len(here) == 1:
            return here[0]
        claim = self._claim_of(pid)
        return claim if claim in here else here[0]

    def _slice_cgroup(self, path: str) -> list[str]:
        cur = path.rstrip("/")
        while cur:
            sids = self.cgroups.get(cur)
            if sids:
                return sids
            cur = cur.rpartition("/")[0]
        return []


__all__ = [
    "Attribution",
    "Attributor",
    "CgroupMount",
    "SliceCgroupMode",
    "SliceCgroups",
    "ancestry",
    "cgroup_v2_path",
    "environ_slice_id",
    "find_cgroup_v2",
    "is_mps_server",
    "owner_anchor",
    "pod_of_path",
    "pod_of_process",
]
