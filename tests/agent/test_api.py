"""The agent's HTTP API in process: answers, error shapes, limits files, idempotency."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from enforcement.agent.app import create_app
from enforcement.agent.service import Agent
from enforcement.limits import is_trusted_limits_file, read_limits_file
from qgpu.model import GpuHealth
from tests.agent.conftest import FakeBackend, make_agent

GIB = 1024**3


@pytest.fixture
def client(agent: Agent) -> TestClient:
    return TestClient(create_app(agent), raise_server_exceptions=False)


def reserve(client: TestClient, **body: object):
    return client.post("/v1/slices", json=body)


def assert_error(response, status: int, field: str, rule_part: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["field"] == field, body
    assert rule_part in body["rule"], body
    assert "value" in body
    assert body["violations"][0]["field"] == field
    return body


def test_reserve_returns_device_limits_and_environment(client: TestClient, agent: Agent) -> None:
    r = reserve(client, request={"qgpu-core": 30, "qgpu-memory": "8Gi", "isolation": "fs"})
    assert r.status_code == 201, r.text
    res = r.json()
    assert res["node"] == "node-a"
    assert res["device_uuid"] in {g.uuid for g in agent.inventory.gpus}
    assert (res["core"], res["memory_gib"], res["memory_limit_bytes"]) == (30, 8, 8 * GIB)
    assert res["isolation"] == "fixed-share"
    assert res["enforcement"] == "interposer"
    env = res["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == res["device_uuid"]
    assert env["QGPU_SLICE_ID"] == res["slice_id"]
    assert env["QGPU_DEVICE_UUID"] == res["device_uuid"]
    assert env["QGPU_MEMORY_LIMIT"] == str(8 * GIB)
    assert env["QGPU_CORE_LIMIT"] == "30"
    assert env["QGPU_ISOLATION"] == "fixed-share"
    assert env["QGPU_LIMITS_FILE"] == res["limits_file"]
    assert env["QGPU_STATE_DIR"] == str(agent.config.slices_dir)
    if agent.hook_path.exists():
        assert env["LD_PRELOAD"] == str(agent.hook_path)
    # the limits file holds the same QGPU_* values, read-only
    path = Path(res["limits_file"])
    assert path == agent.config.slices_dir / res["slice_id"] / "limits.conf"
    assert stat.S_IMODE(path.stat().st_mode) == 0o440
    if os.geteuid() == 0:
        assert is_trusted_limits_file(path)  # the interposer's own rule
    assert stat.S_IMODE(agent.config.ledger_path.stat().st_mode) == 0o600
    limits = read_limits_file(path)
    assert limits == {k: v for k, v in env.items() if k.startswith("QGPU_")}


def test_get_and_list_and_release(client: TestClient) -> None:
    sid = reserve(client, request={"core": 20, "memory": 4}).json()["slice_id"]
    assert client.get(f"/v1/slices/{sid}").json()["slice_id"] == sid
    listed = client.get("/v1/slices").json()
    assert [s["slice_id"] for s in listed["slices"]] == [sid]
    assert listed["slices"][0]["usage"]["memory_used_bytes"] == 0
    first = client.delete(f"/v1/slices/{sid}")
    assert first.json() == {"slice_id": sid, "released": True}
    again = client.post(f"/v1/slices/{sid}/release")
    assert again.status_code == 200 and again.json() == {"slice_id": sid, "released": False}
    assert client.get("/v1/slices").json()["slices"] == []
    assert_error(client.get(f"/v1/slices/{sid}"), 404, "slice_id", "no such slice")


def test_release_removes_limits_file(client: TestClient) -> None:
    res = reserve(client, request={"core": 20, "memory": 4}).json()
    assert Path(res["limits_file"]).exists()
    client.delete(f"/v1/slices/{res['slice_id']}")
    assert not Path(res["limits_file"]).exists()


@pytest.mark.parametrize(
    ("request_body", "field", "rule"),
    [
        ({"core": 150, "memory": 8}, "qgpu-core", "multiple of 100"),
        ({"core": 0, "memory": 8}, "qgpu-core", "1..99"),
        ({"core": 30}, "qgpu-memory", "required for a share"),
        ({"core": 30, "memory": "8.5Gi"}, "qgpu-memory", "whole number of GiB"),
        ({"core": 30, "memory": 81}, "qgpu-memory", "must not exceed the card"),
        ({"core": 30, "memory": 8, "isolation": "strict"}, "isolation", "must be one of"),
        ({"core": 30, "memory": 8, "placement": "random"}, "placement", "must be one of"),
        ({"core": 30, "memory": 8, "colour": "red"}, "request.colour", "unknown field"),
    ],
)
def test_invalid_requests_name_field_value_and_rule(
    client: TestClient, request_body: dict, field: str, rule: str
) -> None:
    assert_error(reserve(client, request=request_body), 422, field, rule)


def test_malformed_bodies_are_422(client: TestClient) -> None:
    assert_error(client.post("/v1/slices", json={}), 422, "request", "required")
    r = client.post(
        "/v1/slices", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["field"]
    assert_error(
        reserve(client, request={"core": 30, "memory": 8}, slice_id="bad id!"),
        422,
        "slice_id",
        "pattern",
    )


def test_pid_owner_must_be_running_and_gets_its_start_time(client: TestClient) -> None:
    body = assert_error(
        reserve(client, request={"core": 10, "memory": 4}, owner={"kind": "pid", "id": "x"}),
        422,
        "owner.id",
        "must be a pid",
    )
    assert body["value"] == "x"
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert_error(
        reserve(
            client, request={"core": 10, "memory": 4}, owner={"kind": "pid", "id": str(dead.pid)}
        ),
        422,
        "owner.id",
        "running process",
    )
    ok = reserve(
        client, request={"core": 10, "memory": 4}, owner={"kind": "pid", "id": str(os.getpid())}
    )
    assert ok.status_code == 201
    assert ok.json()["owner"]["meta"]["start_time"].isdigit()


def test_no_fit_is_409_with_reasons(client: TestClient) -> None:
    for _ in range(2):
        assert reserve(client, request={"core": 60, "memory": 60}).status_code == 201
    body = assert_error(
        reserve(client, request={"core": 60, "memory": 8}), 409, "request", "no GPU"
    )
    assert body["error"] == "no-fit"
    assert body["reasons"], body


def test_slice_id_retry_is_idempotent_and_foreign_owner_is_refused(client: TestClient) -> None:
    body = {"request": {"core": 10, "memory": 4}, "slice_id": "job-7", "owner": {"id": "a"}}
    first = client.post("/v1/slices", json=body).json()
    second = client.post("/v1/slices", json=body).json()
    assert first["slice_id"] == second["slice_id"] == "job-7"
    assert first["device_uuid"] == second["device_uuid"]
    assert len(client.get("/v1/slices").json()["slices"]) == 1
    other = {**body, "owner": {"id": "b"}}
    assert_error(client.post("/v1/slices", json=other), 422, "slice_id", "another owner")


def test_whole_gpu_slices_get_devices_without_caps(client: TestClient) -> None:
    res = reserve(client, request={"core": 200}).json()
    assert res["enforcement"] == "none"
    assert len(res["device_uuids"]) == 2
    assert res["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(res["device_uuids"])
    assert "LD_PRELOAD" not in res["env"] and res["limits_file"] is None
    assert reserve(client, request={"core": 10, "memory": 4}).status_code == 409


def test_devices_and_health(client: TestClient, agent: Agent) -> None:
    reserve(client, request={"core": 25, "memory": 10})
    devices = client.get("/v1/devices").json()
    assert devices["backend"] == "fake" and len(devices["devices"]) == 2
    used = [d for d in devices["devices"] if d["slices"]]
    assert len(used) == 1
    assert (used[0]["core_committed"], used[0]["memory_committed_gib"]) == (25, 10)
    assert used[0]["max_slices"] == 16
    health = client.get("/v1/health").json()
    assert health["slices"] == 1 and health["devices"] == 2
    assert health["status"] == ("ok" if agent.hook_path.exists() else "degraded")


def test_unknown_routes_and_methods_are_json_errors(client: TestClient) -> None:
    assert_error(client.get("/v2/nothing"), 404, "path", "no such endpoint")
    r = client.put("/v1/slices")
    assert r.status_code == 405 and r.json()["field"] == "method"


def test_unhealthy_gpu_is_reported_and_not_used(state_dir: Path, backend: FakeBackend) -> None:
    sick = backend.gpus[1].model_copy(
        update={"health": GpuHealth.UNHEALTHY, "health_reason": "critical Xid 79"}
    )
    backend.gpus[1] = sick
    agent = make_agent(state_dir, backend)
    client = TestClient(create_app(agent))
    health = client.get("/v1/health").json()
    assert health["status"] == "degraded"
    assert health["unhealthy_devices"] == [sick.uuid]
    assert any("Xid 79" in p for p in health["problems"])
    for _ in range(3):
        res = reserve(client, request={"core": 30, "memory": 8}).json()
        assert res["device_uuid"] == backend.gpus[0].uuid
    agent.close()


def test_refresh_picks_up_a_gpu_that_turned_unhealthy(agent: Agent, backend: FakeBackend) -> None:
    assert agent.refresh_inventory() is False
    update = {"health": GpuHealth.UNHEALTHY, "health_reason": "critical Xid 48"}
    backend.gpus[0] = backend.gpus[0].model_copy(update=update)
    assert agent.refresh_inventory() is True
    assert agent.ledger.node("node-a").gpus[0].health is GpuHealth.UNHEALTHY
    health = agent.health()
    assert health.status == "degraded" and health.unhealthy_devices == [backend.gpus[0].uuid]


def test_node_placement_policy_is_the_core_engines(state_dir: Path, backend: FakeBackend) -> None:
    spread = make_agent(state_dir, backend, placement="spread")
    client = TestClient(create_app(spread))
    got = [
        reserve(client, request={"core": 10, "memory": 4}).json()["device_uuid"] for _ in range(4)
    ]
    assert got == [backend.gpus[0].uuid, backend.gpus[1].uuid] * 2
    packed = reserve(client, request={"core": 10, "memory": 4, "placement": "binpack"}).json()
    assert packed["device_uuid"] == backend.gpus[0].uuid  # a per-request override wins
    spread.close()


def test_node_info_for_adapters(client: TestClient, agent: Agent) -> None:
    info = client.get("/v1/node").json()
    assert info["node"] == "node-a" and info["enforcement"] == "interposer"
    assert info["inventory"] == agent.inventory.model_dump(mode="json")
    assert info["workload_env"]["QGPU_STATE_DIR"] == str(agent.config.slices_dir)


def test_record_a_slice_placed_elsewhere(client: TestClient, backend: FakeBackend) -> None:
    gpu1 = backend.gpus[1].uuid
    body = {
        "slice_id": "pod-1",
        "request": {"qgpu-core": 40, "qgpu-memory": "20Gi", "isolation": "fs"},
        "device_uuids": [gpu1],
        "owner": {"kind": "pod", "id": "uid-1"},
    }
    res = client.post("/v1/slices/record", json=body)
    assert res.status_code == 201, res.text
    got = res.json()
    assert (got["device_uuid"], got["core"], got["memory_gib"]) == (gpu1, 40, 20)
    assert got["env"]["QGPU_CORE_LIMIT"] == "40" and Path(got["limits_file"]).exists()
    again = client.post("/v1/slices/record", json=body)
    assert again.status_code == 201 and again.json()["slice_id"] == "pod-1"  # idempotent
    too_big = {**body, "slice_id": "pod-2", "request": {"core": 70, "memory": 8}}
    body2 = assert_error(client.post("/v1/slices/record", json=too_big), 409, "request", "over")
    assert body2["error"] == "no-fit"
    unknown = {**body, "slice_id": "pod-3", "device_uuids": ["GPU-nope"]}
    assert_error(client.post("/v1/slices/record", json=unknown), 422, "device_uuids", "not a GPU")
    two = {**body, "slice_id": "pod-4", "device_uuids": [gpu1, backend.gpus[0].uuid]}
    assert_error(client.post("/v1/slices/record", json=two), 422, "device_uuids", "exactly 1")
    whole = {"slice_id": "pod-5", "request": {"core": 100}, "device_uuids": [backend.gpus[0].uuid]}
    assert client.post("/v1/slices/record", json=whole).json()["enforcement"] == "none"
    held = {s["slice_id"] for s in client.get("/v1/slices").json()["slices"]}
    assert held == {"pod-1", "pod-5"}
