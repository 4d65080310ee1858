"""`qgpu-ray resources` and `qgpu-ray start` for real: a node agent on simulated GPUs, a Ray
head started by the CLI, and a driver that places an SDK actor and a plain-path actor."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_processes_mentioning(marker: str) -> None:
    """Stop only this test's Ray processes (never `ray stop`, which stops every cluster)."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes()
            env = (pid_dir / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd or marker.encode() in env:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_dir.name), signal.SIGKILL)


@pytest.fixture
def agent():
    root = tempfile.mkdtemp(prefix="qgpu-rcli-", dir="/tmp")
    sock = f"{root}/agent.sock"
    proc = subprocess.Popen(
        [
            str(BIN / "qgpu"),
            "agent",
            "--sim",
            "2xA100-40GB",
            "--node-name",
            "cli-node",
            "--state-dir",
            root,
            "--socket",
            sock,
            "--test-mode",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.1)
    yield root, sock
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(root, ignore_errors=True)


def test_resources_prints_what_start_advertises(agent):
    _, sock = agent
    out = subprocess.run(
        [str(BIN / "qgpu-ray"), "resources", "--agent-socket", sock],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["node"] == "cli-node"
    assert doc["resources"]["qgpu-core"] == 200 and doc["resources"]["qgpu-memory"] == 80
    per_gpu = [k for k in doc["resources"] if k.startswith("qgpu-core/")]
    assert len(per_gpu) == 2
    assert doc["labels"]["qgpu.io/gpu-model"] == "A100-40GB"


def test_resources_without_an_agent_is_a_clear_error():
    out = subprocess.run(
        [str(BIN / "qgpu-ray"), "resources", "--agent-socket", "/tmp/none.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "cannot reach the qgpu agent" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [(["--num-gpus=1"], "--num-gpus"), (["--fraction-memory", "lots"], "fraction-memory")],
)
def test_start_refuses_bad_flags_in_one_line(args, field):
    out = subprocess.run(
        [str(BIN / "qgpu-ray"), "start", "--agent-socket", "/tmp/none.sock", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert field in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


DRIVER = textwrap.dedent(
    """
    import json, os, sys, ray, qgpu_ray

    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

    @ray.remote
    class Probe:
        def cuda(self):
            from enforcement import simcuda
            d = simcuda.Driver()
            code = d.try_init()
            total = 0
            if code == 0:
                d.context(0)
                total = d.mem_get_info()[1]
            return {"init": code, "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "total": total, "slice": os.environ.get("QGPU_SLICE_ID")}

    sdk = Probe.options(**qgpu_ray.options(core=30, memory=8, num_cpus=0)).remote()
    plain = Probe.options(num_cpus=0, resources={"qgpu-core": 20, "qgpu-memory": 4}).remote()
    unchanged = Probe.options(num_cpus=0, num_gpus=0.25).remote()
    node = [n for n in ray.nodes() if n["Alive"]][0]
    print(json.dumps({"sdk": ray.get(sdk.cuda.remote(), timeout=120),
                      "plain": ray.get(plain.cuda.remote(), timeout=120),
                      "num_gpus": ray.get(unchanged.cuda.remote(), timeout=120),
                      "labels": node["Labels"], "resources": node["Resources"]}))
    """
)


def test_start_runs_a_ray_node_that_places_and_enforces_slices(agent):
    _root, sock = agent
    tmp = tempfile.mkdtemp(prefix="qgpu-rcli-ray-", dir="/tmp")
    env = dict(os.environ, RAY_TMPDIR=tmp)
    port = _free_port()
    try:
        start = subprocess.run(
            [
                str(BIN / "qgpu-ray"),
                "start",
                "--agent-socket",
                sock,
                "--head",
                f"--port={port}",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, "auto"],  # found through this test's RAY_TMPDIR
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert driver.returncode == 0, driver.stderr[-3000:]
        out = json.loads(driver.stdout.strip().splitlines()[-1])
    finally:
        _kill_processes_mentioning(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    assert out["labels"]["qgpu.io/node"] == "cli-node"
    assert out["resources"]["qgpu-core"] == 200 and out["resources"]["GPU"] == 2
    for path, gib in (("sdk", 8), ("plain", 4), ("num_gpus", 10)):  # floor(0.25 x 40 GiB)
        got = out[path]
        assert got["init"] == 0, got
        assert got["total"] == gib << 30
        assert got["device"].startswith("GPU-") and got["slice"]


def test_a_nodes_reaper_finds_its_raylet_and_sees_it_exit():
    """`qgpu-ray reaper --local-node` ends with its node's raylet (`ray stop` stops the
    raylet, not the reaper); the raylet is found by its ``--node_id`` and start time."""
    from qgpu_ray.reaper import local_raylet, raylet_alive

    node_id = os.urandom(28).hex()
    # a process whose command line is a raylet's: argv[0] .../raylet, --node_id=<id>
    fake = subprocess.Popen(
        [
            "bash",
            "-c",
            'exec -a /opt/ray/core/src/ray/raylet/raylet "$@"',
            "sh",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            f"--node_id={node_id}",
        ],
    )
    try:
        deadline = time.monotonic() + 10
        found = local_raylet(node_id)
        while found is None and time.monotonic() < deadline:
            time.sleep(0.02)
            found = local_raylet(node_id)
        assert found is not None and found[0] == fake.pid
        assert raylet_alive(found)
        assert local_raylet(os.urandom(28).hex()) is None  # another node's id: not here
    finally:
        fake.kill()
        fake.wait()
    assert not raylet_alive(found)
