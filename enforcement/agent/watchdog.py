"""The watchdog: GPU processes over their slice's memory cap, and GPU processes of no slice.

Each scan reads per-process GPU memory from NVML (or the simulated driver, through the same
pynvml calls) and attributes every process to a slice by evidence the process cannot forge
(the slice's cgroup, descent from its owner process, its pod's cgroup; its environment only
where none of those exists: `enforcement.agent.attribution`). A share slice whose processes
together hold more than its cap on its GPU has escaped the interposer (a bypass: static
linking, a raw ioctl, an unpreloaded process). Each such process is reported once while it
stays over, as one structured JSON log line, and counted in ``qgpu_watchdog_over_cap_total``;
``qgpu_watchdog_over_cap_processes`` is the number over the cap at the last scan.
With ``kill`` enabled, the slice's largest processes are SIGKILLed, largest first, until
the rest fit the cap (counted in ``qgpu_watchdog_kills_total``). Whole-GPU slices own their
card: no cap.

Processes that belong to no slice are logged once each and exposed as
``qgpu_watchdog_unowned_processes``. On a GPU that holds a slice the kill policy covers,
every byte is promised to a slice, so such a process (``env -i`` and a static binary, a
process that left its slice, a slice's process on another GPU) takes what a slice was
promised: with ``unowned="kill"`` (the node's default) it is SIGKILLed once it has been
seen for the grace (``qgpu_watchdog_unowned_kills_total``). Processes the agent cannot
see in its own pid namespace are only reported; NVIDIA's MPS server is never unowned.

Compute has the same backstop. The interposer's compute gate runs inside the tenant's own
process, so a process that launches through the raw driver (found in libcuda's symbol
table) is never gated. Each scan also reads every process's newest NVML SM-utilisation
sample; a fixed-share slice (interposer enforcement) whose processes together use more
than its core plus ``core_margin`` percentage points in every new sample for at least the
grace (and at least two samples) is over its core: reported as
``qgpu.watchdog.over_core`` (``qgpu_watchdog_over_core_total``) and, where the kill
policy covers the slice, its busiest processes are killed until the rest fit. Burst-share
slices may legitimately run above their share when the GPU is otherwise idle, best-effort
slices have no share, and under MPS the cap is a share of SMs, not of time: none of
those is checked.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from enforcement.agent.config import WatchdogKill, WatchdogUnowned
from enforcement.agent.reconcile import proc_start_time
from enforcement.discovery import GpuProcess, UtilSample
from qgpu.model import Allocation, IsolationPolicy
from qgpu.units import BYTES_PER_GIB

if TYPE_CHECKING:
    from enforcement.agent.service import Agent

log = logging.getLogger("qgpu.agent.watchdog")


@dataclass(frozen=True)
class OverCap:
    device_uuid: str
    slice_id: str
    pid: int
    used_bytes: int
    slice_used_bytes: int
    limit_bytes: int
    action: str  # reported | killed | kill-failed


@dataclass(frozen=True)
class OverCore:
    device_uuid: str
    slice_id: str
    pid: int
    util_percent: int
    slice_util_percent: int
    core_percent: int
    action: str  # reported | killed | kill-failed


@dataclass
class _CoreWatch:
    """A slice's compute check between scans: the newest sample it judged, and since when
    (and over how many samples) it has been over its core."""

    last_sample_us: int
    over_since: float | None = None
    samples_over: int = 0
    reported: set[int] = field(default_factory=set)  # pids logged in this episode


@dataclass(frozen=True)
class Unowned:
    device_uuid: str
    pid: int
    used_bytes: int | None
    action: str  # reported | killed | kill-failed


@dataclass
class WatchdogReport:
    at: float
    over_cap: list[OverCap] = field(default_factory=list)
    over_core: list[OverCore] = field(default_factory=list)
    unowned: list[GpuProcess] = field(default_factory=list)
    unowned_actions: list[Unowned] = field(default_factory=list)


class Watchdog:
    def __init__(
        self,
        agent: Agent,
        *,
        kill: WatchdogKill = "off",
        grace_s: float = 0.0,
        core_margin: int = 15,
        unowned: WatchdogUnowned = "report",
        killer: Callable[[int, int], None] = os.kill,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.kill = kill
        self.grace_s = grace_s
        self.core_margin = core_margin
        self.unowned = unowned
        self._core: dict[str, _CoreWatch] = {}  # slice -> its compute check
        self._killer = killer
        self._clock = clock
        self._seen_unowned: set[tuple[str, int]] = set()
        # (device, pid, start time) -> when a scan first saw it belong to no slice
        self._unowned_since: dict[tuple[str, int, int | None], float] = {}
        self._seen_over: set[tuple[str, int]] = set()
        self._over_since: dict[str, float] = {}  # slice -> when a scan first saw it over
        self.last: WatchdogReport | None = None

    def kills_for(self, alloc: Allocation) -> bool:
        """Whether this node kills over-cap processes of `alloc`'s policy."""
        if self.kill == "all":
            return True
        shares = (IsolationPolicy.FIXED_SHARE, IsolationPolicy.BURST_SHARE)
        return self.kill == "share" and alloc.isolation in shares

    def scan(self) -> WatchdogReport:
        agent = self.agent
        allocs = agent.ledger.allocations(agent.node)
        procs = agent.backend.processes()
        by_slice, unowned = agent.attribute(allocs, procs)
        report = WatchdogReport(at=time.time(), unowned=unowned)
        now = self._clock()
        over_now: set[str] = set()
        for alloc in allocs:
            if alloc.is_whole_gpu:
                continue
            limit = alloc.memory_gib * BYTES_PER_GIB
            uuid = alloc.gpu_uuids[0]
            mine = [
                p
                for p in by_slice.get(alloc.slice_id, [])
                if p.device_uuid == uuid and p.used_memory_bytes is not None
            ]
            total = sum(p.used_memory_bytes or 0 for p in mine)
            if total <= limit:
                continue
            over_now.add(alloc.slice_id)
            since = self._over_since.setdefault(alloc.slice_id, now)
            kill = self.kills_for(alloc) and now - since >= self.grace_s
            remaining = total
            for proc in sorted(mine, key=lambda p: p.used_memory_bytes or 0, reverse=True):
                action = "reported"
                if kill and remaining > limit:
                    action = self._kill(proc.pid)
                    if action == "killed":
                        remaining -= proc.used_memory_bytes or 0
                        agent.counters.add("watchdog_kills", (uuid, alloc.slice_id))
                event = OverCap(
                    uuid,
                    alloc.slice_id,
                    proc.pid,
                    proc.used_memory_bytes or 0,
                    total,
                    limit,
                    action,
                )
                report.over_cap.append(event)
                key = (alloc.slice_id, proc.pid)
                if key in self._seen_over and action == "reported":
                    continue  # reported at an earlier scan and still running: no new event
                agent.counters.add("watchdog_over_cap", (uuid, alloc.slice_id))
                log.warning(
                    json.dumps(
                        {
                            "event": "qgpu.watchdog.over_cap",
                            "node": agent.node,
                            "device_uuid": uuid,
                            "slice": alloc.slice_id,
                            "owner": f"{alloc.owner.kind.value}:{alloc.owner.id}",
                            "pid": proc.pid,
                            "used_bytes": event.used_bytes,
                            "slice_used_bytes": total,
                            "limit_bytes": limit,
                            "action": action,
                        },
                        sort_keys=True,
                    )
                )
        self._seen_over = {(e.slice_id, e.pid) for e in report.over_cap if e.action == "reported"}
        self._check_compute(allocs, by_slice, report, now)
        self._over_since = {k: v for k, v in self._over_since.items() if k in over_now}
        self._check_unowned(allocs, unowned, report, now)
        self.last = report
        return report

    def _check_unowned(
        self,
        allocs: list[Allocation],
        unowned: list[GpuProcess],
        report: WatchdogReport,
        now: float,
    ) -> None:
        """Report each process of no slice once; where its GPU holds a slice the kill
        policy covers and ``unowned`` is ``kill``, kill it once seen for the grace."""
        agent = self.agent
        guarded = {
            a.gpu_uuids[0] for a in allocs if not a.is_whole_gpu and self.kills_for(a)
        }
        seen: dict[tuple[str, int, int | None], float] = {}
        current: set[tuple[str, int]] = set()
        for proc in unowned:
            started = proc_start_time(proc.pid)
            key = (proc.device_uuid, proc.pid, started)
            since = seen[key] = self._unowned_since.get(key, now)
            current.add((proc.device_uuid, proc.pid))
            action = "reported"
            if (
                self.unowned == "kill"
                and proc.device_uuid in guarded
                and started is not None  # not in our pid namespace: the pid is not its own
                and now - since >= self.grace_s
            ):
                action = self._kill(proc.pid, started)
                if action == "killed":
                    agent.counters.add("watchdog_unowned_kills", proc.device_uuid)
            report.unowned_actions.append(
                Unowned(proc.device_uuid, proc.pid, proc.used_memory_bytes, action)
            )
            if action == "reported" and (proc.device_uuid, proc.pid) in self._seen_unowned:
                continue  # logged at an earlier scan and still there: no new event
            log.warning(
                json.dumps(
                    {
                        "event": "qgpu.watchdog.unowned_process",
                        "node": agent.node,
                        "device_uuid": proc.device_uuid,
                        "pid": proc.pid,
                        "used_bytes": proc.used_memory_bytes,
                        "action": action,
                    },
                    sort_keys=True,
                )
            )
        self._seen_unowned = current
        self._unowned_since = seen

    def _check_compute(
        self,
        allocs: list[Allocation],
        by_slice: dict[str, list[GpuProcess]],
        report: WatchdogReport,
        now: float,
    ) -> None:
        agent = self.agent
        watched = [
            a
            for a in allocs
            if a.isolation is IsolationPolicy.FIXED_SHARE
            and agent.enforcement_of(a) == "interposer"
        ]
        if not watched:
            self._core.clear()
            return
        try:
            utils = agent.backend.process_utilization()
        except Exception as exc:  # NVML can fail in many ways: judge again at the next scan
            log.warning("watchdog could not read process utilisation: %s", exc)
            return
        live: set[str] = set()
        for alloc in watched:
            uuid = alloc.gpu_uuids[0]
            mine = [
                (p.pid, utils[(uuid, p.pid)])
                for p in by_slice.get(alloc.slice_id, [])
                if p.device_uuid == uuid and (uuid, p.pid) in utils
            ]
            if not mine:
                continue
            live.add(alloc.slice_id)
            newest = max(sample.at_us for _pid, sample in mine)
            watch = self._core.get(alloc.slice_id)
            if watch is not None and newest <= watch.last_sample_us:
                continue  # no new sample since the last scan: nothing new to judge
            if watch is None:
                watch = self._core[alloc.slice_id] = _CoreWatch(newest)
            watch.last_sample_us = newest
            used = min(100, sum(sample.sm_util for _pid, sample in mine))
            if used <= alloc.core + self.core_margin:
                watch.over_since, watch.samples_over = None, 0
                watch.reported.clear()
                continue
            if watch.over_since is None:
                watch.over_since = now
            watch.samples_over += 1
            kill = (
                self.kills_for(alloc)
                and watch.samples_over >= 2
                and now - watch.over_since >= self.grace_s
            )
            self._report_over_core(alloc, mine, used, kill, watch, report)
            if kill:
                watch.over_since, watch.samples_over = None, 0
                watch.reported.clear()
        self._core = {k: v for k, v in self._core.items() if k in live}

    def _report_over_core(
        self,
        alloc: Allocation,
        mine: list[tuple[int, UtilSample]],
        used: int,
        kill: bool,
        watch: _CoreWatch,
        report: WatchdogReport,
    ) -> None:
        """Report (and with `kill`, end) a slice over its core: its busiest processes
        first, until what is left fits the core plus the margin."""
        agent = self.agent
        uuid = alloc.gpu_uuids[0]
        remaining = used
        for pid, sample in sorted(mine, key=lambda m: m[1].sm_util, reverse=True):
            action = "reported"
            if kill and remaining > alloc.core + self.core_margin and sample.sm_util > 0:
                action = self._kill(pid)
                if action == "killed":
                    remaining -= sample.sm_util
                    agent.counters.add("watchdog_kills", (uuid, alloc.slice_id))
            event = OverCore(uuid, alloc.slice_id, pid, sample.sm_util, used, alloc.core, action)
            report.over_core.append(event)
            if action == "reported" and pid in watch.reported:
                continue  # logged at an earlier scan of this episode: no new event
            watch.reported.add(pid)
            agent.counters.add("watchdog_over_core", (uuid, alloc.slice_id))
            log.warning(
                json.dumps(
                    {
                        "event": "qgpu.watchdog.over_core",
                        "node": agent.node,
                        "device_uuid": uuid,
                        "slice": alloc.slice_id,
                        "owner": f"{alloc.owner.kind.value}:{alloc.owner.id}",
                        "pid": pid,
                        "util_percent": sample.sm_util,
                        "slice_util_percent": used,
                        "core_percent": alloc.core,
                        "margin_percent": self.core_margin,
                        "action": action,
                    },
                    sort_keys=True,
                )
            )

    def _kill(self, pid: int, started: int | None = None) -> str:
        if pid <= 1 or pid == os.getpid():
            return "kill-failed"
        if started is not None and proc_start_time(pid) != started:
            return "kill-failed"  # gone, or the pid now names another process
        try:
            self._killer(pid, signal.SIGKILL)
        except OSError as exc:
            log.error("watchdog could not kill %d: %s", pid, exc)
            return "kill-failed"
        return "killed"


__all__ = ["OverCap", "OverCore", "Unowned", "Watchdog", "WatchdogReport"]
