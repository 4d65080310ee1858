"""Metrics in a cluster: the agent's read-only metrics port (a real ``qgpu agent``), the
extender's and the webhook's ``/metrics`` after driving them, and every metric the Grafana
dashboard and the documented alert rules query is exported by some component.

The dashboard's and the alerts' PromQL is parsed by a PromQL parser (PyPI `promql-parser`,
a port of Prometheus' own); each selector's metric name must be a sample name that a
component's registry exposes, with the suffix its type gives it (``_total`` for counters,
``_bucket``/``_sum``/``_count`` for histograms).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from enforcement.agent.app import create_app as agent_app
from enforcement.agent.service import Agent
from k8s_bridge.extender.app import create_app as extender_app
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from k8s_bridge.webhook import create_app as webhook_app
from tests.agent.conftest import FakeBackend, free_port, h100, make_agent, short_tmp, start_agent
from tests.fakes.apiserver import FakeApiserver
from tests.helpers import stop_processes
from tests.k8s.helpers import NAMES, gpu, pod_object, publish_node

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# series Prometheus itself writes for every target it scrapes (not exported by a component)
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
}


def _sample_names(text: str) -> dict[str, str]:
    """Every sample name an exposition can carry -> its family type (empty families too)."""
    out: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(fam.type, ("",)):
            out[fam.name + suffix] = fam.type
    return out


def _metric_names(expr: Any) -> set[str]:
    """The metric names a parsed PromQL expression selects."""
    p = promql_parser
    if isinstance(expr, p.VectorSelector):
        return {expr.name} if expr.name else set()
    if isinstance(expr, p.MatrixSelector):
        return _metric_names(expr.vector_selector)
    if isinstance(expr, p.Call):
        return set().union(*(_metric_names(a) for a in expr.args)) if expr.args else set()
    if isinstance(expr, p.BinaryExpr):
        return _metric_names(expr.lhs) | _metric_names(expr.rhs)
    if isinstance(expr, p.AggregateExpr):
        return _metric_names(expr.expr) | (_metric_names(expr.param) if expr.param else set())
    if isinstance(expr, p.ParenExpr | p.UnaryExpr | p.SubqueryExpr):
        return _metric_names(expr.expr)
    return set()


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else None
        if text:  # label_values(metric, label) -> the metric
            m = re.match(r"label_values\((\w+)", text)
            assert m, text
            out.append(m.group(1))
    return out


def alert_queries() -> list[str]:
    """The ``expr`` of every rule in the PrometheusRule example of docs/metrics.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", METRICS_DOC.read_text(), re.S)
    rules = [yaml.safe_load(b) for b in blocks if "kind: PrometheusRule" in b]
    assert rules, "docs/metrics.md has no PrometheusRule example"
    return [r["expr"] for doc in rules for g in doc["spec"]["groups"] for r in g["rules"]]


# --- the agent's metrics port ------------------------------------------------------------


@pytest.fixture
def live_agent() -> Iterator[tuple[Path, int]]:
    state = short_tmp()
    port = free_port()
    proc = start_agent(state, "--sim", "1xH100-80GB", "--metrics-port", str(port))
    yield state, port
    stop_processes([proc])
    shutil.rmtree(state, ignore_errors=True)


def test_agent_metrics_port_serves_metrics_and_nothing_that_changes_a_slice(
    live_agent: tuple[Path, int],
) -> None:
    from enforcement.agent.client import AgentClient

    state, port = live_agent
    with AgentClient(state / "agent.sock") as client:
        sid = client.reserve({"core": 30, "memory": 8}).slice_id
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=10) as http:
        got = http.get("/metrics")
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
        names = _sample_names(got.text)
        assert {"qgpu_device_info", "qgpu_slice_info", "qgpu_agent_reservations_total"} <= set(
            names
        )
        assert f'slice="{sid}"' in got.text
        # the API's mutations are not reachable here, whatever is tried
        for method, path in (
            ("POST", "/v1/slices"),
            ("DELETE", f"/v1/slices/{sid}"),
            ("POST", f"/v1/slices/{sid}/release"),
            ("POST", "/v1/slices/record"),
            ("GET", "/v1/slices"),
        ):
            resp = http.request(method, path, json={"request": {"core": 10, "memory": 1}})
            assert resp.status_code == 404, (method, path, resp.status_code)
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            assert http.request(method, "/metrics").status_code == 405
    with AgentClient(state / "agent.sock") as client:
        assert [s.slice_id for s in client.slices().slices] == [sid]  # still there


# --- extender and webhook /metrics -------------------------------------------------------


@pytest.fixture
def driven(apiserver: FakeApiserver) -> Iterator[dict[str, str]]:
    """Each component driven through its API, then scraped: name -> exposition text."""
    publish_node(apiserver, "n0", [gpu("n0", 0), gpu("n0", 1)])
    publish_node(apiserver, "bad", [gpu("bad", 0)], policy="bogus")
    ext = Extender(Kube(apiserver.client(), NAMES), ExtenderConfig(watch=False))
    ext.start()
    state = short_tmp()
    agent: Agent = make_agent(state, FakeBackend([h100(0)]))
    try:
        http = TestClient(extender_app(ext))
        for name, shape in (("a", [(30, 4)]), ("b", [(30, 4)]), ("huge", [(99, 99)])):
            pod = apiserver.store.create("pods", pod_object(name, shape))
            body = {"Pod": pod, "NodeNames": ["n0", "bad", "nx"]}
            assert http.post("/filter", json=body).status_code == 200
            assert http.post("/prioritize", json=body).status_code == 200
            bind = {
                "PodName": name,
                "PodNamespace": "default",
                "PodUID": pod["metadata"]["uid"],
                "Node": "n0",
            }
            assert http.post("/bind", json=bind).status_code == 200
        assert http.post("/filter", content=b"{").status_code == 400
        hook = TestClient(webhook_app(NAMES, compat_mode=True))
        for limits in (
            {NAMES.core: "30", NAMES.memory: "4"},
            {NAMES.core: "250", NAMES.memory: "4"},
            {"nvidia.com/gpucores": "20", "nvidia.com/gpumem": "2000"},
            {"cpu": "1"},
        ):
            pod = pod_object("w")
            pod["spec"]["containers"][0]["resources"] = {"limits": limits}
            review = {"request": {"uid": "u", "operation": "CREATE", "object": pod}}
            assert hook.post("/mutate", json=review).status_code == 200
        api = TestClient(agent_app(agent))
        sid = api.post("/v1/slices", json={"request": {"core": 20, "memory": 4}}).json()
        api.delete(f"/v1/slices/{sid['slice_id']}")
        yield {
            "extender": http.get("/metrics").text,
            "webhook": hook.get("/metrics").text,
            "agent": api.get("/metrics").text,
        }
    finally:
        ext.stop()
        agent.close()
        shutil.rmtree(state, ignore_errors=True)


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_extender_metrics_count_verbs_outcomes_rules_binds_and_locks(
    driven: dict[str, str],
) -> None:
    text = driven["extender"]
    for verb in ("filter", "prioritize", "bind"):
        assert _value(text, "qgpu_extender_request_duration_seconds_count", verb=verb) >= 3
    assert _value(text, "qgpu_extender_requests_total", verb="filter", outcome="invalid") == 1
    assert _value(text, "qgpu_extender_requests_total", verb="filter", outcome="schedulable") == 2
    assert _value(text, "qgpu_extender_requests_total", verb="filter", outcome="unschedulable") == 1
    assert _value(text, "qgpu_extender_binds_total", result="bound") == 2
    assert _value(text, "qgpu_extender_binds_total", result="no-fit") == 1
    assert _value(text, "qgpu_extender_filter_refusals_total", rule="broken node") == 3
    assert _value(text, "qgpu_extender_filter_refusals_total", rule="no inventory") == 3
    assert _value(text, "qgpu_extender_filter_refusals_total", rule="memory") == 1
    assert _value(text, "qgpu_extender_filter_nodes_total", result="passed") == 2
    locks = _value(text, "qgpu_extender_node_locks_total")
    assert locks >= 2 and _value(text, "qgpu_extender_lock_wait_seconds_count") >= 1
    assert _value(text, "qgpu_extender_nodes", state="broken") == 1
    assert _value(text, "qgpu_extender_pods") == 2
    assert _value(text, "qgpu_extender_core_percent", kind="capacity") == 200
    assert _value(text, "qgpu_extender_core_percent", kind="free") == 140


def test_webhook_metrics_count_admissions_denials_by_rule_and_translations(
    driven: dict[str, str],
) -> None:
    text = driven["webhook"]
    assert _value(text, "qgpu_webhook_request_duration_seconds_count", verb="mutate") == 4
    assert _value(text, "qgpu_webhook_admissions_total", result="mutated") == 2
    assert _value(text, "qgpu_webhook_admissions_total", result="denied") == 1
    assert _value(text, "qgpu_webhook_admissions_total", result="allowed") == 1
    assert _value(text, "qgpu_webhook_denials_total", rule="qgpu-core") == 1
    assert _value(text, "qgpu_webhook_compat_translations_total", source="HAMi") == 2


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_queried_is_exported_by_some_component(
    driven: dict[str, str], source: str
) -> None:
    exported: dict[str, str] = {}
    for text in driven.values():
        exported.update(_sample_names(text))
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    assert len(queries) >= 5
    used: set[str] = set()
    for q in queries:
        names = _metric_names(promql_parser.parse(q))
        assert names, f"no metric in {q!r}"
        used |= names
    missing = sorted(used - set(exported) - SCRAPE_SERIES)
    assert missing == [], f"{source} queries metrics no component exports: {missing}"
    if source == "dashboard":  # the dashboard shows every component
        for prefix in ("qgpu_extender_", "qgpu_webhook_", "qgpu_device_", "qgpu_slice_"):
            assert any(n.startswith(prefix) for n in used), prefix
