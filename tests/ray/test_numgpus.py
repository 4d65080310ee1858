"""Unchanged ``num_gpus`` on qgpu nodes: capped slices, one ledger with qgpu slices, GPU ids.

A real Ray cluster (``ray.cluster_utils.Cluster`` via `LocalCluster`): qgpu-node-0 has ONE
simulated A100-40GB (everything there shares one GPU), qgpu-node-1 has two.
"""

from __future__ import annotations

import pytest

import qgpu_ray
from qgpu.errors import NoFit
from qgpu_ray.resources import LABEL_NODE
from tests.ray.conftest import gpu_free, holders, ray, wait_until
from tests.ray.workloads import SliceProbe

GIB = 1 << 30


@pytest.fixture(scope="module")
def cluster():
    from qgpu_ray.local import LocalCluster

    c = LocalCluster(["1xA100-40GB", "2xA100-40GB"], cpus_per_node=4)
    yield c
    c.shutdown()


def on(node) -> dict:
    return {"num_cpus": 0, "label_selector": {LABEL_NODE: node.name}}


def probe(actors, **options):
    actor = SliceProbe.options(**options).remote()
    actors.append(actor)
    return actor


def check_slice(out: dict, uuid: str, core: int, gib: int) -> None:
    """Device, ids, caps and enforcement inside the worker are those of the slice."""
    assert out["init"] == 0, out.get("bind_error")
    assert out["uuid"] == uuid == out["env"]["CUDA_VISIBLE_DEVICES"]
    assert out["ids"] == {"get_gpu_ids": [uuid], "accelerator_ids": [uuid]}
    assert out["env"]["QGPU_CORE_LIMIT"] == str(core)
    assert out["total"] == gib * GIB
    assert out["over_cap"] == 2  # CUDA_ERROR_OUT_OF_MEMORY from the interposer


def test_fraction_runs_in_a_capped_slice_of_the_gpu_ray_chose(cluster, _clean):
    node = cluster.nodes[1]
    actor = probe(_clean, num_gpus=0.25, **on(node))
    assert ray.get(actor.preloaded.remote(), timeout=60)
    out = ray.get(actor.cuda.remote(), timeout=60)
    uuid = out["uuid"]
    check_slice(out, uuid, core=25, gib=10)  # round(0.25 x 100) %, floor(0.25 x 40) GiB
    assert out["env"]["QGPU_SLICE_ID"].startswith("n-")
    assert gpu_free(uuid) == 75 and gpu_free(uuid, "qgpu-memory") == 30
    assert len(holders()) == 1

    @ray.remote(num_gpus=0.5, num_cpus=0)
    def task():
        import os

        return os.environ["QGPU_MEMORY_LIMIT"], [str(i) for i in ray.get_gpu_ids()]

    limit, ids = ray.get(task.options(label_selector={LABEL_NODE: node.name}).remote(), timeout=60)
    assert limit == str(20 * GIB) and len(ids) == 1
    # a GPU task's worker exits after it (max_calls=1): its slice goes with it
    wait_until(lambda: len(holders()) == 1, timeout=30)


def test_num_gpus_and_qgpu_slices_fill_one_gpu_in_one_ledger(cluster, _clean):
    node = cluster.nodes[0]
    (gpu,) = node.inventory.gpus
    uuid = gpu.uuid
    steps = [
        ("sdk", qgpu_ray.options(core=30, memory=8, include_uuids=[uuid], num_cpus=0), 30, 8),
        ("num_gpus", dict(num_gpus=0.25, **on(node)), 25, 10),
        ("plain", dict(resources={"qgpu-core": 20, "qgpu-memory": 8}, **on(node)), 20, 8),
        ("num_gpus", dict(num_gpus=0.25, **on(node)), 25, 10),
    ]
    for path, options, core, gib in steps:
        out = ray.get(probe(_clean, **options).cuda.remote(), timeout=60)
        check_slice(out, uuid, core, gib)
        assert gpu_free(uuid) >= 0, path
    assert gpu_free(uuid) == 0 and gpu_free(uuid, "qgpu-memory") == 40 - 36

    # the GPU is full: each path is refused or waits; none books it twice
    late = probe(
        _clean, num_gpus=0.1, runtime_env={"env_vars": {"QGPU_RAY_WAIT_S": "1"}}, **on(node)
    )
    out = ray.get(late.cuda.remote(), timeout=90)
    assert out["init"] != 0
    assert "no GPU there has room" in out["bind_error"] and "QGPU_RAY_WAIT_S" in out["bind_error"]
    with pytest.raises(NoFit):
        qgpu_ray.options(core=1, memory=1, include_uuids=[uuid])
    plain = probe(_clean, resources={"qgpu-core": 1, "qgpu-memory": 1}, **on(node))
    assert not ray.wait([plain.env.remote()], timeout=3)[0]  # the node's totals are booked
    assert gpu_free(uuid) == 0 and gpu_free(uuid, "qgpu-memory") == 4

    # the node agent keeps the same one ledger
    slices = node.agent.client.slices().slices
    assert sorted(s.core for s in slices) == [20, 25, 25, 30]


@pytest.mark.parametrize("first", ["sdk", "num_gpus"])
def test_sdk_and_num_gpus_racing_for_the_last_room(cluster, _clean, first):
    """Both are submitted at once for 60 % / 24 GiB of a 100 % / 40 GiB GPU: one runs, the
    other waits (Ray's queue or the worker's wait) until the first is gone."""
    node = cluster.nodes[0]
    uuid = node.inventory.gpus[0].uuid
    options = {
        "sdk": qgpu_ray.options(core=60, memory=24, include_uuids=[uuid], num_cpus=0),
        "num_gpus": dict(num_gpus=0.6, **on(node)),
    }
    order = [first, "num_gpus" if first == "sdk" else "sdk"]
    actors = {path: probe(_clean, **options[path]) for path in order}
    calls = {path: actors[path].cuda.remote() for path in order}
    ready, _ = ray.wait(list(calls.values()), num_returns=1, timeout=90)
    assert ready
    winner = next(p for p in order if calls[p] == ready[0])
    loser = next(p for p in order if p != winner)
    check_slice(ray.get(calls[winner]), uuid, 60, 24)
    assert not ray.wait([calls[loser]], timeout=3)[0]  # not both at once
    assert gpu_free(uuid) == 40 and gpu_free(uuid, "qgpu-memory") == 16
    ray.kill(actors[winner])
    check_slice(ray.get(calls[loser], timeout=90), uuid, 60, 24)
    assert gpu_free(uuid) == 40


def test_num_gpus_moves_off_a_gpu_that_qgpu_slices_hold(cluster, _clean):
    node = cluster.nodes[1]
    first, second = sorted(node.inventory.gpus, key=lambda g: g.index)
    sdk = probe(
        _clean, **qgpu_ray.options(core=80, memory=30, include_uuids=[first.uuid], num_cpus=0)
    )
    ray.get(sdk.env.remote(), timeout=60)
    # Ray's best fit gives GPU id 0 (both look empty to Ray): its qgpu ledger has 20 % left
    out = ray.get(probe(_clean, num_gpus=0.5, **on(node)).cuda.remote(), timeout=60)
    check_slice(out, second.uuid, 50, 20)
    assert gpu_free(first.uuid) == 20 and gpu_free(second.uuid) == 50


def test_whole_num_gpus_is_a_whole_uncapped_card(cluster, _clean):
    node = cluster.nodes[1]
    out = ray.get(probe(_clean, num_gpus=1, **on(node)).cuda.remote(), timeout=60)
    uuid = out["uuid"]
    assert out["init"] == 0 and out["ids"]["get_gpu_ids"] == [uuid]
    assert out["env"]["QGPU_MEMORY_LIMIT"] == "" and out["total"] == 40 * GIB
    assert gpu_free(uuid) == 0 and gpu_free(uuid, "qgpu-memory") == 0
    with pytest.raises(NoFit):
        qgpu_ray.options(core=10, memory=1, include_uuids=[uuid])


def test_isolation_from_the_runtime_env_and_fractions_too_small(cluster, _clean):
    node = cluster.nodes[1]
    fs = probe(_clean, num_gpus=0.2, runtime_env={"env_vars": {"QGPU_ISOLATION": "fs"}}, **on(node))
    out = ray.get(fs.cuda.remote(), timeout=60)
    check_slice(out, out["uuid"], 20, 8)
    assert out["env"]["QGPU_ISOLATION"] == "fixed-share"
    tiny = ray.get(probe(_clean, num_gpus=0.02, **on(node)).cuda.remote(), timeout=60)
    assert tiny["init"] != 0
    assert "num_gpus=0.02" in tiny["bind_error"] and "smallest num_gpus" in tiny["bind_error"]


def test_gpu_ids_name_the_slice_on_every_path(cluster, _clean):
    node = cluster.nodes[1]
    paths = {
        "sdk runtime_env": qgpu_ray.options(core=10, memory=2, via="runtime_env", num_cpus=0),
        "sdk resources": qgpu_ray.options(core=10, memory=2, via="resources", num_cpus=0),
        "plain": dict(resources={"qgpu-core": 10, "qgpu-memory": 2}, **on(node)),
        "num_gpus": dict(num_gpus=0.1, **on(node)),
    }
    for path, options in paths.items():
        actor = probe(_clean, **options)
        ids = ray.get(actor.gpu_ids.remote(), timeout=60)  # before the first CUDA call
        env = ray.get(actor.env.remote(), timeout=60)
        device = env["CUDA_VISIBLE_DEVICES"]
        assert device.startswith("GPU-") and "," not in device, path
        assert ids == {"get_gpu_ids": [device], "accelerator_ids": [device]}, path


def test_ray_still_honours_the_hooks(cluster, _clean):
    """Each Ray internal of qgpu_ray.compat, seen from a worker of a qgpu node: a Ray
    upgrade that stops honouring one fails here, naming it."""
    from qgpu_ray import compat

    node = cluster.nodes[1]
    seen = ray.get(probe(_clean, **on(node)).hooks.remote(), timeout=60)
    assert seen["setup_hook_ran"], f"{compat.RAY_SETUP_HOOK_ENV} no longer runs qgpu's hook"
    assert seen["ld_preload"], f"{compat.RAY_LD_PRELOAD_ENV}: the raylet stripped LD_PRELOAD"
    assert "jemalloc" not in seen["ld_preload_env"], (
        f"{compat.RAY_JEMALLOC_ENV}: Ray replaced the node's LD_PRELOAD with jemalloc"
    )
    assert seen["lookup_patched"], f"{compat.ACCELERATOR_LOOKUP} is no longer Ray's GPU-id lookup"
    uuids = sorted(g.uuid for g in node.inventory.gpus)
    assert sorted(seen["original_ids"]) == uuids, (
        f"{compat.ORIGINAL_IDS}: Ray no longer takes GPU ids from the raylet's CUDA_VISIBLE_DEVICES"
    )


@pytest.mark.slow
def test_unchanged_serve_deployment_gets_capped_slices(cluster, _clean):
    """A Serve deployment written for Ray's fractional GPUs, unchanged."""
    from ray import serve

    @serve.deployment(num_replicas=2, ray_actor_options={"num_gpus": 0.25})
    class Model:
        def __init__(self) -> None:
            from tests.ray.workloads import cuda_report

            self.report = cuda_report()  # loading weights: the first CUDA call

        def __call__(self) -> dict:
            return self.report

    handle = serve.run(Model.bind(), name="numgpus", route_prefix=None)
    try:
        seen: dict[str, dict] = {}
        for _ in range(40):
            out = handle.remote().result(timeout_s=60)
            seen[out["env"]["QGPU_SLICE_ID"]] = out
            if len(seen) == 2:
                break
        assert len(seen) == 2
        for out in seen.values():
            check_slice(out, out["uuid"], core=25, gib=10)
        assert len(holders()) == 2
    finally:
        serve.delete("numgpus")
        serve.shutdown()


@pytest.mark.slow
def test_unchanged_tune_trials_get_capped_slices(cluster, _clean, tmp_path):
    """Ray Tune's documented way to give trials half a GPU, unchanged."""
    from ray import tune

    def trainable(config: dict) -> None:
        from tests.ray.workloads import cuda_report

        out = cuda_report()
        env = out.get("env", {})
        tune.report(
            {
                "init": out["init"],
                "total_gib": out.get("total", 0) / GIB,
                "over_cap": out.get("over_cap", -1),
                "core": int(env.get("QGPU_CORE_LIMIT") or 0),
                "uuid": out.get("uuid", ""),
                "ids_ok": int(out.get("ids", {}).get("get_gpu_ids") == [out.get("uuid")]),
            }
        )

    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1, "gpu": 0.5}),
        param_space={"lr": tune.grid_search([0.1, 0.01])},
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    for result in results:
        m = result.metrics
        assert m["init"] == 0 and m["ids_ok"] == 1, m
        assert (m["core"], m["total_gib"], m["over_cap"]) == (50, 20, 2), m
