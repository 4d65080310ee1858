"""Discovery: short model names, and the pynvml path against the simulated libnvidia-ml.

The simulated NVML is loaded into a fresh interpreter per test (a process can hold one
libnvidia-ml only), exactly as `qgpu agent --sim` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement import sim
from enforcement.discovery import short_model_name
from tests.agent.conftest import REPO


@pytest.mark.parametrize(
    ("name", "mib", "short"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 81920, "A100-80GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA A10", 23028, "A10-24GB"),
        ("H100-80GB", None, "H100-80GB"),
    ],
)
def test_short_model_names(name: str, mib: int | None, short: str) -> None:
    assert short_model_name(name, mib) == short


_DISCOVER = """
import json, sys
from enforcement.discovery import discover, open_backend
b = open_backend("sim", sim_spec=sys.argv[1], state_dir=sys.argv[2], node_name="node-d")
inv = discover(b, "node-d")
print(json.dumps({
    "inventory": inv.model_dump(mode="json"),
    "telemetry": [t.__dict__ for t in b.telemetry()],
    "processes": [p.__dict__ for p in b.processes()],
    "env": b.workload_env,
}))
b.close()
"""


def run_discovery(spec: str, state_dir: Path, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _DISCOVER, spec, str(state_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sim_devices_through_pynvml(state_dir: Path) -> None:
    found = run_discovery("2xH100-80GB,A10-24GB", state_dir)
    gpus = found["inventory"]["gpus"]
    assert [g["model"] for g in gpus] == ["H100-80GB", "H100-80GB", "A10-24GB"]
    assert [g["uuid"] for g in gpus] == [sim.gpu_uuid("node-d", i) for i in range(3)]
    assert [g["index"] for g in gpus] == [0, 1, 2]
    assert gpus[0]["memory_mib"] == 80 * 1024 and gpus[2]["memory_mib"] == 24 * 1024
    assert gpus[0]["sm_count"] == sim.MODELS["h100-80gb"].sms
    assert all(g["health"] == "healthy" for g in gpus)
    assert found["inventory"]["labels"]["qgpu.io/backend"] == "sim"
    assert [t["memory_total_bytes"] for t in found["telemetry"]] == [80 << 30, 80 << 30, 24 << 30]
    assert found["env"]["QGPU_SIM_CONFIG"].startswith(str(state_dir))


def test_sim_processes_are_seen_per_gpu(state_dir: Path) -> None:
    first = run_discovery("1xH100-80GB", state_dir)
    holder = subprocess.Popen(
        [sys.executable, "-u", "-m", "tests.agent.workload", "2"],
        env={**os.environ, **first["env"], "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None
        assert [holder.stdout.readline().strip() for _ in range(2)] == ["ok", "ready"]
        found = run_discovery("1xH100-80GB", state_dir)
        procs = {p["pid"]: p for p in found["processes"]}
        assert holder.pid in procs
        assert procs[holder.pid]["used_memory_bytes"] >= 2 << 30
        assert found["telemetry"][0]["memory_used_bytes"] >= 2 << 30
    finally:
        holder.kill()
        holder.wait()


def test_auto_without_nvml_or_spec_says_what_to_do(state_dir: Path) -> None:
    code = (
        "from enforcement.discovery import open_backend, nvml_available\n"
        "import sys\n"
        "if nvml_available(): sys.exit(0)\n"
        "try:\n    open_backend('auto', state_dir=sys.argv[1])\n"
        "except Exception as e:\n    print(e); sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(state_dir)], capture_output=True, text=True, cwd=REPO
    )
    if out.returncode == 0:
        pytest.skip("a real NVML is present")
    assert out.returncode == 3
    assert "--sim" in out.stdout and "NVML" in out.stdout


def test_bad_sim_spec_is_a_rule_violation(state_dir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "qgpu.cli",
            "agent",
            "--sim",
            "3xZ9000",
            "--state-dir",
            str(state_dir),
            "--test-mode",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2
    assert "sim=" in out.stderr and "unknown model" in out.stderr


# The simulator has no ECC counters or events: patch those pynvml calls, keep the rest real.
_HEALTH = """
import json, sys, time, types
import pynvml
from enforcement.discovery import open_backend

events = [13, 79]  # 13 (application error) is ignored, 79 (fell off the bus) is critical

def wait(event_set, timeout_ms):
    if not events:
        time.sleep(timeout_ms / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
    gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    return types.SimpleNamespace(eventData=events.pop(0), device=gpu0)

def ecc(handle, kind, counter):
    return 3 if pynvml.nvmlDeviceGetIndex(handle) == 1 else 0

pynvml.nvmlEventSetCreate = lambda: object()
pynvml.nvmlDeviceRegisterEvents = lambda handle, types_, event_set: None
pynvml.nvmlEventSetWait_v2 = wait
pynvml.nvmlDeviceGetTotalEccErrors = ecc
b = open_backend("sim", sim_spec="3xH100-80GB", state_dir=sys.argv[1], node_name="node-h")
deadline = time.time() + 10
while events and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.2)
print(json.dumps([(d.health.value, d.health_reason) for d in b.devices()]))
b.close()
"""


def test_health_from_xid_events_and_ecc(state_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HEALTH, str(state_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    health = json.loads(out.stdout)
    assert health[0] == ["unhealthy", "critical Xid 79"]
    assert health[1][0] == "unhealthy" and "3 uncorrectable ECC errors" in health[1][1]
    assert health[2] == ["healthy", None]


_AUTO = """
import json, sys
from enforcement.discovery import discover, open_backend
b = open_backend("auto", state_dir=sys.argv[1], node_name="node-e")
print(json.dumps([g.model for g in discover(b, "node-e").gpus]))
b.close()
"""


def test_qgpu_sim_spec_stands_for_sim_on_a_machine_without_gpus(state_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _AUTO, str(state_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "QGPU_SIM_SPEC": "H100-80GB,A10-24GB"},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["H100-80GB", "A10-24GB"]


def test_a_bad_qgpu_sim_spec_is_named_as_the_variable(state_dir: Path) -> None:
    agent = [sys.executable, "-m", "qgpu.cli", "agent", "--state-dir", str(state_dir)]
    out = subprocess.run(
        [*agent, "--test-mode"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "QGPU_SIM_SPEC": "3xZ9000"},
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "QGPU_SIM_SPEC=" in lines[0] and "unknown model" in lines[0]
