"""A SliceCluster that starts its own agent on two simulated H100s (binpack): placement,
the slice inside a task, resource routing, the no-fit error, and no leak into the parent."""

from __future__ import annotations

import os

import pytest
from distributed import Client

from enforcement import simcuda
from qgpu_dask import NoSliceFits, SliceCluster, task_resources
from tests.dask import workloads

GIB = 1 << 30


@pytest.fixture(scope="module")
def cluster():
    c = SliceCluster(
        [{"core": 30, "memory": 8}, {"core": 50, "memory": 20, "isolation": "fs"}],
        policy="binpack",
        sim="2xH100-80GB",
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster) as c:
        yield c


def test_binpack_puts_both_slices_on_one_gpu_through_the_agent(cluster):
    s0, s1 = cluster.slice_of("slice-0"), cluster.slice_of("slice-1")
    assert s0.device_uuid == s1.device_uuid
    ledger = {s.slice_id: s for s in cluster.agent.client.slices().slices}
    assert set(ledger) == {s0.slice_id, s1.slice_id}
    for res in (s0, s1):
        owner = ledger[res.slice_id].owner
        assert owner.kind.value == "dask-worker"
        assert owner.meta["pid"] == str(os.getpid())


def test_inside_a_task_the_device_and_caps_are_the_slices(client, cluster):
    for name, core, gib, iso in (
        ("slice-0", 30, 8, "best-effort"),
        ("slice-1", 50, 20, "fixed-share"),
    ):
        res = cluster.slice_of(name)
        out = client.submit(workloads.cuda_probe, workers=[name], pure=False).result(timeout=60)
        assert out["worker"] == name
        assert out["CUDA_VISIBLE_DEVICES"] == res.device_uuid
        assert out["QGPU_SLICE_ID"] == res.slice_id
        assert out["QGPU_CORE_LIMIT"] == str(core)
        assert out["QGPU_ISOLATION"] == iso
        assert out["preloaded"] is True
        assert out["uuid"] == res.device_uuid and out["count"] == 1
        assert out["total"] == gib * GIB
        assert out["over_cap"] == simcuda.CUDA_ERROR_OUT_OF_MEMORY
        assert out["half"] == simcuda.CUDA_SUCCESS


def test_workers_advertise_their_slice_as_resources(client):
    info = client.scheduler_info()["workers"].values()
    offered = {w["name"]: w["resources"] for w in info}
    assert offered == {
        "slice-0": {"qgpu-core": 30, "qgpu-memory": 8},
        "slice-1": {"qgpu-core": 50, "qgpu-memory": 20},
    }


def test_resources_route_tasks_to_the_slice_that_fits(client):
    big = [
        client.submit(workloads.where, resources=task_resources(40, 10), pure=False)
        for _ in range(4)
    ]
    assert {f.result(timeout=60)["worker"] for f in big} == {"slice-1"}
    mem = client.submit(workloads.where, resources={"qgpu-memory": 20}, pure=False)
    assert mem.result(timeout=60)["worker"] == "slice-1"
    small = [
        client.submit(workloads.where, resources=task_resources(30, 8), pure=False)
        for _ in range(12)
    ]
    assert {f.result(timeout=60)["worker"] for f in small} <= {"slice-0", "slice-1"}


def test_a_task_larger_than_every_slice_fails_with_a_clear_error(client):
    too_much_core = client.submit(workloads.where, resources={"qgpu-core": 60}, pure=False)
    with pytest.raises(NoSliceFits) as err:
        too_much_core.result(timeout=30)
    assert "qgpu-core=60" in str(err.value)
    assert "largest slice: qgpu-core=50, qgpu-memory=20" in str(err.value)
    # each dimension fits some slice, but no single slice has both
    mixed = client.submit(workloads.where, resources=task_resources(40, 21), pure=False)
    with pytest.raises(NoSliceFits, match="qgpu-core=40, qgpu-memory=21"):
        mixed.result(timeout=30)
    # the cluster still serves fitting work
    ok = client.submit(workloads.where, resources=task_resources(30, 8), pure=False)
    assert ok.result(timeout=60)["worker"] in ("slice-0", "slice-1")


def test_the_slice_environment_does_not_leak_into_the_parent(cluster):
    for key in ("LD_PRELOAD", "QGPU_SLICE_ID", "QGPU_MEMORY_LIMIT", "CUDA_VISIBLE_DEVICES"):
        assert key not in os.environ or all(
            os.environ[key] != res.env.get(key) for res in cluster.slices.values()
        )


def test_scaling_beyond_the_slices_is_refused(cluster):
    from qgpu.errors import QgpuError

    with pytest.raises(QgpuError, match="one worker per reserved slice"):
        cluster.scale(3)


def test_a_restarted_worker_comes_back_inside_its_slice(client, cluster):
    before = client.submit(workloads.where, workers=["slice-1"], pure=False).result(timeout=60)
    client.restart_workers(["slice-1"], timeout=60)
    after = client.submit(workloads.cuda_probe, workers=["slice-1"], pure=False).result(timeout=60)
    assert after["pid"] != before["pid"]
    assert after["QGPU_SLICE_ID"] == cluster.slice_of("slice-1").slice_id
    assert after["preloaded"] is True
    assert after["total"] == 20 * GIB
    assert after["over_cap"] == simcuda.CUDA_ERROR_OUT_OF_MEMORY
