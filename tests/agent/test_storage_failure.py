"""The agent as a real process when its state directory cannot be written.

The disk fault is made with ``RLIMIT_FSIZE`` on the agent's own process (``prlimit`` on a
running agent, ``ulimit -f`` before one starts): every write of a file then fails with
``EFBIG``, for SQLite (its WAL and database) and for the slice files alike, which is what a
full disk does to a writer, and it works as root too (where ``chmod`` stops nothing) without
mounting anything. CPython ignores ``SIGXFSZ``, so the writes fail instead of killing it.
"""

from __future__ import annotations

import errno
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from enforcement.agent.client import AgentClient, AgentError
from enforcement.agent.service import Agent
from enforcement.limits import read_limits_file
from tests.agent.conftest import REPO, agent_command, slice_dirs, start_agent, stop_agent
from tests.agent.conftest import rows_and_dirs as _state

pytestmark = pytest.mark.slow
SIM = ("--sim", "2xH100-80GB")


def _set_fsize(pid: int, soft: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture
def agent_proc(state_dir: Path) -> Iterator[subprocess.Popen]:
    proc = start_agent(state_dir, *SIM)
    yield proc
    stop_agent(proc)


def test_full_disk_answers_503_keeps_slices_and_leaves_no_partial_slice(
    agent_proc: subprocess.Popen, state_dir: Path
) -> None:
    sock = state_dir / "agent.sock"
    with AgentClient(sock) as client:
        kept = client.reserve({"core": 30, "memory": 8}, slice_id="kept-1")
        assert kept.limits_file is not None
        limits_before = read_limits_file(Path(kept.limits_file))

        _set_fsize(agent_proc.pid, 0)  # from now on every file write of the agent fails
        with pytest.raises(AgentError) as refused:
            client.reserve({"core": 20, "memory": 4}, slice_id="new-1")
        err = refused.value
        assert err.status == 503, err
        assert err.field == "state_dir" and err.value == str(state_dir)
        assert "state directory" in err.rule and "nothing was recorded" in err.rule
        with pytest.raises(AgentError) as not_released:
            client.release("kept-1")
        assert not_released.value.status == 503

        raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://a")
        with raw:
            health = raw.get("/v1/health")
            assert health.status_code == 503
            assert health.json()["status"] == "failing"
            assert any("state directory" in p for p in health.json()["problems"])
            # reads still work and show exactly the slices that were committed
            assert [s.slice_id for s in client.slices().slices] == ["kept-1"]

            _set_fsize(agent_proc.pid, resource.RLIM_INFINITY)  # the disk has room again
            assert raw.get("/v1/health").status_code == 200
        assert [s.slice_id for s in client.slices().slices] == ["kept-1"]
    assert agent_proc.poll() is None  # no crash

    # the refused slice left nothing behind: no SQLite row, no directory, no limits file
    stop_agent(agent_proc)
    rows, dirs = _state(state_dir)
    assert rows == {"kept-1"} and dirs == {"kept-1"}
    assert read_limits_file(Path(kept.limits_file)) == limits_before

    again = start_agent(state_dir, *SIM)
    try:
        with AgentClient(sock) as client:
            assert [s.slice_id for s in client.slices().slices] == ["kept-1"]
            assert client.get("kept-1").model_dump() == kept.model_dump()
            retried = client.reserve({"core": 20, "memory": 4}, slice_id="new-1")
            assert retried.slice_id == "new-1"
            assert client.release("kept-1").released
        rows, dirs = _state(state_dir)
        assert rows == {"new-1"} and dirs == {"new-1"}
    finally:
        stop_agent(again)


def _start_once(state_dir: Path, fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))

    return subprocess.run(
        agent_command(state_dir, *SIM),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        preexec_fn=limit,
    )


def test_start_on_a_full_state_dir_exits_2_with_one_line(state_dir: Path) -> None:
    out = _start_once(state_dir, fsize=0)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "--state-dir" in lines[0] and str(state_dir) in lines[0]
    assert "free space (File too large)" in lines[0], lines[0]
    assert "Traceback" not in out.stderr and not out.stdout


def test_start_on_a_state_dir_that_is_a_file_exits_2_with_one_line(state_dir: Path) -> None:
    not_a_dir = state_dir / "plain-file"
    not_a_dir.write_text("x")
    out = _start_once(not_a_dir)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "--state-dir" in lines[0] and str(not_a_dir) in lines[0]
    assert "must be a writable directory" in lines[0], lines[0]
    assert "Traceback" not in out.stderr


# -- the commit worked, the slice's files did not (the disk filled in between) -----------


def test_slice_files_failing_after_the_commit_leave_no_partial_slice(
    agent: Agent, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from enforcement.agent.app import create_app
    from enforcement.limits import write_limits_file as real_write

    client = TestClient(create_app(agent), raise_server_exceptions=False)
    kept = client.post("/v1/slices", json={"request": {"core": 30, "memory": 8}})
    assert kept.status_code == 201

    def write_then_fill(path: Path, limits: object, **kw: object) -> Path:
        real_write(path.with_name("probe"), limits, **kw)  # the directory was made
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("enforcement.state_tree.write_limits_file", write_then_fill)
    r = client.post("/v1/slices", json={"request": {"core": 20, "memory": 4}, "slice_id": "s-2"})
    assert r.status_code == 503, r.text
    assert r.json()["field"] == "state_dir" and "full" in r.json()["rule"]
    rows = {a.slice_id for a in agent.ledger.allocations("node-a")}
    dirs = slice_dirs(state_dir)
    assert rows == dirs == {kept.json()["slice_id"]}


def test_a_limits_file_is_whole_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write (a nearly full disk) is completed; a failing one leaves no file."""
    import os

    from enforcement import limits

    real = os.write
    calls: list[int] = []

    def short_then(fd: int, data: bytes, fail: bool = False) -> int:
        calls.append(len(data))
        if fail and len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bytes(data[:3]))

    values = {"QGPU_CORE_LIMIT": "30", "QGPU_MEMORY_LIMIT": str(8 << 30)}
    monkeypatch.setattr(limits.os, "write", short_then)
    whole = limits.write_limits_file(tmp_path / "a.conf", values)
    assert len(calls) > 2 and read_limits_file(whole) == values
    monkeypatch.setattr(limits.os, "write", lambda fd, d: short_then(fd, d, fail=True))
    with pytest.raises(OSError):
        limits.write_limits_file(tmp_path / "b.conf", values)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.conf"]
