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
process and debits a kernel only once it has ended, so a process that launches through the
raw driver (found in libcuda's symbol table), or one kernel that runs for many seconds,
holds its time slices of the GPU whatever the gate says. Each scan also reads every
process's newest NVML SM-utilisation sample and judges each interposer slice against its
allowance (`allowance`), in every new sample, plus ``core_margin`` percentage points:

* fixed-share: its core, always;
* burst-share: its core, while another slice on its GPU is busy (it may borrow only idle
  compute);
* best-effort: what the busy guaranteed (fixed- or burst-share) slices leave, 100 minus
  their cores, split between the busy best-effort slices, while a guaranteed slice is busy.

A slice is *busy* when NVML's fresh samples of its processes add up to at least
``BUSY_PERCENT``; a neighbour counts only when it was busy at this scan and the one before,
so a well-behaved slice has had a scan's time to see it (below). A slice over its allowance
for at least the grace (and at least two samples) is reported as ``qgpu.watchdog.over_core``
(``qgpu_watchdog_over_core_total``) and, where the kill policy covers it, its busiest
processes are killed until the rest fit. Under MPS the cap is a share of SMs, not of time:
not checked.

The interposer decides for itself when a burst-share slice may burst and what a best-effort
slice may take, from the activity files the slices of the GPU write about themselves; a
neighbour whose work bypasses the hook, sits in one long kernel, or that hides its file, is
missing there. So each scan also writes the slices it saw busy to the GPU's busy list
(``.gpu-<uuid>/busy``, `enforcement.busy_view`), which the interposer counts as active
neighbours: a well-behaved slice falls back before the watchdog could judge it, and a
tenant that hides its work cannot get its neighbour killed nor take its neighbour's share.

GPU settings have a backstop too. Root may change a GPU's compute mode and accounting mode
through NVML for every process on it: EXCLUSIVE_PROCESS or PROHIBITED denies every other
slice a new context. The interposer refuses these calls in a slice; a process that goes
around it does not ask. The first scan records each GPU's `GPU_SETTINGS` as the agent found
them (the operator's), and every later scan sets back any that changed, logging
``qgpu.watchdog.gpu_setting`` (which setting, found, restored to, the action) and counting
``qgpu_watchdog_gpu_settings_restored_total``. Who changed it is not known (NVML does not
say). An operator who changes one on purpose restarts the agent after.
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
from enforcement.busy_view import BusySlice, BusyView
from enforcement.discovery import GPU_SETTINGS, GpuProcess, UtilSample
from enforcement.state_tree import busy_file
from qgpu.model import Allocation, IsolationPolicy
from qgpu.units import BYTES_PER_GIB

if TYPE_CHECKING:
    from enforcement.agent.service import Agent

log = logging.getLogger("qgpu.agent.watchdog")

# A slice is busy when its processes' fresh NVML samples add up to at least this many
# percent of the GPU (any measured use; NVML reports whole percents).
BUSY_PERCENT = 1
# Samples older than this before the GPU's newest one are stale for telling who is busy.
BUSY_FRESH_US = 1_000_000


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
    allowed_percent: float = 0.0  # what the slice was judged against (before the margin)
    isolation: str = "fixed-share"
    busy_slices: tuple[str, ...] = ()  # the busy neighbours that made it an allowance


@dataclass(frozen=True)
class Allowance:
    """What a slice may use of its GPU right now (percent), and the busy neighbours that
    make it so."""

    percent: float
    busy: tuple[str, ...] = ()


def busy_slices(
    group: list[Allocation], samples: dict[str, list[tuple[int, UtilSample]]]
) -> dict[str, int]:
    """The slices of one GPU that NVML's fresh samples show busy, with their use."""
    stamps = [s.at_us for a in group for _pid, s in samples.get(a.slice_id, [])]
    if not stamps:
        return {}
    fresh_from = max(stamps) - BUSY_FRESH_US
    out = {}
    for alloc in group:
        mine = samples.get(alloc.slice_id, [])
        used = sum(s.sm_util for _pid, s in mine if s.at_us >= fresh_from)
        if used >= BUSY_PERCENT:
            out[alloc.slice_id] = min(100, used)
    return out


def allowance(
    alloc: Allocation,
    group: list[Allocation],
    busy_now: dict[str, int] | set[str],
    busy_before: set[str],
) -> Allowance | None:
    """What `alloc` may use of its GPU (see the module docstring); None: anything (its
    neighbours are idle). `group` is every slice on the GPU; a neighbour counts as busy
    when it is busy now and was at the previous scan."""
    others = [
        a
        for a in group
        if a.slice_id != alloc.slice_id and a.slice_id in busy_now and a.slice_id in busy_before
    ]
    names = tuple(sorted(a.slice_id for a in others))
    if alloc.isolation is IsolationPolicy.FIXED_SHARE:
        return Allowance(alloc.core, names)
    if not others:
        return None
    if alloc.isolation is IsolationPolicy.BURST_SHARE:
        return Allowance(alloc.core, names)
    guaranteed = [a for a in others if a.isolation is not IsolationPolicy.BEST_EFFORT]
    if not guaranteed:
        return None
    rest = max(0, 100 - sum(a.core for a in guaranteed))
    peers = 1 + sum(
        1
        for a in group
        if a.slice_id != alloc.slice_id
        and a.isolation is IsolationPolicy.BEST_EFFORT
        and a.slice_id in busy_now
    )
    return Allowance(rest / peers, tuple(sorted(a.slice_id for a in guaranteed)))


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


@dataclass(frozen=True)
class SettingChange:
    """A GPU setting found changed since the first scan, and what the watchdog did."""

    device_uuid: str
    setting: str
    found: int
    expected: int
    action: str  # "restored", or "not_restored: <NVML's error>"


@dataclass
class WatchdogReport:
    at: float
    over_cap: list[OverCap] = field(default_factory=list)
    over_core: list[OverCore] = field(default_factory=list)
    unowned: list[GpuProcess] = field(default_factory=list)
    unowned_actions: list[Unowned] = field(default_factory=list)
    settings: list[SettingChange] = field(default_factory=list)


class Watchdog:
    def __init__(
        self,
        agent: Agent,
        *,
        kill: WatchdogKill = "off",
        grace_s: float = 0.0,
        core_margin: int = 15,
        interval_s: float = 5.0,
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
        self._busy_before: dict[str, set[str]] = {}  # GPU -> slices busy at the last scan
        self._views: dict[str, BusyView] = {}  # GPU -> its busy list
        # how long a published busy list holds if no scan replaces it (the agent stalled)
        self.publish_for_s = 3 * interval_s + 1.0
        self._killer = killer
        self._clock = clock
        self._seen_unowned: set[tuple[str, int]] = set()
        # (device, pid, start time) -> when a scan first saw it belong to no slice
        self._unowned_since: dict[tuple[str, int, int | None], float] = {}
        self._seen_over: set[tuple[str, int]] = set()
        self._over_since: dict[str, float] = {}  # slice -> when a scan first saw it over
        self.last: WatchdogReport | None = None
        self._settings: dict[str, dict[str, int]] | None = None  # GPU -> as first found
        self._seen_settings: set[tuple[str, str, int]] = set()  # unrestorable, logged once

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
        self._keep_settings(report)
        self.last = report
        return report

    def _keep_settings(self, report: WatchdogReport) -> None:
        """Sets back every GPU setting that changed since the first scan."""
        agent = self.agent
        found = agent.backend.gpu_settings()
        if self._settings is None:
            self._settings = found
            return
        for uuid, expected in self._settings.items():
            now = found.get(uuid, {})
            for name in GPU_SETTINGS:
                want, have = expected.get(name), now.get(name)
                if want is None or have is None or want == have:
                    continue
                error = agent.backend.set_gpu_setting(uuid, name, want)
                action = "restored" if error is None else f"not_restored: {error}"
                report.settings.append(SettingChange(uuid, name, have, want, action))
                if error is None:
                    agent.counters.add("watchdog_settings_restored", (uuid, name))
                elif (uuid, name, have) in self._seen_settings:
                    continue  # cannot set it back: said once
                else:
                    self._seen_settings.add((uuid, name, have))
                log.warning(
                    json.dumps(
                        {
                            "event": "qgpu.watchdog.gpu_setting",
                            "node": agent.node,
                            "device_uuid": uuid,
                            "setting": name,
                            "found": have,
                            "expected": want,
                            "action": action,
                        },
                        sort_keys=True,
                    )
                )

    def kills_compute_for(self, alloc: Allocation) -> bool:
        """Whether this node kills processes of `alloc` for compute. Every compute rule
        protects a guaranteed (fixed- or burst-share) slice's promise: a share slice over its
        own core, or a best-effort slice taking what busy guaranteed slices were promised.
        So `all` (the default) and `share` kill for all three policies; `off` reports."""
        return self.kill != "off"

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
            a for a in allocs if not a.is_whole_gpu and agent.enforcement_of(a) == "interposer"
        ]
        if not watched:
            self._core.clear()
            self._busy_before.clear()
            self._publish_busy({})
            return
        try:
            utils = agent.backend.process_utilization()
        except Exception as exc:  # NVML can fail in many ways: judge again at the next scan
            log.warning("watchdog could not read process utilisation: %s", exc)
            return
        on_gpu: dict[str, list[Allocation]] = {}
        samples: dict[str, list[tuple[int, UtilSample]]] = {}
        for alloc in watched:
            uuid = alloc.gpu_uuids[0]
            on_gpu.setdefault(uuid, []).append(alloc)
            samples[alloc.slice_id] = [
                (p.pid, utils[(uuid, p.pid)])
                for p in by_slice.get(alloc.slice_id, [])
                if p.device_uuid == uuid and (uuid, p.pid) in utils
            ]
        busy = {uuid: busy_slices(group, samples) for uuid, group in on_gpu.items()}
        live: set[str] = set()
        for alloc in watched:
            mine = samples[alloc.slice_id]
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
            uuid = alloc.gpu_uuids[0]
            used = min(100, sum(sample.sm_util for _pid, sample in mine))
            judged = allowance(alloc, on_gpu[uuid], busy[uuid], self._busy_before.get(uuid, set()))
            if judged is None or used <= judged.percent + self.core_margin:
                watch.over_since, watch.samples_over = None, 0
                watch.reported.clear()
                continue
            if watch.over_since is None:
                watch.over_since = now
            watch.samples_over += 1
            kill = (
                self.kills_compute_for(alloc)
                and watch.samples_over >= 2
                and now - watch.over_since >= self.grace_s
            )
            self._report_over_core(alloc, mine, used, judged, kill, watch, report)
            if kill:
                watch.over_since, watch.samples_over = None, 0
                watch.reported.clear()
        self._core = {k: v for k, v in self._core.items() if k in live}
        self._busy_before = {uuid: set(b) for uuid, b in busy.items()}
        self._publish_busy(
            {
                uuid: [(a, busy[uuid][a.slice_id]) for a in group if a.slice_id in busy[uuid]]
                for uuid, group in on_gpu.items()
            }
        )

    def _report_over_core(
        self,
        alloc: Allocation,
        mine: list[tuple[int, UtilSample]],
        used: int,
        judged: Allowance,
        kill: bool,
        watch: _CoreWatch,
        report: WatchdogReport,
    ) -> None:
        """Report (and with `kill`, end) a slice over its allowance: its busiest processes
        first, until what is left fits the allowance plus the margin."""
        agent = self.agent
        uuid = alloc.gpu_uuids[0]
        limit = judged.percent + self.core_margin
        remaining = used
        for pid, sample in sorted(mine, key=lambda m: m[1].sm_util, reverse=True):
            action = "reported"
            if kill and remaining > limit and sample.sm_util > 0:
                action = self._kill(pid)
                if action == "killed":
                    remaining -= sample.sm_util
                    agent.counters.add("watchdog_kills", (uuid, alloc.slice_id))
            event = OverCore(
                uuid,
                alloc.slice_id,
                pid,
                sample.sm_util,
                used,
                alloc.core,
                action,
                allowed_percent=judged.percent,
                isolation=alloc.isolation.value,
                busy_slices=judged.busy,
            )
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
                        "isolation": alloc.isolation.value,
                        "pid": pid,
                        "util_percent": sample.sm_util,
                        "slice_util_percent": used,
                        "core_percent": alloc.core,
                        "allowed_percent": round(judged.percent, 1),
                        "margin_percent": self.core_margin,
                        "busy_slices": list(judged.busy),
                        "action": action,
                    },
                    sort_keys=True,
                )
            )

    def _publish_busy(self, busy: dict[str, list[tuple[Allocation, int]]]) -> None:
        """Tell the interposers of every GPU which slices NVML shows busy."""
        for gpu in self.agent.inventory.gpus:
            try:
                view = self._views.get(gpu.uuid)
                if view is None:
                    path = busy_file(self.agent.tree.root, gpu.uuid)
                    if not path.exists():
                        continue  # not made by this agent (ensure_busy): nobody reads it
                    view = self._views[gpu.uuid] = BusyView(path)
                listed = [BusySlice(a.slice_id, used) for a, used in busy.get(gpu.uuid, [])]
                view.write(listed, self.publish_for_s)
            except (OSError, ValueError) as exc:
                log.warning("watchdog could not publish the busy slices of %s: %s", gpu.uuid, exc)

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


__all__ = [
    "BUSY_PERCENT",
    "Allowance",
    "OverCap",
    "OverCore",
    "Unowned",
    "Watchdog",
    "WatchdogReport",
    "allowance",
    "busy_slices",
]
