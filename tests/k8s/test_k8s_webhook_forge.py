"""Attack: a tenant who can create pods presets what only the qgpu scheduler's bind writes.

The extender's bind writes ``<prefix>/qgpu-assignment`` (the GPU(s) and slice chosen) and
sets ``spec.nodeName``; the device plugin hands kubelet the slice the assignment names.
A pod created with a forged assignment and a preset ``spec.nodeName`` skips the scheduler
and the extender and would take a GPU / slice nobody granted. The webhook (over real HTTP)
must deny it on CREATE, naming the field; what stays open is written down in
docs/kubernetes.md (trust model)."""

from __future__ import annotations

import pytest

from tests.k8s.helpers import NAMES, TEST_KEYS, PodDenied, U, assignment_of, pod_object
from tests.k8s.test_k8s_e2e import make_cluster  # noqa: F401  (fixture)


def _forged(name: str, assignment: str, node: str, core: int = 30, memory: int = 4) -> dict:
    pod = pod_object(name, [(core, memory)], annotations={NAMES.assignment_annotation: assignment})
    pod["spec"]["nodeName"] = node
    return pod


def test_pod_presetting_the_assignment_and_node_is_denied(make_cluster) -> None:  # noqa: F811
    cluster = make_cluster()
    cluster.run(pod_object("victim", [(30, 4)]))
    granted = assignment_of(cluster.srv, "victim")
    text = granted.model_copy(update={"bound_at": granted.bound_at + 1}).dumps()
    with pytest.raises(PodDenied, match=r"metadata\.annotations\[.*qgpu-assignment\]="):
        cluster.submit(_forged("thief", text, granted.node))
    # the annotation alone (the pod would then go through the scheduler, which rewrites it,
    # but the device plugin reads it as soon as any node name appears): denied as well
    alone = pod_object("thief2", [(30, 4)], annotations={NAMES.assignment_annotation: text})
    with pytest.raises(PodDenied, match="qgpu-assignment"):
        cluster.submit(alone)
    claim = pod_object("thief3", [(30, 4)], annotations={NAMES.allocated_annotation: "{}"})
    with pytest.raises(PodDenied, match="qgpu-allocated"):
        cluster.submit(claim)
    mac = pod_object("thief5", [(30, 4)], annotations={NAMES.assignment_mac_annotation: "v1.0"})
    with pytest.raises(PodDenied, match="qgpu-assignment-mac"):
        cluster.submit(mac)
    # the node alone skips the extender: kubelet would admit it with no assignment at all
    bare = pod_object("thief4", [(30, 4)])
    bare["spec"]["nodeName"] = "n0"
    with pytest.raises(PodDenied, match=r"spec\.nodeName='n0': .*qgpu scheduler's bind"):
        cluster.submit(bare)
    stored = {p["metadata"]["name"] for p in cluster.srv.store.list("pods", None, None, None)[0]}
    assert stored == {"victim"}
    # nothing the thieves asked for was handed out: the victim's GPU holds only the victim
    assert granted.containers["c0"].gpus == [U(granted.node, 0)]


def test_plain_pods_with_a_node_name_and_the_bind_path_stay_allowed(make_cluster) -> None:  # noqa: F811
    cluster = make_cluster()
    plain = pod_object("daemon")  # asks for no qgpu resource: nodeName is its own business
    plain["spec"]["nodeName"] = "n1"
    assert cluster.submit(plain)["spec"]["nodeName"] == "n1"
    node, results = cluster.run(pod_object("legit", [(30, 4)]))
    assert assignment_of(cluster.srv, "legit").node == node
    assert results["c0"].envs["QGPU_CORE_LIMIT"] == "30"


def test_device_plugin_refuses_a_forged_assignment_of_another_scheduler(make_cluster) -> None:  # noqa: F811
    """Past the webhook (disabled, failurePolicy Ignore, or a pod stored some other way), the
    device plugin (real gRPC from the fake kubelet) honours only pods of the qgpu scheduler:
    the extender binds no other, so their assignment was written by their author."""
    from tests.fakes.kubelet import AdmissionError

    cluster = make_cluster()
    cluster.run(pod_object("victim", [(30, 4)]))
    granted = assignment_of(cluster.srv, "victim")
    (u,) = granted.containers["c0"].gpus
    # 60% and 8 GiB of the victim's GPU, a layout no claimed container has
    c0 = granted.containers["c0"].model_copy(
        update={"core": 60, "memory_gib": [8], "devices": {"core": {u: 60}, "memory": {u: 8}}}
    )
    text = granted.model_copy(update={"containers": {"c0": c0}, "bound_at": 2e9}).dumps()
    forged = _forged("thief", text, granted.node, core=60, memory=8)
    forged["spec"]["schedulerName"] = "default-scheduler"
    stored = cluster.srv.store.create("pods", forged)  # straight in, as a bypass would
    # before the check the plugin answered QGPU_CORE_LIMIT=60 on the victim's GPU
    with pytest.raises(AdmissionError, match="no pod assigned to node n0 waits"):
        cluster.kubelets[granted.node].admit(stored)


def test_device_plugin_ignores_an_assignment_the_pod_does_not_ask_for(make_cluster) -> None:  # noqa: F811
    """A pod of the qgpu scheduler that asks for nothing (so the webhook's matchCondition
    never sends it) or for less than its assignment grants carries a forged assignment: the
    plugin takes only an assignment that is the slice the pod's own container asks for."""
    from k8s_bridge.deviceplugin.claims import pending_pods

    cluster = make_cluster()
    cluster.run(pod_object("victim", [(30, 4)]))
    granted = assignment_of(cluster.srv, "victim")
    text = granted.model_copy(update={"bound_at": 2e9}).dumps()
    asks_nothing = pod_object("thief-a", [], annotations={NAMES.assignment_annotation: text})
    asks_nothing["spec"].update(schedulerName="qgpu-scheduler", nodeName=granted.node)
    asks_less = _forged("thief-b", text, granted.node, core=10, memory=2)
    same = _forged("copy", text, granted.node, core=30, memory=4)
    pods = [cluster.srv.store.create("pods", p) for p in (asks_nothing, asks_less, same)]
    victim = cluster.srv.store.get("pods", "default", "victim")
    found = pending_pods(NAMES, granted.node, [victim, *pods], "qgpu-scheduler")
    assert sorted(c.pod.metadata.name for c in found) == ["copy", "victim"]
    # with the assignment key (the chart's default) the copy is not one either: its MAC
    # (none here) is not the extender's for its UID
    rejected: list[str] = []
    found = pending_pods(
        NAMES,
        granted.node,
        [victim, *pods],
        "qgpu-scheduler",
        TEST_KEYS,
        lambda pod, why: rejected.append(f"{pod.metadata.name}: {why}"),
    )
    assert [c.pod.metadata.name for c in found] == ["victim"]
    assert rejected == [
        "thief-a: its assignment MAC annotation is missing",
        "thief-b: its assignment MAC annotation is missing",
        "copy: its assignment MAC annotation is missing",
    ]
