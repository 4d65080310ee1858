"""A GPU's busy list (``.gpu-<uuid>/busy``): the slices the node agent's watchdog saw run
in NVML's per-process samples at its last scan, for the interposer to count as active
(read in enforcement/native/hook/busy.c, which documents the same layout: keep them
together).

A slice's own activity file says only what its hooked processes tell: work through the raw
driver, a static binary or the middle of a kernel longer than the activity window is
missing there, and a tenant may hide its file altogether. A burst-share or best-effort slice
that cannot see such a neighbour would take what it was promised (and the watchdog, which
judges by NVML, would then find the well-behaved slice over its allowance). The driver's
view has no such hole, so the watchdog writes it here each scan; the interposer counts a
slice active if its activity says so or this list names it. The file lies in the GPU's
directory next to the roster and is written only by the agent (root, mode 0640, group: the
workload group), so a tenant can neither hide a neighbour nor invent one. It names slices
only: their policy and share come from the roster.

Layout (little endian, `SIZE` bytes)::

    0   magic u64 "QGPUBSY1"      8  version u32 (1)       12 count u32 (entries in use)
    16  seq u64 (odd while the agent writes: readers retry)
    24  valid_until_ns i64 (CLOCK_MONOTONIC; after it the list says nothing: the agent
        stopped)
    64  entries[64], 80 bytes each: slice_id char[72], util i32 (NVML SM %, summed over the
        slice's processes), reserved u32
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x3159534255504751  # "QGPUBSY1" little endian
VERSION = 1
MAX_ENTRIES = 64
HEADER_SIZE = 64
ENTRY_SIZE = 80
SIZE = HEADER_SIZE + MAX_ENTRIES * ENTRY_SIZE
BUSY_NAME = "busy"
BUSY_MODE = 0o640
_HEADER = struct.Struct("<QII")
_SEQ = struct.Struct("<Q")
_UNTIL = struct.Struct("<q")
_ENTRY = struct.Struct("<72si4x")


@dataclass(frozen=True)
class BusySlice:
    slice_id: str
    util_percent: int


class BusyView:
    """The busy list of one GPU, mapped from its file (made by `StateTree.ensure_busy`)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if _HEADER.unpack_from(self._map, 0)[0] != MAGIC:
            self.clear()

    def write(self, slices: list[BusySlice], valid_for_s: float) -> None:
        """Replace the list; readers see it (or the one before) whole, never half."""
        shown = slices[:MAX_ENTRIES]
        until = time.monotonic_ns() + int(valid_for_s * 1e9)
        self._replace(shown, until)

    def clear(self) -> None:
        """A list that names nobody and is valid never (a previous run's list, or one from
        before a reboot, whose monotonic clock started again, says nothing true now)."""
        self._replace([], 0)

    def _replace(self, shown: list[BusySlice], until: int) -> None:
        m = self._map
        (seq,) = _SEQ.unpack_from(m, 16)
        seq |= 1  # odd: being written
        _SEQ.pack_into(m, 16, seq)
        for i, s in enumerate(shown):
            _ENTRY.pack_into(
                m, HEADER_SIZE + i * ENTRY_SIZE, s.slice_id.encode()[:71], s.util_percent
            )
        _UNTIL.pack_into(m, 24, until)
        _HEADER.pack_into(m, 0, MAGIC, VERSION, len(shown))
        _SEQ.pack_into(m, 16, seq + 1)  # even: whole

    def read(self) -> tuple[list[BusySlice], int]:
        """The list and its valid_until_ns (for tests and diagnostics)."""
        m = self._map
        _magic, _version, count = _HEADER.unpack_from(m, 0)
        (until,) = _UNTIL.unpack_from(m, 24)
        out = []
        for i in range(min(count, MAX_ENTRIES)):
            raw, util = _ENTRY.unpack_from(m, HEADER_SIZE + i * ENTRY_SIZE)
            out.append(BusySlice(raw.split(b"\0", 1)[0].decode(errors="replace"), util))
        return out, until

    def close(self) -> None:
        self._map.close()


__all__ = ["BUSY_MODE", "BUSY_NAME", "SIZE", "BusySlice", "BusyView"]
