"""Reading the interposer's shared per-slice ledger
(``<QGPU_STATE_DIR>/<id>/ledger/slice-<id>.ledger``, see `enforcement.state_tree`).

The interposer (enforcement/native/hook/ledger.c) keeps, per slice and shared by all of the
slice's processes, the memory charged (per process slot: pid, start time, bytes, device
busy time, launches), the slice's measured device busy time, and (ledger version >= 2) how
many allocations it refused at the memory cap and how long launches waited for compute
credit. The agent only reads it (read-only mmap-free ``pread`` of the first pages), to
report the slice's real usage; slots of processes that died are skipped (pid + start time,
like the interposer does).

Layout (little endian), kept in sync with ``slice_ledger_t`` in ledger.c:
offset 0 magic u64 ("QGPULED1"), 8 version u32, 12 max_slots u32, 16 mem_limit u64,
24 mem_used u64, 32 tokens_ns i64, 40 refill_ns i64, 48 busy_ns u64, 128 slice_id[72],
200 core i32, 204 policy i32, 208 oom_refusals u64 (v2), 216 throttled_ns u64 (v2),
512 slots[64] of 64 bytes: pid i32, flags u32, start_time u64, mem_used u64, busy_ns u64,
launches u64. Version 2 only filled padding that version 1 left zero, so one reader serves
both; a version-1 ledger (an older interposer) reports no counters (None).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from enforcement.agent.reconcile import proc_start_time
from enforcement.state_tree import slice_files

LEDGER_MAGIC = 0x3144454C55504751
_HEADER = struct.Struct("<QIIQQqqQ")
_COUNTERS = struct.Struct("<QQ")  # oom_refusals, throttled_ns
_COUNTERS_OFFSET = 208
_COUNTERS_VERSION = 2
_SLOT = struct.Struct("<iIQQQQ24x")
_SLOTS_OFFSET = 512
_MAX_SLOTS = 64
_SIZE = _SLOTS_OFFSET + _MAX_SLOTS * _SLOT.size


@dataclass(frozen=True)
class SliceLedger:
    mem_used: int  # bytes held by live processes of the slice
    busy_ns: int  # device time the slice has used, all processes, ever
    pids: tuple[int, ...]
    mem_by_pid: dict[int, int]
    # allocations refused with CUDA_ERROR_OUT_OF_MEMORY at the cap, all processes, ever;
    # None from a version-1 ledger (an interposer that did not count them)
    oom_refusals: int | None = None
    # time kernel launches waited for compute credit (summed over waiting launches); None
    # from a version-1 ledger
    throttled_ns: int | None = None


def ledger_path(state_dir: Path, slice_id: str) -> Path:
    """The ledger of `slice_id` under the slices root `state_dir` (QGPU_STATE_DIR)."""
    return slice_files(state_dir, slice_id).ledger


def read_slice_ledger(state_dir: Path, slice_id: str) -> SliceLedger | None:
    """The slice's shared ledger, or None when no process of the slice has used CUDA yet."""
    try:
        path = ledger_path(state_dir, slice_id)
    except ValueError:  # not a slice id
        return None
    return read_ledger_file(path)


def read_ledger_file(path: str | Path) -> SliceLedger | None:
    """A slice ledger file (never through a symlink), or None when missing or not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = b""
        while len(data) < _SIZE and (more := os.pread(fd, _SIZE - len(data), len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) < _SIZE:
        return None
    magic, version, max_slots, _limit, _used, _tokens, _refill, busy = _HEADER.unpack_from(data)
    if magic != LEDGER_MAGIC:
        return None
    ooms: int | None = None
    throttled: int | None = None
    if version >= _COUNTERS_VERSION:
        ooms, throttled = _COUNTERS.unpack_from(data, _COUNTERS_OFFSET)
    mem_by_pid: dict[int, int] = {}
    for i in range(min(max_slots or _MAX_SLOTS, _MAX_SLOTS)):
        pid, _flags, start, mem, _busy, _launches = _SLOT.unpack_from(
            data, _SLOTS_OFFSET + i * _SLOT.size
        )
        if pid <= 0 or proc_start_time(pid) != start:
            continue
        mem_by_pid[pid] = mem_by_pid.get(pid, 0) + mem
    return SliceLedger(
        mem_used=sum(mem_by_pid.values()),
        busy_ns=busy,
        pids=tuple(sorted(mem_by_pid)),
        mem_by_pid=mem_by_pid,
        oom_refusals=ooms,
        throttled_ns=throttled,
    )


class BusyRate:
    """Per-slice compute use (percent of the GPU) from successive busy-time samples.

    A rate needs two samples at least `min_interval_s` apart; until then the last rate
    computed is returned (None before the first).
    """

    def __init__(self, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self._prev: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}
        self._lock = threading.Lock()

    def update(self, slice_id: str, busy_ns: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        with self._lock:
            prev = self._prev.get(slice_id)
            if prev is None:
                self._prev[slice_id] = (now, busy_ns)
                return None
            t0, b0 = prev
            if now - t0 >= self.min_interval_s:
                delta = max(0, busy_ns - b0)
                self._rate[slice_id] = round(100.0 * delta / ((now - t0) * 1e9), 2)
                self._prev[slice_id] = (now, busy_ns)
            return self._rate.get(slice_id)

    def forget(self, keep: set[str]) -> None:
        with self._lock:
            for sid in [s for s in self._prev if s not in keep]:
                self._prev.pop(sid, None)
                self._rate.pop(sid, None)


__all__ = ["BusyRate", "SliceLedger", "ledger_path", "read_ledger_file", "read_slice_ledger"]
