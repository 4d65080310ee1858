"""qgpu-dask-worker against a real scheduler and node agent on simulated GPUs: the worker
runs inside its slice, SIGTERM releases the slice directly, SIGKILL leaves it to the agent's
reconcile (the owner process is gone), and bad input exits with a clear message."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from enforcement import simcuda
from enforcement.agent.reconcile import proc_start_time
from qgpu.model import OwnerKind
from qgpu_dask.agent import LocalAgent
from qgpu_dask.nofit import PLUGIN_NAME, NoSliceFits
from tests.dask import workloads
from tests.dask.conftest import live_slices
from tests.helpers import wait_until

WORKER_CLI = [sys.executable, "-m", "qgpu_dask.worker_cli"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def scheduler():
    """A fresh plain scheduler per test (no qgpu plugin until a qgpu-dask-worker joins)."""
    with LocalCluster(
        n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None
    ) as cluster:
        yield cluster


@pytest.fixture
def client(scheduler):
    with Client(scheduler) as c:
        yield c


def start_worker(scheduler, agent: LocalAgent, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *WORKER_CLI,
            scheduler.scheduler_address,
            "--core",
            "30",
            "--memory",
            "8",
            "--agent-socket",
            str(agent.socket),
            "--no-fit-grace",
            "0.5",
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def joined(client: Client, proc: subprocess.Popen[str]) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stdout.read()}")
        return len(client.scheduler_info()["workers"]) == 1

    wait_until(ready, timeout=60)


def test_sigterm_runs_inside_the_slice_then_releases_it(scheduler, client, agent):
    assert PLUGIN_NAME not in scheduler.scheduler.plugins
    # waits in no-worker before any worker (and the plugin) exists
    too_big = client.submit(workloads.where, resources={"qgpu-memory": 9}, pure=False)
    proc = start_worker(scheduler, agent, "--isolation", "fs", "--name", "w-term")
    try:
        joined(client, proc)
        (res,) = live_slices(agent)
        assert res.owner.kind is OwnerKind.DASK_WORKER and res.owner.id == "w-term"
        assert res.owner.meta["pid"] == str(proc.pid)
        assert res.isolation.value == "fixed-share"
        out = client.submit(workloads.cuda_probe, resources={"qgpu-core": 30}, pure=False)
        out = out.result(timeout=60)
        assert out["worker"] == "w-term" and out["QGPU_SLICE_ID"] == res.slice_id
        assert out["preloaded"] and out["uuid"] == res.device_uuid
        assert out["total"] == 8 * (1 << 30)
        assert out["over_cap"] == simcuda.CUDA_ERROR_OUT_OF_MEMORY
        # the worker installed the no-fit plugin on this plain scheduler; it also fails the
        # task that was waiting before, and one submitted now
        with pytest.raises(NoSliceFits, match="qgpu-memory=9"):
            too_big.result(timeout=30)
        too_big = client.submit(workloads.where, resources={"qgpu-core": 31}, pure=False)
        with pytest.raises(NoSliceFits, match="largest slice: qgpu-core=30, qgpu-memory=8"):
            too_big.result(timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert f"released slice {res.slice_id}" in proc.stdout.read()
        assert live_slices(agent) == []  # released by the worker itself, before it exited
        wait_until(lambda: not client.scheduler_info()["workers"], timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_leaves_the_release_to_the_agents_reconcile(scheduler, client, agent):
    proc = start_worker(scheduler, agent, "--name", "w-kill")
    try:
        joined(client, proc)
        (res,) = live_slices(agent)
        assert res.owner.meta["pid"] == str(proc.pid)
        worker_pid = client.submit(workloads.where, pure=False).result(timeout=60)["pid"]
        assert worker_pid != proc.pid
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_until(lambda: not live_slices(agent), timeout=30)
        # the worker process does not outlive its nanny
        wait_until(lambda: proc_start_time(worker_pid) is None, timeout=30)
        wait_until(lambda: not client.scheduler_info()["workers"], timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["--core", "150", "--memory", "8"], 2, ["--core 150: ", "2 GPUs", "multiple of 100"]),
        (["--core", "30", "--memory", "90"], 2, ["--memory 90: ", "must not exceed the card"]),
        (["--core", "30", "--memory", "8", "--isolation", "hard"], 2, ["--isolation: 'hard'"]),
    ],
)
def test_invalid_requests_exit_2_naming_field_value_and_rule(agent, args, code, needles):
    proc = subprocess.run(
        [*WORKER_CLI, "tcp://127.0.0.1:9", *args, "--agent-socket", str(agent.socket)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    assert live_slices(agent) == []


def test_an_unreachable_agent_is_a_clear_error(tmp_path):
    missing = tmp_path / "agent.sock"
    proc = subprocess.run(
        [
            *WORKER_CLI,
            "tcp://127.0.0.1:9",
            "--core",
            "30",
            "--memory",
            "8",
            "--agent-socket",
            str(missing),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"cannot reach the qgpu agent at {missing}" in proc.stderr


def test_an_unreachable_scheduler_fails_and_releases_the_slice(agent):
    proc = subprocess.run(
        [
            *WORKER_CLI,
            "tcp://127.0.0.1:9",
            "--core",
            "30",
            "--memory",
            "8",
            "--agent-socket",
            str(agent.socket),
            "--death-timeout",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 1
    assert "could not start against tcp://127.0.0.1:9" in proc.stderr
    assert "released slice" in proc.stderr
    assert live_slices(agent) == []


def test_an_agent_away_at_exit_leaves_the_slice_to_its_reconcile(scheduler, client):
    root = Path(tempfile.mkdtemp(prefix="qgpu-dask-t-", dir="/tmp"))
    own = LocalAgent(root / "agent", gpus="1xH100-80GB", reconcile_interval=0.5)
    try:
        proc = start_worker(scheduler, own, "--name", "w-away")
        try:
            joined(client, proc)
            (res,) = live_slices(own)
            own.stop()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            out = proc.stdout.read()
            assert f"could not release slice {res.slice_id}" in out
            assert "reconcile releases it" in out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # the restarted agent finds the owner gone and releases the slice
        own = LocalAgent(root / "agent", gpus="1xH100-80GB", reconcile_interval=0.5)
        wait_until(lambda: not live_slices(own), timeout=30)
    finally:
        own.stop()
        shutil.rmtree(root, ignore_errors=True)
