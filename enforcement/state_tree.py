"""The node's slice files on disk: one directory per slice, one region file per GPU, and who
owns what. The node agent and the device plugin (without an agent) create them; the
interposer (enforcement/native/hook/ledger.c, region.c) and `enforcement.agent.slice_stats`
use them. The layout under a slices root (``<state-dir>/slices``, the workloads'
``QGPU_STATE_DIR``)::

    slices/                                 root 0711   traversable, not listable
    slices/gpu-<uuid>.region                root:<workload gid> 0660   what the processes
                                                        on one GPU tell each other
    slices/gpu-<uuid>.busy                  root:<workload gid> 0640   which slices NVML
                                                        shows busy (the agent's watchdog)
    slices/<id>/                            root:<gid> 0750   the slice's directory
    slices/<id>/limits.conf                 root:<gid> 0440   its caps (trusted by the hook)
    slices/<id>/ledger/                     <uid>:<gid> 0700  the only place it writes
    slices/<id>/ledger/slice-<id>.ledger    <uid>:<gid> 0600  its processes' shared ledger

``<uid>:<gid>`` is the slice's workload identity (`Identity`): the user its processes run
as. The ledger is created here, before the workload starts, owned by that user: the
interposer then opens a file nobody else can open, and no other user can create it first.
A workload cannot replace its limits file (its directory is not writable by it). Nothing
in the tree is writable by "other". In Kubernetes a container receives its slice's
``ledger/`` directory, its ``limits.conf`` (read-only), its GPU's region file and (read-only)
its GPU's busy file — nothing of another slice.

Without root (tests, laptops, ``--test-mode``) nothing is chowned: every file belongs to
the process that runs the agent, with the same modes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from enforcement.busy_view import BUSY_MODE, SIZE, busy_file
from enforcement.limits import SliceLimits, write_limits_file
from qgpu.model import check_slice_id, is_slice_id

ROOT_MODE = 0o711
SLICE_DIR_MODE = 0o750
LEDGER_DIR_MODE = 0o700
LEDGER_MODE = 0o600
LIMITS_MODE = 0o440
REGION_MODE = 0o660
LIMITS_NAME = "limits.conf"
LEDGER_DIR_NAME = "ledger"


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
    """The paths of one slice under a slices root (each built once, on first use)."""

    root: Path
    slice_id: str

    @cached_property
    def dir(self) -> Path:
        return self.root / self.slice_id

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


def region_file(root: Path, uuid: str) -> Path:
    return Path(root) / f"gpu-{uuid}.region"


class StateTree:
    """Creates, repairs and removes the slice files under one slices root.

    `privileged`: chown to root and to the slices' identities (the agent or plugin runs as
    root in production); otherwise files keep the caller's ownership. `workload_gid`: the
    group that may use the GPUs' region files (0: root only).
    """

    def __init__(self, root: Path, *, privileged: bool, workload_gid: int = 0) -> None:
        self.root = Path(root)
        self.privileged = privileged
        self.workload_gid = workload_gid
        self._files: dict[str, SliceFiles] = {}

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
        existing ones get their owner and mode back; a symlink in their place is refused."""
        f = self.files(slice_id)
        _mkdir(f.dir)
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
        """The slice's limits file: root-owned (when privileged), readable by its group only."""
        f = self.files(slice_id)
        return write_limits_file(
            f.limits_file,
            limits,
            mode=LIMITS_MODE,
            owner=(0, who.gid) if self.privileged else None,
            fsync=False,
        )

    def retire_limits(self, slice_id: str) -> bool:
        """Move a slice's limits file aside before its release is committed (a process that
        starts then finds no caps and refuses to run). False when it has none. Raises
        OSError, with nothing changed, when the tree cannot be written (a read-only disk):
        the release is then refused instead of half done."""
        f = self.files(slice_id)
        try:
            os.rename(f.limits_file, f.retired_limits_file)
        except FileNotFoundError:
            return False
        return True

    def unretire_limits(self, slice_id: str) -> None:
        """Put a retired limits file back (the release was not committed)."""
        f = self.files(slice_id)
        os.rename(f.retired_limits_file, f.limits_file)

    def remove_limits(self, slice_id: str) -> None:
        f = self.files(slice_id)
        f.limits_file.unlink(missing_ok=True)
        f.retired_limits_file.unlink(missing_ok=True)

    def remove(self, slice_id: str) -> None:
        """Delete the slice's directory (its processes are gone)."""
        f = self.files(slice_id)
        if f.dir.is_symlink():
            f.dir.unlink()
        else:
            shutil.rmtree(f.dir, ignore_errors=True)

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

    def ensure_region(self, uuid: str) -> Path:
        """A GPU's region file, pre-created root:<workload gid> 0660 (the interposer sizes
        and initialises it); a legacy world-writable one is tightened."""
        path = region_file(self.root, uuid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, REGION_MODE)
        try:
            self._own_fd(fd, 0, self.workload_gid, REGION_MODE)
        finally:
            os.close(fd)
        return path

    def ensure_busy(self, uuid: str) -> Path:
        """A GPU's busy file (`enforcement.busy_view`), root:<workload gid> 0640: only the
        agent writes it; the GPU's workloads read it."""
        path = busy_file(self.root, uuid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, BUSY_MODE)
        try:
            self._own_fd(fd, 0, self.workload_gid, BUSY_MODE)
            if os.fstat(fd).st_size != SIZE:
                os.ftruncate(fd, SIZE)
        finally:
            os.close(fd)
        return path

    def legacy_files(self) -> list[Path]:
        """Files of the flat layout before per-slice directories (``slice-<id>.ledger``)."""
        try:
            return sorted(self.root.glob("slice-*.ledger"))
        except OSError:
            return []

    # -- ownership ---------------------------------------------------------------------

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


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise OSError(errno.EEXIST, "exists and is not a directory", str(path)) from None


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
    "process_identity",
    "region_file",
    "slice_files",
    "world_writable",
]
