"""A SliceCluster process killed with SIGKILL: its worker processes exit, the agent's
reconcile releases its slices (their owner pid is gone), and an agent the cluster started
itself does not outlive it. A process that ends without closing its cluster releases the
slices itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from enforcement.agent.reconcile import proc_start_time
from tests.dask.conftest import live_slices
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "dask" / "cluster_process.py"


def _run_and_kill(target: str, root: Path) -> dict:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), target, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()
        assert line, f"cluster process exited {proc.wait()}"
        report = json.loads(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return report


def test_sigkilled_cluster_slices_are_released_by_reconcile(agent, tmp_path):
    report = _run_and_kill(str(agent.socket), tmp_path)
    assert len(report["slices"]) == 2 and len(report["worker_pids"]) == 2
    wait_until(lambda: not live_slices(agent), timeout=30)
    for pid in report["worker_pids"]:
        wait_until(lambda pid=pid: proc_start_time(pid) is None, timeout=30)


def test_an_agent_the_cluster_started_dies_with_it():
    root = Path(tempfile.mkdtemp(prefix="qgpu-dask-t-", dir="/tmp"))  # short socket path
    try:
        report = _run_and_kill("sim", root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert report["agent_pid"] is not None
    wait_until(lambda: proc_start_time(report["agent_pid"]) is None, timeout=30)
    for pid in report["worker_pids"]:
        wait_until(lambda pid=pid: proc_start_time(pid) is None, timeout=30)


def _owner_gone_releases(agent) -> float:
    for line in agent.client.metrics().splitlines():
        if line.startswith("qgpu_agent_releases_total") and 'reason="owner-gone"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_process_that_exits_without_close_releases_its_slices(agent, tmp_path):
    reconciled = _owner_gone_releases(agent)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(agent.socket), str(tmp_path), "exit"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout.splitlines()[0])["slices"]) == 2
    assert live_slices(agent) == []
    assert _owner_gone_releases(agent) == reconciled  # released by the exit hook, not reconcile
