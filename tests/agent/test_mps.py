"""The MPS backend against a fake nvidia-cuda-mps-control: the exact command sequence."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from enforcement.agent.app import create_app
from enforcement.agent.config import AgentConfig
from enforcement.agent.mps import MpsError, MpsManager
from enforcement.agent.service import MPS_CAPS_ADVISORY, Agent
from qgpu.model import Allocation, IsolationPolicy
from tests.agent.conftest import FakeBackend

FAKE = str(Path(__file__).resolve().parents[1] / "fakes" / "nvidia-cuda-mps-control")
UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"]


@pytest.fixture
def mps_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "mps.log"
    monkeypatch.setenv("QGPU_FAKE_MPS_LOG", str(log))
    return log


def calls(log: Path) -> list[tuple[str, tuple[str, ...], str]]:
    out = []
    for line in log.read_text().splitlines():
        r = json.loads(line)
        out.append((r["CUDA_VISIBLE_DEVICES"], tuple(r["argv"]), r["stdin"]))
    return out


QUERY = "get_default_active_thread_percentage\n"


def test_start_runs_one_daemon_per_gpu_with_its_own_pipe(tmp_path: Path, mps_log: Path) -> None:
    mps = MpsManager(FAKE, tmp_path / "mps")
    mps.start(UUIDS)
    assert calls(mps_log) == [
        (UUIDS[0], (), QUERY),
        (UUIDS[0], ("-d",), ""),
        (UUIDS[0], (), QUERY),
        (UUIDS[1], (), QUERY),
        (UUIDS[1], ("-d",), ""),
        (UUIDS[1], (), QUERY),
    ]
    records = [json.loads(x) for x in mps_log.read_text().splitlines()]
    pipes = {r["CUDA_VISIBLE_DEVICES"]: r["CUDA_MPS_PIPE_DIRECTORY"] for r in records}
    assert pipes == {u: str(tmp_path / "mps" / u / "pipe") for u in UUIDS}
    assert all(r["CUDA_MPS_LOG_DIRECTORY"].endswith("/log") for r in records)
    assert mps.started == UUIDS


def test_restart_reuses_running_daemons_and_stop_quits(tmp_path: Path, mps_log: Path) -> None:
    MpsManager(FAKE, tmp_path / "mps").start(UUIDS)
    mps_log.unlink()
    again = MpsManager(FAKE, tmp_path / "mps")
    again.start(UUIDS)
    assert calls(mps_log) == [(UUIDS[0], (), QUERY), (UUIDS[1], (), QUERY)]
    assert again.started == []
    mps_log.unlink()
    again.stop(UUIDS)
    assert calls(mps_log) == [(UUIDS[0], (), "quit\n"), (UUIDS[1], (), "quit\n")]
    assert not again.answers(UUIDS[0])


def test_failed_start_is_a_clear_error(
    tmp_path: Path, mps_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QGPU_FAKE_MPS_FAIL_START", "1")
    with pytest.raises(MpsError, match="already running"):
        MpsManager(FAKE, tmp_path / "mps").start(UUIDS[:1])


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MpsError, match=r"configured for MPS .* was not found"):
        MpsManager("/nonexistent/nvidia-cuda-mps-control", tmp_path)


@pytest.mark.parametrize(
    ("isolation", "percentage"),
    [(IsolationPolicy.FIXED_SHARE, "30"), (IsolationPolicy.BEST_EFFORT, "100")],
)
def test_slice_environment(
    tmp_path: Path, mps_log: Path, isolation: IsolationPolicy, percentage: str
) -> None:
    mps = MpsManager(FAKE, tmp_path / "mps")
    alloc = Allocation(
        slice_id="s-1", node="n", gpu_uuids=[UUIDS[1]], core=30, memory_gib=8, isolation=isolation
    )
    env = mps.slice_env(alloc)
    assert env == {
        "CUDA_VISIBLE_DEVICES": UUIDS[1],
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / UUIDS[1] / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / UUIDS[1] / "log"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percentage,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
        "QGPU_SLICE_ID": "s-1",
    }


def test_agent_in_mps_mode_hands_out_mps_environment(
    state_dir: Path, backend: FakeBackend, mps_log: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = AgentConfig(
        node_name="n", state_dir=state_dir, test_mode=True, enforcement="mps", mps_control=FAKE
    )
    with caplog.at_level(logging.WARNING, logger="qgpu.agent"):
        agent = Agent(cfg, backend, mps=MpsManager(FAKE, cfg.mps_dir))
    # the caps are the clients' own environment: said so, once, when the daemons start
    assert [r.getMessage() for r in caplog.records].count(MPS_CAPS_ADVISORY) == 1
    assert [c[1] for c in calls(mps_log)].count(("-d",)) == 2
    client = TestClient(create_app(agent))
    body = {"request": {"core": 40, "memory": 10, "isolation": "fs"}}
    res = client.post("/v1/slices", json=body).json()
    assert res["enforcement"] == "mps"
    assert res["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert res["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    # and the interposer, whose limits name the GPU's daemon: it sets the MPS caps from them
    # at cuInit, whatever the process's own environment says
    assert res["env"]["LD_PRELOAD"] == str(agent.hook_path)
    limits = Path(res["limits_file"]).read_text()
    pipe = res["env"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert f"QGPU_MPS_PIPE_DIRECTORY={pipe}" in limits.splitlines()
    assert "QGPU_CORE_LIMIT=40" in limits.splitlines()
    assert client.get("/v1/health").json()["enforcement"] == "mps"
    agent.close()
