"""docs/metrics.md documents every metric the agent exports; the dashboard uses only
documented metrics (the agent's and, since the Kubernetes components export theirs too,
the extender's and webhook's: tests/k8s checks those are exported)."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from enforcement.agent.app import create_app
from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from qgpu.model import SliceRequest
from tests.agent.conftest import REPO

K8S_PREFIXES = ("qgpu_extender_", "qgpu_webhook_")  # exported by the Kubernetes components


def documented() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(qgpu_[a-z_]+)`", text, re.MULTILINE))


def test_every_exported_metric_is_documented(agent: Agent) -> None:
    agent.reserve(ReserveRequest(request=SliceRequest(core=10, memory_gib=4)))
    agent.watchdog.scan()
    text = TestClient(create_app(agent)).get("/metrics").text
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    docs = {m for m in documented() if not m.startswith(K8S_PREFIXES)}
    assert exported - docs == set()
    # the two interposer-only counters are documented even when no slice reports them
    assert docs - exported <= {
        "qgpu_slice_throttled_seconds_total",
        "qgpu_slice_oom_refusals_total",
    }


def test_dashboard_queries_use_documented_metrics() -> None:
    dash = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    panels = [q for p in dash["panels"] for q in [p, *p.get("panels", [])]]  # rows nest
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    found = {m for e in exprs for m in re.findall(r"qgpu_[a-z_]+", e)}
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for m in found}
    assert used and used <= documented()
