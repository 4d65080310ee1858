"""SliceCluster against a node agent it did not start: spread placement, release on close,
all-or-nothing reservation, and invalid requests rejected by the core model."""

from __future__ import annotations

import pytest
from distributed import Client

from qgpu.errors import NoFit, QgpuError, RuleViolation
from qgpu_dask import SliceCluster
from tests.dask import workloads
from tests.dask.conftest import live_slices


def test_spread_places_slices_on_different_gpus_and_close_releases_them(agent):
    slices = [{"core": 30, "memory": 8}, {"core": 30, "memory": 8}]
    with SliceCluster(slices, policy="spread", agent_socket=agent.socket) as cluster:
        uuids = {res.device_uuid for res in cluster.slices.values()}
        assert len(uuids) == 2
        assert {s.slice_id for s in live_slices(agent)} == {
            res.slice_id for res in cluster.slices.values()
        }
        with Client(cluster) as client:
            seen = client.run(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"])
            assert set(seen.values()) == uuids
            out = client.submit(workloads.where, pure=False).result(timeout=60)
            assert out["QGPU_SLICE_ID"] in {r.slice_id for r in cluster.slices.values()}
    assert live_slices(agent) == []


def test_binpack_fills_one_gpu_and_a_whole_gpu_slice_takes_the_other(agent):
    slices = [{"core": 100}, {"core": 30, "memory": 8}, {"core": 30, "memory": 8}]
    cluster = SliceCluster(slices, policy="binpack", agent_socket=agent.socket)
    try:
        whole, a, b = (cluster.slice_of(f"slice-{i}") for i in range(3))
        assert a.device_uuid == b.device_uuid != whole.device_uuid
        assert whole.enforcement == "none" and whole.memory_gib == 80
        with Client(cluster) as client:
            offered = {
                w["name"]: w["resources"] for w in client.scheduler_info()["workers"].values()
            }
            assert offered["slice-0"] == {"qgpu-core": 100, "qgpu-memory": 80}
            out = client.submit(workloads.where, resources={"qgpu-core": 100}, pure=False)
            out = out.result(timeout=60)
            assert out["worker"] == "slice-0"
            assert out["CUDA_VISIBLE_DEVICES"] == whole.device_uuid
    finally:
        cluster.close()
    assert live_slices(agent) == []


def test_slices_that_do_not_fit_fail_before_any_worker_and_keep_nothing(agent):
    slices = [{"core": 60, "memory": 30}] * 3  # two H100s hold two of them
    with pytest.raises(NoFit, match=r"slices\[2\]"):
        SliceCluster(slices, agent_socket=agent.socket)
    assert live_slices(agent) == []


def test_invalid_requests_name_field_value_and_rule(agent):
    with pytest.raises(RuleViolation) as err:
        SliceCluster([{"core": 150, "memory": 8}], agent_socket=agent.socket)
    assert err.value.field == "qgpu-core" and err.value.value == 150
    with pytest.raises(RuleViolation) as err:
        SliceCluster([{"core": 30}], agent_socket=agent.socket)
    assert err.value.field == "qgpu-memory"
    with pytest.raises(RuleViolation) as err:  # the card's limit, checked by the agent
        SliceCluster([{"core": 30, "memory": 90}], agent_socket=agent.socket)
    assert err.value.field == "slices[0].qgpu-memory" and "exceed" in err.value.rule
    assert live_slices(agent) == []


def test_an_agent_that_cannot_start_is_a_clear_error():
    with pytest.raises(QgpuError, match="unknown model"):
        SliceCluster([{"core": 30, "memory": 8}], sim="2xNOPE-8GB")
