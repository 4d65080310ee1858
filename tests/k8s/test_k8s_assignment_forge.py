"""Attacks past the webhook on what the device plugin hands out (issue 18, forged placement).

1. A tenant with ``patch`` on its own pods rewrites ``<prefix>/qgpu-assignment`` of its pod
   after the extender bound it and before kubelet admitted it (plain pod UPDATEs are not
   routed to the webhook), naming a GPU the scheduler did not choose; or copies another
   pod's assignment; or a pod that bypassed the webhook carries an assignment of its own.
   The extender signs what it writes (HMAC-SHA256 over pod UID, node and the assignment's
   text, `k8s_bridge.assignment_mac`); the device plugin takes no assignment whose MAC is
   missing or wrong, and says why in its log.
2. A pod kubelet admits on a node without any assignment the plugin takes asks for the same
   layout (IDs per GPU) as a container that already claimed: the plugin matched claimed
   containers by layout and handed it that container's slice (its slice id, its ledger).
   Claims now record kubelet's device IDs and a claimed container is matched by them.

Everything runs over the real gRPC device plugin, the fake apiserver over HTTP and the
extender served over HTTP (`tests.k8s.helpers.Cluster`)."""

from __future__ import annotations

import logging

import pytest

from k8s_bridge.kube import Kube
from k8s_bridge.protocol import load_allocated
from tests.fakes.kubelet import AdmissionError, StartError
from tests.k8s.helpers import NAMES, U, assignment_of, pod_object, wait_until
from tests.k8s.test_k8s_e2e import make_cluster  # noqa: F401  (fixture)


def _tenant_patch(cluster, name: str, annotations: dict[str, str | None]) -> None:
    """What `kubectl annotate --overwrite` does with a tenant's pod `patch` RBAC: a plain
    merge-patch UPDATE, which the chart does not route to the webhook."""
    kube = Kube(cluster.srv.client(), NAMES)
    kube.patch_pod("default", name, {"metadata": {"annotations": annotations}})


def _bound(cluster, name: str, containers) -> tuple[str, dict]:
    """Submit and schedule (filter, prioritize, bind) without kubelet admitting it."""
    created = cluster.submit(pod_object(name, containers))
    node, why = cluster.scheduler.schedule("default", created["metadata"]["name"])
    assert node is not None, why
    return node, cluster.srv.store.get("pods", "default", name)


def test_post_bind_patch_naming_another_gpu_is_refused(make_cluster, caplog) -> None:  # noqa: F811
    cluster = make_cluster()
    node, victim = cluster.run(pod_object("victim", [(30, 4)]))
    victim_gpu = victim["c0"].envs["CUDA_VISIBLE_DEVICES"]
    node2, _ = _bound(cluster, "thief", [(30, 4)])
    assert node2 == node  # binpack: the same node
    granted = assignment_of(cluster.srv, "thief")
    (chosen,) = granted.containers["c0"].gpus
    other = U(node, 1) if chosen == U(node, 0) else U(node, 0)
    ca = granted.containers["c0"]
    moved = {k: {other: sum(per.values())} for k, per in ca.devices.items()}
    forged_c0 = ca.model_copy(update={"gpus": [other], "devices": moved})
    forged = granted.model_copy(update={"containers": {"c0": forged_c0}}).dumps()
    original = cluster.srv.store.get("pods", "default", "thief")["metadata"]["annotations"]
    _tenant_patch(cluster, "thief", {NAMES.assignment_annotation: forged})
    pod = cluster.srv.store.get("pods", "default", "thief")
    # the extender sees the patch on its watch and keeps holding the GPU it chose (it would
    # otherwise free `chosen` for the next pod and count `other`)
    uid, rv = pod["metadata"]["uid"], int(pod["metadata"]["resourceVersion"])
    held = cluster.extender.state.pods
    wait_until(lambda: held[uid].resource_version >= rv, what="the extender to see the patch")
    assert held[uid].assignment.containers["c0"].gpus == [chosen]
    caplog.set_level(logging.WARNING, logger="k8s_bridge.deviceplugin")
    # before the MAC the plugin answered CUDA_VISIBLE_DEVICES=<other>: a GPU nobody granted
    with pytest.raises(AdmissionError, match="ignored 1 assignment"):
        cluster.kubelets[node].admit(pod)
    assert any(
        "default/thief" in r.getMessage() and "MAC" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert other != chosen and victim_gpu in (chosen, other)
    # the tenant puts the extender's own assignment back: admitted where it was bound
    _tenant_patch(
        cluster, "thief", {NAMES.assignment_annotation: original[NAMES.assignment_annotation]}
    )
    kl = cluster.kubelets[node]
    kl.release(pod["metadata"]["uid"])
    res = kl.admit(cluster.srv.store.get("pods", "default", "thief"))
    assert res["c0"].envs["CUDA_VISIBLE_DEVICES"] == chosen


def test_copied_or_dropped_mac_is_refused(make_cluster) -> None:  # noqa: F811
    """Another pod's assignment with its MAC (the MAC covers the pod's UID), or an assignment
    whose MAC the tenant removed, is not a candidate."""
    cluster = make_cluster()
    node, _ = cluster.run(pod_object("victim", [(30, 4)]))
    ann = cluster.srv.store.get("pods", "default", "victim")["metadata"]["annotations"]
    assert ann[NAMES.assignment_mac_annotation].startswith("v1.")
    # a pod that bypassed the webhook (created straight in, bound by its author), carrying
    # the victim's assignment and MAC
    copy = pod_object(
        "copy",
        [(30, 4)],
        annotations={
            k: ann[k] for k in (NAMES.assignment_annotation, NAMES.assignment_mac_annotation)
        },
    )
    copy["spec"]["nodeName"] = node
    stored = cluster.srv.store.create("pods", copy)
    with pytest.raises(AdmissionError, match="ignored 1 assignment"):
        cluster.kubelets[node].admit(stored)
    cluster.kubelets[node].release(stored["metadata"]["uid"])
    # a bound pod whose MAC its owner removed
    node2, _ = _bound(cluster, "dropped", [(30, 4)])
    assert node2 == node
    _tenant_patch(cluster, "dropped", {NAMES.assignment_mac_annotation: None})
    with pytest.raises(AdmissionError, match="ignored 2 assignment"):
        cluster.kubelets[node].admit(cluster.srv.store.get("pods", "default", "dropped"))


def test_a_second_container_of_the_same_layout_cannot_take_over_a_claim(make_cluster) -> None:  # noqa: F811
    """A pod with no assignment the plugin takes (here: none at all, bound by its author)
    asks for the layout a running container claimed. Before claims carried device IDs the
    plugin answered it with that container's slice: its slice id, limits file and ledger."""
    cluster = make_cluster()
    node, victim = cluster.run(pod_object("victim", [(30, 4)]))
    (gpu_uuid,) = assignment_of(cluster.srv, "victim").containers["c0"].gpus
    thief = pod_object("thief", [(30, 4)], scheduler_name="default-scheduler")
    thief["spec"]["nodeName"] = node
    stored = cluster.srv.store.create("pods", thief)
    kl = cluster.kubelets[node]
    try:
        got = kl.admit(stored)
    except AdmissionError as exc:
        assert "waits for" in str(exc)
    else:  # the attack won: say what it got
        pytest.fail(
            f"thief got slice {got['c0'].envs.get('QGPU_SLICE_ID')} "
            f"(victim's: {victim['c0'].envs['QGPU_SLICE_ID']}) on {gpu_uuid}"
        )
    # the victim's own repeat (kubelet's checkpoint: the same IDs) still gets its answer
    ids = kl.allocated[
        (
            victim_uid := cluster.srv.store.get("pods", "default", "victim")["metadata"]["uid"],
            "c0",
            NAMES.core,
        )
    ]
    again = cluster.plugins[node].allocate("core", ids)
    assert dict(again.envs)["QGPU_SLICE_ID"] == victim["c0"].envs["QGPU_SLICE_ID"]
    assert victim_uid in dict(again.envs)["QGPU_SLICE_ID"]


def test_removing_its_own_claim_does_not_hand_its_slice_to_the_next_pod(make_cluster) -> None:  # noqa: F811
    """A tenant removes the claim annotation of its running pod: its container looks
    unallocated, was bound first, and so ranked first for the next pod of the same layout on
    that GPU, which was then answered with the tenant's slice (one slice's caps and ledger
    shared by two tenants). The plugin's own record of its claims on the node wins."""
    cluster = make_cluster()
    node, mine = cluster.run(pod_object("mine", [(30, 4)]))
    _tenant_patch(cluster, "mine", {NAMES.allocated_annotation: None})
    node2, _ = _bound(cluster, "other", [(30, 4)])
    assert node2 == node
    theirs = assignment_of(cluster.srv, "other").containers["c0"].gpus
    assert theirs == assignment_of(cluster.srv, "mine").containers["c0"].gpus  # binpack
    got = cluster.kubelets[node].admit(cluster.srv.store.get("pods", "default", "other"))["c0"]
    other_uid = cluster.srv.store.get("pods", "default", "other")["metadata"]["uid"]
    assert got.envs["QGPU_SLICE_ID"] == f"{other_uid}.c0", (
        f"other got {got.envs['QGPU_SLICE_ID']}; mine is {mine['c0'].envs['QGPU_SLICE_ID']}"
    )


def _uid(cluster, name: str) -> str:
    return cluster.srv.store.get("pods", "default", name)["metadata"]["uid"]


def _victim_and_thief(cluster) -> tuple[str, dict]:
    """A pod "victim" bound (not admitted) and a pod "thief" of its layout that names the
    victim's node itself (no scheduler, no extender, no webhook): (node, the thief)."""
    node, _ = _bound(cluster, "victim", [(30, 4)])
    thief = pod_object("thief", [(30, 4)], scheduler_name="default-scheduler")
    thief["spec"]["nodeName"] = node
    return node, cluster.srv.store.create("pods", thief)


def test_a_pod_past_the_extender_cannot_take_a_pending_pods_slice(make_cluster) -> None:  # noqa: F811
    """The residual of the forge attacks: a pod with no assignment the plugin takes
    (``spec.nodeName`` preset: it skipped the scheduler, the extender and the webhook)
    reaches kubelet while a pod of the same layout is bound to that node and not yet
    admitted. Allocate names device IDs only, so the plugin answers it with the bound pod's
    slice. At PreStartContainer kubelet's pod-resources API names the container that got
    these IDs: not the claimed one, so its start is refused and the claim withdrawn; the
    bound pod is then admitted with its own slice."""
    cluster = make_cluster()
    node, stored = _victim_and_thief(cluster)
    kl = cluster.kubelets[node]
    victim_uid = _uid(cluster, "victim")
    try:
        got = kl.admit(stored)
    except StartError as exc:  # admitted (Allocate cannot tell), never started
        assert "kubelet gave" in str(exc) and "default/thief/c0" in str(exc), exc
    else:  # the attack won: say what it got
        pytest.fail(
            f"thief started with slice {got['c0'].envs.get('QGPU_SLICE_ID')} "
            f"(the victim's uid: {victim_uid})"
        )
    # kubelet retrying the thief's start: refused again
    with pytest.raises(StartError, match="no allocated container"):
        kl.start_containers(stored)
    # the victim, admitted next, gets its own slice on its own GPU
    res = kl.admit(cluster.srv.store.get("pods", "default", "victim"))["c0"]
    assert res.envs["QGPU_SLICE_ID"] == f"{victim_uid}.c0"
    (gpu_uuid,) = assignment_of(cluster.srv, "victim").containers["c0"].gpus
    assert res.envs["CUDA_VISIBLE_DEVICES"] == gpu_uuid
    claim = load_allocated(
        cluster.srv.store.get("pods", "default", "victim")["metadata"]["annotations"][
            NAMES.allocated_annotation
        ]
    )
    assert claim.claimed_ids("c0", "core") == sorted(kl.allocated[(victim_uid, "c0", NAMES.core)])


def test_a_bound_pod_admitted_while_the_thief_waits_gets_its_slice(make_cluster) -> None:  # noqa: F811
    """The same attack, with the bound pod admitted between the thief's admission and its
    container start (an image pull takes that long): the thief's claim on the bound pod's
    container is withdrawn at the bound pod's Allocate (kubelet lists those IDs under the
    thief), so it is not refused for want of a pending container."""
    cluster = make_cluster()
    node, stored = _victim_and_thief(cluster)
    kl = cluster.kubelets[node]
    kl.admit_only(stored)
    res = kl.admit(cluster.srv.store.get("pods", "default", "victim"))["c0"]
    assert res.envs["QGPU_SLICE_ID"] == f"{_uid(cluster, 'victim')}.c0"
    with pytest.raises(StartError, match="kubelet gave them to default/thief/c0"):
        kl.start_containers(stored)


def test_two_bound_pods_admitted_out_of_order_do_not_swap(make_cluster) -> None:  # noqa: F811
    """Two bound pods of one layout on different GPUs of a node, admitted in the reverse of
    their binding order (a batch delivered at once): the first admitted was answered with
    the other's slice (its GPU, slice id and ledger), and the other with its slice. The
    plugin now withdraws a claim that kubelet's pod-resources API shows under another
    container before it matches the next Allocate, so the pod bound first gets its own
    slice; the pod admitted out of order cannot start (its device IDs and env name the
    other pod's GPU and slice, and an Allocate answer cannot be changed afterwards)."""
    cluster = make_cluster(gpu_policy="spread")
    node, _ = _bound(cluster, "first", [(30, 4)])
    node2, _ = _bound(cluster, "second", [(30, 4)])
    assert node2 == node  # binpack across nodes, spread over the node's GPUs
    gpus = {n: assignment_of(cluster.srv, n).containers["c0"].gpus for n in ("first", "second")}
    assert gpus["first"] != gpus["second"]
    kl = cluster.kubelets[node]
    second = cluster.srv.store.get("pods", "default", "second")
    kl.admit_only(second)  # admitted; its container not started yet (image pull)
    got = kl.admit(cluster.srv.store.get("pods", "default", "first"))["c0"]
    assert got.envs["QGPU_SLICE_ID"] == f"{_uid(cluster, 'first')}.c0", (
        f"first got {got.envs['QGPU_SLICE_ID']} on {got.envs['CUDA_VISIBLE_DEVICES']}"
    )
    assert [got.envs["CUDA_VISIBLE_DEVICES"]] == gpus["first"]
    with pytest.raises(StartError, match="kubelet gave them to default/second/c0"):
        kl.start_containers(second)


def test_a_swap_on_full_gpus_starts_neither_pod_in_the_other_s_slice(make_cluster) -> None:  # noqa: F811
    """The same out-of-order admission where the pod admitted first holds device IDs the
    pod bound first needs (60 + 60 > 100 core IDs on one GPU): that pod cannot be given its
    own GPU, and is not given the other's slice either (the other's container was allocated
    by kubelet already): its admission fails, and the out-of-order pod is refused at start.
    Both are recreated by their controllers; neither runs in a slice that is not its own."""
    cluster = make_cluster(gib=16)
    node, _ = _bound(cluster, "first", [(60, 8)])
    assert _bound(cluster, "second", [(60, 8)])[0] == node
    kl = cluster.kubelets[node]
    second = cluster.srv.store.get("pods", "default", "second")
    kl.admit_only(second)
    with pytest.raises(AdmissionError, match="no pod assigned to node") as info:
        kl.admit(cluster.srv.store.get("pods", "default", "first"))
    assert info.value.code is not None and info.value.code.name == "NOT_FOUND"
    with pytest.raises(StartError, match="kubelet gave them to default/second/c0"):
        kl.start_containers(second)
