"""End to end: webhook -> filter -> prioritize -> bind -> kubelet Allocate, over the real
protocols (HTTP to extender and webhook, the official client to the fake apiserver, gRPC
over unix sockets between the fake kubelet and the device plugin)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qgpu.units import BYTES_PER_GIB
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import (
    NAMES,
    Cluster,
    PodDenied,
    U,
    assignment_of,
    gpu,
    gpu_usage,
    pod_object,
)

NODES = ["n0", "n1", "n2"]


def three_nodes(gib: int = 32) -> dict[str, list]:
    return {n: [gpu(n, 0, gib), gpu(n, 1, gib)] for n in NODES}


@pytest.fixture
def make_cluster(apiserver: FakeApiserver) -> Iterator:
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(apiserver, three_nodes(kw.pop("gib", 32)), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# 20 pods: one whole GPU, one two-container pod, 18 single-container shares.
MIXED: list[list[tuple[int, int | None]]] = (
    [[(100, None)], [(10, 2), (10, 2)]] + [[(10, 2)]] * 6 + [[(15, 2)]] * 6 + [[(5, 1)]] * 6
)


def check_pod(cluster: Cluster, name: str, node: str, results: dict) -> None:
    """Each container's env carries its device and caps, matching the assignment."""
    a = assignment_of(cluster.srv, name)
    assert a.node == node
    for cname, ca in a.containers.items():
        env = results[cname].envs
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(ca.gpus)
        ids = results[cname].ids
        # kubelet's device IDs came from the assigned GPU(s): steering worked
        assert {d.rpartition("_")[0] for d in ids[NAMES.core]} == set(ca.gpus)
        if ca.core < 100:
            assert env["QGPU_DEVICE_UUID"] == ca.gpus[0]
            assert int(env["QGPU_CORE_LIMIT"]) == ca.core
            assert int(env["QGPU_MEMORY_LIMIT"]) == ca.memory_gib[0] * BYTES_PER_GIB
            assert env["QGPU_ISOLATION"] == ca.isolation.value
            assert env["QGPU_LIMITS_FILE"] == "/etc/qgpu/limits.conf"
            mounts = {m.container_path: m for m in results[cname].mounts}
            assert mounts["/etc/ld.so.preload"].read_only
            assert mounts["/etc/qgpu/limits.conf"].read_only
            limits = Path(mounts["/etc/qgpu/limits.conf"].host_path).read_text()
            assert f"QGPU_CORE_LIMIT={ca.core}\n" in limits
            assert {d.rpartition("_")[0] for d in ids[NAMES.memory]} == set(ca.gpus)
        else:
            assert "QGPU_CORE_LIMIT" not in env


def check_no_overcommit(cluster: Cluster) -> None:
    caps = {g.uuid: g for p in cluster.plugins.values() for g in p.inventory.gpus}
    for u, row in gpu_usage(cluster.srv).items():
        assert row["core"] <= 100, (u, row)
        assert row["memory"] <= caps[u].memory_gib, (u, row)
        assert row["slices"] <= caps[u].max_slices(), (u, row)
    # kubelet's own accounting: no device ID handed out twice on any node
    for kl in cluster.kubelets.values():
        seen: set[str] = set()
        for ids in kl.allocated.values():
            assert not seen & set(ids)
            seen |= set(ids)
    cluster.extender.state.state.check_invariants()


def node_core(cluster: Cluster) -> dict[str, int]:
    owner = {U(n, i): n for n in NODES for i in (0, 1)}
    out = dict.fromkeys(NODES, 0)
    for u, row in gpu_usage(cluster.srv).items():
        out[owner[u]] += row["core"]
    return out


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_twenty_mixed_pods_end_to_end(make_cluster, policy: str) -> None:
    cluster = make_cluster(node_policy=policy, shuffle_resources=True)
    placed = {}
    for i, containers in enumerate(MIXED):
        node, results = cluster.run(pod_object(f"p{i}", containers))
        placed[f"p{i}"] = node
        check_pod(cluster, f"p{i}", node, results)
        pod = cluster.srv.store.get("pods", "default", f"p{i}")
        assert pod["spec"]["schedulerName"] == "qgpu-scheduler"
        assert pod["spec"]["nodeName"] == node
    check_no_overcommit(cluster)
    used = node_core(cluster)
    assert sum(used.values()) == 100 + 20 + 60 + 90 + 30
    if policy == "binpack":
        # 300 core of demand packs onto two nodes; the third stays empty
        assert used["n2"] == 0 and placed["p0"] == "n0"
    else:
        # spread: every node carries load and none is more than one big pod apart
        assert all(v > 0 for v in used.values())
        assert max(used.values()) - min(used.values()) <= 100
    # every claim is recorded on the pods
    for name in placed:
        ann = cluster.srv.store.get("pods", "default", name)["metadata"]["annotations"]
        assert NAMES.allocated_annotation in ann


def test_layout_binpack(make_cluster, apiserver: FakeApiserver) -> None:
    packed = make_cluster(node_policy="binpack")
    for i in range(6):
        packed.run(pod_object(f"b{i}", [(30, 4)]))
    layout = {u: r["core"] for u, r in gpu_usage(apiserver).items()}
    assert layout == {U("n0", 0): 90, U("n0", 1): 90}


def test_layout_spread(make_cluster, apiserver: FakeApiserver) -> None:
    spread = make_cluster(node_policy="spread")
    for i in range(6):
        spread.run(pod_object(f"s{i}", [(30, 4)]))
    layout = {u: r["core"] for u, r in gpu_usage(apiserver).items()}
    assert layout == {U(n, i): 30 for n in NODES for i in (0, 1)}


def test_per_pod_policy_annotation_overrides_the_default(make_cluster, apiserver) -> None:
    cluster = make_cluster(node_policy="binpack")
    cluster.run(pod_object("a", [(30, 4)]))
    spread = {NAMES.placement_annotation: "spread"}
    node, _ = cluster.run(pod_object("b", [(30, 4)], annotations=spread))
    assert node != "n0"  # spread leaves the node binpack just started on
    gpu_level = {NAMES.gpu_placement_annotation: "spread"}
    cluster.run(pod_object("c", [(30, 4)], annotations=gpu_level))
    assert assignment_of(apiserver, "c").containers["c0"].gpus == [U("n0", 1)]


def test_isolation_from_node_label_and_pod_annotation(make_cluster, apiserver) -> None:
    cluster = make_cluster(node_policy="binpack", policies={"n0": "fs", "n1": "burst-share"})
    _, res = cluster.run(pod_object("a", [(30, 4)]))
    assert res["c0"].envs["QGPU_ISOLATION"] == "fixed-share"
    _, res = cluster.run(pod_object("b", [(30, 4)], annotations={NAMES.policy_label: "bs"}))
    assert res["c0"].envs["QGPU_ISOLATION"] == "burst-share"


def test_invalid_pods_are_denied_with_the_rule(make_cluster) -> None:
    cluster = make_cluster()
    with pytest.raises(PodDenied, match=r"must be 1\.\.99"):
        cluster.submit(pod_object("x", [(250, 4)]))
    bad = pod_object("y", [(30, 4)])
    bad["spec"]["containers"][0]["resources"]["requests"][NAMES.memory] = "2"
    with pytest.raises(PodDenied, match="requests must equal limits"):
        cluster.submit(bad)
    with pytest.raises(PodDenied, match="qgpu-memory"):
        cluster.submit(pod_object("z", [(30, None)]))
