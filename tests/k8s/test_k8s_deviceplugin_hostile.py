"""The device plugin over real gRPC against requests it must not serve: device IDs that are
not ours or name GPUs of another node, sizes nobody waits for, IDs of one kind sent to the
other plugin; and the repeats kubelet sends after a restart (GetPreferredAllocation and
Allocate for a container that already claimed) answered the same way without a second
claim. Every refusal is a gRPC status with a message, never UNKNOWN or INTERNAL (what an
exception escaping the servicer becomes)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, U
from tests.k8s.test_k8s_deviceplugin import Node

REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}


@pytest.fixture
def node(apiserver: FakeApiserver) -> Iterator[Node]:
    n = Node(apiserver)
    yield n
    n.close()


def allocate(node: Node, kind: str, ids: list[str]) -> pb.ContainerAllocateResponse:
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    return node.stub(kind).Allocate(req, timeout=10).container_responses[0]


def preferred(node: Node, kind: str, available: list[str], size: int) -> list[str]:
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=[], allocation_size=size
            )
        ]
    )
    answer = node.stub(kind).GetPreferredAllocation(req, timeout=10)
    return list(answer.container_responses[0].deviceIDs)


def refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    assert info.value.code() in REFUSALS, (info.value.code(), info.value.details())
    assert info.value.details()
    return info.value


def every_core_id() -> list[str]:
    return [f"{U('n0', g)}_c{i}" for g in (0, 1) for i in range(100)]


@pytest.mark.parametrize(
    "ids",
    [
        ["../../etc/passwd"],
        [""],
        ["GPU-x_c"],
        ["GPU-x_cx1"],
        ["_c1"],
        [f"{U('n0', 0)}_z1"],
        [f"{U('n0', 0)}_c-1"],
        ["é" * 5000 + "_c1"],
        [f"{U('n9', 0)}_c{i}" for i in range(30)],  # a GPU of another node
        [f"{U('n0', 0)}_m{i}" for i in range(4)],  # memory IDs to the core plugin
        [],
    ],
)
def test_allocate_refuses_ids_that_are_not_ours(node: Node, ids: list[str]) -> None:
    node.bound_pod("a", [(30, 4)])
    refused(allocate, node, "core", ids)
    # the pod that waits is still served afterwards, on its own GPU
    res = node.kubelet.admit(node.srv.store.get("pods", "default", "a"))["c0"]
    assert res.envs["CUDA_VISIBLE_DEVICES"] == U("n0", 0)


def test_preferred_refuses_what_nobody_waits_for(node: Node) -> None:
    node.bound_pod("a", [(30, 4)])
    refused(preferred, node, "core", every_core_id(), 10**6)
    refused(preferred, node, "core", every_core_id(), 31)
    refused(preferred, node, "core", ["not-an-id"], 30)
    refused(preferred, node, "core", [f"{U('n9', 0)}_c{i}" for i in range(100)], 30)
    assert len(preferred(node, "core", every_core_id(), 30)) == 30


def test_a_pod_of_another_node_is_not_served(node: Node) -> None:
    """A pod bound to n0 is not served by a plugin of another node, and the plugin on n0
    does not serve IDs laid out for a pod assigned elsewhere."""
    node.bound_pod("a", [(30, 4)])
    elsewhere = [f"{U('n0', 1)}_c{i}" for i in range(30)]
    refused(allocate, node, "core", elsewhere)


def test_repeats_after_a_claim_get_the_same_answer_and_no_second_claim(node: Node) -> None:
    """kubelet asks again (its Allocate answer was lost, or it restarted from its
    checkpoint): GetPreferredAllocation still steers to the claimed GPU, Allocate answers
    the same env and mounts, and the pod's claim annotation is unchanged."""
    pod = node.bound_pod("a", [(30, 4)])
    first = node.kubelet.admit(pod)["c0"]
    claim = node.srv.store.get("pods", "default", "a")["metadata"]["annotations"][
        NAMES.allocated_annotation
    ]
    ids = first.ids[NAMES.core]
    steered = preferred(node, "core", every_core_id(), 30)
    assert {d.rpartition("_")[0] for d in steered} == {U("n0", 0)}
    assert preferred(node, "core", every_core_id(), 30) == steered
    answers = [allocate(node, "core", ids) for _ in range(3)]
    for again in answers:
        assert dict(again.envs) == dict(answers[0].envs)
        assert dict(again.envs)["QGPU_SLICE_ID"] == first.envs["QGPU_SLICE_ID"]
        mounts = sorted((m.container_path, m.host_path, m.read_only) for m in again.mounts)
        assert mounts == sorted((m.container_path, m.host_path, m.read_only) for m in first.mounts)
    after = node.srv.store.get("pods", "default", "a")["metadata"]["annotations"]
    assert after[NAMES.allocated_annotation] == claim
    # the repeats made no second slice directory
    slices = [p for p in node.paths.slices_dir.iterdir() if p.is_dir()]
    assert [p.name for p in slices] == [first.envs["QGPU_SLICE_ID"]]
