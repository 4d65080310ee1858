"""The agent as a real process on the simulated GPUs: security, restarts, crashes, load."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enforcement.agent.client import AgentClient, AgentError, AgentUnavailable, AsyncAgentClient
from enforcement.limits import read_limits_file
from qgpu.ledger import Ledger
from tests.agent.conftest import (
    REPO,
    agent_command,
    free_port,
    slice_dirs,
    start_agent,
    stop_agent,
)

pytestmark = pytest.mark.slow
GIB = 1 << 30


@pytest.fixture
def live(state_dir: Path) -> Iterator[tuple[subprocess.Popen, AgentClient]]:
    proc = start_agent(state_dir, "--sim", "2xH100-80GB")
    client = AgentClient(state_dir / "agent.sock")
    yield proc, client
    client.close()
    stop_agent(proc)


# -- security ---------------------------------------------------------------------------


def test_socket_is_0600_and_refuses_another_user(
    live: tuple[subprocess.Popen, AgentClient], state_dir: Path
) -> None:
    sock = state_dir / "agent.sock"
    mode = sock.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert sock.stat().st_uid == os.geteuid()
    if os.geteuid() != 0:
        pytest.skip("trying as another uid needs root")
    pid = os.fork()
    if pid == 0:  # child: become nobody, try to talk to the agent
        code = 3
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(sock))
                code = 1  # connected: the socket is open to other users
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_tcp_needs_the_bearer_token(state_dir: Path) -> None:
    token = "t0k3n-" + "x" * 26
    token_file = state_dir / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    proc = start_agent(
        state_dir, "--sim", "1xH100-80GB", "--tcp-port", str(port), "--token-file", str(token_file)
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for path in ("/v1/health", "/v1/slices", "/metrics", "/openapi.json"):
            bare = httpx.get(url + path)
            assert bare.status_code == 401, path
            assert bare.json()["field"] == "Authorization"
            wrong = httpx.get(url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        no_token = httpx.post(url + "/v1/slices", json={"request": {"core": 10, "memory": 4}})
        assert no_token.status_code == 401
        with AgentClient(url=url, token=token) as client:
            assert client.health().status in ("ok", "degraded")
            res = client.reserve({"core": 10, "memory": 4})
            assert client.release(res.slice_id).released
        # the unix socket needs no token (its file mode guards it)
        with AgentClient(state_dir / "agent.sock") as local:
            assert local.health().node == "node-a"
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "qgpu.cli",
                "status",
                "--url",
                url,
                "--token-file",
                str(token_file),
                "--json",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["health"]["node"] == "node-a"
    finally:
        stop_agent(proc)


def test_refuses_non_loopback_tcp_and_loose_token_files(state_dir: Path) -> None:
    token_file = state_dir / "token"
    token_file.write_text("x" * 32)
    token_file.chmod(0o600)
    common = ["--sim", "1xH100-80GB", "--tcp-port", str(free_port())]
    bad_host = subprocess.run(
        [
            *agent_command(state_dir, *common, "--token-file", str(token_file)),
            "--tcp-host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert bad_host.returncode == 2
    assert "--tcp-host 0.0.0.0: " in bad_host.stderr and "loopback" in bad_host.stderr
    token_file.chmod(0o644)
    loose = subprocess.run(
        agent_command(state_dir, *common, "--token-file", str(token_file)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert loose.returncode == 2 and "chmod 600" in loose.stderr
    no_token = subprocess.run(
        agent_command(state_dir, *common), capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert no_token.returncode == 2 and "--token-file: is required" in no_token.stderr


# -- restarts ---------------------------------------------------------------------------


def workload(env: dict[str, str], *gib: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", _WORKLOAD],
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdin is not None
    proc.stdin.write(" ".join(str(g) for g in gib) + "\n")
    proc.stdin.flush()
    return proc


# Allocates the sizes given on each stdin line; answers one word per allocation.
_WORKLOAD = """
import sys
import time
from enforcement.simcuda import Driver
d = Driver(); d.init(); d.context(0); held = []
for line in sys.stdin:
    out = []
    for g in line.split():
        code, a = d.try_mem_alloc(int(float(g) * (1 << 30)))
        out.append("ok" if a is not None else "oom")
        if a is not None:
            held.append(a)
    print(" ".join(out), flush=True)
"""


def test_kill_9_and_restart_loses_nothing(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "2xH100-80GB")
    with AgentClient(state_dir / "agent.sock") as client:
        res = [
            client.reserve({"core": c, "memory": m}, {"id": f"job-{c}"})
            for c, m in ((30, 4), (50, 8), (20, 6))
        ]
        before = {s.slice_id: s for s in client.slices().slices}
        limits = {r.slice_id: Path(r.limits_file).read_text() for r in res if r.limits_file}
    capped = res[0]
    # 2 GiB and the process's context (640 MiB on the simulated H100) of the 4 GiB slice
    running = workload(capped.env, 2)
    assert running.stdout is not None and running.stdout.readline().split() == ["ok"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = start_agent(state_dir, "--sim", "2xH100-80GB")
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            after = {s.slice_id: s for s in client.slices().slices}
            assert after.keys() == before.keys()
            for sid, s in after.items():
                assert s.env == before[sid].env
                assert s.device_uuids == before[sid].device_uuids
                assert (s.core, s.memory_gib, s.owner) == (
                    before[sid].core,
                    before[sid].memory_gib,
                    before[sid].owner,
                )
            for sid, text in limits.items():
                assert Path(before[sid].limits_file).read_text() == text
            # the running process kept its 4 GiB cap across the restart ...
            assert running.stdin is not None
            running.stdin.write("2\n")
            running.stdin.flush()
            assert running.stdout.readline().split() == ["oom"]
            # ... shared with a new process of the same slice
            second = workload(capped.env, 0.5, 1)
            assert second.stdout is not None
            assert second.stdout.readline().split() == ["ok", "oom"]
            # read while both hold their memory: a killed process's share is reaped
            usage = next(s for s in client.slices().slices if s.slice_id == capped.slice_id).usage
            second.kill()
            second.wait()
            assert usage.source == "interposer"
            assert usage.memory_used_bytes is not None and usage.memory_used_bytes >= 3 * GIB
            assert running.pid in usage.pids
    finally:
        running.kill()
        stop_agent(proc)


def test_restart_repairs_limits_files(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    with AgentClient(state_dir / "agent.sock") as client:
        kept = client.reserve({"core": 10, "memory": 4})
    stop_agent(proc)
    assert kept.limits_file is not None
    Path(kept.limits_file).unlink()
    stray = state_dir / "slices" / "s-gone"  # a released slice's directory a crash left
    (stray / "ledger").mkdir(parents=True)
    (stray / "limits.conf").write_text("QGPU_SLICE_ID=s-gone\n")
    legacy = state_dir / "limits" / "s-old.limits"  # the flat layout of older versions
    legacy.parent.mkdir()
    legacy.write_text("QGPU_SLICE_ID=s-old\n")
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    try:
        assert read_limits_file(kept.limits_file)["QGPU_SLICE_ID"] == kept.slice_id
        assert not stray.exists()
        assert not legacy.parent.exists()
    finally:
        stop_agent(proc)


def test_crash_during_a_burst_keeps_every_acknowledged_reservation(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "4xH100-80GB")
    acked: list[str] = []
    kill_after = 40

    async def burst() -> None:
        async with AsyncAgentClient(state_dir / "agent.sock", max_connections=32) as client:

            async def one(i: int) -> None:
                try:
                    res = await client.reserve(
                        {"core": 1 + i % 5, "memory": 4}, {"id": f"b{i}"}, slice_id=f"b-{i}"
                    )
                except (AgentUnavailable, AgentError):
                    return
                acked.append(res.slice_id)
                if len(acked) == kill_after:
                    proc.send_signal(signal.SIGKILL)

            await asyncio.gather(*(one(i) for i in range(200)))

    asyncio.run(burst())
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= kill_after
    proc = start_agent(state_dir, "--sim", "4xH100-80GB")
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            held = {s.slice_id for s in client.slices().slices}
            assert set(acked) <= held
            for d in client.devices().devices:
                assert d.core_committed <= 100 and d.slices <= d.max_slices
                assert d.memory_committed_gib <= d.memory_mib // 1024
        files = slice_dirs(state_dir)
        assert files == held
        ledger = Ledger(state_dir / "ledger.sqlite")
        ledger.state().check_invariants()
        assert {a.slice_id for a in ledger.allocations()} == held
        ledger.close()
    finally:
        stop_agent(proc)


# -- load -------------------------------------------------------------------------------


def test_1000_concurrent_reserve_and_release_calls(
    live: tuple[subprocess.Popen, AgentClient],
) -> None:
    _proc, sync = live
    pre = [sync.reserve({"core": 5, "memory": 4}, {"id": "pre"}).slice_id for _ in range(16)]
    rng = random.Random(7)
    sizes = [(rng.choice([3, 5, 10, 20, 40]), rng.choice([4, 4, 6, 10, 20])) for _ in range(984)]
    results: dict[str, int] = {}
    releases: dict[str, bool] = {}
    errors: list[str] = []

    async def run() -> None:
        async with AsyncAgentClient(sync.where, max_connections=1000) as client:

            async def reserve(i: int, core: int, mem: int) -> None:
                sid = f"load-{i}"
                try:
                    await client.reserve({"core": core, "memory": mem}, {"id": sid}, slice_id=sid)
                    results[sid] = 201
                except AgentError as exc:
                    results[sid] = exc.status
                    if exc.status != 409:
                        errors.append(str(exc))

            async def release(sid: str) -> None:
                releases[sid] = (await client.release(sid)).released

            calls = [reserve(i, c, m) for i, (c, m) in enumerate(sizes)]
            calls += [release(s) for s in pre]
            rng.shuffle(calls)
            await asyncio.gather(*calls)

    asyncio.run(run())
    assert errors == []
    assert len(results) == 984 and set(results.values()) <= {201, 409}
    assert releases == {s: True for s in pre}
    acked = {sid for sid, code in results.items() if code == 201}
    held = [s.slice_id for s in sync.slices().slices]
    assert len(held) == len(set(held))  # no duplicates
    assert set(held) == acked  # none lost, none extra
    devices = sync.devices().devices
    assert sum(d.slices for d in devices) == len(acked)
    for d in devices:  # no over-commit
        assert d.core_committed <= 100
        assert d.memory_committed_gib <= 80
        assert d.slices <= d.max_slices

    async def release_all() -> list[bool]:
        async with AsyncAgentClient(sync.where, max_connections=200) as client:
            ids = sorted(acked) * 2
            return [r.released for r in await asyncio.gather(*(client.release(s) for s in ids))]

    flags = asyncio.run(release_all())
    assert flags.count(True) == len(acked) and flags.count(False) == len(acked)
    assert sync.slices().slices == []


def test_a_second_agent_on_the_same_socket_refuses_to_start(
    live: tuple[subprocess.Popen, AgentClient], state_dir: Path
) -> None:
    second = subprocess.run(
        agent_command(state_dir, "--sim", "2xH100-80GB"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert second.returncode == 2
    assert "already listening" in second.stderr
    _proc, client = live
    assert client.health().node == "node-a"  # the first one is untouched


def test_live_agent_reconciles_and_watchdog_kills_a_bypass(state_dir: Path) -> None:
    proc = start_agent(
        state_dir,
        "--sim",
        "1xH100-80GB",
        "--reconcile-interval",
        "0.3",
        "--watchdog-interval",
        "0.3",
        "--watchdog-kill",
        "--watchdog-grace",
        "0",
    )
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    bypass: subprocess.Popen | None = None
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            mine = client.reserve({"core": 20, "memory": 4}, {"kind": "pid", "id": str(owner.pid)})
            keep = client.reserve(
                {"core": 20, "memory": 4}, {"kind": "pid", "id": str(os.getpid())}
            )
            # a process of the slice that skips the interposer and takes 6 GiB of a 4 GiB cap
            env = {k: v for k, v in keep.env.items() if k != "LD_PRELOAD"}
            bypass = workload(env, 6)
            assert bypass.stdout is not None and bypass.stdout.readline().split() == ["ok"]
            assert bypass.wait(timeout=20) == -signal.SIGKILL
            metrics = client.metrics()
            assert f'qgpu_watchdog_kills_total{{device_uuid="{keep.device_uuid}"' in metrics
            owner.kill()
            owner.wait()
            deadline = time.monotonic() + 20
            while any(s.slice_id == mine.slice_id for s in client.slices().slices):
                assert time.monotonic() < deadline, "the dead owner's slice was not released"
                time.sleep(0.1)
            assert [s.slice_id for s in client.slices().slices] == [keep.slice_id]
    finally:
        owner.kill()
        if bypass is not None:
            bypass.kill()
        stop_agent(proc)


def test_sigterm_shuts_down_cleanly(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    with AgentClient(state_dir / "agent.sock") as client:
        sid = client.reserve({"core": 10, "memory": 4}).slice_id
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert not (state_dir / "agent.sock").exists()
    assert (state_dir / "slices" / sid / "limits.conf").exists()  # slices outlive the agent


_SPINNER = """
import time
from enforcement.simcuda import open_driver
d = open_driver()
print("ready", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    d.launch_busy(2_000_000)
    d.ctx_synchronize()
"""


def test_core_used_comes_from_the_interposer_busy_time(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    spinner: subprocess.Popen | None = None
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            res = client.reserve({"core": 30, "memory": 4, "isolation": "fs"})
            spinner = subprocess.Popen(
                [sys.executable, "-u", "-c", _SPINNER],
                env={**os.environ, **res.env, "PYTHONPATH": str(REPO)},
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            assert spinner.stdout is not None and spinner.stdout.readline().strip() == "ready"
            seen = []
            for _ in range(4):
                seen.append(client.slices().slices[0].usage.core_used_percent)
                time.sleep(1.1)
            rates = [r for r in seen if r is not None]
            assert seen[0] is None and rates  # a rate needs two samples
            assert 15 < rates[-1] < 45, seen  # a 30% fixed share, measured from busy time
            assert "qgpu_slice_core_used_percent{" in client.metrics()
    finally:
        if spinner is not None:
            spinner.kill()
        stop_agent(proc)


def slice_counter(metrics_text: str, name: str, slice_id: str) -> float | None:
    """The value of a per-slice counter sample in /metrics text, None when absent."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("slice") == slice_id:
                return sample.value
    return None


def test_oom_refusals_come_from_the_interposer_ledger(state_dir: Path) -> None:
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    running: subprocess.Popen | None = None
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            res = client.reserve({"core": 20, "memory": 4, "isolation": "be"})
            # the context (640 MiB on the simulated H100), 3 GiB, 2 GiB refused, then 0.25 GiB
            running = workload(res.env, 3, 2, 0.25)
            assert running.stdout is not None
            assert running.stdout.readline().split() == ["ok", "oom", "ok"]
            assert running.stdin is not None
            running.stdin.write("0.5 8\n")  # the cap is full: two more refusals
            running.stdin.flush()
            assert running.stdout.readline().split() == ["oom", "oom"]
            usage = client.slices().slices[0].usage
            assert usage.source == "interposer"
            assert usage.oom_refusals == 3
            assert usage.throttled_seconds == 0.0  # best-effort: never held back
            text = client.metrics()
            assert slice_counter(text, "qgpu_slice_oom_refusals_total", res.slice_id) == 3
            assert slice_counter(text, "qgpu_slice_throttled_seconds_total", res.slice_id) == 0
    finally:
        if running is not None:
            running.kill()
        stop_agent(proc)


def test_throttled_seconds_come_from_the_interposer_ledger(state_dir: Path) -> None:
    """A saturating 30 % fixed-share slice is held back for a large part of each second; a
    best-effort slice running the same loop next to it is held only to what the guaranteed
    slice leaves (70 %), so it waits much less; both counters come from the ledgers."""
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    spinners: list[subprocess.Popen] = []
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            capped = client.reserve({"core": 30, "memory": 4, "isolation": "fs"})
            free = client.reserve({"core": 20, "memory": 4, "isolation": "be"})
            for res in (capped, free):
                spinner = subprocess.Popen(
                    [sys.executable, "-u", "-c", _SPINNER],
                    env={**os.environ, **res.env, "PYTHONPATH": str(REPO)},
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                )
                spinners.append(spinner)
            for spinner in spinners:
                assert spinner.stdout is not None and spinner.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            usage = {s.slice_id: s.usage for s in client.slices().slices}
            text = client.metrics()
            held = usage[capped.slice_id].throttled_seconds
            assert held is not None and held > 0.2, usage
            unheld = usage[free.slice_id].throttled_seconds
            assert unheld is not None and unheld < held / 2, usage
            assert usage[capped.slice_id].oom_refusals == 0
            counted = slice_counter(text, "qgpu_slice_throttled_seconds_total", capped.slice_id)
            assert counted is not None and counted >= held
            counted = slice_counter(text, "qgpu_slice_throttled_seconds_total", free.slice_id)
            assert counted is not None and counted >= unheld
    finally:
        for spinner in spinners:
            spinner.kill()
        stop_agent(proc)
