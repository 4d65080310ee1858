"""The SDK path on a real 3-node Ray cluster with simulated GPUs (2 nodes x 2 x 40 GiB)."""

from __future__ import annotations

import pytest

import qgpu_ray
from qgpu.errors import NoFit, RuleViolation
from tests.ray.conftest import all_free, gpu_free, ray, wait_until
from tests.ray.workloads import SliceProbe


def start(actors, n, **slice_kwargs):
    made = []
    for _ in range(n):
        opts = qgpu_ray.options(num_cpus=0, **slice_kwargs)
        actor = SliceProbe.options(**opts).remote()
        made.append(actor)
        actors.append(actor)
    return made, [ray.get(a.env.remote(), timeout=60) for a in made]


def test_binpack_three_30_on_one_gpu(cluster, _clean):
    _, envs = start(_clean, 3, core=30, memory=8, policy="binpack")
    assert len({e["CUDA_VISIBLE_DEVICES"] for e in envs}) == 1
    uuid = envs[0]["CUDA_VISIBLE_DEVICES"]
    assert gpu_free(uuid) == 10 and gpu_free(uuid, "qgpu-memory") == 40 - 24


def test_spread_three_30_on_three_gpus(cluster, _clean):
    _, envs = start(_clean, 3, core=30, memory=8, policy="spread")
    assert len({e["CUDA_VISIBLE_DEVICES"] for e in envs}) == 3


def test_fourth_never_overcommits_either_dimension(cluster, _clean):
    _, envs = start(_clean, 3, core=30, memory=12, policy="binpack")
    full = envs[0]["CUDA_VISIBLE_DEVICES"]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {full}
    # core fits on `full` (10 left) but memory does not (4 GiB left)
    _, (fourth,) = start(_clean, 1, core=10, memory=8, policy="binpack")
    assert fourth["CUDA_VISIBLE_DEVICES"] != full
    # core does not fit (10 left) although memory would
    _, (fifth,) = start(_clean, 1, core=20, memory=2, policy="binpack")
    assert fifth["CUDA_VISIBLE_DEVICES"] != full
    for node in cluster.nodes:
        for g in node.inventory.gpus:
            assert 0 <= gpu_free(g.uuid) <= 100
            assert 0 <= gpu_free(g.uuid, "qgpu-memory") <= g.memory_gib


def test_inside_the_actor_device_and_caps_are_the_slice(cluster, _clean):
    (actor,), (env,) = start(_clean, 1, core=20, memory=4, isolation="fs")
    assert env["QGPU_CORE_LIMIT"] == "20"
    assert env["QGPU_ISOLATION"] == "fixed-share"
    assert env["QGPU_MEMORY_LIMIT"] == str(4 << 30)
    assert ray.get(actor.preloaded.remote())
    out = ray.get(actor.cuda.remote(), timeout=60)
    assert out["init"] == 0
    assert out["count"] == 1
    assert out["uuid"] == env["CUDA_VISIBLE_DEVICES"]
    assert out["total"] == 4 << 30
    assert out["over_cap"] == 2  # CUDA_ERROR_OUT_OF_MEMORY from the interposer
    assert out["half"] == 0


def test_killing_an_actor_frees_its_slice(cluster, _clean):
    (actor,), (env,) = start(_clean, 1, core=50, memory=16)
    uuid = env["CUDA_VISIBLE_DEVICES"]
    assert gpu_free(uuid) == 50
    ray.kill(actor)
    wait_until(lambda: gpu_free(uuid) == 100 and gpu_free(uuid, "qgpu-memory") == 40)


def test_decorator_for_functions_and_classes(cluster, _clean):
    @qgpu_ray.remote(core=10, memory=2, num_cpus=0)
    def where():
        import os

        return os.environ["CUDA_VISIBLE_DEVICES"], os.environ["QGPU_CORE_LIMIT"]

    uuid, core = ray.get(where.remote(), timeout=60)
    assert core == "10" and uuid.startswith("GPU-")

    Probe = qgpu_ray.remote(core=15, memory=3, num_cpus=0)(SliceProbe.__ray_actor_class__)
    a = Probe.remote()
    _clean.append(a)
    assert ray.get(a.env.remote(), timeout=60)["QGPU_CORE_LIMIT"] == "15"


def test_placement_group_pack_and_spread(cluster, _clean):
    gang = qgpu_ray.placement_group([{"core": 40, "memory": 8}] * 2, policy="binpack")
    assert gang.wait(30)
    assert len({d.gpu_uuids for d in gang.decisions}) == 1
    actors = [SliceProbe.options(**gang.bundle_options(i, num_cpus=0)).remote() for i in range(2)]
    _clean.extend(actors)
    envs = [ray.get(a.env.remote(), timeout=60) for a in actors]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == set(gang.decisions[0].gpu_uuids)
    for a in actors:
        ray.kill(a)
    _clean.clear()
    gang.remove()
    wait_until(lambda: all_free(cluster))

    spread = qgpu_ray.placement_group([{"core": 40, "memory": 8}] * 2, policy="spread")
    assert spread.wait(30)
    assert len({d.node for d in spread.decisions}) == 2
    spread.remove()


def test_whole_gpu_request(cluster, _clean):
    _, (env,) = start(_clean, 1, core=200)
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    assert env["QGPU_CORE_LIMIT"] == "" and env["QGPU_MEMORY_LIMIT"] == ""  # no caps


def test_invalid_and_unfittable_requests(cluster):
    with pytest.raises(RuleViolation) as info:
        qgpu_ray.options(core=150, memory=8)
    assert info.value.field == "qgpu-core"
    with pytest.raises(RuleViolation):
        qgpu_ray.options(core=30, memory="lots")
    with pytest.raises(NoFit, match="Ray cluster"):
        qgpu_ray.options(core=600)


def test_resource_only_mode_binds_to_the_chosen_gpu(cluster, _clean):
    opts = qgpu_ray.options(core=35, memory=6, isolation="fs", via="resources", num_cpus=0)
    assert "runtime_env" not in opts
    chosen = [k.split("/", 1)[1] for k in opts["resources"] if k.startswith("qgpu-core/")]
    assert opts["resources"]["qgpu-isolation/fixed-share"] == 0.001
    actor = SliceProbe.options(**opts).remote()
    _clean.append(actor)
    before = ray.get(actor.env.remote(), timeout=60)  # bound when Ray started it
    assert before["QGPU_SLICE_ID"].startswith("r-") and before["CUDA_VISIBLE_DEVICES"] == chosen[0]
    out = ray.get(actor.cuda.remote(), timeout=60)
    assert out["init"] == 0, out.get("bind_error")
    assert out["uuid"] == chosen[0] == out["env"]["CUDA_VISIBLE_DEVICES"]
    assert out["env"]["QGPU_CORE_LIMIT"] == "35"
    assert out["env"]["QGPU_ISOLATION"] == "fixed-share"
    assert out["total"] == 6 << 30 and out["over_cap"] == 2
    assert gpu_free(chosen[0]) == 65  # held by the actor itself: no holder group
    with pytest.raises(RuleViolation) as info:
        qgpu_ray.options(core=10, memory=1, via="magic")
    assert info.value.field == "via"
