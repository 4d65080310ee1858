"""Compatibility mode: HAMi and Koordinator names translated by the webhook (over HTTP),
exact or denied with the rule; with compat off, pods asking for them are never silently
placed on qgpu nodes; qgpu's own memory percentage; filter reasons that name a bad label."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from k8s_bridge import compat
from k8s_bridge.extender.models import ExtenderArgs
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from k8s_bridge.resources import parse_pod, pod_slice_requests
from k8s_bridge.webhook import create_app
from qgpu.errors import RuleViolation
from tests.fakes.apiserver import FakeApiserver, json_patch, node_object
from tests.k8s.helpers import NAMES, ServedApp, assignment_of, gpu, pod_object, publish_node


def _pod(limits: dict[str, Any], annotations: dict[str, str] | None = None, **extra: Any) -> dict:
    container: dict[str, Any] = {"name": "main", "image": "cuda", "resources": {"limits": limits}}
    container["resources"].update(extra)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "annotations": annotations or {}},
        "spec": {"containers": [container]},
    }


@pytest.fixture(scope="module")
def hooks() -> Iterator[dict[bool, httpx.Client]]:
    served = {
        mode: ServedApp(create_app(NAMES, compat_mode=mode)).start() for mode in (True, False)
    }
    clients = {mode: httpx.Client(base_url=s.url, timeout=10) for mode, s in served.items()}
    yield clients
    for mode in clients:
        clients[mode].close()
        served[mode].stop()


def _review(client: httpx.Client, pod: dict) -> dict:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": "CREATE", "object": pod},
    }
    return client.post("/mutate", json=body).json()["response"]


def _admitted(resp: dict, pod: dict) -> dict:
    """The pod as the apiserver stores it after the webhook's JSON patch."""
    assert resp["allowed"], resp
    ops = json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []
    return json_patch(pod, ops)


@pytest.mark.parametrize(
    ("limits", "annotations", "want", "warning"),
    [
        (
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30},
            {},
            {"core": 30, "memory_gib": 3},
            "nvidia.com/gpumem=3000 MiB rounded up to 3 GiB",
        ),
        (
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "50"},
            {},
            {"core": 50, "memory_gib": 8},
            "nvidia.com/gpucores=50",
        ),
        (
            {"nvidia.com/gpumem-percentage": 25, "nvidia.com/gpucores": 20},
            {"hami.io/node-scheduler-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"},
            {"core": 20, "memory_percent": 25, "placement": "spread", "gpu_placement": "binpack"},
            "hami.io/node-scheduler-policy -> tke.cloud.tencent.com/qgpu-placement=spread",
        ),
        (
            {"nvidia.com/gpu": 2, "nvidia.com/gpucores": 100},
            {},
            {"core": 200},
            "-> tke.cloud.tencent.com/qgpu-core=200",
        ),
        (
            {"koordinator.sh/gpu-core": 40, "koordinator.sh/gpu-memory": "6Gi"},
            {"metax-tech.com/sgpu-qos-policy": "fixed-share"},
            {"core": 40, "memory_gib": 6, "isolation": "fixed-share"},
            "metax-tech.com/sgpu-qos-policy -> tke.cloud.tencent.com/qgpu-schedule-policy",
        ),
        (
            {"koordinator.sh/gpu-core": 10, "koordinator.sh/gpu-memory": "1500Mi"},
            {},
            {"core": 10, "memory_gib": 2},
            "rounded up to 2 GiB",
        ),
        (
            {"koordinator.sh/gpu-core": 30, "koordinator.sh/gpu-memory-ratio": 50},
            {"nvidia.com/use-gputype": "A100,H100"},
            {"core": 30, "memory_percent": 50, "model": "A100|H100"},
            "koordinator.sh/gpu-memory-ratio=50",
        ),
        ({"koordinator.sh/gpu": 100}, {}, {"core": 100}, "koordinator.sh/gpu=100"),
    ],
)
def test_foreign_names_are_translated_exactly_with_a_warning(
    hooks: dict[bool, httpx.Client],
    limits: dict,
    annotations: dict,
    want: dict,
    warning: str,
) -> None:
    pod = _pod(limits, annotations)
    resp = _review(hooks[True], pod)
    stored = _admitted(resp, pod)
    assert stored["spec"]["schedulerName"] == "qgpu-scheduler"
    left = stored["spec"]["containers"][0]["resources"]["limits"]
    assert not [k for k in left if k in compat.FOREIGN_RESOURCES or k == "nvidia.com/gpu"]
    (cr,) = pod_slice_requests(NAMES, parse_pod(stored))
    got = cr.request.model_dump(exclude_defaults=True)
    assert {k: got.get(k) for k in want} == want
    assert any(warning in w for w in resp["warnings"]), resp["warnings"]
    record = json.loads(stored["metadata"]["annotations"][NAMES.compat_annotation])
    assert record["main"]["to"][NAMES.core] == str(want["core"])


@pytest.mark.parametrize(
    ("limits", "annotations", "field", "words"),
    [
        ({"nvidia.com/gpumem": 3000}, {}, "nvidia.com/gpucores", "no compute limit"),
        ({"nvidia.com/gpucores": 0, "nvidia.com/gpumem": 10}, {}, "gpucores", "1..100"),
        (
            {"nvidia.com/gpucores": 100, "nvidia.com/gpumem": 4000},
            {},
            "nvidia.com/gpumem",
            "whole GPUs",
        ),
        ({"nvidia.com/gpu": 3, "nvidia.com/gpucores": 60}, {}, "nvidia.com/gpu", "at most 2"),
        ({"nvidia.com/gpu": 2, "nvidia.com/gpucores": 40}, {}, "nvidia.com/gpucores", "50%"),
        # exact, but a share over 2 GPUs: the Kubernetes rule refuses it
        (
            {"nvidia.com/gpu": 2, "nvidia.com/gpucores": 80, "nvidia.com/gpumem": 30720},
            {},
            "qgpu-core",
            "split over 2 GPUs",
        ),
        (
            {
                "nvidia.com/gpumem": 100,
                "nvidia.com/gpumem-percentage": 10,
                "nvidia.com/gpucores": 5,
            },
            {},
            "gpumem-percentage",
            "one memory cap",
        ),
        ({"koordinator.sh/gpu-memory": "4Gi"}, {}, "koordinator.sh/gpu-core", "compute share"),
        ({"koordinator.sh/gpu-core": 150}, {}, "koordinator.sh/gpu-core", "multiple of 100"),
        (
            {"koordinator.sh/gpu-core": 200, "koordinator.sh/gpu-memory-ratio": 100},
            {},
            "gpu-memory-ratio",
            "whole card",
        ),
        ({"koordinator.sh/gpu-core": 20}, {}, "koordinator.sh/gpu-memory", "required for a share"),
        (
            {"nvidia.com/gpucores": 20, "koordinator.sh/gpu-core": 20},
            {},
            "koordinator.sh/gpu-core",
            "cannot be combined",
        ),
        (
            {"nvidia.com/gpucores": 20, f"{NAMES.core}": 20},
            {},
            "qgpu-core",
            "cannot be combined",
        ),
        (
            {"nvidia.com/gpucores": 20},
            {"hami.io/gpu-scheduler-policy": "topology-aware"},
            "hami.io/gpu-scheduler-policy",
            "no qgpu equivalent",
        ),
        (
            {"nvidia.com/gpucores": 20},
            {"nvidia.com/nouse-gputype": "T4"},
            "nouse-gputype",
            "no qgpu equivalent",
        ),
        (
            {"nvidia.com/gpucores": 20},
            {"metax-tech.com/sgpu-qos-policy": "strict"},
            "sgpu-qos-policy",
            "must be one of",
        ),
        (
            {"koordinator.sh/gpu-core": 20, "koordinator.sh/gpu-memory-ratio": 50},
            {NAMES.placement_annotation: "binpack", "hami.io/node-scheduler-policy": "spread"},
            NAMES.placement_annotation,
            "conflicts",
        ),
    ],
)
def test_what_cannot_be_translated_exactly_is_denied_with_the_rule(
    hooks: dict[bool, httpx.Client], limits: dict, annotations: dict, field: str, words: str
) -> None:
    resp = _review(hooks[True], _pod(limits, annotations))
    assert resp["allowed"] is False and resp["status"]["code"] == 400, resp
    message = resp["status"]["message"]
    assert field in message and words in message, message
    with pytest.raises(RuleViolation):  # the same rule from the module itself
        translated = compat.translate(NAMES, _pod(limits, annotations))
        pod_slice_requests(NAMES, parse_pod(translated.pod))


def test_requests_must_equal_limits_for_foreign_names_too(hooks) -> None:
    pod = _pod({"nvidia.com/gpucores": 20}, requests={"nvidia.com/gpucores": 30})
    resp = _review(hooks[True], pod)
    assert not resp["allowed"] and "requests must equal limits" in resp["status"]["message"]
    same = _pod({"nvidia.com/gpucores": 20}, requests={"nvidia.com/gpucores": "20"})
    stored = _admitted(_review(hooks[True], same), same)
    assert stored["spec"]["containers"][0]["resources"]["requests"] == {}


def test_compat_off_never_translates_and_refuses_mixing(hooks) -> None:
    hami = _pod({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30})
    resp = _review(hooks[False], hami)
    assert resp["allowed"] and "patch" not in resp  # left to whoever schedules it
    assert "do not isolate" in resp["warnings"][0] and "compat.enabled" in resp["warnings"][0]
    mixed = _pod({NAMES.core: 30, NAMES.memory: 4, "nvidia.com/gpucores": 30})
    denied = _review(hooks[False], mixed)
    assert not denied["allowed"] and "cannot be mixed" in denied["status"]["message"]
    ours = _pod({NAMES.core: 30, NAMES.memory: 4})
    assert _review(hooks[False], ours)["allowed"]


def _extender(srv: FakeApiserver, compat_mode: bool) -> Extender:
    ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False, compat=compat_mode))
    ext.start()
    return ext


@pytest.mark.parametrize("compat_mode", [False, True])
def test_extender_refuses_qgpu_nodes_for_untranslated_foreign_pods(
    apiserver: FakeApiserver, compat_mode: bool
) -> None:
    publish_node(apiserver, "gpu-a", [gpu("gpu-a", 0)])
    apiserver.store.create("nodes", node_object("hami-node", {}))
    ext = _extender(apiserver, compat_mode)
    try:
        pod = apiserver.store.create(
            "pods", _pod({"nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30})
        )
        res = ext.filter(ExtenderArgs(Pod=pod, NodeNames=["gpu-a", "hami-node"]))
    finally:
        ext.stop()
    assert res.node_names == ["hami-node"]  # another project's node may isolate it
    reason = res.failed_and_unresolvable_nodes["gpu-a"]
    assert "nvidia.com/gpumem (HAMi)" in reason
    assert ("untranslated" in reason) if compat_mode else ("compat.enabled" in reason)


def test_a_bad_node_label_is_named_in_the_filter_reason(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "good", [gpu("good", 0)])
    publish_node(apiserver, "bogus", [gpu("bogus", 0)], policy="bogus")
    publish_node(apiserver, "slices", [gpu("slices", 0)])

    def label(node: dict) -> dict:
        node["metadata"]["labels"] = {NAMES.slices_label: "40"}
        return node

    apiserver.store.update("nodes", "", "slices", label)
    apiserver.store.create("nodes", node_object("plain", {}))
    ext = _extender(apiserver, False)
    try:
        pod = apiserver.store.create("pods", pod_object("p", [(30, 4)]))
        res = ext.filter(ExtenderArgs(Pod=pod, NodeNames=["good", "bogus", "slices", "plain"]))
        text = ext.metrics.registry
    finally:
        ext.stop()
    assert res.node_names == ["good"]
    why = res.failed_and_unresolvable_nodes
    assert f"node label {NAMES.policy_label}='bogus'" in why["bogus"]
    assert "must be one of best-effort" in why["bogus"]
    assert f"node label {NAMES.slices_label}='40'" in why["slices"]
    assert "floor-gib" in why["slices"]
    assert why["plain"].startswith("node publishes no qgpu GPU inventory")
    broken = text.get_sample_value("qgpu_extender_nodes", {"state": "broken"})
    assert broken == 2


def test_memory_percentage_pods_get_their_share_of_the_chosen_card(
    apiserver: FakeApiserver,
) -> None:
    publish_node(apiserver, "n0", [gpu("n0", 0, gib=16), gpu("n0", 1, gib=80)])
    ext = _extender(apiserver, False)
    try:
        raw = _pod({NAMES.core: "30", NAMES.memory_percent: "50"})
        pod = apiserver.store.create("pods", raw)
        assert ext.filter(ExtenderArgs(Pod=pod, NodeNames=["n0"])).node_names == ["n0"]
        uid = pod["metadata"]["uid"]
        from k8s_bridge.extender.models import ExtenderBindingArgs

        args = ExtenderBindingArgs(PodName="p", PodNamespace="default", PodUID=uid, Node="n0")
        assert ext.bind(args).error == ""
    finally:
        ext.stop()
    ca = assignment_of(apiserver, "p").containers["main"]
    card = 16 if ca.gpus[0].endswith("0" * 12) else 80
    assert ca.memory_gib == [card // 2]
    assert set(ca.devices) == {"core"}  # no memory IDs: the percentage is the extender's
