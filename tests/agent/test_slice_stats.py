"""Reading the interposer's per-slice ledger file, and the busy-time rate."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

from enforcement.agent.models import ReserveRequest
from enforcement.agent.reconcile import proc_start_time
from enforcement.agent.service import Agent
from enforcement.agent.slice_stats import (
    LEDGER_MAGIC,
    BusyRate,
    ledger_path,
    read_slice_ledger,
)
from qgpu.model import SliceRequest

GIB = 1 << 30


def write_ledger(
    path: Path,
    busy_ns: int,
    slots: list[tuple[int, int, int]],
    version: int = 2,
    oom_refusals: int = 0,
    throttled_ns: int = 0,
) -> None:
    """A slice ledger laid out as slice_ledger_t in enforcement/native/hook/ledger.c."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(512 + 64 * 64)
    used = sum(m for _, _, m in slots)
    struct.pack_into("<QIIQQqqQ", data, 0, LEDGER_MAGIC, version, 64, 4 * GIB, used, 0, 0, busy_ns)
    if version >= 2:
        struct.pack_into("<QQ", data, 208, oom_refusals, throttled_ns)
    for i, (pid, start, mem) in enumerate(slots):
        struct.pack_into("<iIQQQQ", data, 512 + 64 * i, pid, 0, start, mem, 0, 1)
    path.write_bytes(bytes(data))


def test_live_slots_only(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    start = proc_start_time(me)
    assert start is not None
    write_ledger(
        ledger_path(tmp_path, "s-1"),
        busy_ns=7_000_000,
        slots=[(me, start, 2 * GIB), (dead.pid, 1234, GIB), (me, start + 1, GIB)],
    )
    led = read_slice_ledger(tmp_path, "s-1")
    assert led is not None
    assert led.mem_used == 2 * GIB  # the dead process and the reused pid do not count
    assert led.pids == (me,)
    assert led.busy_ns == 7_000_000


def test_oom_and_throttle_counters_from_version_2_only(tmp_path: Path) -> None:
    write_ledger(ledger_path(tmp_path, "s-v2"), 0, [], oom_refusals=3, throttled_ns=1_500_000)
    led = read_slice_ledger(tmp_path, "s-v2")
    assert led is not None
    assert (led.oom_refusals, led.throttled_ns) == (3, 1_500_000)
    # an older interposer's ledger: same layout, the counters were never kept
    write_ledger(ledger_path(tmp_path, "s-v1"), 0, [], version=1)
    led = read_slice_ledger(tmp_path, "s-v1")
    assert led is not None
    assert (led.oom_refusals, led.throttled_ns) == (None, None)


def test_missing_or_foreign_files_read_as_none(tmp_path: Path) -> None:
    assert read_slice_ledger(tmp_path, "s-none") is None
    for sid in ("s-bad", "s-short"):
        ledger_path(tmp_path, sid).parent.mkdir(parents=True)
    ledger_path(tmp_path, "s-bad").write_bytes(b"\0" * 5000)
    assert read_slice_ledger(tmp_path, "s-bad") is None
    ledger_path(tmp_path, "s-short").write_bytes(b"\0" * 10)
    assert read_slice_ledger(tmp_path, "s-short") is None
    # never through a symlink (another slice's ledger, or any file of the node)
    write_ledger(ledger_path(tmp_path, "s-real"), 0, [])
    link = ledger_path(tmp_path, "s-link")
    link.parent.mkdir(parents=True)
    link.symlink_to(ledger_path(tmp_path, "s-real"))
    assert read_slice_ledger(tmp_path, "s-real") is not None
    assert read_slice_ledger(tmp_path, "s-link") is None
    assert read_slice_ledger(tmp_path, "..") is None  # not a slice id: no path at all


def test_busy_rate_is_busy_time_per_wall_second() -> None:
    rate = BusyRate(min_interval_s=1.0)
    assert rate.update("s", 0, now=100.0) is None
    assert rate.update("s", 100_000_000, now=100.5) is None  # too soon for a rate
    assert rate.update("s", 300_000_000, now=101.0) == 30.0  # 0.3 s busy in 1 s
    assert rate.update("s", 300_000_000, now=101.2) == 30.0  # keeps the last rate
    assert rate.update("s", 300_000_000, now=102.0) == 0.0
    rate.forget(set())
    assert rate.update("s", 0, now=103.0) is None


def test_release_drops_the_slice_ledger_once_its_processes_are_gone(agent: Agent) -> None:
    req = ReserveRequest(request=SliceRequest(core=10, memory_gib=4))
    idle, busy = agent.reserve(req).slice_id, agent.reserve(req).slice_id
    me = os.getpid()
    write_ledger(ledger_path(agent.config.slices_dir, idle), 0, [(me, 1, GIB)])  # stale slot
    write_ledger(ledger_path(agent.config.slices_dir, busy), 0, [(me, proc_start_time(me), GIB)])
    agent.release(idle)
    agent.release(busy)
    assert not (agent.config.slices_dir / idle).exists()  # the whole slice directory
    assert ledger_path(agent.config.slices_dir, busy).exists()  # a live process still maps it
    assert not (agent.config.slices_dir / busy / "limits.conf").exists()  # no new process
