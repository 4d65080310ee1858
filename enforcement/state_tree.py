"""The node's slice files on disk: one directory per slice, one directory per GPU, and who
owns what. The node agent and the device plugin (without an agent) create them; the
interposer (enforcement/native/hook/ledger.c, roster.c, region.c) and
`enforcement.agent.slice_stats` use them. The layout under a slices root
(``<state-dir>/slices``, the workloads' ``QGPU_STATE_DIR``)::

    slices/                                 root 0711   traversable, not listable
    slices/<id>/                            root:<gid> 0750   the slice's directory
    slices/<id>/limits.conf                 root:<gid> 0440   its caps (trusted by the hook)
    slices/<id>/ledger/                     <uid>:<gid> 0700  its processes' shared ledger
    slices/<id>/ledger/slice-<id>.ledger    <uid>:<gid> 0600  (memory, compute bucket)
    slices/.gpu-<uuid>/                     root:<wgid> 0750  what the slices of one GPU
                                                              tell each other
    slices/.gpu-<uuid>/roster               root:<wgid> 0640  every slice on the GPU with
                                                              its policy and share
    slices/.gpu-<uuid>/<id>.activity        <uid>:<wgid> 0640 when the slice last launched,
                                                              until when it has work queued
    slices/.gpu-<uuid>/busy                 root:<wgid> 0640  the slices the agent's
                                                              watchdog saw run (NVML)

``<uid>:<gid>`` is the slice's workload identity (`Identity`): the user its processes run
as; ``<wgid>`` the workload group (``--workload-gid``) every tenant of the GPUs is in. The
ledger is created here, before the workload starts, owned by that user: the interposer then
opens a file nobody else can open, and no other user can create it first. A workload cannot
replace its limits file (its directory is not writable by it). A GPU's roster is written
only here (`enforcement.gpu_roster`), so no tenant can say what another slice's policy or
share is; each slice writes only its own activity file, so a tenant can lie only about
itself; the busy list is written only by the node agent (`ensure_busy` makes it, its
watchdog fills it: `enforcement.busy_view`), so what the driver saw run counts whatever an
activity file says. ``.gpu-<uuid>`` starts with a dot so that no slice id can name it.
Nothing in the tree is writable by "other". In Kubernetes a container receives its slice's
``ledger/`` directory, its ``limits.conf`` (read-only), its GPU's directory read-only (the
busy list with it) and its own activity file in it writable — nothing else of another
slice.

Without root (tests, laptops, ``--test-mode``) nothing is chowned: every file belongs to
the process that runs the agent, with the same modes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from enforcement.busy_view import BUSY_MODE, BUSY_NAME, BusyView
from enforcement.gpu_roster import (
    ROSTER_SIZE,
    RosterEdit,
    RosterEntry,
    edit_mapped_roster,
    edit_roster,
    init_roster,
    read_roster,
)
from enforcement.limits import SliceLimits, process_umask, write_limits_file
from qgpu.model import IsolationPolicy, check_slice_id, is_slice_id

ROOT_MODE = 0o711
SLICE_DIR_MODE = 0o750
LEDGER_DIR_MODE = 0o700
LEDGER_MODE = 0o600
LIMITS_MODE = 0o440
GPU_DIR_MODE = 0o750
ROSTER_MODE = 0o640
ACTIVITY_MODE = 0o640
LIMITS_NAME = "limits.conf"
LEDGER_DIR_NAME = "ledger"
ROSTER_NAME = "roster"
ACTIVITY_SUFFIX = ".activity"


@dataclass(frozen=True)
class Identity:
    """Who a slice's processes run as: the owner of its ledger."""

    uid: int
    gid: int

    @classmethod
    def current(cls) -> Identity:
        return cls(os.geteuid(), os.getegid())


def process_identity(pid: int) -> Identity | None:
    """The effective uid/gid of a live process (``/proc/<pid>/status``), else None."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    ids: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Uid", "Gid"):
            fields = rest.split()
            if len(fields) >= 2:
                ids[key] = int(fields[1])
    if "Uid" not in ids or "Gid" not in ids:
        return None
    return Identity(ids["Uid"], ids["Gid"])


FILES_KEPT = 4096  # slices whose paths StateTree.files keeps built


@dataclass(frozen=True)
class SliceFiles:
    """The paths of one slice under a slices root (each built once, on first use; the
    ``*_s`` twins are plain strings, for the system calls of the hot path)."""

    root: Path
    slice_id: str

    @cached_property
    def dir(self) -> Path:
        return self.root / self.slice_id

    @cached_property
    def dir_s(self) -> str:
        return f"{self.root}/{self.slice_id}"

    @cached_property
    def limits_s(self) -> str:
        return f"{self.dir_s}/{LIMITS_NAME}"

    @cached_property
    def retired_s(self) -> str:
        return f"{self.dir_s}/.{LIMITS_NAME}.released"

    @cached_property
    def ledger_dir_s(self) -> str:
        return f"{self.dir_s}/{LEDGER_DIR_NAME}"

    @cached_property
    def ledger_s(self) -> str:
        return f"{self.ledger_dir_s}/slice-{self.slice_id}.ledger"

    @cached_property
    def limits_file(self) -> Path:
        return self.dir / LIMITS_NAME

    @cached_property
    def retired_limits_file(self) -> Path:
        """Where a limits file waits while its slice's release is being committed."""
        return self.dir / f".{LIMITS_NAME}.released"

    @cached_property
    def ledger_dir(self) -> Path:
        return self.dir / LEDGER_DIR_NAME

    @cached_property
    def ledger(self) -> Path:
        return self.ledger_dir / f"slice-{self.slice_id}.ledger"


def slice_files(root: Path, slice_id: str) -> SliceFiles:
    """The files of `slice_id` under `root` (the id is checked: it names a directory)."""
    return SliceFiles(Path(root), check_slice_id(slice_id))


def gpu_dir(root: Path, uuid: str) -> Path:
    """What the slices of one GPU share (a name no slice id can take: ids never start with
    a dot)."""
    return Path(root) / f".gpu-{uuid}"


def busy_file(root: Path, uuid: str) -> Path:
    """The GPU's busy list (`enforcement.busy_view`), written only by the node agent."""
    return gpu_dir(root, uuid) / BUSY_NAME


def activity_file(root: Path, uuid: str, slice_id: str) -> Path:
    return gpu_dir(root, uuid) / f"{check_slice_id(slice_id)}{ACTIVITY_SUFFIX}"


class StateTree:
    """Creates, repairs and removes the slice files under one slices root.

    `privileged`: chown to root and to the slices' identities (the agent or plugin runs as
    root in production); otherwise files keep the caller's ownership. `workload_gid`: the
    group of the GPUs' shared state, which their tenants read (0: root only).
    """

    def __init__(
        self, root: Path, *, privileged: bool, workload_gid: int = 0, keep_rosters: bool = False
    ) -> None:
        self.root = Path(root)
        self.privileged = privileged
        self.workload_gid = workload_gid
        self._files: dict[str, SliceFiles] = {}
        self._umask = process_umask()
        # slices whose directory this tree made and whose limits file it has not written
        self._unwritten: set[str] = set()
        # keep_rosters (the node agent): each GPU's roster stays open and mapped between
        # edits, checked against its path before each (a replaced file is opened again)
        self._keep_rosters = keep_rosters
        self._rosters: dict[str, _OpenRoster] = {}
        self._rosters_lock = threading.Lock()
        self._gpu_dirs: dict[str, str] = {}

    def prepare(self) -> None:
        """The root itself: created, root-owned, 0711 (a legacy 1777 root is tightened)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._own(self.root, 0, 0, ROOT_MODE)

    def files(self, slice_id: str) -> SliceFiles:
        """The slice's paths (checked id); recent ones are kept, a reservation and its
        answer ask for them several times."""
        found = self._files.get(slice_id)
        if found is None:
            if len(self._files) >= FILES_KEPT:
                self._files.clear()
            found = self._files[slice_id] = slice_files(self.root, slice_id)
        return found

    def create(self, slice_id: str, who: Identity) -> SliceFiles:
        """The slice's directories and (empty) ledger, owned as the layout says. Idempotent:
        existing ones get their owner and mode back; a symlink in their place is refused.

        A directory made here is new and empty, in a root only its owner can write: its
        objects are made with their mode (owner-only where a chown follows, which then opens
        them up) and not checked again; only an existing one is inspected and repaired."""
        f = self.files(slice_id)
        try:
            os.mkdir(f.dir_s, self._new_mode(SLICE_DIR_MODE))
        except FileExistsError:
            return self._repair(f, who)
        self._unwritten.add(slice_id)
        self._finish(f.dir_s, 0, who.gid, SLICE_DIR_MODE)
        os.mkdir(f.ledger_dir_s, self._new_mode(LEDGER_DIR_MODE))
        self._finish(f.ledger_dir_s, who.uid, who.gid, LEDGER_DIR_MODE)
        fd = os.open(f.ledger_s, _NEW_FILE, self._new_mode(LEDGER_MODE))
        try:
            self._finish(fd, who.uid, who.gid, LEDGER_MODE)
        finally:
            os.close(fd)
        return f

    def _repair(self, f: SliceFiles, who: Identity) -> SliceFiles:
        """An existing slice directory: owners and modes put right, missing parts made."""
        self._unwritten.discard(f.slice_id)
        if f.dir.is_symlink() or not f.dir.is_dir():
            raise OSError(errno.EEXIST, "exists and is not a directory", str(f.dir))
        self._own(f.dir, 0, who.gid, SLICE_DIR_MODE)
        _mkdir(f.ledger_dir)
        self._own(f.ledger_dir, who.uid, who.gid, LEDGER_DIR_MODE)
        fd = os.open(f.ledger, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LEDGER_MODE)
        try:
            self._own_fd(fd, who.uid, who.gid, LEDGER_MODE)
        finally:
            os.close(fd)
        return f

    def write_limits(
        self, slice_id: str, limits: SliceLimits | Mapping[str, str], who: Identity
    ) -> Path:
        """The slice's limits file: root-owned (when privileged), readable by its group only.
        In a directory `create` has just made (its slice is not published yet: no process
        can read the file before the caller answers) it is written in place; otherwise
        through a temporary file and a rename, so a reader sees the old file or the new."""
        f = self.files(slice_id)
        owner = (0, who.gid) if self.privileged else None
        if slice_id in self._unwritten:
            self._unwritten.discard(slice_id)
            with contextlib.suppress(FileExistsError):
                return write_limits_file(
                    f.limits_file, limits, mode=LIMITS_MODE, owner=owner, fsync=False, new=True
                )
        return write_limits_file(f.limits_file, limits, mode=LIMITS_MODE, owner=owner, fsync=False)

    def retire_limits(self, slice_id: str) -> bool:
        """Move a slice's limits file aside before its release is committed (a process that
        starts then finds no caps and refuses to run). False when it has none. Raises
        OSError, with nothing changed, when the tree cannot be written (a read-only disk):
        the release is then refused instead of half done."""
        f = self.files(slice_id)
        try:
            os.rename(f.limits_s, f.retired_s)
        except FileNotFoundError:
            return False
        return True

    def unretire_limits(self, slice_id: str) -> None:
        """Put a retired limits file back (the release was not committed)."""
        f = self.files(slice_id)
        os.rename(f.retired_limits_file, f.limits_file)

    def remove_limits(self, slice_id: str, retired: bool = False) -> None:
        """Delete the slice's limits file (`retired`: it was moved aside, only that one)."""
        f = self.files(slice_id)
        for path in (f.retired_s,) if retired else (f.limits_s, f.retired_s):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def remove(self, slice_id: str) -> None:
        """Delete the slice's directory (its processes are gone). The usual content (limits
        file, ledger directory and ledger) goes by name; anything else, or anything that is
        not what it should be, by a walk that never follows a symlink."""
        f = self.files(slice_id)
        self._unwritten.discard(slice_id)
        try:
            st = os.lstat(f.dir_s)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):  # a symlink (or file) in its place: only that goes
            os.unlink(f.dir_s)
            return
        try:
            for path in (f.limits_s, f.retired_s, f.ledger_s):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(f.ledger_dir_s)
            os.rmdir(f.dir_s)
        except OSError:
            shutil.rmtree(f.dir_s, ignore_errors=True)

    def slice_ids(self) -> list[str]:
        """Slices that have a directory here (valid ids only)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        return sorted(
            e.name for e in entries if is_slice_id(e.name) and e.is_dir(follow_symlinks=False)
        )

    def identity_of(self, slice_id: str) -> Identity | None:
        """Who owns an existing slice's ledger directory (kept across agent restarts)."""
        try:
            st = os.lstat(self.files(slice_id).ledger_dir)
        except OSError:
            return None
        return Identity(st.st_uid, st.st_gid) if stat.S_ISDIR(st.st_mode) else None

    def ensure_gpu(self, uuid: str) -> Path:
        """A GPU's directory (root:<workload gid> 0750) and its roster (0640, initialised):
        workloads read both and write neither."""
        d = gpu_dir(self.root, uuid)
        _mkdir(d)
        self._own(d, 0, self.workload_gid, GPU_DIR_MODE)
        fd = os.open(d / ROSTER_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self._own_fd(fd, 0, self.workload_gid, ROSTER_MODE)
            init_roster(fd)
        finally:
            os.close(fd)
        return d

    def join_gpu(
        self,
        uuid: str,
        slice_id: str,
        who: Identity,
        isolation: IsolationPolicy,
        core: int,
        writer: int,
    ) -> Path:
        """List a slice on its GPU (its policy and share) and make its activity file,
        owned by its user and readable by the GPU's other workloads. Idempotent. (The GPU's
        directory and roster are made here when missing; the agent makes and repairs them
        for every GPU when it starts.)"""
        path = self._activity(uuid, slice_id)
        try:
            self._make_activity(path, who)
        except FileNotFoundError:  # the GPU's directory is missing
            self.ensure_gpu(uuid)
            self._make_activity(path, who)
        self._edit(uuid, lambda r: r.put(RosterEntry.of(slice_id, isolation, core, writer)))
        return Path(path)

    def _gpu_dir(self, uuid: str) -> str:
        """`gpu_dir` as a string, kept per GPU."""
        found = self._gpu_dirs.get(uuid)
        if found is None:
            found = self._gpu_dirs[uuid] = str(gpu_dir(self.root, uuid))
        return found

    def _activity(self, uuid: str, slice_id: str) -> str:
        """`activity_file` as a string."""
        return f"{self._gpu_dir(uuid)}/{check_slice_id(slice_id)}{ACTIVITY_SUFFIX}"

    def _make_activity(self, path: str, who: Identity) -> None:
        """A slice's activity file: made new, or an existing one's owner and mode put
        right (a symlink in its place is refused)."""
        try:
            fd = os.open(path, _NEW_FILE, self._new_mode(ACTIVITY_MODE))
        except FileExistsError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                self._own_fd(fd, who.uid, self.workload_gid, ACTIVITY_MODE)
            finally:
                os.close(fd)
            return
        try:
            self._finish(fd, who.uid, self.workload_gid, ACTIVITY_MODE)
        finally:
            os.close(fd)

    def ensure_busy(self, uuid: str) -> Path:
        """The GPU's busy list (`enforcement.busy_view`) in its directory, root:<workload
        gid> 0640, emptied: only the node agent makes it (its watchdog writes it each scan);
        the GPU's workloads read it."""
        d = gpu_dir(self.root, uuid)
        if not (d / ROSTER_NAME).is_file():
            self.ensure_gpu(uuid)
        path = busy_file(self.root, uuid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self._own_fd(fd, 0, self.workload_gid, BUSY_MODE)
        finally:
            os.close(fd)
        view = BusyView(path)
        try:
            view.clear()
        finally:
            view.close()
        return path

    def leave_gpu(self, uuid: str, slice_id: str) -> None:
        """Take a slice off its GPU (its processes, if any still run, count for nobody)."""
        try:
            self._edit(uuid, lambda r: r.remove(slice_id))
        except FileNotFoundError:  # no roster: nothing lists it
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._activity(uuid, slice_id))

    def sync_gpu(self, uuid: str, writer: int, listed: Mapping[str, RosterEntry]) -> None:
        """Make `writer`'s entries of the GPU's roster exactly `listed` (other writers' are
        kept) and delete activity files of slices the roster does not list."""
        d = self.ensure_gpu(uuid)

        def sync(r: RosterEdit) -> None:
            for e in r.entries():
                if e.writer == writer and e.slice_id not in listed:
                    r.remove(e.slice_id)
            for e in listed.values():
                r.put(e)

        self._edit(uuid, sync)
        keep = {e.slice_id for e in read_roster(d / ROSTER_NAME)}
        for path in d.glob(f"*{ACTIVITY_SUFFIX}"):
            if path.name[: -len(ACTIVITY_SUFFIX)] not in keep:
                path.unlink(missing_ok=True)

    def evict_idle(self, uuid: str, writer: int, idle_s: float) -> list[str]:
        """Take `writer`'s slices off the GPU whose activity file has not changed and whose
        last launch is older than `idle_s` seconds (or that have no activity file); returns
        their ids."""
        gone = []
        for e in self.gpu_entries(uuid):
            if e.writer == writer and _idle_for(activity_file(self.root, uuid, e.slice_id), idle_s):
                gone.append(e.slice_id)
                self.leave_gpu(uuid, e.slice_id)
        return gone

    def gpu_entries(self, uuid: str) -> list[RosterEntry]:
        return read_roster(gpu_dir(self.root, uuid) / ROSTER_NAME)

    def _edit(self, uuid: str, change: Callable[[RosterEdit], object]) -> None:
        """Change the GPU's roster under its lock (FileNotFoundError: it has none)."""
        path = f"{self._gpu_dir(uuid)}/{ROSTER_NAME}"
        if not self._keep_rosters:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with edit_roster(fd) as r:
                    change(r)
            finally:
                os.close(fd)
            return
        with self._rosters_lock:  # threads share the kept descriptor, so flock cannot
            st = os.stat(path, follow_symlinks=False)  # tell them apart: this lock does
            kept = self._rosters.get(uuid)
            if kept is None or kept.identity != (st.st_dev, st.st_ino):
                if kept is not None:
                    kept.close()
                    del self._rosters[uuid]
                kept = self._rosters[uuid] = _OpenRoster(path)
            with edit_mapped_roster(kept.fd, kept.map) as r:
                change(r)

    def close(self) -> None:
        """Close the rosters kept open (`keep_rosters`); later edits open them again."""
        with self._rosters_lock:
            for kept in self._rosters.values():
                kept.close()
            self._rosters.clear()

    def legacy_gpu_files(self) -> list[Path]:
        """The per-GPU files of older versions, replaced by ``.gpu-<uuid>/``: region files
        (``gpu-<uuid>.region``, one writable file shared by every tenant of a GPU) and the
        agent's busy lists (``gpu-<uuid>.busy``)."""
        try:
            return sorted([*self.root.glob("gpu-*.region"), *self.root.glob("gpu-*.busy")])
        except OSError:
            return []

    def legacy_files(self) -> list[Path]:
        """Files of the flat layout before per-slice directories (``slice-<id>.ledger``)."""
        try:
            return sorted(self.root.glob("slice-*.ledger"))
        except OSError:
            return []

    # -- ownership ---------------------------------------------------------------------

    def _new_mode(self, mode: int) -> int:
        """The mode to make a new object with: its final one where nobody but its maker can
        get it meanwhile (no chown follows), else owner-only until `_finish` opens it up."""
        return mode & 0o700 if self.privileged else mode

    def _finish(self, target: str | int, uid: int, gid: int, mode: int) -> None:
        """Give an object made with `_new_mode` (a path, never followed, or an open file)
        its owner (when privileged) and then its mode, where creation did not."""
        if self.privileged:
            if isinstance(target, int):
                os.fchown(target, uid, gid)
            else:
                os.chown(target, uid, gid, follow_symlinks=False)
        if mode & self._umask or self._new_mode(mode) != mode:
            if isinstance(target, int):
                os.fchmod(target, mode)
            else:
                os.chmod(target, mode)  # a directory made here: not a symlink

    def _own(self, path: Path, uid: int, gid: int, mode: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY)
        try:
            self._own_fd(fd, uid, gid, mode)
        finally:
            os.close(fd)

    def _own_fd(self, fd: int, uid: int, gid: int, mode: int) -> None:
        st = os.fstat(fd)
        if self.privileged and (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)


_NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenRoster:
    """A GPU's roster kept open and mapped (`StateTree(keep_rosters=True)`)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < ROSTER_SIZE:
                raise OSError(errno.EINVAL, "not an initialised GPU roster", str(path))
            self.map = mmap.mmap(fd, ROSTER_SIZE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self.map.closed:
                self.close()


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise OSError(errno.EEXIST, "exists and is not a directory", str(path)) from None


_ACTIVITY_MAGIC = 0x3154434155504751  # "QGPUACT1" (enforcement/native/hook/region.c)


def _idle_for(path: Path, idle_s: float) -> bool:
    """An activity file untouched for `idle_s` seconds whose slice last launched longer ago
    than that (on the monotonic clock the interposer writes), or no file at all."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 24, 0)
    finally:
        os.close(fd)
    if time.time() - max(st.st_mtime, st.st_ctime) < idle_s:
        return False
    if len(head) == 24 and struct.unpack_from("<Q", head)[0] == _ACTIVITY_MAGIC:
        last = struct.unpack_from("<q", head, 16)[0]
        return last < time.monotonic_ns() - int(idle_s * 1e9)
    return True


def world_writable(root: Path) -> list[Path]:
    """Every file or directory under `root` that "other" can write (an audit for tests and
    health); symlinks are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and st.st_mode & stat.S_IWOTH:
                    found.append(path)
    with contextlib.suppress(OSError):
        if os.lstat(root).st_mode & stat.S_IWOTH:
            found.insert(0, Path(root))
    return found


__all__ = [
    "Identity",
    "SliceFiles",
    "StateTree",
    "activity_file",
    "busy_file",
    "gpu_dir",
    "process_identity",
    "slice_files",
    "world_writable",
]
