"""Races: concurrent binds to one node (one extender and two replicas), two equal pods
pending at once, stale node locks, a device plugin restarted mid-allocation, a failed
Binding rolled back."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from k8s_bridge.deviceplugin.allocation import AllocationPaths
from k8s_bridge.deviceplugin.server import PluginConfig, QgpuDevicePlugin
from k8s_bridge.extender.app import create_app
from k8s_bridge.extender.models import ExtenderBindingArgs
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.kube import Kube, KubeError, make_api_client
from k8s_bridge.protocol import NodeLock, load_allocated
from qgpu.model import NodeInventory
from tests.fakes.apiserver import FakeApiserver
from tests.fakes.kubelet import AdmissionError, ContainerResult, FakeKubelet
from tests.k8s.helpers import (
    NAMES,
    ServedApp,
    assignment_of,
    free_port,
    gpu,
    gpu_usage,
    pod_object,
    publish_node,
    wait_until,
)


def _extender(srv: FakeApiserver, **cfg) -> Extender:
    ext = Extender(Kube(srv.client(), NAMES), ExtenderConfig(**cfg))
    ext.start()
    return ext


def _bind_args(srv: FakeApiserver, name: str, node: str) -> ExtenderBindingArgs:
    pod = srv.store.get("pods", "default", name)
    return ExtenderBindingArgs(
        PodName=name, PodNamespace="default", PodUID=pod["metadata"]["uid"], Node=node
    )


def _assert_within_capacity(srv: FakeApiserver, gib: int = 16) -> None:
    for u, row in gpu_usage(srv).items():
        assert row["core"] <= 100 and row["memory"] <= gib and row["slices"] <= gib // 4, (u, row)


def test_concurrent_binds_to_one_node_over_http(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [gpu("n0", 0), gpu("n0", 1)])
    ext = _extender(apiserver, watch=False)
    served = ServedApp(create_app(ext)).start()
    names = [f"p{i}" for i in range(12)]
    for n in names:
        apiserver.store.create("pods", pod_object(n, [(30, 4)]))
    bodies = [_bind_args(apiserver, n, "n0").model_dump(by_alias=True) for n in names]
    try:
        with httpx.Client(base_url=served.url, timeout=30) as http, ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda b: http.post("/bind", json=b).json(), bodies))
    finally:
        served.stop()
    ok = [r for r in results if not r.get("Error")]
    failed = [r["Error"] for r in results if r.get("Error")]
    assert len(ok) == 6  # 3 x 30% per GPU, two GPUs
    assert all("cannot take" in e for e in failed), failed
    _assert_within_capacity(apiserver)
    bound = [apiserver.store.get("pods", "default", n)["spec"].get("nodeName") for n in names]
    assert bound.count("n0") == 6
    # failed binds left no assignment behind
    for n in names:
        pod = apiserver.store.get("pods", "default", n)
        has = NAMES.assignment_annotation in (pod["metadata"].get("annotations") or {})
        assert has == (pod["spec"].get("nodeName") == "n0")
    # the lock lingers for the next bind, and is given back when the extender stops
    ext.stop()
    lock = apiserver.store.get("nodes", "", "n0")["metadata"]["annotations"]
    assert NAMES.lock_annotation not in lock
    assert ext.held_locks() == []
    ext.state.state.check_invariants()


def _epoch(srv: FakeApiserver, node: str) -> int:
    return int(srv.store.get("nodes", "", node)["metadata"]["annotations"][NAMES.epoch_annotation])


def test_lock_lingers_for_the_next_bind_then_is_released(apiserver: FakeApiserver) -> None:
    """Back-to-back binds to one node share one lock (one epoch, one write each); the lock
    is released once no bind used it for the linger time; without linger every bind
    takes and releases its own."""
    publish_node(apiserver, "n0", [gpu("n0", 0), gpu("n0", 1)])
    ext = _extender(apiserver, watch=False, lock_linger_s=30.0)
    for n in ("a", "b", "c"):
        apiserver.store.create("pods", pod_object(n, [(30, 4)]))
        assert ext.bind(_bind_args(apiserver, n, "n0")).error == ""
    assert _epoch(apiserver, "n0") == 1
    assert ext.held_locks() == ["n0"]
    annotations = apiserver.store.get("nodes", "", "n0")["metadata"]["annotations"]
    assert NAMES.lock_annotation in annotations
    # bind order stays total inside one epoch: bound_at strictly increases
    stamps = [
        json.loads(
            apiserver.store.get("pods", "default", n)["metadata"]["annotations"][
                NAMES.assignment_annotation
            ]
        )
        for n in ("a", "b", "c")
    ]
    assert {s["lock_epoch"] for s in stamps} == {1}
    assert stamps[0]["bound_at"] < stamps[1]["bound_at"] < stamps[2]["bound_at"]
    assert ext.release_idle_locks(idle_s=60.0) == 0  # used just now: kept
    assert ext.release_idle_locks(idle_s=0.0) == 1
    annotations = apiserver.store.get("nodes", "", "n0")["metadata"]["annotations"]
    assert NAMES.lock_annotation not in annotations
    # the next bind takes a new lock: the epoch moves
    apiserver.store.create("pods", pod_object("d", [(30, 4)]))
    assert ext.bind(_bind_args(apiserver, "d", "n0")).error == ""
    assert _epoch(apiserver, "n0") == 2
    ext.stop()

    other = _extender(apiserver, watch=False, lock_linger_s=0.05)
    apiserver.store.create("pods", pod_object("e", [(10, 1)]))
    assert other.bind(_bind_args(apiserver, "e", "n0")).error == ""
    # the background releaser gives the idle lock back by itself
    wait_until(
        lambda: (
            NAMES.lock_annotation
            not in apiserver.store.get("nodes", "", "n0")["metadata"]["annotations"]
        ),
        10,
        "the idle lock to be released",
    )
    assert other.held_locks() == []
    other.stop()

    eager = _extender(apiserver, watch=False, lock_linger_s=0)
    for n in ("f", "g"):
        apiserver.store.create("pods", pod_object(n, [(10, 1)]))
        assert eager.bind(_bind_args(apiserver, n, "n0")).error == ""
    assert _epoch(apiserver, "n0") == 5  # d: 2, e: 3, f: 4, g: 5
    assert eager.held_locks() == []


def test_a_lingering_lock_is_not_reused_past_its_max_hold(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [gpu("n0", 0)])
    ext = _extender(apiserver, watch=False, lock_linger_s=30.0, lock_max_hold_s=0.01)
    for n in ("a", "b"):
        apiserver.store.create("pods", pod_object(n, [(10, 1)]))
        assert ext.bind(_bind_args(apiserver, n, "n0")).error == ""
        time.sleep(0.02)
    assert _epoch(apiserver, "n0") == 2
    ext.stop()


def test_two_extender_replicas_never_overcommit_a_node(apiserver: FakeApiserver) -> None:
    """Replicas do not see each other's binds in memory (no watch): the node lock and the
    epoch it carries make each re-read the node's pods before choosing."""
    publish_node(apiserver, "n0", [gpu("n0", 0), gpu("n0", 1)])
    a = _extender(apiserver, watch=False)
    b = _extender(apiserver, watch=False)
    names = [f"p{i}" for i in range(12)]
    for n in names:
        apiserver.store.create("pods", pod_object(n, [(30, 4)]))
    jobs = [((a, b)[i % 2], _bind_args(apiserver, n, "n0")) for i, n in enumerate(names)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda j: j[0].bind(j[1]), jobs))
    assert sum(1 for r in results if not r.error) == 6
    _assert_within_capacity(apiserver)
    usage = gpu_usage(apiserver)
    assert sorted(r["core"] for r in usage.values()) == [90, 90]


def test_stale_lock_expires_and_live_lock_blocks(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [gpu("n0", 0)])
    # lock_linger_s=0: this test overwrites the lock behind the extender's back (no watch),
    # which no lock holder would do; a lingering lock would not notice
    ext = _extender(apiserver, watch=False, lock_timeout_s=0.6, lock_linger_s=0)
    kube = Kube(apiserver.client(), NAMES)

    def lock_by_other(expires_in: float) -> None:
        text = NodeLock(holder="dead-extender", expires=time.time() + expires_in)
        kube.publish_node_annotations("n0", {NAMES.lock_annotation: text.model_dump_json()})

    for n in ("stale", "short", "long"):
        apiserver.store.create("pods", pod_object(n, [(10, 1)]))
    lock_by_other(-1.0)  # expired a second ago: taken over at once
    assert ext.bind(_bind_args(apiserver, "stale", "n0")).error == ""
    lock_by_other(0.3)  # expires while we wait
    t0 = time.monotonic()
    assert ext.bind(_bind_args(apiserver, "short", "n0")).error == ""
    assert time.monotonic() - t0 >= 0.2
    lock_by_other(60.0)  # live: the bind gives up with the holder's name
    err = ext.bind(_bind_args(apiserver, "long", "n0")).error
    assert "locked by dead-extender" in err
    assert apiserver.store.get("pods", "default", "long")["spec"].get("nodeName") is None


def test_binding_without_an_answer_is_resolved_by_reading_the_pod(
    apiserver: FakeApiserver,
) -> None:
    """The apiserver hangs up on the Binding: done or not, the extender reads the pod
    instead of binding again; a bind that did not happen is rolled back."""
    publish_node(apiserver, "n0", [gpu("n0", 0)])
    ext = _extender(apiserver, watch=False)
    for n in ("done", "lost"):
        apiserver.store.create("pods", pod_object(n, [(40, 4)]))
    apiserver.drop_next("POST", r"/pods/done/binding$", when="after")
    assert ext.bind(_bind_args(apiserver, "done", "n0")).error == ""
    assert apiserver.store.get("pods", "default", "done")["spec"]["nodeName"] == "n0"
    assert "done" in {r.name for r in ext.state.pods.values()}

    apiserver.drop_next("POST", r"/pods/lost/binding$", when="before")
    err = ext.bind(_bind_args(apiserver, "lost", "n0")).error
    assert "no answer from the apiserver" in err
    assert apiserver.store.get("pods", "default", "lost")["spec"].get("nodeName") is None
    assert {r.name for r in ext.state.pods.values()} == {"done"}
    assert int(ext.state.state.free_core[0]) == 60
    assert ext.bind(_bind_args(apiserver, "lost", "n0")).error == ""  # the retry binds it
    assert int(ext.state.state.free_core[0]) == 20
    ext.stop()


def test_an_unreachable_apiserver_is_a_kube_error_with_no_status() -> None:
    kube = Kube(make_api_client(f"http://127.0.0.1:{free_port()}"), NAMES)
    with pytest.raises(KubeError) as caught:
        kube.get_node("n0")
    assert caught.value.status == 0
    assert "get node n0: no answer from the apiserver" in str(caught.value)


def test_failed_binding_is_rolled_back(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [gpu("n0", 0)])
    ext = _extender(apiserver, watch=False)
    apiserver.store.create("pods", pod_object("p", [(50, 8)]))
    apiserver.fail_next("POST", r"/binding$", 500, "InternalError", "etcd timeout")
    err = ext.bind(_bind_args(apiserver, "p", "n0")).error
    assert "500" in err
    pod = apiserver.store.get("pods", "default", "p")
    assert NAMES.assignment_annotation not in (pod["metadata"].get("annotations") or {})
    assert not ext.state.pods
    assert int(ext.state.state.free_core[0]) == 100
    # the retry that kube-scheduler makes then succeeds
    assert ext.bind(_bind_args(apiserver, "p", "n0")).error == ""
    # and a repeated bind of the bound pod is a no-op, not a second assignment
    assert ext.bind(_bind_args(apiserver, "p", "n0")).error == ""
    assert int(ext.state.state.free_core[0]) == 50


@pytest.fixture
def node_with_plugin(apiserver: FakeApiserver) -> Iterator[dict]:
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="qr"))
    hook = tmp / "hook.so"
    hook.write_bytes(b"stand-in")
    apiserver.store.create("nodes", {"metadata": {"name": "n0"}})
    kl = FakeKubelet(tmp / "dp").start()
    inv = NodeInventory(name="n0", gpus=[gpu("n0", 0), gpu("n0", 1)])

    def new_plugin() -> QgpuDevicePlugin:
        p = QgpuDevicePlugin(
            PluginConfig(
                node_name="n0",
                plugin_dir=kl.dir,
                poll_s=0.05,
                pod_resources_socket=kl.pod_resources_socket,
            ),
            Kube(apiserver.client(), NAMES),
            inv,
            AllocationPaths(state_dir=tmp / "state", hook_library=hook),
        )
        p.start()
        kl.wait_ready([NAMES.core, NAMES.memory])
        return p

    env = {"kubelet": kl, "new_plugin": new_plugin, "plugins": []}
    env["plugins"].append(new_plugin())
    env["extender"] = _extender(apiserver, watch=False, gpu_policy="spread")
    yield env
    for p in env["plugins"]:
        p.stop()
    kl.stop()


def test_plugin_restart_in_the_middle_of_an_allocation(apiserver, node_with_plugin) -> None:
    kl, ext = node_with_plugin["kubelet"], node_with_plugin["extender"]
    apiserver.store.create("pods", pod_object("p", [(30, 4)]))
    assert ext.bind(_bind_args(apiserver, "p", "n0")).error == ""
    pod = apiserver.store.get("pods", "default", "p")
    uid = pod["metadata"]["uid"]
    out = ContainerResult()
    kl.allocate_resource(uid, "c0", NAMES.core, 30, out)  # kubelet allocated the core resource...
    node_with_plugin["plugins"].pop().stop()  # ...then the plugin died
    node_with_plugin["plugins"].append(node_with_plugin["new_plugin"]())
    kl.allocate_resource(uid, "c0", NAMES.memory, 4, out)  # the new plugin finishes the container
    gpu_uuid = assignment_of(apiserver, "p").containers["c0"].gpus[0]
    assert out.envs["CUDA_VISIBLE_DEVICES"] == gpu_uuid
    assert {d.rpartition("_")[0] for d in out.ids[NAMES.memory]} == {gpu_uuid}
    ann = apiserver.store.get("pods", "default", "p")["metadata"]["annotations"]
    assert load_allocated(ann[NAMES.allocated_annotation]).claimed("c0") == {"core", "memory"}


def test_kubelet_restart_reregisters_and_keeps_allocations(apiserver, node_with_plugin) -> None:
    kl, ext = node_with_plugin["kubelet"], node_with_plugin["extender"]
    apiserver.store.create("pods", pod_object("a", [(30, 4)]))
    assert ext.bind(_bind_args(apiserver, "a", "n0")).error == ""
    kl.admit(apiserver.store.get("pods", "default", "a"))
    plugin = node_with_plugin["plugins"][0]
    before = plugin.registrations
    kl.restart()
    kl.wait_ready([NAMES.core, NAMES.memory])
    # kubelet lists a resource's devices as soon as its Register call arrives; the plugin
    # counts the registration when that call has returned to it, a moment later
    wait_until(lambda: plugin.registrations >= before + 2, timeout=10)
    assert kl.capacity(NAMES.core) == (200, 170)
    apiserver.store.create("pods", pod_object("b", [(30, 4)]))
    assert ext.bind(_bind_args(apiserver, "b", "n0")).error == ""
    res = kl.admit(apiserver.store.get("pods", "default", "b"))
    assert (
        res["c0"].envs["CUDA_VISIBLE_DEVICES"]
        == assignment_of(apiserver, "b").containers["c0"].gpus[0]
    )


RESOURCES = {"core": NAMES.core, "memory": NAMES.memory}


def test_two_equal_pods_pending_at_once(apiserver, node_with_plugin) -> None:
    """Two identical replicas created in the same second, both bound before kubelet admits
    either, bound in the reverse of their names' order: kubelet sees them in binding order,
    and the plugin matches in binding order, so each pod gets exactly its own assignment
    (ordering by name, or by the one-second creationTimestamp, would swap them). Each
    container is claimed once; kubelet's device IDs and the env name the same GPU."""
    kl, ext = node_with_plugin["kubelet"], node_with_plugin["extender"]
    order = ("zeta", "alpha")
    for n in order:
        apiserver.store.create("pods", pod_object(n, [(60, 8)]))
    for n in order:
        assert ext.bind(_bind_args(apiserver, n, "n0")).error == ""
    gpus = {n: assignment_of(apiserver, n).containers["c0"].gpus[0] for n in order}
    assert gpus["zeta"] != gpus["alpha"]  # 60 + 60 > 100: two GPUs
    envs = {}
    for n in order:  # kubelet's watch delivers them in binding order
        res = kl.admit(apiserver.store.get("pods", "default", n))["c0"]
        envs[n] = res.envs["CUDA_VISIBLE_DEVICES"]
        for ids in res.ids.values():
            assert {d.rpartition("_")[0] for d in ids} == {envs[n]}
    assert envs == gpus
    for n in order:
        pod = apiserver.store.get("pods", "default", n)
        claim = json.loads(pod["metadata"]["annotations"][NAMES.allocated_annotation])
        assert claim["containers"] == {"c0": ["core", "memory"]}
        # the claim records kubelet's device IDs (a claimed container is known by them)
        uid = pod["metadata"]["uid"]
        assert claim["devices"] == {
            "c0": {k: sorted(kl.allocated[(uid, "c0", r)]) for k, r in RESOURCES.items()}
        }
    # a third equal pod has nowhere to go on this node
    apiserver.store.create("pods", pod_object("third", [(60, 8)]))
    assert "cannot take" in ext.bind(_bind_args(apiserver, "third", "n0")).error


def test_allocate_without_assignment_is_a_grpc_error(apiserver, node_with_plugin) -> None:
    """A pod that bypassed the extender gets an error from the plugin, never devices."""
    kl = node_with_plugin["kubelet"]
    apiserver.store.create("pods", pod_object("rogue", [(30, 4)]))
    apiserver.store.update(
        "pods", "default", "rogue", lambda o: {**o, "spec": {**o["spec"], "nodeName": "n0"}}
    )
    with pytest.raises(AdmissionError, match="no pod assigned to node n0") as info:
        kl.admit(apiserver.store.get("pods", "default", "rogue"))
    assert info.value.code is not None and info.value.code.name == "NOT_FOUND"
    assert not kl.allocated
