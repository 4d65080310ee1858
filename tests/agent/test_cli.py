"""`qgpu status` against a live agent, and its failure when no agent answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.agent.client import AgentClient, AgentError
from qgpu.model import Owner, OwnerKind, SliceRequest
from tests.agent.conftest import REPO, start_agent, stop_agent

pytestmark = pytest.mark.slow


def qgpu(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "qgpu.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


def test_status_shows_devices_and_slices(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "2xH100-80GB")
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            res = client.reserve({"core": 30, "memory": 8, "isolation": "fs"}, {"id": "nb-1"})
            typed = client.reserve(
                SliceRequest(core=20, memory_gib=4, isolation="bs"),
                Owner(kind=OwnerKind.MANUAL, id="typed"),
            )
            assert (typed.core, typed.memory_gib, typed.isolation.value) == (20, 4, "burst-share")
            with pytest.raises(AgentError) as refused:
                client.reserve({"core": 150, "memory": 8})
            assert refused.value.status == 422
            assert (refused.value.field, refused.value.value) == ("qgpu-core", 150)
            assert "multiple of 100" in refused.value.rule
            assert client.release(typed.slice_id).released
            node = client.node()
            assert [g.model for g in node.inventory.gpus] == ["H100-80GB", "H100-80GB"]
            assert node.workload_env["QGPU_SIM_CONFIG"].startswith(str(state_dir))
            assert node.workload_env["QGPU_STATE_DIR"] == str(state_dir / "slices")
        table = qgpu("status", "--state-dir", str(state_dir))
        assert table.returncode == 0, table.stderr
        assert "node node-a" in table.stdout and "backend sim" in table.stdout
        assert res.slice_id in table.stdout and "fixed-share" in table.stdout
        assert res.device_uuid in table.stdout and "30/100" in table.stdout
        as_json = qgpu("status", "--socket", str(state_dir / "agent.sock"), "--json")
        data = json.loads(as_json.stdout)
        assert [s["slice_id"] for s in data["slices"]["slices"]] == [res.slice_id]
        assert len(data["devices"]["devices"]) == 2
    finally:
        stop_agent(proc)


def test_status_without_an_agent_fails_clearly(state_dir: Path) -> None:
    out = qgpu("status", "--state-dir", str(state_dir))
    assert out.returncode == 1
    assert "cannot reach the qgpu agent" in out.stderr
