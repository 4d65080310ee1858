"""Kubernetes-specific request rules, resource names, the device-ID and annotation formats,
the webhook's AdmissionReview over HTTP, and the KubeRay helpers."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_bridge.kuberay import (
    patch_ray_cluster,
    ray_resources_from_env,
    ray_resources_from_pod,
    ray_start_params,
)
from k8s_bridge.protocol import device_id, ids_per_gpu, parse_device_id, split_ids
from k8s_bridge.resources import Names, parse_pod, pod_slice_requests
from k8s_bridge.webhook import create_app
from qgpu.errors import RuleViolation
from qgpu.model import IsolationPolicy, PlacementPolicy
from tests.k8s.helpers import NAMES, ServedApp, pod_object


def reqs(pod: dict, names: Names = NAMES):
    return pod_slice_requests(names, parse_pod(pod))


def test_names_follow_the_prefix() -> None:
    assert NAMES.core == "tke.cloud.tencent.com/qgpu-core"
    assert NAMES.memory == "tke.cloud.tencent.com/qgpu-memory"
    assert NAMES.policy_label == "tke.cloud.tencent.com/qgpu-schedule-policy"
    other = Names("qgpu.example.com")
    assert other.core == "qgpu.example.com/qgpu-core"
    with pytest.raises(RuleViolation, match="DNS subdomain"):
        Names("Not A Domain")


@pytest.mark.parametrize(
    ("containers", "core", "memory"),
    [([(30, 8)], 30, 8), ([(1, 1)], 1, 1), ([(99, 40)], 99, 40), ([(200, None)], 200, None)],
)
def test_valid_requests_map_onto_slice_requests(containers, core, memory) -> None:
    (cr,) = reqs(pod_object("p", containers))
    assert (cr.container, cr.request.core, cr.request.memory_gib) == ("c0", core, memory)


@pytest.mark.parametrize(
    ("containers", "needle"),
    [
        ([(0, 4)], "must be 1..99"),
        ([(250, 4)], "must be 1..99"),
        ([(150, 4)], "split over 2 GPUs"),
        ([(30, 0)], "GiB >= 1"),
        ([(30, None)], "is required for a share"),
    ],
)
def test_seed_rules_are_enforced_with_the_rule(containers, needle) -> None:
    with pytest.raises(RuleViolation) as info:
        reqs(pod_object("p", containers))
    assert needle in str(info.value)
    assert "spec.containers[0]" in info.value.field


def test_requests_must_equal_limits_and_may_be_omitted() -> None:
    assert reqs(pod_object("p", [(30, 4)], requests_too=False))[0].request.core == 30
    pod = pod_object("p", [(30, 4)])
    pod["spec"]["containers"][0]["resources"]["requests"][NAMES.core] = "20"
    with pytest.raises(RuleViolation, match="requests must equal limits"):
        reqs(pod)
    only_requests = pod_object("p", [(30, 4)])
    del only_requests["spec"]["containers"][0]["resources"]["limits"][NAMES.memory]
    with pytest.raises(RuleViolation, match="must be set in limits"):
        reqs(only_requests)


def test_quantities_are_plain_integers_and_core_is_needed() -> None:
    pod = pod_object("p", [(30, 4)])
    pod["spec"]["containers"][0]["resources"] = {"limits": {NAMES.core: "30", NAMES.memory: "4Gi"}}
    with pytest.raises(RuleViolation, match="plain whole number"):
        reqs(pod)
    pod["spec"]["containers"][0]["resources"] = {"limits": {NAMES.memory: "4"}}
    with pytest.raises(RuleViolation, match="is required when"):
        reqs(pod)
    pod["spec"]["initContainers"] = [
        {"name": "init", "resources": {"limits": {NAMES.core: "10", NAMES.memory: "1"}}}
    ]
    with pytest.raises(RuleViolation, match="not init containers"):
        reqs(pod)


def test_pod_annotations_override_policies_and_selection() -> None:
    ann = {
        NAMES.policy_label: "fs",
        NAMES.placement_annotation: "spread",
        NAMES.gpu_placement_annotation: "binpack",
        NAMES.model_annotation: "T4|V100M32",
        NAMES.exclude_annotation: "GPU-a,GPU-b",
    }
    (cr,) = reqs(pod_object("p", [(30, 4)], annotations=ann))
    r = cr.request
    assert r.isolation is IsolationPolicy.FIXED_SHARE
    assert r.placement is PlacementPolicy.SPREAD and r.gpu_placement is PlacementPolicy.BINPACK
    assert r.model_names == ("T4", "V100M32") and r.exclude_uuids == ["GPU-a", "GPU-b"]
    with pytest.raises(RuleViolation, match="must be one of"):
        reqs(pod_object("p", [(30, 4)], annotations={NAMES.policy_label: "max-share"}))


@given(
    uuid=st.from_regex(r"GPU-[a-f0-9]{1,12}(-[a-f0-9]{1,8}){0,3}", fullmatch=True),
    kind=st.sampled_from(["core", "memory"]),
    i=st.integers(0, 10_000),
)
def test_device_ids_round_trip(uuid: str, kind, i: int) -> None:
    assert parse_device_id(device_id(uuid, kind, i)) == (uuid, kind)


@given(total=st.integers(1, 400), n=st.integers(1, 8))
def test_split_ids_is_even_and_complete(total: int, n: int) -> None:
    gpus = [f"GPU-{i}" for i in range(n)]
    split = split_ids(total, gpus)
    assert sum(split.values()) == total and max(split.values()) - min(split.values()) <= 1


def test_ids_per_gpu_rejects_foreign_ids() -> None:
    assert ids_per_gpu(["GPU-a_c1", "GPU-a_c2", "GPU-b_c0"]) == ({"core"}, {"GPU-a": 2, "GPU-b": 1})
    with pytest.raises(RuleViolation, match="not a qgpu device ID"):
        ids_per_gpu(["nvidia0"])


# --- the webhook over HTTP -----------------------------------------------------------------


@pytest.fixture
def webhook() -> httpx.Client:
    served = ServedApp(create_app(NAMES, "qgpu-scheduler")).start()
    with httpx.Client(base_url=served.url, timeout=10) as client:
        yield client
    served.stop()


def _review(client: httpx.Client, pod: dict, op: str = "CREATE") -> dict:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": op, "object": pod},
    }
    out = client.post("/mutate", json=body).json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "u-1"
    return out["response"]


def test_webhook_sets_scheduler_name_with_a_json_patch(webhook) -> None:
    resp = _review(webhook, pod_object("p", [(30, 4)]))
    assert resp["allowed"] and resp["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(resp["patch"]))
    assert patch == [{"op": "add", "path": "/spec/schedulerName", "value": "qgpu-scheduler"}]


def test_webhook_leaves_other_pods_and_operations_alone(webhook) -> None:
    resp = _review(webhook, pod_object("plain"))
    assert resp["allowed"] and "patch" not in resp
    already = pod_object("p", [(30, 4)])
    already["spec"]["schedulerName"] = "qgpu-scheduler"
    assert "patch" not in _review(webhook, already)
    assert "patch" not in _review(webhook, pod_object("p", [(30, 4)]), op="UPDATE")


def test_webhook_denies_with_the_rule(webhook) -> None:
    resp = _review(webhook, pod_object("p", [(120, 4)]))
    assert resp["allowed"] is False and resp["status"]["code"] == 400
    assert (
        "qgpu-core" in resp["status"]["message"] and "multiple of 100" in resp["status"]["message"]
    )


# --- KubeRay -------------------------------------------------------------------------------


def test_kuberay_pod_resources_become_ray_resources() -> None:
    template = pod_object("w", [(30, 8)])
    assert ray_resources_from_pod(template) == {"qgpu-core": 30, "qgpu-memory": 8}
    params = ray_start_params(template, base={"resources": '"{\\"custom\\": 1}"'})
    assert json.loads(json.loads(params["resources"])) == {
        "custom": 1,
        "qgpu-core": 30,
        "qgpu-memory": 8,
    }
    assert params["num-gpus"] == "0"
    assert "num-gpus" not in ray_start_params(pod_object("w", [(100, None)]))


def test_kuberay_patches_every_group_of_a_raycluster() -> None:
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": pod_object("h")},
            "workerGroupSpecs": [
                {"groupName": "small", "template": pod_object("s", [(25, 4)])},
                {"groupName": "big", "template": pod_object("b", [(50, 10)])},
            ],
        },
    }
    out = patch_ray_cluster(cluster)
    head, small, big = (
        out["spec"]["headGroupSpec"],
        *out["spec"]["workerGroupSpecs"],
    )
    assert head["rayStartParams"] == {}
    assert json.loads(json.loads(small["rayStartParams"]["resources"]))["qgpu-core"] == 25
    assert json.loads(json.loads(big["rayStartParams"]["resources"]))["qgpu-memory"] == 10
    assert "rayStartParams" not in cluster["spec"]["workerGroupSpecs"][0]  # input untouched


def test_kuberay_reads_the_slice_from_the_plugin_env() -> None:
    env = {
        "QGPU_CORE_LIMIT": "30",
        "QGPU_MEMORY_LIMIT": str(8 * 1024**3),
        "CUDA_VISIBLE_DEVICES": "GPU-a",
    }
    assert ray_resources_from_env(env) == {"qgpu-core": 30, "qgpu-memory": 8}
    whole = {"QGPU_SLICE_ID": "x", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert ray_resources_from_env(whole) == {"qgpu-core": 200}
    assert ray_resources_from_env({}) == {}
