"""Hostile input against the agent as a real process (uvicorn on its unix socket, the
guarded httptools protocol): lone surrogates, huge integers, wrong types, 10 MB bodies, deep
nesting, non-UTF-8, path tricks in slice ids, half-sent requests. The rule: never a
response >= 500, every refusal an `ErrorBody` naming the field, every answer small."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcement.agent.client import AgentClient
from tests.agent.conftest import REPO, start_agent, stop_agent

pytestmark = pytest.mark.slow
OK_REQUEST = {"core": 10, "memory": 4}


@pytest.fixture(scope="module")
def agent_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="qh", dir="/tmp"))
    proc = start_agent(path, "--sim", "1xH100-80GB", "--head-timeout", "0.5", "--body-timeout", "1")
    yield path
    stop_agent(proc)
    shutil.rmtree(path, ignore_errors=True)


def raw(
    sock_path: Path, method: str, path: str, body: bytes = b"", *, send_all: bool = True
) -> tuple[int, dict[str, Any], bytes]:
    """One HTTP/1.1 request written by hand (so nothing is escaped or refused on our side)."""
    head = (
        f"{method} {path} HTTP/1.1\r\nhost: agent\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(sock_path))
        s.sendall(head)
        if send_all:
            # refused before the whole body went out: the answer is still there
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(body)
        else:
            s.sendall(body[: 1 << 16])
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    status = int(status_line.split()[1])
    _, _, payload = rest.partition(b"\r\n\r\n")
    parsed = json.loads(payload) if payload else {}
    return status, parsed, payload


def post(agent_dir: Path, body: bytes | dict[str, Any], path: str = "/v1/slices") -> tuple:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return raw(agent_dir / "agent.sock", "POST", path, data)


def refused(answer: tuple, status: int, field: str | None = None) -> dict[str, Any]:
    code, body, payload = answer
    assert code == status, (code, payload[:500])
    assert body["error"] and body["rule"] and "value" in body, body
    if field is not None:
        assert body["field"] == field, body
    assert len(payload) < 8192  # every echoed value is truncated
    payload.decode("utf-8")  # and valid UTF-8
    return body


SURROGATE = b'"\\ud800"'


@pytest.mark.parametrize(
    ("template", "field"),
    [
        (b'{"request": {"core": 10, "memory": 4, "model": %s}}', "request.model"),
        (b'{"request": {"core": 10, "memory": 4}, "owner": {"id": %s}}', "owner.id"),
        (b'{"request": {"core": 10, "memory": 4}, "owner": {"meta": {"k": %s}}}', "owner.meta.k"),
        (b'{"request": {"core": 10, "memory": 4}, "slice_id": %s}', "slice_id"),
        (b'{"request": {"core": 10, "memory": 4, "isolation": %s}}', "request.isolation"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(
    agent_dir: Path, template: bytes, field: str
) -> None:
    body = refused(post(agent_dir, template % SURROGATE), 422, field)
    assert "surrogate" in body["rule"]


def test_a_surrogate_in_a_key_is_refused_too(agent_dir: Path) -> None:
    body = b'{"request": {"core": 10, "memory": 4}, "owner": {"meta": {"\\udc00": "x"}}}'
    answer = refused(post(agent_dir, body), 422)
    assert answer["field"].startswith("owner.meta.") and "(a key)" in answer["field"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"core": 10**30, "memory": 4}, "qgpu-core"),
        ({"core": "1" + "0" * 4000, "memory": 4}, "qgpu-core"),
        ({"core": 10, "memory": 10**30}, "qgpu-memory"),
        ({"core": 10, "memory": "9" * 5000 + "Gi"}, "qgpu-memory"),
        ({"core": 1e308, "memory": 4}, "qgpu-core"),
        ({"core": 300, "memory": 4, "cpu_milli": 10**30}, "request.cpu_milli"),
    ],
)
def test_huge_numbers_are_invalid_not_a_retryable_no_fit(
    agent_dir: Path, request_: dict[str, Any], field: str
) -> None:
    refused(post(agent_dir, {"request": request_}), 422, field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"request": OK_REQUEST, "uid": 2**64}, "uid"),
        ({"request": OK_REQUEST, "expires_s": 1e308}, "expires_s"),
        ({"request": OK_REQUEST, "expires_s": -1}, "expires_s"),
        ({"request": "x"}, "request"),
        ({"request": OK_REQUEST, "owner": []}, "owner"),
        ({"request": OK_REQUEST, "owner": {"meta": {"a": 1}}}, "owner.meta.a"),
        ({"request": OK_REQUEST, "owner": {"meta": {"a": "x" * 5000}}}, "owner.meta.a"),
        ({"request": OK_REQUEST, "slice_id": 5}, "slice_id"),
        ([1, 2, 3], None),
        ("just a string", None),
        (None, None),
    ],
)
def test_wrong_types_are_invalid(agent_dir: Path, body: Any, field: str | None) -> None:
    refused(post(agent_dir, body), 422, field)


@pytest.mark.parametrize("sid", [".", "..", ".x", "-x", "_x", "a/b", "a" * 65, "x\n", ""])
def test_slice_ids_that_would_be_paths_are_refused(agent_dir: Path, sid: str) -> None:
    refused(post(agent_dir, {"request": OK_REQUEST, "slice_id": sid}), 422, "slice_id")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/slices/..",
        "/v1/slices/.x",
        "/v1/slices/%2e%2e",
        "/v1/slices/..%2f..%2fetc",
        "/v1/slices/a%00b",
        "/v1/slices/%ff%fe",
        "/v1/slices/" + "a" * 5000,
    ],
)
def test_path_tricks_never_reach_a_file(agent_dir: Path, path: str) -> None:
    for method in ("GET", "DELETE", "POST"):
        target = path + ("/release" if method == "POST" else "")
        code, body, payload = raw(agent_dir / "agent.sock", method, target)
        assert code in (404, 422), (method, target, code, payload[:300])
        assert body["field"]


def test_ten_megabytes_are_refused_before_they_are_read(agent_dir: Path) -> None:
    body = b'{"request": {"core": 10, "memory": 4}, "owner": {"id": "' + b"x" * (10 << 20) + b'"}}'
    started = time.monotonic()
    answer = refused(post(agent_dir, body), 413, "body")
    assert answer["error"] == "too-large"
    assert time.monotonic() - started < 10


def test_deep_nesting_and_bad_encodings_are_invalid_json(agent_dir: Path) -> None:
    deep = b'{"request": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # under the size limit
    assert "nest" in refused(post(agent_dir, deep), 422, "body")["rule"]
    medium = b'{"request": {"core": 10, "memory": 4}, "owner": {"meta": ' + b'{"a": ' * 40
    medium += b"1" + b"}" * 40 + b"}}"
    assert "nest" in refused(post(agent_dir, medium), 422)["rule"]
    latin1 = '{"request": {"core": 10, "memory": 4}, "owner": {"id": "é"}}'.encode("latin-1")
    assert "UTF-8" in refused(post(agent_dir, latin1), 422, "body")["rule"]
    assert "JSON" in refused(post(agent_dir, b'{"request": '), 422, "body")["rule"]
    assert "JSON" in refused(post(agent_dir, b"\xff\xfe{}"), 422, "body")["rule"]


def test_a_half_sent_request_is_cut_off(agent_dir: Path) -> None:
    """A client that sends part of a request head (or body) loses its connection at the
    deadline instead of holding it for ever."""
    for partial in (b"POST /v1/slices HTTP/1.1\r\nhost: a\r\n", b""):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(agent_dir / "agent.sock"))
            if partial:
                s.sendall(partial)
            started = time.monotonic()
            assert s.recv(100) == b""  # closed by the agent
            assert time.monotonic() - started < 5
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent_dir / "agent.sock"))
        s.sendall(b"POST /v1/slices HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n{")
        started = time.monotonic()
        assert s.recv(100) == b""  # the body did not come in time
        assert time.monotonic() - started < 5
    with AgentClient(agent_dir / "agent.sock") as client:
        assert client.health().status in ("ok", "degraded")  # and it still serves


def _cut_off_after(s: socket.socket, trickle: bytes) -> float:
    """Send `trickle` a byte every 0.1 s until the agent closes; seconds until it did."""
    started = time.monotonic()
    for byte in trickle:
        try:
            s.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        time.sleep(0.1)
    s.settimeout(10)
    assert s.recv(100) == b""
    return time.monotonic() - started


def test_a_trickled_request_is_cut_off_at_its_deadline(agent_dir: Path) -> None:
    """Bytes that keep coming do not extend a deadline (it runs from the start of the head,
    or of the body), and a kept-alive connection's next request gets its own deadline."""
    trickle = b"x-padding: " + b"a" * 60
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(agent_dir / "agent.sock"))
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: a\r\n")
        assert _cut_off_after(s, trickle) < 3  # head deadline 0.5 s; 6 s of bytes offered
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(agent_dir / "agent.sock"))
        s.sendall(b"POST /v1/slices HTTP/1.1\r\nhost: a\r\ncontent-length: 1000\r\n\r\n")
        assert _cut_off_after(s, b" " * 60) < 4  # body deadline 1 s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent_dir / "agent.sock"))
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: a\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(4096)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += s.recv(4096)
        time.sleep(1)  # a keep-alive pause longer than the head deadline is fine
        s.sendall(b"GET /v1/health HTTP/1.1\r\n")
        assert _cut_off_after(s, trickle) < 3


def test_an_endless_head_is_refused_at_its_size_limit(agent_dir: Path) -> None:
    """A head that never ends is refused (431, connection closed) once it passes the limit,
    not buffered until its deadline."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent_dir / "agent.sock"))
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: a\r\nx-big: ")
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 64 << 20:
                s.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 1 << 20  # cut off long before 64 MiB
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["field"] == "head"


def test_the_server_never_answered_5xx(agent_dir: Path) -> None:
    """Runs last in this module: the agent counted no internal error for all of the above."""
    with AgentClient(agent_dir / "agent.sock") as client:
        text = client.metrics()
    errors = [line for line in text.splitlines() if line.startswith("qgpu_agent_errors_total{")]
    assert errors == [], errors
    answered_5xx = [line for line in text.splitlines() if "_count" in line and ',status="5' in line]
    assert answered_5xx == [], answered_5xx


def test_a_surrogate_stored_by_an_older_version_is_readable(state_dir: Path) -> None:
    """Rows written before input was sanitised (a lone surrogate in owner.meta, an id the
    rule now refuses) must not make listing or `qgpu status` fail, even after restarts."""
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    with AgentClient(state_dir / "agent.sock") as client:
        kept = client.reserve(OK_REQUEST, {"id": "job"})
    stop_agent(proc)
    db = sqlite3.connect(state_dir / "ledger.sqlite")
    db.execute(
        "UPDATE slices SET owner_meta=? WHERE slice_id=?",
        ('{"k": "\\ud800", "\\udfff": "v"}', kept.slice_id),
    )
    (gpu,) = db.execute("SELECT gpu_uuid FROM slice_gpus").fetchone()
    db.execute(
        "INSERT INTO slices VALUES ('.x', 'node-a', 10, 4, 'best-effort', 'manual', '', '{}', "
        '\'{"core": 10, "memory_gib": 4}\', 0)'
    )
    db.execute("INSERT INTO slice_gpus VALUES ('.x', ?, 10, 4)", (gpu,))
    db.commit()
    db.close()
    proc = start_agent(state_dir, "--sim", "1xH100-80GB")
    try:
        with AgentClient(state_dir / "agent.sock") as client:
            listed = {s.slice_id: s for s in client.slices().slices}
            assert list(listed) == [kept.slice_id]  # '.x' was released at start
            assert "\ufffd" in listed[kept.slice_id].owner.meta["k"]
        status = subprocess.run(
            [sys.executable, "-m", "qgpu.cli", "status", "--state-dir", str(state_dir), "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert [s["slice_id"] for s in json.loads(status.stdout)["slices"]["slices"]] == [
            kept.slice_id
        ]
    finally:
        stop_agent(proc)
