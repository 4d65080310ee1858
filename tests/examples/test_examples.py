"""The Kubernetes examples: schema-checked, and run through the k8s_bridge code they meet.

- examples/pod.yaml: validated against the Kubernetes schemas (kubernetes-validate, strict),
  its slice parsed by `k8s_bridge.resources`, admitted by the webhook's `review`, selected by
  the chart's CEL matchCondition, and addressed to the chart's scheduler profile;
- examples/kuberay-raycluster.yaml: the RayCluster fields checked against a model of
  KubeRay's ray.io/v1 types (no schema ships for the CRD), every pod template validated as a
  Kubernetes PodTemplateSpec, the advertised Ray resources equal to what
  `k8s_bridge.kuberay` computes from the pods' limits AND to what a worker reads from the
  environment Allocate gives it (`enforcement.limits`), every worker pod admitted by the
  webhook.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from k8s_bridge.kuberay import (
    crd_has_group_resources,
    patch_ray_cluster,
    ray_resources_from_env,
    ray_resources_from_pod,
)
from k8s_bridge.resources import Names, parse_pod, pod_overrides, pod_slice_requests
from k8s_bridge.webhook import AdmissionRequest, review
from qgpu.model import Allocation, IsolationPolicy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NAMES = Names()
SCHEDULER = "qgpu-scheduler"
KUBE_VERSIONS = ("1.28", "1.30", "1.34")
TESTED = {"pod.yaml", "kuberay-raycluster.yaml"}
Obj = dict[str, Any]


def _load(name: str) -> Obj:
    return yaml.safe_load((EXAMPLES / name).read_text())


def test_every_kubernetes_example_is_tested_here() -> None:
    manifests = set()
    for path in EXAMPLES.glob("*.y*ml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                manifests.add(path.name)
    assert manifests == TESTED


def test_paths_named_in_the_examples_and_install_guide_exist() -> None:
    texts = [(EXAMPLES / n).read_text() for n in TESTED]
    texts.append((ROOT / "docs" / "install.md").read_text())
    named = {m for t in texts for m in re.findall(r"\bexamples/[\w.-]+\.(?:py|yaml)\b", t)}
    assert {"examples/ray_serve_inference.py", "examples/dask_inference.py"} <= named
    for path in named:
        assert (ROOT / path).is_file(), path


def _admit(pod: Obj) -> Any:
    return review(NAMES, SCHEDULER, AdmissionRequest(uid="u1", operation="CREATE", object=pod))


# --- pod.yaml ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_pod_validates_against_the_kubernetes_schemas(version: str) -> None:
    kubernetes_validate.validate(_load("pod.yaml"), version, strict=True)


def test_pod_asks_for_one_valid_slice() -> None:
    pod = _load("pod.yaml")
    assert pod["spec"]["schedulerName"] == SCHEDULER
    parsed = parse_pod(pod)
    (req,) = pod_slice_requests(NAMES, parsed)
    assert (req.container, req.request.core, req.request.memory_gib) == ("cuda", 30, 8)
    assert req.request.isolation is IsolationPolicy.FIXED_SHARE
    overrides = pod_overrides(NAMES, parsed)
    assert overrides.placement == "binpack"


def test_pod_is_admitted_and_routed_to_the_qgpu_scheduler() -> None:
    pod = _load("pod.yaml")
    ok = _admit(pod)
    assert ok.allowed and ok.patch is None  # schedulerName already set
    bare = copy.deepcopy(pod)
    del bare["spec"]["schedulerName"]
    routed = _admit(bare)
    assert routed.allowed and routed.patch_type == "JSONPatch"
    assert json.loads(base64.b64decode(routed.patch or "")) == [
        {"op": "add", "path": "/spec/schedulerName", "value": SCHEDULER}
    ]


def test_pod_matches_the_chart_webhook_and_scheduler_profile() -> None:
    import cel

    from tests.helm import chart
    rendered = chart.render()
    (hook,) = rendered.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    pod = _load("pod.yaml")
    assert cel.evaluate(hook["matchConditions"][0]["expression"], {"object": pod}) is True
    profiles = [p["schedulerName"] for p in rendered.scheduler_config()["profiles"]]
    assert pod["spec"]["schedulerName"] in profiles


def test_pod_with_a_broken_slice_is_denied() -> None:
    pod = _load("pod.yaml")
    pod["spec"]["containers"][0]["resources"]["limits"][NAMES.core] = 150
    denied = _admit(pod)
    assert not denied.allowed
    assert denied.status is not None and "qgpu-core" in denied.status.message


# --- kuberay-raycluster.yaml -------------------------------------------------------------


class _KubeRay(BaseModel):
    """ray.io/v1 field names (github.com/ray-project/kuberay ray-operator/apis/ray/v1)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class HeadGroupSpec(_KubeRay):
    ray_start_params: dict[str, str] = Field(alias="rayStartParams")
    resources: dict[str, str] | None = None  # KubeRay >= 1.5: the typed Ray resources
    template: Obj
    service_type: str | None = Field(None, alias="serviceType")
    enable_ingress: bool | None = Field(None, alias="enableIngress")


class WorkerGroupSpec(_KubeRay):
    group_name: str = Field(alias="groupName", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    replicas: int = Field(ge=0)
    min_replicas: int = Field(alias="minReplicas", ge=0)
    max_replicas: int = Field(alias="maxReplicas", ge=0)
    ray_start_params: dict[str, str] = Field(alias="rayStartParams")
    resources: dict[str, str] | None = None  # KubeRay >= 1.5: the typed Ray resources
    template: Obj
    num_of_hosts: int | None = Field(None, alias="numOfHosts")

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroupSpec:
        assert self.min_replicas <= self.replicas <= self.max_replicas, self.group_name
        return self


class RayClusterSpec(_KubeRay):
    ray_version: str = Field(alias="rayVersion")
    head_group_spec: HeadGroupSpec = Field(alias="headGroupSpec")
    worker_group_specs: list[WorkerGroupSpec] = Field(alias="workerGroupSpecs")
    enable_in_tree_autoscaling: bool | None = Field(None, alias="enableInTreeAutoscaling")


class RayCluster(_KubeRay):
    api_version: str = Field(alias="apiVersion", pattern=r"^ray\.io/v1$")
    kind: str = Field(pattern=r"^RayCluster$")
    metadata: Obj
    spec: RayClusterSpec


@pytest.fixture(scope="module")
def raycluster() -> Obj:
    return _load("kuberay-raycluster.yaml")


def _groups(cluster: Obj) -> list[Obj]:
    return [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]


def _advertised(group: Obj) -> dict[str, int]:
    text = group["rayStartParams"].get("resources")
    return json.loads(json.loads(text)) if text else {}


def test_raycluster_fields_follow_kuberay_v1(raycluster: Obj) -> None:
    model = RayCluster.model_validate(raycluster)
    assert [g.group_name for g in model.spec.worker_group_specs] == ["slice-30", "whole-gpu"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_raycluster_pod_templates_validate_as_pod_template_specs(
    raycluster: Obj, version: str
) -> None:
    for i, group in enumerate(_groups(raycluster)):
        doc = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"group-{i}"},
            "template": group["template"],
        }
        kubernetes_validate.validate(doc, version, strict=True)


def test_raycluster_advertises_exactly_what_the_pods_request(raycluster: Obj) -> None:
    assert patch_ray_cluster(raycluster) == raycluster  # nothing left for the helper to fix
    slice_group, whole_group = raycluster["spec"]["workerGroupSpecs"]
    assert _advertised(slice_group) == {"qgpu-core": 30, "qgpu-memory": 8}
    assert slice_group["rayStartParams"]["num-gpus"] == "0"
    assert _advertised(whole_group) == {"qgpu-core": 100}
    assert "num-gpus" not in whole_group["rayStartParams"]
    head = raycluster["spec"]["headGroupSpec"]
    assert _advertised(head) == {} and ray_resources_from_pod(head["template"]) == {}
    for group in raycluster["spec"]["workerGroupSpecs"]:
        assert _advertised(group) == ray_resources_from_pod(group["template"])


def _kuberay_node_types(cluster: Obj) -> dict[str, dict]:
    """The Ray resources each group gets, read the way the Ray autoscaler reads a KubeRay
    RayCluster (Ray's own parser of rayStartParams and the typed resources map)."""
    from ray.autoscaler._private.kuberay import autoscaling_config as autoscaling
    cr = copy.deepcopy(cluster)
    cr["metadata"].setdefault("namespace", "default")
    config = autoscaling._derive_autoscaling_config_from_ray_cr(cr)
    types = config["available_node_types"]
    types["head"] = types.pop(autoscaling._HEAD_GROUP_NAME)
    return {name: t["resources"] for name, t in types.items()}


@pytest.mark.parametrize("typed", [False, True], ids=["rayStartParams", "typed-map"])
def test_raycluster_resources_parse_the_way_kuberay_reads_them(raycluster: Obj, typed) -> None:
    cluster = patch_ray_cluster(raycluster, typed_resources=typed)
    RayCluster.model_validate(cluster)
    slice_group = cluster["spec"]["workerGroupSpecs"][0]
    if typed:
        assert slice_group["resources"] == {"qgpu-core": "30", "qgpu-memory": "8"}
        assert "resources" not in slice_group["rayStartParams"]
    types = _kuberay_node_types(cluster)
    assert types["slice-30"]["qgpu-core"] == 30 and types["slice-30"]["qgpu-memory"] == 8
    assert types["slice-30"]["GPU"] == 0  # num-gpus "0": Ray leaves the slice's device alone
    assert types["whole-gpu"]["qgpu-core"] == 100
    assert "qgpu-core" not in types["head"]


def test_typed_resources_only_where_the_crd_has_them() -> None:
    # the shape of KubeRay's released CRD (checked by reading it, see docs/ray.md): both
    # maps are objects of strings, on headGroupSpec and on each workerGroupSpecs item
    strings = {"type": "object", "additionalProperties": {"type": "string"}}

    def crd(with_resources: bool) -> Obj:
        group = {"type": "object", "properties": {"rayStartParams": strings}}
        if with_resources:
            group["properties"]["resources"] = strings
        spec = {"headGroupSpec": group, "workerGroupSpecs": {"type": "array", "items": group}}
        schema = {"properties": {"spec": {"type": "object", "properties": spec}}}
        return {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}

    assert crd_has_group_resources(crd(True))
    assert not crd_has_group_resources(crd(False))
    assert not crd_has_group_resources({})


def test_a_slice_worker_reads_the_same_resources_from_its_allocate_env(raycluster: Obj) -> None:
    """What the device plugin puts in the container's environment (`enforcement.limits`, the
    mapping Allocate uses) makes `ray_resources_from_env` say what rayStartParams says."""
    from enforcement.limits import allocation_env, limits_for_allocation

    slice_group, whole_group = raycluster["spec"]["workerGroupSpecs"]
    (req,) = pod_slice_requests(NAMES, parse_pod({"metadata": {}, **slice_group["template"]}))
    alloc = Allocation(
        slice_id="pod-uid.ray-worker",
        node="gpu-node-1",
        gpu_uuids=["GPU-00000000-0000-4000-8000-000000000001"],
        core=req.request.core,
        memory_gib=req.request.memory_gib or 0,
        isolation=req.request.effective_isolation(IsolationPolicy.BEST_EFFORT),
    )
    env = limits_for_allocation(alloc, state_dir="/run/qgpu/slices").to_env()
    env["CUDA_VISIBLE_DEVICES"] = alloc.gpu_uuids[0]
    assert ray_resources_from_env(env) == _advertised(slice_group)

    whole = Allocation(
        slice_id="pod-uid.ray-worker",
        node="gpu-node-1",
        gpu_uuids=["GPU-00000000-0000-4000-8000-000000000002"],
        core=100,
        memory_gib=80,
    )
    assert ray_resources_from_env(allocation_env(whole)) == _advertised(whole_group)


def test_raycluster_worker_pods_are_admitted(raycluster: Obj) -> None:
    for group in raycluster["spec"]["workerGroupSpecs"]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"}, **group["template"]}
        pod["metadata"] = {"name": "w", **(group["template"].get("metadata") or {})}
        decision = _admit(pod)
        assert decision.allowed, decision.status
        assert pod["spec"]["schedulerName"] == SCHEDULER
        for c in pod["spec"]["containers"]:
            res = c["resources"]
            for name in (NAMES.core, NAMES.memory):
                if name in res.get("requests", {}):
                    assert res["requests"][name] == res["limits"][name]
