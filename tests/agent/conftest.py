"""Fixtures of the agent tests: an in-memory GPU backend double, agents, apps, live agents."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from enforcement.agent.config import AgentConfig
from enforcement.agent.service import Agent
from enforcement.agent.watchdog import Watchdog
from enforcement.discovery import DeviceTelemetry, GpuProcess, UtilSample
from qgpu.model import GpuDevice

REPO = Path(__file__).resolve().parents[2]


@dataclass
class FakeBackend:
    """A GPU backend double: fixed devices, processes the test sets."""

    gpus: list[GpuDevice]
    kind: str = "fake"
    workload_env: dict[str, str] = field(default_factory=dict)
    procs: list[GpuProcess] = field(default_factory=list)
    util: dict[tuple[str, int], UtilSample] = field(default_factory=dict)
    settings: dict[str, dict[str, int]] = field(default_factory=dict)  # GPU -> NVML settings
    refuse_settings: str | None = None  # set_gpu_setting's error, when it should fail
    closed: bool = False

    def devices(self) -> list[GpuDevice]:
        return list(self.gpus)

    def telemetry(self) -> list[DeviceTelemetry]:
        out = []
        for g in self.gpus:
            used = sum(p.used_memory_bytes or 0 for p in self.procs if p.device_uuid == g.uuid)
            out.append(DeviceTelemetry(g.uuid, g.memory_mib * 1024 * 1024, used, 0))
        return out

    def processes(self) -> list[GpuProcess]:
        return list(self.procs)

    def process_utilization(self) -> dict[tuple[str, int], UtilSample]:
        return dict(self.util)

    def gpu_settings(self) -> dict[str, dict[str, int]]:
        return {uuid: dict(s) for uuid, s in self.settings.items()}

    def set_gpu_setting(self, uuid: str, name: str, value: int) -> str | None:
        if self.refuse_settings is not None:
            return self.refuse_settings
        self.settings[uuid][name] = value
        return None

    def close(self) -> None:
        self.closed = True


def h100(i: int) -> GpuDevice:
    return GpuDevice(
        uuid=f"GPU-00000000-0000-0000-0000-00000000000{i}",
        index=i,
        model="H100-80GB",
        memory_mib=80 * 1024,
        sm_count=132,
        numa_node=0,
    )


def short_tmp() -> Path:
    """A short directory (unix socket paths must stay under ~100 characters)."""
    return Path(tempfile.mkdtemp(prefix="qa", dir="/tmp"))


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend([h100(0), h100(1)])


def make_agent(state_dir: Path, backend: FakeBackend, **kw: object) -> Agent:
    cfg = AgentConfig(node_name="node-a", state_dir=state_dir, test_mode=True, **kw)
    agent = Agent(cfg, backend)
    agent.watchdog = Watchdog(agent)
    return agent


@pytest.fixture
def agent(state_dir: Path, backend: FakeBackend) -> Iterator[Agent]:
    a = make_agent(state_dir, backend)
    yield a
    a.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(state_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qgpu.cli",
        "agent",
        "--state-dir",
        str(state_dir),
        "--node-name",
        "node-a",
        "--test-mode",
        "--log-level",
        "warning",
        *extra,
    ]


def start_agent(
    state_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `qgpu agent` as a real process and wait until its socket answers."""
    from enforcement.agent.client import AgentClient, AgentUnavailable

    log = open(state_dir / "agent.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        agent_command(state_dir, *extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )
    deadline = time.monotonic() + 30
    sock = state_dir / "agent.sock"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"agent exited {proc.returncode}: {(state_dir / 'agent.log').read_text()[-3000:]}"
            )
        if sock.exists():
            try:
                with AgentClient(sock, timeout=2) as c:
                    c.health()
                return proc
            except AgentUnavailable:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("agent did not come up in 30 s")


def rows_and_dirs(state_dir: Path, node: str = "node-a") -> tuple[set[str], set[str]]:
    """The slices an agent's SQLite ledger holds, and the slices that have a directory."""
    from qgpu.ledger import Ledger

    ledger = Ledger(state_dir / "ledger.sqlite")
    try:
        rows = {a.slice_id for a in ledger.allocations(node)}
    finally:
        ledger.close()
    return rows, slice_dirs(state_dir)


def slice_dirs(state_dir: Path) -> set[str]:
    """The slices that have a directory under ``slices/`` (not the GPUs' ``.gpu-<uuid>/``),
    checking on the way that the GPUs' rosters list exactly those slices (no orphan entry
    or activity file is left where no orphan directory is)."""
    from enforcement.gpu_roster import read_roster
    from enforcement.state_tree import StateTree

    root = state_dir / "slices"
    dirs = set(StateTree(root, privileged=False).slice_ids())
    gpus = [d for d in root.iterdir() if d.name.startswith(".gpu-")]
    listed = {e.slice_id for d in gpus for e in read_roster(d / "roster")}
    activity = {f.name.removesuffix(".activity") for d in gpus for f in d.glob("*.activity")}
    assert listed == activity == dirs, (listed, activity, dirs)
    return dirs


def stop_agent(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
