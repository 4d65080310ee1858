"""The fake apiserver is only useful if it behaves like the real one for the official
client: selectors, the three patch types, resourceVersion preconditions, the binding
subresource, Status errors and watches (including 410 Expired)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.fakes.apiserver import FakeApiserver, node_object


@pytest.fixture
def api(apiserver: FakeApiserver) -> client.CoreV1Api:
    return client.CoreV1Api(apiserver.client())


def _pod(name: str, labels: dict | None = None) -> dict:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def test_patch_types_and_resource_version_precondition(apiserver, api) -> None:
    apiserver.store.create("nodes", node_object("n1", {"a": "1"}))
    rv = api.read_node("n1").metadata.resource_version
    api.patch_node("n1", {"metadata": {"annotations": {"k": "v"}}})  # strategic merge (dict)
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"metadata": {"resourceVersion": rv, "labels": {"b": "2"}}})
    assert info.value.status == 409
    assert json.loads(info.value.body)["reason"] == "Conflict"
    api.patch_node("n1", [{"op": "add", "path": "/metadata/labels/b", "value": "2"}])  # json
    api.patch_node(
        "n1",
        {"metadata": {"annotations": {"k": None}}},
        _content_type="application/merge-patch+json",
    )
    node = api.read_node("n1")
    assert node.metadata.labels == {"a": "1", "b": "2"} and not node.metadata.annotations
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", [{"op": "test", "path": "/metadata/labels/a", "value": "x"}])
    assert info.value.status == 422


def test_selectors_and_binding(apiserver, api) -> None:
    for name, labels in (("a", {"app": "x"}), ("b", {"app": "y"}), ("c", {})):
        api.create_namespaced_pod("default", _pod(name, labels))
    body = {"target": {"kind": "Node", "name": "n1"}, "metadata": {"name": "a"}}
    resp = api.create_namespaced_pod_binding("a", "default", body, _preload_content=False)
    assert resp.status == 201 and json.loads(resp.data)["status"] == "Success"
    with pytest.raises(ApiException) as info:
        api.create_namespaced_pod_binding("a", "default", body, _preload_content=False)
    assert info.value.status == 409 and "already assigned" in info.value.body

    def names(**kw) -> list[str]:
        return [p.metadata.name for p in api.list_pod_for_all_namespaces(**kw).items]

    assert names(label_selector="app") == ["a", "b"]
    assert names(label_selector="!app") == ["c"]
    assert names(label_selector="app in (y,z)") == ["b"]
    assert names(label_selector="app!=x") == ["b", "c"]
    assert names(field_selector="spec.nodeName=n1") == ["a"]
    assert names(field_selector="spec.nodeName=n1", label_selector="app=y") == []
    with pytest.raises(ApiException) as info:
        api.read_namespaced_pod("zz", "default")
    assert info.value.status == 404 and json.loads(info.value.body)["kind"] == "Status"


def test_watch_streams_events_and_selector_transitions(apiserver, api) -> None:
    api.create_namespaced_pod("default", _pod("a", {"q": "1"}))
    rv = api.list_pod_for_all_namespaces(label_selector="q").metadata.resource_version
    seen: list[tuple[str, str]] = []

    def run() -> None:
        w = watch.Watch()
        for ev in w.stream(
            api.list_pod_for_all_namespaces,
            label_selector="q",
            resource_version=rv,
            timeout_seconds=2,
        ):
            seen.append((ev["type"], ev["object"].metadata.name))
            if len(seen) == 3:
                w.stop()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)
    api.create_namespaced_pod("default", _pod("b", {"q": "2"}))
    api.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"q": None}}})
    api.delete_namespaced_pod("b", "default")
    t.join(5)
    # "a" leaving the selector arrives as DELETED, as the real watch cache sends it
    assert seen == [("ADDED", "b"), ("DELETED", "a"), ("DELETED", "b")]


def test_watch_from_an_expired_version_raises_410(apiserver, api) -> None:
    from tests.fakes import apiserver as fake

    small = fake.Store()
    small.history = fake.deque(maxlen=2)
    apiserver.store = small
    for i in range(4):
        api.create_namespaced_pod("default", _pod(f"p{i}"))
    with pytest.raises(ApiException) as info:
        for _ in watch.Watch().stream(
            api.list_pod_for_all_namespaces, resource_version="1", timeout_seconds=1
        ):
            pass
    assert info.value.status == 410


def test_k8s_bridge_needs_no_ray_and_the_core_no_k8s_bridge() -> None:
    code = (
        "import sys, k8s_bridge.cli, k8s_bridge.kuberay, k8s_bridge.webhook, "
        "k8s_bridge.extender.app, k8s_bridge.deviceplugin.server\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "import qgpu.cli, qgpu.placement\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    core = (
        "import sys, qgpu.cli, qgpu.placement, qgpu.ledger\nassert 'k8s_bridge' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", core], check=True)
