"""The agent as a real process on a state directory that is really read-only.

The read-only file system is a read-only bind mount in a private mount namespace:
``unshare --user --map-root-user --mount`` (an unprivileged user and mount namespace; as
root a mount namespace alone would do, the same command works for both), so nothing is
mounted outside the test, nothing needs root, and the mount ends with the namespace. The
agent runs inside the namespace; the test talks to its socket and reads its state from
outside, where the directory is the ordinary, writable one.

- At start-up the state directory is mounted read-only before the agent starts.
- While it runs, a read-only bind mount is put *over* the state directory and later
  unmounted. Linux refuses to remount read-only a mount with files open for writing
  (``EBUSY``: the agent's SQLite database is), so this is how a directory turns read-only
  under a running program without root: every path operation (mkdir, create, rename,
  unlink, statvfs) sees the read-only file system, while SQLite's descriptors opened before
  keep writing. A fully read-only disk, the ledger included, is covered in-process by
  tests/agent/test_storage_rollback.py.

Where user namespaces are not allowed (``kernel.unprivileged_userns_clone=0``, AppArmor's
``apparmor_restrict_unprivileged_userns``) these tests are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import httpx
import pytest

from enforcement.agent.client import AgentClient, AgentError, AgentUnavailable
from enforcement.limits import read_limits_file
from tests.agent.conftest import (
    REPO,
    agent_command,
    short_tmp,
    start_agent,
    stop_agent,
)
from tests.agent.conftest import rows_and_dirs as _state

SIM = ("--sim", "2xH100-80GB")
NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]
# inside the namespace: make $1 a read-only bind mount of itself (over what is there)
RO_BIND = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"'


@cache
def _namespace_problem() -> str | None:
    """Why a read-only bind mount in a private namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "util-linux's unshare and mount are not installed"
    probe = short_tmp()
    try:
        script = RO_BIND + ' && ! touch "$1/x" 2>/dev/null'
        out = subprocess.run(
            [*NAMESPACE, "sh", "-c", script, "probe", str(probe)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if out.returncode != 0:
        return (
            "an unprivileged user+mount namespace with a read-only bind mount is not allowed "
            f"here ({' '.join(NAMESPACE)} sh -c '{RO_BIND}' exited {out.returncode}: "
            f"{out.stderr.strip()[:300]})"
        )
    return None


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    problem = _namespace_problem()
    if problem is not None:  # these machines (and CI's) allow them: a missing one is a defect
        pytest.fail(f"{problem}; this test needs unprivileged user namespaces (util-linux unshare)")


@pytest.mark.slow
def test_start_on_a_read_only_state_dir_exits_2_with_one_line(state_dir: Path) -> None:
    cmd = agent_command(state_dir, *SIM)
    out = subprocess.run(
        [*NAMESPACE, "sh", "-c", RO_BIND + ' && shift && exec "$@"', "ns", str(state_dir), *cmd],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "--state-dir" in lines[0] and str(state_dir) in lines[0], lines[0]
    assert "Read-only file system" in lines[0], lines[0]
    assert "Traceback" not in out.stderr and not out.stdout
    assert list(state_dir.iterdir()) == []  # it wrote nothing (outside, the dir is writable)


class Namespace:
    """A shell in a private user+mount namespace that runs the agent and, on request,
    puts a read-only bind mount over its state directory or takes it away."""

    SCRIPT = r"""
state=$1; shift
"$@" >>"$state.log" 2>&1 &
agent=$!
echo "agent $agent"
while read -r cmd; do
    case $cmd in
        ro) mount --bind "$state" "$state" && mount -o remount,bind,ro "$state"; echo "ro $?" ;;
        rw) umount "$state"; echo "rw $?" ;;
        stop) break ;;
    esac
done
kill -TERM $agent 2>/dev/null
wait $agent
echo "exit $?"
"""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        agent = agent_command(state_dir, *SIM)
        self.proc = subprocess.Popen(
            [*NAMESPACE, "sh", "-c", self.SCRIPT, "ns", str(state_dir), *agent],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            self.agent_pid = int(self._answer("agent"))
            self._wait_until_serving()
        except BaseException:
            if hasattr(self, "agent_pid"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.agent_pid, signal.SIGKILL)
            self.proc.kill()  # the shell; its namespace and mounts end with it
            self.proc.wait()
            raise

    def _answer(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, (line, self.log())
        return line[1]

    def log(self) -> str:
        path = Path(f"{self.state_dir}.log")
        return path.read_text()[-3000:] if path.exists() else ""

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with AgentClient(self.state_dir / "agent.sock", timeout=2) as client:
                    client.health()
                return
            except AgentUnavailable:
                time.sleep(0.05)
        raise RuntimeError(f"the agent did not come up: {self.log()}")

    def command(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert self._answer(cmd) == "0", self.log()

    def stop(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
            code = int(self._answer("exit"))
            self.proc.wait(timeout=30)
            return code
        return -1


@pytest.fixture
def namespace(state_dir: Path) -> Iterator[Namespace]:
    ns = Namespace(state_dir)
    yield ns
    if ns.proc.poll() is None:
        ns.stop()
    Path(f"{state_dir}.log").unlink(missing_ok=True)


@pytest.mark.slow
def test_state_dir_turning_read_only_answers_503_and_loses_nothing(
    namespace: Namespace, state_dir: Path
) -> None:
    sock = state_dir / "agent.sock"
    with AgentClient(sock) as client:
        kept = client.reserve({"core": 30, "memory": 8}, slice_id="kept-1")
        other = client.reserve({"core": 20, "memory": 4}, slice_id="kept-2")
        assert kept.limits_file is not None and other.limits_file is not None
        limits_before = read_limits_file(Path(kept.limits_file))

        namespace.command("ro")
        with pytest.raises(AgentError) as refused:
            client.reserve({"core": 20, "memory": 4}, slice_id="new-1")
        err = refused.value
        assert err.status == 503, err
        assert err.field == "state_dir" and err.value == str(state_dir)
        assert "read-only file system" in err.rule and "nothing was recorded" in err.rule
        with pytest.raises(AgentError) as not_released:
            client.release("kept-1")
        assert not_released.value.status == 503
        assert "read-only file system" in not_released.value.rule

        raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://a")
        with raw:
            health = raw.get("/v1/health")
            assert health.status_code == 503, health.text
            assert health.json()["status"] == "failing"
            assert any("read-only file system" in p for p in health.json()["problems"])
            # reads still work and show exactly the slices that were acknowledged
            assert {s.slice_id for s in client.slices().slices} == {"kept-1", "kept-2"}

            namespace.command("rw")  # the file system is writable again
            assert raw.get("/v1/health").status_code == 200
        assert {s.slice_id for s in client.slices().slices} == {"kept-1", "kept-2"}
        assert client.release("kept-2").released
    assert namespace.stop() == 0  # no crash: it stopped on SIGTERM

    # the refused writes left nothing behind: no row, no directory, no half-made file
    rows, dirs = _state(state_dir)
    assert rows == dirs == {"kept-1"}
    assert sorted(p.name for p in Path(kept.slice_dir or "").iterdir()) == [
        "ledger",
        "limits.conf",
    ]
    assert read_limits_file(Path(kept.limits_file)) == limits_before

    again = start_agent(state_dir, *SIM)
    try:
        with AgentClient(sock) as client:
            assert client.get("kept-1").model_dump() == kept.model_dump()
            assert client.reserve({"core": 20, "memory": 4}, slice_id="new-1").slice_id == "new-1"
            assert client.release("kept-1").released
        assert _state(state_dir) == ({"new-1"}, {"new-1"})
    finally:
        stop_agent(again)


if __name__ == "__main__":  # python -m tests.agent.test_readonly_state: can it run here?
    print(_namespace_problem() or "read-only bind mounts in a user namespace work here")
    sys.exit(0)
