"""Prometheus metrics of the agent: a custom collector that reads current state at scrape time.

Nothing is cached between scrapes: each scrape reads the ledger, NVML (or the simulator)
and the agent's event counters. Every metric is documented in docs/metrics.md; labels are
``node``, ``device_uuid``, ``slice`` and ``owner`` (``<kind>:<id>``) where they apply.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from enforcement.agent.service import Agent

SLICE_LABELS = ["node", "device_uuid", "slice", "owner"]


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def describe(self) -> list[Metric]:
        return []  # dynamic collector: no registration-time scrape

    def collect(self) -> Iterator[Metric]:
        yield from self._devices()
        yield from self._slices()
        yield from self._agent()
        yield from self._watchdog()

    def _devices(self) -> Iterator[Metric]:
        agent = self.agent
        node = agent.node
        labels = ["node", "device_uuid"]
        info = GaugeMetricFamily(
            "qgpu_device_info", "A GPU of the node (value 1)", labels=[*labels, "index", "model"]
        )
        total = GaugeMetricFamily("qgpu_device_memory_total_bytes", "GPU memory", labels=labels)
        used = GaugeMetricFamily(
            "qgpu_device_memory_used_bytes", "GPU memory in use (all processes)", labels=labels
        )
        util = GaugeMetricFamily(
            "qgpu_device_utilization_ratio", "GPU busy fraction (NVML, 0..1)", labels=labels
        )
        healthy = GaugeMetricFamily(
            "qgpu_device_healthy", "1 healthy, 0 unhealthy (ECC/Xid)", labels=labels
        )
        slices = GaugeMetricFamily("qgpu_device_slices", "Slices on the GPU", labels=labels)
        max_slices = GaugeMetricFamily(
            "qgpu_device_max_slices", "Slice limit of the GPU", labels=labels
        )
        core = GaugeMetricFamily(
            "qgpu_device_core_committed_percent", "Sum of the slices' core", labels=labels
        )
        mem = GaugeMetricFamily(
            "qgpu_device_memory_committed_bytes", "Sum of the slices' memory caps", labels=labels
        )
        for d in agent.devices().devices:
            key = [node, d.uuid]
            info.add_metric([*key, str(d.index), d.model], 1)
            total.add_metric(key, d.memory_total_bytes or d.memory_mib * 1024 * 1024)
            if d.memory_used_bytes is not None:
                used.add_metric(key, d.memory_used_bytes)
            if d.utilization_percent is not None:
                util.add_metric(key, d.utilization_percent / 100)
            healthy.add_metric(key, 1 if d.health.value == "healthy" else 0)
            slices.add_metric(key, d.slices)
            max_slices.add_metric(key, d.max_slices)
            core.add_metric(key, d.core_committed)
            mem.add_metric(key, d.memory_committed_gib * 1024**3)
        yield from (info, total, used, util, healthy, slices, max_slices, core, mem)

    def _slices(self) -> Iterator[Metric]:
        agent = self.agent
        info = GaugeMetricFamily(
            "qgpu_slice_info",
            "A slice (value 1) with its isolation policy and enforcement",
            labels=[*SLICE_LABELS, "policy", "enforcement"],
        )
        mem_limit = GaugeMetricFamily(
            "qgpu_slice_memory_limit_bytes", "Memory cap of the slice", labels=SLICE_LABELS
        )
        mem_used = GaugeMetricFamily(
            "qgpu_slice_memory_used_bytes", "Memory the slice's processes hold", labels=SLICE_LABELS
        )
        core_limit = GaugeMetricFamily(
            "qgpu_slice_core_limit_percent", "Compute share of the slice", labels=SLICE_LABELS
        )
        core_used = GaugeMetricFamily(
            "qgpu_slice_core_used_percent",
            "Compute the slice used (percent of the GPU)",
            labels=SLICE_LABELS,
        )
        throttled = CounterMetricFamily(
            "qgpu_slice_throttled_seconds",
            "Time the interposer held back the slice's kernel launches",
            labels=SLICE_LABELS,
        )
        ooms = CounterMetricFamily(
            "qgpu_slice_oom_refusals",
            "Allocations refused with CUDA_ERROR_OUT_OF_MEMORY at the cap",
            labels=SLICE_LABELS,
        )
        for s in agent.slices().slices:
            owner = f"{s.owner.kind.value}:{s.owner.id}"
            for uuid in s.device_uuids:
                key = [agent.node, uuid, s.slice_id, owner]
                info.add_metric([*key, s.isolation.value, s.enforcement], 1)
                mem_limit.add_metric(key, s.memory_limit_bytes)
                core_limit.add_metric(key, s.core)
                u = s.usage
                if u.memory_used_bytes is not None:
                    mem_used.add_metric(key, u.memory_used_bytes)
                if u.core_used_percent is not None:
                    core_used.add_metric(key, u.core_used_percent)
                if u.throttled_seconds is not None:
                    throttled.add_metric(key, u.throttled_seconds)
                if u.oom_refusals is not None:
                    ooms.add_metric(key, u.oom_refusals)
        yield from (info, mem_limit, mem_used, core_limit, core_used, throttled, ooms)

    def _agent(self) -> Iterator[Metric]:
        agent = self.agent
        node = agent.node
        c = agent.counters
        with c._lock:
            reservations = dict(c.reservations)
            releases = dict(c.releases)
            errors = dict(c.errors)
            reconciled = c.reconcile_released
        res = CounterMetricFamily(
            "qgpu_agent_reservations", "Reservation requests by result", labels=["node", "result"]
        )
        for result in ("ok", "invalid", "no-fit", "unavailable", "abandoned"):
            res.add_metric([node, result], reservations.get(result, 0))
        rel = CounterMetricFamily(
            "qgpu_agent_releases", "Releases by reason", labels=["node", "reason"]
        )
        for reason in ("request", "owner-gone", "lease-expired", "already-gone"):
            rel.add_metric([node, reason], releases.get(reason, 0))
        err = CounterMetricFamily(
            "qgpu_agent_errors", "Internal errors by exception type", labels=["node", "type"]
        )
        for kind, n in sorted(errors.items()):
            err.add_metric([node, kind], n)
        rec = CounterMetricFamily(
            "qgpu_agent_reconcile_released",
            "Slices released because their owner died",
            labels=["node"],
        )
        rec.add_metric([node], reconciled)
        start = GaugeMetricFamily(
            "qgpu_agent_start_time_seconds", "Unix time the agent started", labels=["node"]
        )
        start.add_metric([node], agent.started_at)
        yield from (res, rel, err, rec, start)

    def _watchdog(self) -> Iterator[Metric]:
        agent = self.agent
        wd = agent.watchdog
        over = CounterMetricFamily(
            "qgpu_watchdog_over_cap",
            "Scans that found a slice's process over the slice's memory cap (a bypass)",
            labels=["node", "device_uuid", "slice"],
        )
        over_core = CounterMetricFamily(
            "qgpu_watchdog_over_core",
            "Processes found in a slice over its compute allowance (its core; for burst-share "
            "while a neighbour is busy; for best-effort what busy guaranteed slices leave) plus "
            "the margin for the grace, one per process and episode",
            labels=["node", "device_uuid", "slice"],
        )
        kills = CounterMetricFamily(
            "qgpu_watchdog_kills",
            "Processes the watchdog killed for exceeding their cap (memory or core)",
            labels=["node", "device_uuid", "slice"],
        )
        unowned_kills = CounterMetricFamily(
            "qgpu_watchdog_unowned_kills",
            "GPU processes of no slice the watchdog killed (on a GPU holding a slice the kill "
            "policy covers, with --watchdog-unowned kill)",
            labels=["node", "device_uuid"],
        )
        restored = CounterMetricFamily(
            "qgpu_watchdog_gpu_settings_restored",
            "GPU settings (compute mode, accounting mode) the watchdog set back to what the "
            "agent found at its first scan",
            labels=["node", "device_uuid", "setting"],
        )
        with agent.counters._lock:
            unowned_kill_counts = dict(agent.counters.watchdog_unowned_kills)
            restored_counts = dict(agent.counters.watchdog_settings_restored)
            over_counts = dict(agent.counters.watchdog_over_cap)
            core_counts = dict(agent.counters.watchdog_over_core)
            kill_counts = dict(agent.counters.watchdog_kills)
        for (uuid, sid), n in sorted(over_counts.items()):
            over.add_metric([agent.node, uuid, sid], n)
        for (uuid, sid), n in sorted(core_counts.items()):
            over_core.add_metric([agent.node, uuid, sid], n)
        for (uuid, sid), n in sorted(kill_counts.items()):
            kills.add_metric([agent.node, uuid, sid], n)
        for uuid, n in sorted(unowned_kill_counts.items()):
            unowned_kills.add_metric([agent.node, uuid], n)
        for (uuid, name), n in sorted(restored_counts.items()):
            restored.add_metric([agent.node, uuid, name], n)
        unowned = GaugeMetricFamily(
            "qgpu_watchdog_unowned_processes",
            "GPU processes that belong to no slice, at the last scan",
            labels=["node", "device_uuid"],
        )
        if wd is not None and wd.last is not None:
            per_dev: dict[str, int] = {g.uuid: 0 for g in agent.inventory.gpus}
            for p in wd.last.unowned:
                per_dev[p.device_uuid] = per_dev.get(p.device_uuid, 0) + 1
            for uuid, n in sorted(per_dev.items()):
                unowned.add_metric([agent.node, uuid], n)
        current = GaugeMetricFamily(
            "qgpu_watchdog_over_cap_processes",
            "Processes over their slice's memory cap at the last scan",
            labels=["node", "device_uuid", "slice"],
        )
        if wd is not None and wd.last is not None:
            per_slice: dict[tuple[str, str], int] = {}
            for e in wd.last.over_cap:
                if e.action == "reported":
                    per_slice[(e.device_uuid, e.slice_id)] = (
                        per_slice.get((e.device_uuid, e.slice_id), 0) + 1
                    )
            for (uuid, sid), n in sorted(per_slice.items()):
                current.add_metric([agent.node, uuid, sid], n)
        yield from (over, over_core, kills, unowned_kills, restored, unowned, current)


KNOWN_ROUTES = ("/v1/node", "/v1/devices", "/v1/slices", "/v1/health", "/metrics")


def route_label(path: str) -> str:
    """A bounded route label: slice ids are folded into the template."""
    if path == "/v1/slices/record":
        return path
    if path.startswith("/v1/slices/"):
        for verb in ("release", "lease"):
            if path.endswith(f"/{verb}"):
                return f"/v1/slices/{{slice_id}}/{verb}"
        return "/v1/slices/{slice_id}"
    return path if path in KNOWN_ROUTES else "other"


def request_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "qgpu_agent_request_duration_seconds",
        "Time the agent took to answer an API request",
        ["node", "method", "route", "status"],
        registry=registry,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
    )


def build_registry(agent: Agent) -> CollectorRegistry:
    """A private registry (one per agent, so tests can run several agents in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry


__all__ = ["AgentCollector", "build_registry"]
