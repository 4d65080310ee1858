"""Reservations that survive lost answers and vanished holders, against the agent as a real
process on its unix socket: the client retries with the slice id it chose, so an answer
lost on the way back (the agent committed the slice) gives one slice, not two; a lease
that its holder does not renew returns the slice by itself."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.agent.client import AgentClient, AgentError
from tests.agent.conftest import start_agent, stop_agent

OK_REQUEST = {"core": 10, "memory": 4}


@pytest.fixture(scope="module")
def agent_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ql", dir="/tmp"))
    proc = start_agent(path, "--sim", "1xH100-80GB")
    yield path
    stop_agent(proc)
    shutil.rmtree(path, ignore_errors=True)


def _read_message(conn: socket.socket, buf: bytes) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message with a Content-Length body (all the agent and httpx send
    here), and what followed it; None when the peer closed first."""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


class LossyProxy:
    """A unix socket in front of the agent that forwards every request and drops the
    answers to the first `drop` reservations (it closes the client's connection instead):
    the agent did the work, its client never heard."""

    def __init__(self, upstream: Path, drop: int) -> None:
        self.upstream, self.drop = upstream, drop
        self.dir = Path(tempfile.mkdtemp(prefix="qp", dir="/tmp"))
        self.path = self.dir / "proxy.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(8)
        self.forwarded = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
            up.connect(str(self.upstream))
            pending = b""
            while True:
                got = _read_message(client, pending)
                if got is None:
                    return
                request, pending = got
                up.sendall(request)
                answer = _read_message(up, b"")
                if answer is None:
                    return
                self.forwarded += 1
                if request.startswith(b"POST /v1/slices ") and self.drop > 0:
                    self.drop -= 1
                    return  # the answer is lost: the connection closes without it
                client.sendall(answer[0])

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def held_by(client: AgentClient, owner_id: str) -> list[str]:
    return [s.slice_id for s in client.slices().slices if s.owner.id == owner_id]


def test_a_lost_answer_gives_one_slice_not_two(agent_dir: Path) -> None:
    proxy = LossyProxy(agent_dir / "agent.sock", drop=2)
    try:
        with AgentClient(proxy.path) as client:
            res = client.reserve(OK_REQUEST, {"id": "lossy"})
        assert proxy.drop == 0 and proxy.forwarded == 3  # two answers lost, the third came
        with AgentClient(agent_dir / "agent.sock") as direct:
            assert held_by(direct, "lossy") == [res.slice_id]
            direct.release(res.slice_id)
    finally:
        proxy.close()


def test_a_repeat_with_the_same_id_is_the_same_slice(agent_dir: Path) -> None:
    with AgentClient(agent_dir / "agent.sock") as client:
        first = client.reserve(OK_REQUEST, {"id": "again"}, slice_id="job-1")
        second = client.reserve(OK_REQUEST, {"id": "again"}, slice_id="job-1")
        assert (second.slice_id, second.device_uuid, second.created_at) == (
            first.slice_id,
            first.device_uuid,
            first.created_at,
        )
        assert held_by(client, "again") == ["job-1"]
        with pytest.raises(AgentError) as info:  # another owner cannot take over the id
            client.reserve(OK_REQUEST, {"id": "thief"}, slice_id="job-1")
        assert info.value.status == 422 and info.value.field == "slice_id"
        assert held_by(client, "thief") == []
        client.release("job-1")


def test_a_restarted_process_of_the_owner_takes_its_slice_over(agent_dir: Path) -> None:
    """Same owner kind and id, another process (a worker restarted under its name): the
    slice is handed over once the first process is gone, never while it runs."""
    import subprocess
    import sys

    def sleeper() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def owner(proc: subprocess.Popen[bytes]) -> dict[str, object]:
        return {"kind": "dask-worker", "id": "w0", "meta": {"pid": str(proc.pid)}}

    first, second = sleeper(), sleeper()
    try:
        with AgentClient(agent_dir / "agent.sock") as client:
            held = client.reserve(OK_REQUEST, owner(first), slice_id="worker-w0")
            with pytest.raises(AgentError) as info:
                client.reserve(OK_REQUEST, owner(second), slice_id="worker-w0")
            assert info.value.status == 422 and info.value.field == "slice_id"
            assert f"process {first.pid}, which is still running" in info.value.rule
            assert client.get("worker-w0").owner.meta["pid"] == str(first.pid)

            first.kill()
            first.wait()
            taken = client.reserve(OK_REQUEST, owner(second), slice_id="worker-w0")
            assert (taken.device_uuid, taken.created_at) == (held.device_uuid, held.created_at)
            assert taken.owner.meta["pid"] == str(second.pid)
            assert client.get("worker-w0").owner == taken.owner  # recorded: reconcile follows it
            assert [s.slice_id for s in client.slices().slices] == ["worker-w0"]
            client.release("worker-w0")
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_a_lease_not_renewed_returns_the_slice(agent_dir: Path) -> None:
    with AgentClient(agent_dir / "agent.sock") as client:
        gone = client.reserve(OK_REQUEST, {"id": "lease"}, expires_s=1)
        renewed = client.reserve(OK_REQUEST, {"id": "lease"}, expires_s=1)
        kept = client.reserve(OK_REQUEST, {"id": "lease"}, expires_s=1)
        assert gone.expires_at is not None
        assert client.renew(renewed.slice_id, 120).expires_at > time.time() + 60
        assert client.renew(kept.slice_id, None).expires_at is None
        deadline = time.monotonic() + 15
        while gone.slice_id in held_by(client, "lease") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(held_by(client, "lease")) == sorted([renewed.slice_id, kept.slice_id])
        with pytest.raises(AgentError) as info:  # its holder learns it is gone
            client.renew(gone.slice_id, 60)
        assert info.value.status == 404
        for sid in (renewed.slice_id, kept.slice_id):
            client.release(sid)
    assert not (agent_dir / "slices" / gone.slice_id / "limits.conf").exists()  # nor its caps
