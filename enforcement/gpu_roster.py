"""A GPU's roster file: which slices are on the GPU, with their policy and share.

Only whoever places slices writes it (the node agent, the Kubernetes device plugin; the
interposer itself only in a directory private to its user when neither runs); workloads read
it, so no tenant can say what another slice's policy or share is. The interposer reads it in
``enforcement/native/hook/roster.c``, which documents the same layout (keep them together):

    0 magic u64 "QGPUROS1"   8 seq u64 (odd while a writer is at work)
   16 version u32            20 max_entries u32            64 entries[128] of 96 bytes
   entry: slice_id char[72] (empty = free), policy i32 (0 best-effort, 1 fixed-share,
          2 burst-share), core i32, writer u32 (1 agent, 2 device plugin, 3 hook)

Writers hold ``flock(LOCK_EX)`` on the file and make ``seq`` odd around a change; readers
copy the entries and retry while ``seq`` moved. The file is never shrunk (readers map it).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from qgpu.model import IsolationPolicy

ROSTER_MAGIC = 0x31534F5255504751  # "QGPUROS1"
ROSTER_VERSION = 1
ROSTER_MAX = 128
_HEADER = struct.Struct("<QQII")
_ENTRY = struct.Struct("<72siiI12x")
_ENTRIES_AT = 64
_ID_SIZE = 72
ROSTER_SIZE = _ENTRIES_AT + ROSTER_MAX * _ENTRY.size

WRITER_AGENT, WRITER_PLUGIN, WRITER_HOOK = 1, 2, 3
POLICY_CODES = {
    IsolationPolicy.BEST_EFFORT: 0,
    IsolationPolicy.FIXED_SHARE: 1,
    IsolationPolicy.BURST_SHARE: 2,
}


@dataclass(frozen=True)
class RosterEntry:
    slice_id: str
    policy: int
    core: int
    writer: int

    @classmethod
    def of(cls, slice_id: str, isolation: IsolationPolicy, core: int, writer: int) -> RosterEntry:
        return cls(slice_id, POLICY_CODES[IsolationPolicy(isolation)], core, writer)

    def pack(self) -> bytes:
        return _ENTRY.pack(self.slice_id.encode(), self.policy, self.core, self.writer)


class RosterFull(OSError):
    """Every entry of the GPU's roster is taken (more slices than one GPU can hold)."""


def _unpack(buf: bytes | mmap.mmap, i: int) -> RosterEntry | None:
    sid, policy, core, writer = _ENTRY.unpack_from(buf, _ENTRIES_AT + i * _ENTRY.size)
    name = sid.split(b"\0", 1)[0]
    if not name:
        return None
    return RosterEntry(name.decode(errors="replace"), policy, core, writer)


class RosterEdit:
    """The entries of a locked roster, changed in place (each change bumps ``seq``)."""

    def __init__(self, m: mmap.mmap) -> None:
        self._m = m

    def entries(self) -> list[RosterEntry]:
        return [e for i in range(ROSTER_MAX) if (e := _unpack(self._m, i)) is not None]

    def _write(self, i: int, data: bytes) -> None:
        seq = struct.unpack_from("<Q", self._m, 8)[0] | 1
        struct.pack_into("<Q", self._m, 8, seq)  # odd: readers wait
        off = _ENTRIES_AT + i * _ENTRY.size
        self._m[off : off + _ENTRY.size] = data
        struct.pack_into("<Q", self._m, 8, seq + 1)

    def _index_of(self, slice_id: str) -> int | None:
        """The entry that lists `slice_id` (a search of the mapping for its NUL-ended name
        at an entry's start, rather than unpacking every entry)."""
        needle = slice_id.encode() + b"\0"
        if len(needle) > _ID_SIZE:
            return None  # longer than an entry's name: never listed
        start = _ENTRIES_AT
        while (at := self._m.find(needle, start, ROSTER_SIZE)) >= 0:
            i, off = divmod(at - _ENTRIES_AT, _ENTRY.size)
            if off == 0:
                return i
            start = at + 1
        return None

    def _free_index(self) -> int | None:
        """The first free entry (its name's first byte is NUL)."""
        i = self._m[_ENTRIES_AT : ROSTER_SIZE : _ENTRY.size].find(b"\0")
        return None if i < 0 else i

    def put(self, entry: RosterEntry) -> None:
        """List a slice (or update its policy and share)."""
        i = self._index_of(entry.slice_id)
        if i is not None:
            if _unpack(self._m, i) != entry:
                self._write(i, entry.pack())
            return
        free = self._free_index()
        if free is None:
            raise RosterFull(f"the GPU roster has no free entry for slice {entry.slice_id}")
        self._write(free, entry.pack())

    def remove(self, slice_id: str) -> bool:
        i = self._index_of(slice_id)
        if i is None:
            return False
        self._write(i, bytes(_ENTRY.size))
        return True


def init_roster(fd: int) -> None:
    """Size and initialise a roster file (open for writing; idempotent)."""
    with _locked(fd):
        if os.fstat(fd).st_size < ROSTER_SIZE:
            os.ftruncate(fd, ROSTER_SIZE)
        with mmap.mmap(fd, ROSTER_SIZE) as m:
            if struct.unpack_from("<Q", m, 0)[0] != ROSTER_MAGIC:
                _HEADER.pack_into(m, 0, 0, 0, ROSTER_VERSION, ROSTER_MAX)
                struct.pack_into("<Q", m, 0, ROSTER_MAGIC)  # last: readers check it


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def edit_roster(fd: int) -> Iterator[RosterEdit]:
    """The roster of an initialised file open for writing, locked against other writers."""
    with mmap.mmap(fd, ROSTER_SIZE) as m, edit_mapped_roster(fd, m) as r:
        yield r


@contextlib.contextmanager
def edit_mapped_roster(fd: int, m: mmap.mmap) -> Iterator[RosterEdit]:
    """As `edit_roster`, through a mapping of `fd`'s file that the caller keeps."""
    with _locked(fd):
        if struct.unpack_from("<Q", m, 0)[0] != ROSTER_MAGIC:
            raise OSError(f"fd {fd} is not an initialised GPU roster")
        yield RosterEdit(m)


def read_roster(path: str | os.PathLike[str]) -> list[RosterEntry]:
    """The listed slices (a consistent copy); [] when the file is missing or not a roster."""
    try:
        with open(path, "rb") as f:
            for _ in range(100):
                buf = f.read(ROSTER_SIZE)
                f.seek(0)
                if len(buf) < ROSTER_SIZE or _HEADER.unpack_from(buf)[0] != ROSTER_MAGIC:
                    return []
                seq = _HEADER.unpack_from(buf)[1]
                again = os.pread(f.fileno(), 16, 0)
                if seq % 2 == 0 and struct.unpack_from("<Q", again, 8)[0] == seq:
                    return [e for i in range(ROSTER_MAX) if (e := _unpack(buf, i)) is not None]
    except FileNotFoundError:
        return []
    raise OSError(f"{path}: a writer kept the roster busy")


__all__ = [
    "POLICY_CODES",
    "ROSTER_MAX",
    "ROSTER_SIZE",
    "WRITER_AGENT",
    "WRITER_HOOK",
    "WRITER_PLUGIN",
    "RosterEdit",
    "RosterEntry",
    "RosterFull",
    "edit_mapped_roster",
    "edit_roster",
    "init_roster",
    "read_roster",
]
