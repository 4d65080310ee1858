"""The plain ``resources=`` path, node removal, and Ray Serve on slices."""

from __future__ import annotations

import pytest

import qgpu_ray
from qgpu_ray.resources import LABEL_NODE
from tests.ray.conftest import gpu_free, holders, ray, wait_until
from tests.ray.workloads import SliceProbe

PLAIN = {"qgpu-core": 30, "qgpu-memory": 8}


def plain_actor(actors, node=None, resources=PLAIN):
    opts = {"num_cpus": 0, "resources": dict(resources)}
    if node is not None:
        opts["label_selector"] = {LABEL_NODE: node}
    actor = SliceProbe.options(**opts).remote()
    actors.append(actor)
    return actor


def test_plain_resources_bind_before_user_code_runs(cluster, _clean):
    actor = plain_actor(_clean)
    # bound when Ray started the actor (its GPU-id lookup), before any CUDA call
    before = ray.get(actor.env.remote(), timeout=60)
    assert before["QGPU_SLICE_ID"].startswith("p-")
    assert before["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
    out = ray.get(actor.cuda.remote(), timeout=60)
    assert out["init"] == 0, out.get("bind_error")
    env = out["env"]
    assert env == before
    assert env["QGPU_CORE_LIMIT"] == "30"
    assert out["uuid"] == env["CUDA_VISIBLE_DEVICES"]
    assert out["total"] == 8 << 30
    assert out["over_cap"] == 2
    # Ray's per-GPU accounting includes the plain slice (holder placement group)
    assert gpu_free(env["CUDA_VISIBLE_DEVICES"]) == 70
    assert len(holders()) == 1


def test_plain_path_binpacks_with_sdk_slices(cluster, _clean):
    node = cluster.nodes[0].name
    sdk = SliceProbe.options(**qgpu_ray.options(core=40, memory=8, num_cpus=0)).remote()
    _clean.append(sdk)
    sdk_gpu = ray.get(sdk.env.remote(), timeout=60)["CUDA_VISIBLE_DEVICES"]
    owner = cluster.node_of(sdk_gpu).name
    actor = plain_actor(_clean, node=owner)
    out = ray.get(actor.cuda.remote(), timeout=60)
    assert out["init"] == 0, out.get("bind_error")
    assert out["uuid"] == sdk_gpu  # binpack: the partly used GPU first
    assert gpu_free(sdk_gpu) == 30
    assert node  # the cluster has named nodes


def test_plain_path_fragmentation_error_points_at_the_sdk(cluster, _clean):
    node = cluster.nodes[1]
    # leave 25 core free on each GPU of the node: 50 free in total, but no GPU has 30
    for gpu in node.inventory.gpus:
        a = SliceProbe.options(
            **qgpu_ray.options(core=75, memory=4, include_uuids=[gpu.uuid], num_cpus=0)
        ).remote()
        _clean.append(a)
        ray.get(a.env.remote(), timeout=60)
    actor = plain_actor(_clean, node=node.name)
    out = ray.get(actor.cuda.remote(), timeout=60)
    assert out["init"] != 0
    message = out["bind_error"]
    assert "fragments" in message and "qgpu_ray.options" in message
    assert "qgpu-core=30" in message


def test_killed_plain_actor_is_released(cluster, _clean):
    actor = plain_actor(_clean)
    out = ray.get(actor.cuda.remote(), timeout=60)
    uuid = out["env"]["CUDA_VISIBLE_DEVICES"]
    assert gpu_free(uuid) == 70
    ray.kill(actor)
    _clean.remove(actor)
    wait_until(lambda: gpu_free(uuid) == 100 and not holders())


def test_serve_two_replicas_on_slices(cluster, _clean):
    from ray import serve

    from examples.ray_serve_inference import deploy, free_port, query

    url = deploy(free_port(), replicas=2)
    try:
        seen = set()
        for _ in range(12):
            out = query(url, [[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
            assert out["classes"] == [0, 1, 2]
            assert out["slice"].startswith("p-") and out["device"].startswith("GPU-")
            seen.add(out["slice"])
        assert len(seen) == 2
        assert len(holders()) == 2
    finally:
        serve.shutdown()


def test_removing_a_node_frees_its_slices(cluster, _clean):
    extra = cluster.add_node("2xA100-40GB", name="qgpu-node-extra")
    sdk = SliceProbe.options(
        **qgpu_ray.options(
            core=50, memory=8, include_uuids=[extra.inventory.gpus[0].uuid], num_cpus=0
        )
    ).remote()
    plain = plain_actor([], node=extra.name)
    ray.get(sdk.env.remote(), timeout=60)
    assert ray.get(plain.cuda.remote(), timeout=60)["init"] == 0
    assert len(holders()) == 1
    cluster.remove_node(extra)
    wait_until(lambda: not holders(), timeout=30)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(sdk.env.remote(), timeout=30)
    nodes = {n.inventory.name for n in qgpu_ray.view.ray_nodes()}
    assert extra.name not in nodes
