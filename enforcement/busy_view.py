"""gpu-<uuid>.busy: which slices NVML shows busy on a GPU, as the node agent's watchdog
judged them, for the interposer (enforcement/native/hook/busy.c) to read.

The interposer's own view of its neighbours (the GPU region: launches in the last 100 ms,
work it expects queued) is what each process publishes about itself, so it misses work
that does not go through the hook (launches through the raw driver, a static binary) and
the middle of a kernel longer than 100 ms. A burst-share or best-effort slice that cannot
see such a neighbour bursts into it; the watchdog, judging by NVML, would then find that
well-behaved slice over its share beside a busy neighbour. So the watchdog publishes what
it saw here, each scan, and the interposer counts every slice listed as active. The file is
written only by the agent (root, mode 0640, group: the workloads' group), so a tenant can
neither hide a neighbour nor invent one.

Layout (little endian, 6208 bytes)::

    0   magic u64 "QGPUBSY1"      8  version u32 (1)       12 count u32 (entries in use)
    16  seq u64 (odd while the agent writes: readers retry)
    24  valid_until_ns i64 (CLOCK_MONOTONIC; after it the list says nothing)
    64  entries[64], 96 bytes each: slice_id char[72], policy i32 (0 best-effort,
        1 fixed-share, 2 burst-share), core i32, util i32 (NVML SM %, summed), pad
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from qgpu.model import IsolationPolicy

MAGIC = 0x3159534255504751  # "QGPUBSY1" little endian
VERSION = 1
MAX_ENTRIES = 64
HEADER_SIZE = 64
ENTRY_SIZE = 96
SIZE = HEADER_SIZE + MAX_ENTRIES * ENTRY_SIZE
BUSY_MODE = 0o640
_HEADER = struct.Struct("<QII")
_SEQ = struct.Struct("<Q")
_UNTIL = struct.Struct("<q")
_ENTRY = struct.Struct("<72siii")
POLICY_CODE = {
    IsolationPolicy.BEST_EFFORT: 0,
    IsolationPolicy.FIXED_SHARE: 1,
    IsolationPolicy.BURST_SHARE: 2,
}


def busy_file(root: Path, uuid: str) -> Path:
    return root / f"gpu-{uuid}.busy"


@dataclass(frozen=True)
class BusySlice:
    slice_id: str
    isolation: IsolationPolicy
    core: int
    util_percent: int


class BusyView:
    """The agent's writer of one GPU's busy file (created by `StateTree.ensure_busy`)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, _version, _count = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC:
            self._map[:] = bytes(SIZE)
            _HEADER.pack_into(self._map, 0, MAGIC, VERSION, 0)

    def write(self, slices: list[BusySlice], valid_for_s: float) -> None:
        """Replace the list; readers see it (or the one before) whole, never half."""
        m = self._map
        (seq,) = _SEQ.unpack_from(m, 16)
        seq += 1 if seq % 2 == 0 else 0  # odd: being written
        _SEQ.pack_into(m, 16, seq)
        shown = slices[:MAX_ENTRIES]
        for i, s in enumerate(shown):
            _ENTRY.pack_into(
                m,
                HEADER_SIZE + i * ENTRY_SIZE,
                s.slice_id.encode()[:71],
                POLICY_CODE[s.isolation],
                s.core,
                s.util_percent,
            )
        until = time.monotonic_ns() + int(valid_for_s * 1e9)
        _UNTIL.pack_into(m, 24, until)
        _HEADER.pack_into(m, 0, MAGIC, VERSION, len(shown))
        _SEQ.pack_into(m, 16, seq + 1)  # even: whole

    def read(self) -> tuple[list[BusySlice], int]:
        """The list and its valid_until_ns (for tests and `qgpu status`-like readers)."""
        m = self._map
        _magic, _version, count = _HEADER.unpack_from(m, 0)
        (until,) = _UNTIL.unpack_from(m, 24)
        by_code = {v: k for k, v in POLICY_CODE.items()}
        out = []
        for i in range(min(count, MAX_ENTRIES)):
            raw, policy, core, util = _ENTRY.unpack_from(m, HEADER_SIZE + i * ENTRY_SIZE)
            out.append(BusySlice(raw.split(b"\0", 1)[0].decode(), by_code[policy], core, util))
        return out, until

    def close(self) -> None:
        self._map.close()


__all__ = ["BUSY_MODE", "SIZE", "BusySlice", "BusyView", "busy_file"]
