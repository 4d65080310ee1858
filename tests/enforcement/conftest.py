"""Fixtures for the enforcement tests: simulated GPUs in a short /tmp directory, slice
environments for the real compiled interposer, and workload processes (worker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import enforcement.native
from enforcement.native import hook_library_path, sim_library_dir
from enforcement.sim import (
    MODELS,
    SimConfig,
    busy_share,
    read_gpu_state,
    write_sim_config,
)

# Proving that a test catches an old simulator: QGPU_TEST_SIM_LIB_DIR names the directory of
# another build of the simulated libcuda.so.1 / libnvidia-ml.so.1 (e.g. one built from an
# older commit) for the tests' processes to load instead of this checkout's. Never set in CI.
if os.environ.get("QGPU_TEST_SIM_LIB_DIR"):
    enforcement.native.SIM_DIR = Path(os.environ["QGPU_TEST_SIM_LIB_DIR"]).resolve()

GIB = 1 << 30
# what each process's CUDA context costs on the simulated H100s of the `sim` fixture (more
# than the interposer's default charge: it must measure them)
CTX = MODELS["h100-80gb"].context_memory
WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Sim:
    """Simulated GPUs plus the environment helpers a test needs."""

    config: SimConfig
    state_dir: Path

    def uuid(self, gpu: int = 0) -> str:
        return self.config.gpus[gpu].uuid

    def base_env(self, gpu: int = 0) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("QGPU_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        }
        env["LD_LIBRARY_PATH"] = str(sim_library_dir())
        env["QGPU_SIM_CONFIG"] = str(self.config.path)
        env["CUDA_VISIBLE_DEVICES"] = self.uuid(gpu)
        env["PYTHONPATH"] = str(REPO)
        # an empty limits file anyone could write: it has no authority, so the tests do not
        # depend on whether the machine has a /etc/qgpu/limits.conf
        neutral = self.config.path.parent / "neutral-limits.conf"
        if not neutral.exists():
            neutral.write_text("# no limits\n")
            neutral.chmod(0o666)
        env["QGPU_LIMITS_FILE"] = str(neutral)
        return env

    def slice_env(
        self,
        slice_id: str,
        gpu: int = 0,
        memory: int | None = 4 * GIB,
        core: int = 100,
        policy: str = "best-effort",
        hook: bool = True,
    ) -> dict[str, str]:
        env = self.base_env(gpu)
        env.update(self.config.device_sharing_env())
        env.update(
            QGPU_SLICE_ID=slice_id,
            QGPU_DEVICE_UUID=self.uuid(gpu),
            QGPU_CORE_LIMIT=str(core),
            QGPU_ISOLATION=policy,
            QGPU_STATE_DIR=str(self.state_dir),
        )
        if memory is not None:
            env["QGPU_MEMORY_LIMIT"] = str(memory)
        if hook:
            env["LD_PRELOAD"] = str(hook_library_path())
        return env


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="qe-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sim(short_tmp: Path) -> Sim:
    """Five simulated H100s (separate timelines for tests that run side by side)."""
    cfg = write_sim_config(short_tmp / "sim.conf", "5xH100-80GB", node=f"test-{short_tmp.name}")
    return Sim(cfg, short_tmp / "ledgers")


class Worker:
    """An interactive worker.py process (``serve`` mode)."""

    def __init__(self, env: dict[str, str], resolve: str = "dlsym") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--resolve", resolve, "serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, line: str) -> list[str]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"worker died on {line!r}: {self.stderr()}"
        return reply.split()

    def start(self) -> Worker:
        """cuInit (must succeed) and a context."""
        assert self.ask("init") == ["ok", "0"], self.stderr()
        assert self.ask("ctx") == ["ok"]
        return self

    def alloc(self, api: str, size: int) -> tuple[str, int]:
        status, value = self.ask(f"alloc {api} {size}")
        return status, int(value)

    def meminfo(self) -> tuple[int, int]:
        _, free, total = self.ask("meminfo")
        return int(free), int(total)

    def quit(self) -> tuple[int, str]:
        """Ends the worker; returns (exit code, stderr)."""
        self.ask("quit")
        assert self.proc.stdin
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        return code, self.stderr()

    def stderr(self) -> str:
        if self.proc.poll() is None or not self.proc.stderr:
            return ""
        return self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Workers started by a test; all killed at the end."""
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


_BURNS: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_leftover_burns() -> Iterator[None]:
    """A failed assertion must not leave saturating workers running."""
    yield
    while _BURNS:
        p = _BURNS.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def _boost_priority() -> None:
    """Workers whose CPU time decides whether the device is kept busy run at a higher
    priority where allowed (root): other tests loading the CPUs then cannot starve them.
    They sleep almost all the time, so they take little from anyone. With scheduler
    autogroups (one per session) a nice value alone only counts inside the session."""
    with contextlib.suppress(OSError):
        os.setsid()  # its own session, so its own scheduler autogroup ...
        with open("/proc/self/autogroup", "w") as f:
            f.write("-15")  # ... which competes with other sessions at a higher weight
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -15)


def start_burn(
    env: dict[str, str],
    ns: int = 5_000_000,
    depth: int = 8,
    api: str = "kernel",
    resolve: str = "dlsym",
    wrap: list[str] | None = None,
) -> subprocess.Popen[str]:
    """A saturating workload (worker.py burn): prints 'ready' once its context exists and
    runs until finish() closes its stdin. `wrap`: a command that ends by exec'ing the rest
    (the process keeps its pid)."""
    proc = subprocess.Popen(
        [
            *(wrap or []),
            sys.executable,
            str(WORKER),
            "--resolve",
            resolve,
            "burn",
            "--ns",
            str(ns),
            "--depth",
            str(depth),
            "--api",
            api,
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_boost_priority,
    )
    _BURNS.append(proc)
    return proc


def wait_ready(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", p.stderr.read() if p.stderr else ""


def measure_shares(
    sim: Sim,
    placements: list[tuple[int, subprocess.Popen[str]]],
    warmup: float = 0.5,
    window: float = 1.5,
) -> list[float]:
    """Share of device time (percent, on each process's simulated GPU) over ``window``
    seconds, after ``warmup``. Measured on the simulated timeline."""
    time.sleep(warmup)
    gpus = sorted({g for g, _ in placements})
    before = {g: read_gpu_state(sim.config, g) for g in gpus}
    time.sleep(window)
    after = {g: read_gpu_state(sim.config, g) for g in gpus}
    return [100 * busy_share(before[g], after[g], p.pid) for g, p in placements]


def run_json(env: dict[str, str], script: str, *args: str, timeout: float = 60) -> Any:
    """Run a Python snippet in a fresh process with ``env`` and parse the JSON it prints last
    (a fresh process: the driver reads its config once per process)."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def finish(procs: list[subprocess.Popen[str]]) -> None:
    """Stop burn workers (close stdin) and check they exited cleanly."""
    for p in procs:
        try:
            _out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err
