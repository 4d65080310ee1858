"""Prometheus metrics of the scheduler extender and the admission webhook (``GET /metrics``).

Each server owns a private `CollectorRegistry` (several can live in one process, as in the
tests). Every metric is documented in docs/metrics.md; label values come from closed sets
(verbs, outcomes, the placement engine's rule names, the fields of the slice rules), never
from pod or node names, so the series count stays bounded whatever the cluster does.

Extender: request latency per verb and outcome counts, filter results per node and the
rule that refused each node, binds by result, node-lock waits and reuse, and the cluster
as the extender sees it (nodes, pods, free core and memory) read at scrape time.
Webhook: request latency, admissions by result, denials by the broken rule, compat
translations by source.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qgpu.errors import RuleViolation

if TYPE_CHECKING:
    from k8s_bridge.extender.state import ExtenderState

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
LOCK_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus' text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


_INDEX = re.compile(r"\[\d+\]")
_KEY = re.compile(r"\[([^\]]+)\]")


def rule_key(v: RuleViolation) -> str:
    """A bounded name for the rule a violation broke: the resource or annotation it is
    about (``qgpu-core``, ``qgpu-memory``, ``nvidia.com/gpucores``, ``qgpu-schedule-policy``),
    ``requests`` for a request differing from its limit, ``init-containers``, else the
    field's last word. Fields name what our code checks, never user data."""
    field = _INDEX.sub("", v.field)
    if field.startswith("spec.initContainers"):
        return "init-containers"
    if ".requests[" in field:
        return "requests"
    keys = _KEY.findall(field)
    if keys:
        key = keys[-1]
        prefix, _, name = key.rpartition("/")
        return name if prefix and not prefix.startswith(("nvidia.com", "koordinator.sh")) else key
    last = re.split(r"[.: ]+", field.strip())[-1]
    return last or "request"


_M = TypeVar("_M", Counter, Histogram)


class _Children(Generic[_M]):
    """A labelled metric whose children are looked up once per label values.

    prometheus_client's ``labels()`` checks the values and takes a lock on every call, and the
    extender calls it about ten times per pod; label values come from closed sets (see the
    module docstring), so the memo stays as small as the series count."""

    def __init__(self, metric: _M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def labels(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class _ComponentMetrics:
    """A component's own registry and its per-verb request latency histogram."""

    duration: Histogram | _Children[Histogram]

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)

    @contextmanager
    def timed(self, verb: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.duration.labels(verb).observe(time.perf_counter() - start)


class ExtenderMetrics(_ComponentMetrics):
    """The extender's metrics; `state` (set by the extender) feeds the scrape-time gauges."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.duration = _Children(
            Histogram(
                "qgpu_extender_request_duration_seconds",
                "Time the extender took to answer kube-scheduler, per verb",
                ["verb"],
                registry=r,
                buckets=LATENCY_BUCKETS,
            )
        )
        self.requests = _Children(
            Counter(
                "qgpu_extender_requests",
                "Extender calls by verb and outcome",
                ["verb", "outcome"],
                registry=r,
            )
        )
        self.filter_nodes = _Children(
            Counter(
                "qgpu_extender_filter_nodes",
                "Nodes answered by filter: passed, failed (could fit later), unresolvable",
                ["result"],
                registry=r,
            )
        )
        self.filter_refusals = _Children(
            Counter(
                "qgpu_extender_filter_refusals",
                "Nodes filter refused, by the rule that refused them",
                ["rule"],
                registry=r,
            )
        )
        self.binds = _Children(
            Counter("qgpu_extender_binds", "Binds by result", ["result"], registry=r)
        )
        self.lock_wait = Histogram(
            "qgpu_extender_lock_wait_seconds",
            "Time a bind waited to take a node's lock (the apiserver round trips included)",
            registry=r,
            buckets=LOCK_BUCKETS,
        )
        self.locks = _Children(
            Counter(
                "qgpu_extender_node_locks",
                "Node locks a bind used: acquired, reused (held from the bind before), timeout",
                ["how"],
                registry=r,
            )
        )
        self.resyncs = Counter(
            "qgpu_extender_node_resyncs",
            "Nodes whose pods were re-read because another writer bound pods there",
            registry=r,
        )
        self.state: ExtenderState | None = None
        r.register(_StateCollector(self))


class _StateCollector(Collector):
    """The extender's view of the cluster, read at scrape time under the state's lock."""

    def __init__(self, metrics: ExtenderMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state = self.metrics.state
        nodes = GaugeMetricFamily(
            "qgpu_extender_nodes",
            "Nodes the extender knows: ready (a readable GPU inventory), broken (a bad "
            "inventory or qgpu label: filter names the cause)",
            labels=["state"],
        )
        pods = GaugeMetricFamily("qgpu_extender_pods", "Pods holding qgpu slices")
        assumed = GaugeMetricFamily(
            "qgpu_extender_assumed_pods", "Pods whose GPUs are held between prioritize and bind"
        )
        gpus = GaugeMetricFamily("qgpu_extender_gpus", "GPUs of the ready nodes")
        core = GaugeMetricFamily(
            "qgpu_extender_core_percent",
            "qgpu-core of all GPUs (100 per GPU), by capacity and free",
            labels=["kind"],
        )
        memory = GaugeMetricFamily(
            "qgpu_extender_memory_bytes",
            "GPU memory of all GPUs (whole GiB), by capacity and free",
            labels=["kind"],
        )
        if state is not None:
            with state.lock:
                s = state.state
                nodes.add_metric(["ready"], len(state.inventories))
                nodes.add_metric(["broken"], len(state.broken))
                pods.add_metric([], len(state.pods))
                assumed.add_metric([], len(state.assumed))
                gpus.add_metric([], s.gpu_total)
                core.add_metric(["capacity"], float(s.cap_core.sum()))
                core.add_metric(["free"], float(s.free_core.sum()))
                memory.add_metric(["capacity"], float(s.cap_mem.sum()) * 1024**3)
                memory.add_metric(["free"], float(s.free_mem.sum()) * 1024**3)
        yield from (nodes, pods, assumed, gpus, core, memory)


class WebhookMetrics(_ComponentMetrics):
    """The admission webhook's metrics."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.duration = Histogram(
            "qgpu_webhook_request_duration_seconds",
            "Time the webhook took to answer the apiserver, per verb",
            ["verb"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.admissions = Counter(
            "qgpu_webhook_admissions",
            "Admission answers: allowed (untouched), mutated (patched), denied",
            ["result"],
            registry=r,
        )
        self.denials = Counter(
            "qgpu_webhook_denials",
            "Pods denied, by the rule they broke (the resource or annotation it is about)",
            ["rule"],
            registry=r,
        )
        self.translations = Counter(
            "qgpu_webhook_compat_translations",
            "Containers or annotations translated by compat mode, by source project",
            ["source"],
            registry=r,
        )


__all__ = ["ExtenderMetrics", "WebhookMetrics", "exposition", "rule_key"]
