"""The device plugin over real gRPC (unix sockets), driven by the fake kubelet or by stubs:
registration, ListAndWatch and health, steering, Allocate/PreStart errors, published
inventory, limits files and device nodes."""

from __future__ import annotations

import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from k8s_bridge.deviceplugin.allocation import AllocationPaths
from k8s_bridge.deviceplugin.server import PluginConfig, QgpuDevicePlugin
from k8s_bridge.deviceplugin.v1beta1 import api_pb2 as pb
from k8s_bridge.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from k8s_bridge.extender.models import ExtenderBindingArgs
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube
from k8s_bridge.protocol import load_inventory
from qgpu.model import GpuDevice, GpuHealth, NodeInventory
from tests.fakes.apiserver import FakeApiserver
from tests.fakes.kubelet import AdmissionError, FakeKubelet
from tests.k8s.helpers import NAMES, U, assignment_of, gpu, pod_object


class Node:
    def __init__(self, srv: FakeApiserver, hook: bool = True, devices: bool = False) -> None:
        self.srv = srv
        self.tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qd"))
        self.hook = self.tmp / "hook.so"
        if hook:
            self.hook.write_bytes(b"stand-in")
        dev = self.tmp / "dev"
        dev.mkdir()
        if devices:
            for name in ("nvidia0", "nvidia1", "nvidiactl"):
                (dev / name).write_text("")
        srv.store.create("nodes", {"metadata": {"name": "n0"}})
        self.kubelet = FakeKubelet(self.tmp / "dp").start()
        g0 = GpuDevice(uuid=U("n0", 0), index=0, model="T4", memory_mib=16 * 1024, numa_node=0)
        self.inventory = NodeInventory(name="n0", gpus=[g0, gpu("n0", 1)])
        self.paths = AllocationPaths(
            state_dir=self.tmp / "state", hook_library=self.hook, dev_dir=dev
        )
        self.plugin = QgpuDevicePlugin(
            PluginConfig(
                node_name="n0",
                plugin_dir=self.kubelet.dir,
                poll_s=0.05,
                pod_resources_socket=self.kubelet.pod_resources_socket,
            ),
            Kube(srv.client(), NAMES),
            self.inventory,
            self.paths,
        )
        self.plugin.start()
        self.kubelet.wait_ready([NAMES.core, NAMES.memory])
        self.extender = Extender(Kube(srv.client(), NAMES), ExtenderConfig(watch=False))
        self.extender.start()

    def stub(self, kind: str) -> pb_grpc.DevicePluginStub:
        channel = grpc.insecure_channel(f"unix://{self.kubelet.dir / f'qgpu-{kind}.sock'}")
        return pb_grpc.DevicePluginStub(channel)

    def bound_pod(self, name: str, containers: list) -> dict:
        pod = self.srv.store.create("pods", pod_object(name, containers))
        args = ExtenderBindingArgs(
            PodName=name, PodNamespace="default", PodUID=pod["metadata"]["uid"], Node="n0"
        )
        assert self.extender.bind(args).error == ""
        return self.srv.store.get("pods", "default", name)

    def close(self) -> None:
        self.plugin.stop()
        self.kubelet.stop()


@pytest.fixture
def node(apiserver: FakeApiserver) -> Iterator[Node]:
    n = Node(apiserver)
    yield n
    n.close()


def test_registers_both_resources_with_options(node: Node) -> None:
    plugins = node.kubelet.plugins
    assert plugins[NAMES.core].endpoint == "qgpu-core.sock"
    assert plugins[NAMES.memory].endpoint == "qgpu-memory.sock"
    for p in plugins.values():
        assert p.options.pre_start_required and p.options.get_preferred_allocation_available
    assert node.kubelet.capacity(NAMES.core) == (200, 200)
    assert node.kubelet.capacity(NAMES.memory) == (32, 32)


def test_list_and_watch_carries_topology_and_health(node: Node) -> None:
    stream = node.stub("core").ListAndWatch(pb.Empty(), timeout=5)
    first = next(stream)
    by_id = {d.ID: d for d in first.devices}
    assert by_id[f"{U('n0', 0)}_c0"].topology.nodes[0].ID == 0
    assert by_id[f"{U('n0', 1)}_c99"].health == "Healthy"
    sick = node.inventory.gpus[1].model_copy(update={"health": GpuHealth.UNHEALTHY})
    node.plugin.set_inventory(
        node.inventory.model_copy(update={"gpus": [node.inventory.gpus[0], sick]})
    )
    second = next(stream)
    stream.cancel()
    assert {d.health for d in second.devices if d.ID.startswith(U("n0", 1))} == {"Unhealthy"}
    # the kubelet's own stream saw it too, and the Node annotation says so
    import time

    deadline = time.monotonic() + 5
    while node.kubelet.capacity(NAMES.core)[0] != 100 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.kubelet.capacity(NAMES.core) == (100, 100)
    ann = node.srv.store.get("nodes", "", "n0")["metadata"]["annotations"]
    inv = load_inventory(ann[NAMES.inventory_annotation])
    assert [g.healthy for g in inv.gpus] == [True, False]


def test_preferred_allocation_steers_to_the_assigned_gpu(node: Node) -> None:
    node.bound_pod("a", [(60, 8)])  # binpack: GPU-n0-0
    node.bound_pod("b", [(60, 8)])  # no room left there: GPU-n0-1
    target = assignment_of(node.srv, "b").containers["c0"].gpus[0]
    assert target == U("n0", 1)
    available = [f"{U('n0', g)}_c{i}" for g in (0, 1) for i in range(100)]
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=[], allocation_size=60
            )
        ]
    )
    ids = node.stub("core").GetPreferredAllocation(req, timeout=5).container_responses[0].deviceIDs
    # the oldest pending pod ("a") is served first: GPU-n0-0
    assert len(ids) == 60 and {d.rpartition("_")[0] for d in ids} == {U("n0", 0)}


def test_allocate_ids_from_the_wrong_gpu_is_an_error(node: Node) -> None:
    node.bound_pod("a", [(30, 4)])
    wrong = [f"{U('n0', 1)}_c{i}" for i in range(30)]
    with pytest.raises(grpc.RpcError) as info:
        node.stub("core").Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=wrong)]),
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    mixed = [f"{U('n0', 0)}_c0", f"{U('n0', 0)}_m0"]
    with pytest.raises(grpc.RpcError) as info:
        node.stub("core").Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=mixed)]),
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prestart_without_claim_is_an_error(node: Node) -> None:
    node.bound_pod("a", [(30, 4)])
    ids = [f"{U('n0', 0)}_c{i}" for i in range(30)]
    with pytest.raises(grpc.RpcError) as info:
        node.stub("core").PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_limits_file_is_read_only_and_matches(node: Node) -> None:
    pod = node.bound_pod("a", [(30, 4)])
    res = node.kubelet.admit(pod)["c0"]
    mounts = {m.container_path: m for m in res.mounts}
    host = Path(mounts["/etc/qgpu/limits.conf"].host_path)
    assert stat.S_IMODE(host.stat().st_mode) == 0o440
    text = host.read_text()
    assert "QGPU_MEMORY_LIMIT=4294967296\n" in text and f"QGPU_DEVICE_UUID={U('n0', 0)}\n" in text
    assert Path(mounts["/etc/ld.so.preload"].host_path).read_text().strip() == (
        "/usr/local/qgpu/lib/libqgpu_hook.so"
    )
    assert mounts["/usr/local/qgpu/lib/libqgpu_hook.so"].host_path == str(node.hook)
    sid = res.envs["QGPU_SLICE_ID"]
    assert not mounts[f"/run/qgpu/slices/{sid}/ledger"].read_only
    # of its GPU's shared state: the directory read-only, its own activity file writable,
    # mounted after the directory it lies in
    gpu = f"/run/qgpu/slices/.gpu-{U('n0', 0)}"
    assert mounts[gpu].read_only and not mounts[f"{gpu}/{sid}.activity"].read_only
    order = [m.container_path for m in res.mounts]
    assert order.index(gpu) < order.index(f"{gpu}/{sid}.activity")
    assert not any(p.endswith(".region") for p in mounts)


def test_share_without_interposer_is_refused(apiserver: FakeApiserver) -> None:
    n = Node(apiserver, hook=False)
    try:
        pod = n.bound_pod("a", [(30, 4)])
        with pytest.raises(AdmissionError, match="interposer library is not available") as info:
            n.kubelet.admit(pod)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        whole = n.bound_pod("w", [(100, None)])  # whole GPUs need no interposer
        assert n.kubelet.admit(whole)["c0"].envs["CUDA_VISIBLE_DEVICES"] == U("n0", 1)
    finally:
        n.close()


def test_device_nodes_are_passed_when_present(apiserver: FakeApiserver) -> None:
    n = Node(apiserver, devices=True)
    try:
        res = n.kubelet.admit(n.bound_pod("a", [(30, 4)]))["c0"]
        paths = sorted(d.container_path for d in res.devices)
        assert paths == ["/dev/nvidia0", "/dev/nvidiactl"]
    finally:
        n.close()


def test_allocating_a_claimed_container_again_gives_the_same_answer(node: Node) -> None:
    """kubelet re-allocates from its checkpoint after a restart: same IDs, same env."""
    pod = node.bound_pod("a", [(30, 4)])
    first = node.kubelet.admit(pod)["c0"]
    ids = first.ids[NAMES.core]
    again = node.stub("core").Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
        timeout=5,
    )
    envs = dict(again.container_responses[0].envs)
    assert envs["CUDA_VISIBLE_DEVICES"] == first.envs["CUDA_VISIBLE_DEVICES"]
    assert envs["QGPU_SLICE_ID"] == first.envs["QGPU_SLICE_ID"]


def test_two_whole_gpus_with_memory_take_ids_from_both(node: Node) -> None:
    """For whole GPUs qgpu-memory is the minimum card size (the core's rule); kubelet still
    hands out that many memory IDs, spread over the cards."""
    pod = node.bound_pod("w", [(200, 16)])
    ca = assignment_of(node.srv, "w").containers["c0"]
    assert ca.memory_gib == [16, 16]
    assert ca.devices["memory"] == {U("n0", 0): 8, U("n0", 1): 8}
    res = node.kubelet.admit(pod)["c0"]
    assert res.envs["CUDA_VISIBLE_DEVICES"] == f"{U('n0', 0)},{U('n0', 1)}"
    per_gpu = {}
    for d in res.ids[NAMES.memory]:
        per_gpu[d.rpartition("_")[0]] = per_gpu.get(d.rpartition("_")[0], 0) + 1
    assert per_gpu == {U("n0", 0): 8, U("n0", 1): 8}
    assert len(res.ids[NAMES.core]) == 200


def test_plugin_started_before_kubelet_registers_when_it_comes(apiserver) -> None:
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qb"))
    (tmp / "dp").mkdir()
    apiserver.store.create("nodes", {"metadata": {"name": "n0"}})
    plugin = QgpuDevicePlugin(
        PluginConfig(
            node_name="n0",
            plugin_dir=tmp / "dp",
            poll_s=0.05,
            register_timeout_s=0.5,
            pod_resources_socket=tmp / "dp-podres" / "kubelet.sock",  # the fake kubelet's
        ),
        Kube(apiserver.client(), NAMES),
        NodeInventory(name="n0", gpus=[gpu("n0", 0)]),
        AllocationPaths(state_dir=tmp / "state", hook_library=None),
    )
    plugin.start()  # no kubelet.sock yet
    assert plugin.registrations == 0
    kubelet = FakeKubelet(tmp / "dp").start()
    try:
        kubelet.wait_ready([NAMES.core, NAMES.memory])
        assert kubelet.capacity(NAMES.memory) == (16, 16)
    finally:
        plugin.stop()
        kubelet.stop()


def test_fake_kubelet_pod_resources_list_as_kubelet_serves_it(node: Node) -> None:
    """kubelet's pod-resources List over real gRPC: a container's devices are there as soon
    as Allocate returned (before PreStartContainer), one entry per NUMA node; a pod
    rejected at admission and a released pod are not listed."""
    from k8s_bridge.deviceplugin.pod_resources import ContainerRef, PodResourcesClient
    from k8s_bridge.podresources.v1 import api_pb2 as pr
    from k8s_bridge.podresources.v1 import api_pb2_grpc as pr_grpc

    pod = node.bound_pod("w", [(200, 16)])  # both GPUs: GPU 0 on NUMA node 0, GPU 1 on none
    got = node.kubelet.admit_only(pod)["c0"]
    assert not [c for c in node.kubelet.calls if c.startswith("PreStartContainer")]
    with grpc.insecure_channel(f"unix://{node.kubelet.pod_resources_socket}") as ch:
        resp = pr_grpc.PodResourcesListerStub(ch).List(pr.ListPodResourcesRequest(), timeout=5)
    (listed,) = resp.pod_resources
    assert (listed.namespace, listed.name, [c.name for c in listed.containers]) == (
        "default",
        "w",
        ["c0"],
    )
    core = [d for d in listed.containers[0].devices if d.resource_name == NAMES.core]
    assert sorted([n.ID for n in d.topology.nodes] for d in core) == [[], [0]]
    assert sorted(i for d in core for i in d.device_ids) == sorted(got.ids[NAMES.core])
    client = PodResourcesClient(node.kubelet.pod_resources_socket)
    try:
        me = ContainerRef(namespace="default", pod="w", container="c0")
        assert client.owner(NAMES.core, got.ids[NAMES.core]) == me
        assert client.owner(NAMES.core, got.ids[NAMES.core][:-1]) is None  # exactly these
        rogue = node.srv.store.create("pods", pod_object("rogue", [(30, 4)]))
        with pytest.raises(AdmissionError):
            node.kubelet.admit(rogue)  # no assignment: rejected, not an active pod
        node.kubelet.start_containers(pod)
        node.kubelet.release(pod["metadata"]["uid"])
        assert client.devices() == {}
    finally:
        client.close()


def test_prestart_fails_closed_without_the_pod_resources_api(node: Node) -> None:
    """kubelet's pod-resources API not answering (kubelet restarting, socket gone): the
    container does not start; kubelet retries the start and it goes through once the API
    answers again."""
    from tests.fakes.kubelet import StartError

    pod = node.bound_pod("a", [(30, 4)])
    node.kubelet.admit_only(pod)
    lister = node.kubelet._pod_resources
    assert node.plugin.check is not None and lister is not None
    node.plugin.check.client.timeout_s = 0.5  # how long a List waits for kubelet
    lister.stop(0).wait(2)
    with pytest.raises(StartError, match="pod-resources API") as info:
        node.kubelet.start_containers(pod)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    node.kubelet.restart()  # the API comes back with kubelet
    node.kubelet.wait_ready([NAMES.core, NAMES.memory])
    node.kubelet.start_containers(pod)


def test_device_plugin_does_not_start_without_the_pod_resources_api(tmp_path: Path) -> None:
    """Fail closed at start-up: no socket at --pod-resources-socket is one line naming the
    flag, the path and the way out (exit 2); a socket that does not answer List too."""
    import argparse

    from k8s_bridge.cli import _pod_resources_socket
    from qgpu.errors import RuleViolation
    from tests.k8s.helpers import one_error_line, run_qgpu

    missing = tmp_path / "kubelet.sock"
    proc = run_qgpu(
        "device-plugin",
        "--node-name=n0",
        f"--pod-resources-socket={missing}",
        "--apiserver=http://127.0.0.1:9",
    )
    assert one_error_line(proc) == (
        f"error: --pod-resources-socket {missing}: is not a socket (kubelet's pod-resources "
        "API): mount kubelet's pod-resources directory into the plugin, or pass "
        "--no-pod-resources-check to run without this check"
    )
    kubelet = FakeKubelet(Path(tempfile.mkdtemp(dir="/tmp", prefix="qs")) / "dp").start()
    try:  # kubelet's Registration socket serves no PodResourcesLister
        args = argparse.Namespace(
            no_pod_resources_check=False,
            pod_resources_socket=str(kubelet.socket),
            pod_resources_wait=0.0,
        )
        with pytest.raises(RuleViolation, match="UNIMPLEMENTED"):
            _pod_resources_socket(args)
        args.pod_resources_socket = str(kubelet.pod_resources_socket)
        assert _pod_resources_socket(args) == kubelet.pod_resources_socket
        args.no_pod_resources_check = True
        assert _pod_resources_socket(args) is None
    finally:
        kubelet.stop()
