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


def test_status_wait_outlasts_an_agent_still_starting(state_dir: Path) -> None:
    """``qgpu agent ... &`` then ``qgpu status --wait``: the status waits for the socket."""
    from tests.agent.conftest import agent_command

    status = subprocess.Popen(
        [sys.executable, "-m", "qgpu.cli", "status", "--state-dir", str(state_dir), "--wait",
         "60", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    agent = subprocess.Popen(
        agent_command(state_dir, "--sim", "1xH100-80GB"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        out, err = status.communicate(timeout=90)
        assert status.returncode == 0, err
        assert json.loads(out)["health"]["node"] == "node-a"
    finally:
        stop_agent(agent)


def test_status_wait_gives_up_with_one_line(state_dir: Path) -> None:
    out = qgpu("status", "--state-dir", str(state_dir), "--wait", "0.5")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "(waited 0.5 s)" in out.stderr


def test_status_tables_are_not_cut_in_a_pipe(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "2xH100-80GB")
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            res = client.reserve({"core": 30, "memory": 8, "isolation": "fs"}, {"id": "wide"})
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        table = subprocess.run(
            [sys.executable, "-m", "qgpu.cli", "status", "--state-dir", str(state_dir)],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
        )  # fmt: skip
        assert table.returncode == 0, table.stderr
        assert res.slice_id in table.stdout and res.device_uuid in table.stdout
        header = next(line for line in table.stdout.splitlines() if "owner" in line)
        assert "isolation" in header and "policy" not in header
        assert max(len(line) for line in table.stdout.splitlines()) > 80
    finally:
        stop_agent(proc)


def _agent_args(*argv: str):
    import argparse

    from enforcement.agent.cli import register_agent

    parser = argparse.ArgumentParser(prog="qgpu")
    register_agent(parser.add_subparsers())
    return parser.parse_args(["agent", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reconcile-interval", "-5"], "--reconcile-interval -5.0: "),
        (["--max-slices-per-gpu", "0"], "--max-slices-per-gpu 0: "),
        (["--tcp-port", "7070"], "--token-file: is required with --tcp-port"),
    ],
)
def test_agent_settings_errors_name_the_flag(argv: list[str], message: str) -> None:
    from enforcement.agent.cli import config_from_args
    from qgpu.cli_common import describe
    from qgpu.errors import RuleViolation

    with pytest.raises(RuleViolation) as refused:
        config_from_args(_agent_args("--state-dir", "/tmp/x", *argv))
    assert describe(refused.value).startswith(message), describe(refused.value)


def test_agent_enumerated_options_follow_the_case_rule() -> None:
    from enforcement.agent.cli import config_from_args

    cfg = config_from_args(
        _agent_args("--state-dir", "/tmp/x", "--backend", "SIM", "--isolation", "FS",
                    "--placement", "Spread", "--enforcement", "Interposer")
    )  # fmt: skip
    assert (cfg.backend, cfg.default_isolation.value, cfg.placement.value) == (
        "sim",
        "fixed-share",
        "spread",
    )


@pytest.mark.parametrize(
    ("pid", "rule"),
    [("1", "must be this agent's parent, and still running"), ("-3", "must be a process id (> 0)")],
)
def test_exit_with_parent_refuses_a_process_that_is_not_the_parent(
    state_dir: Path, pid: str, rule: str
) -> None:
    args = ["agent", "--sim", "1xH100-80GB", "--state-dir", str(state_dir), "--test-mode"]
    proc = qgpu(*args, "--exit-with-parent", pid)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --exit-with-parent {pid}: {rule}"
    assert not (state_dir / "agent.sock").exists()  # refused before it served anything
