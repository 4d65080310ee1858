"""The per-bind apiserver transports: the lean one and the library one (the official client's
own urllib3 pool) give the same answers and errors, the configuration's token on every call,
and the library one takes what the lean one does not cover."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from k8s_bridge.apiserver_http import ApiserverHTTP
from k8s_bridge.kube import Conflict, Kube, KubeError
from k8s_bridge.lean_http import Connection, LeanTransport
from tests.fakes.apiserver import FakeApiserver
from tests.k8s.helpers import NAMES, pod_object, publish_node


def _kube(srv: FakeApiserver, lean: bool) -> Kube:
    kube = Kube(srv.client(), NAMES, transport="lean" if lean else "library")
    assert isinstance(kube.http, LeanTransport if lean else ApiserverHTTP)
    return kube


def test_lean_and_official_client_answer_alike(apiserver: FakeApiserver) -> None:
    publish_node(apiserver, "n0", [])
    for i, lean in enumerate((True, False)):
        kube = _kube(apiserver, lean)
        apiserver.store.create("pods", pod_object(f"p{i}", [(10, 1)]))
        pod = kube.get_pod("default", f"p{i}")
        assert pod["metadata"]["name"] == f"p{i}"
        node = kube.patch_node("n0", {"metadata": {"labels": {"seen": str(i)}}})
        assert node["metadata"]["labels"]["seen"] == str(i)
        # a stale resourceVersion is a Conflict, a missing object a KubeError with its status
        with pytest.raises(Conflict) as conflict:
            kube.patch_node("n0", {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})
        assert conflict.value.status == 409
        with pytest.raises(KubeError) as missing:
            kube.get_pod("default", "nope")
        assert missing.value.status == 404 and "get pod default/nope: HTTP 404" in str(
            missing.value
        )
        kube.bind("default", f"p{i}", pod["metadata"]["uid"], "n0", annotations={"a": "b"})
        bound = apiserver.store.get("pods", "default", f"p{i}")
        assert bound["spec"]["nodeName"] == "n0" and bound["metadata"]["annotations"]["a"] == "b"
        with pytest.raises(Conflict):  # bound already
            kube.bind("default", f"p{i}", pod["metadata"]["uid"], "n0")


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        type(self).seen.append(dict(self.headers))
        body = b'{"metadata": {"name": "p"}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[ThreadingHTTPServer]:
    _Recorder.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("transport", ["lean", "library"])
def test_the_configurations_token_goes_with_every_call_and_refreshes(
    recorder: ThreadingHTTPServer, transport: str
) -> None:
    _Recorder.seen.clear()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{recorder.server_address[1]}"
    cfg.api_key = {"authorization": "first"}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    kube = Kube(client.ApiClient(cfg), NAMES, transport=transport)
    kube.get_pod("default", "p")
    cfg.api_key["authorization"] = "second"  # what an in-cluster token refresh does
    kube.get_pod("default", "p")
    assert [h.get("authorization") for h in _Recorder.seen] == ["Bearer first", "Bearer second"]


def test_a_closed_keep_alive_connection_is_replaced_before_use(
    apiserver: FakeApiserver,
) -> None:
    kube = _kube(apiserver, lean=True)
    publish_node(apiserver, "n0", [])
    kube.patch_node("n0", {"metadata": {"labels": {"a": "1"}}})
    assert isinstance(kube.http, LeanTransport)
    conn = kube.http._local.conn
    conn.sock.shutdown(2)  # the connection dies while idle (server restart, idle timeout)
    assert kube.patch_node("n0", {"metadata": {"labels": {"a": "2"}}})["metadata"]["labels"] == {
        "a": "2"
    }
    assert kube.http._local.conn is not conn


@pytest.mark.parametrize(
    "setting",
    [
        {"proxy": "http://proxy:3128"},
        {"username": "admin", "password": "x"},
        {"tls_server_name": "kubernetes"},
        {"assert_hostname": "kubernetes"},
        {"host": "unix:///run/k8s.sock"},
    ],
)
def test_configurations_it_does_not_cover_go_over_the_library(setting: dict) -> None:
    cfg = client.Configuration()
    cfg.host = "https://10.96.0.1:443"
    for key, value in setting.items():
        setattr(cfg, key, value)
    assert LeanTransport.for_configuration(cfg) is None
    assert isinstance(Kube(client.ApiClient(cfg), NAMES).http, ApiserverHTTP)


def test_https_with_verification_off_is_covered() -> None:
    cfg = client.Configuration()
    cfg.host = "https://10.96.0.1"
    cfg.verify_ssl = False
    lean = LeanTransport.for_configuration(cfg)
    assert lean is not None and lean.https and lean.port == 443
    assert lean.context is not None and not lean.context.check_hostname


class ScriptedSocket:
    """A socket whose peer answers with the given chunks, then closes."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))

    def recv(self, n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def close(self) -> None:
        pass


def _conn(*chunks: bytes) -> tuple[Connection, ScriptedSocket]:
    sock = ScriptedSocket(*chunks)
    return Connection(sock, "10.0.0.1:6443"), sock  # type: ignore[arg-type]


def test_a_request_leaves_in_one_write_with_its_length() -> None:
    conn, sock = _conn(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
    status, body, keep = conn.request(
        "POST", "/api/v1/x", {"Content-Type": "application/json"}, b'{"a":1}'
    )
    assert (status, body, keep) == (201, b"{}", True)
    assert sock.sent == [
        b"POST /api/v1/x HTTP/1.1\r\nHost: 10.0.0.1:6443\r\nContent-Type: application/json\r\n"
        b'Content-Length: 7\r\n\r\n{"a":1}'
    ]


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        # a reply split anywhere, Content-Length
        ((b"HTTP/1.1 200 OK\r\nConte", b"nt-Length: 5\r\n\r\nhel", b"lo"), (200, b"hello", True)),
        # chunked, with an extension and a trailer
        (
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nhel\r\n",
                b"2\r\nlo\r\n0\r\nX-Trailer: 1\r\n\r\n",
            ),
            (200, b"hello", True),
        ),
        # an informational answer first; the server closes after this one
        (
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 409 Conflict\r\nConnection: close\r\n"
                b"Content-Length: 2\r\n\r\n{}",
            ),
            (409, b"{}", False),
        ),
        # no length at all: the body runs to the close
        ((b"HTTP/1.1 200 OK\r\n\r\nall of", b" it"), (200, b"all of it", False)),
        # HTTP/1.0 closes unless it says keep-alive
        ((b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",), (200, b"", False)),
        (
            (b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n",),
            (200, b"", True),
        ),
        ((b"HTTP/1.1 204 No Content\r\n\r\n",), (204, b"", True)),
    ],
)
def test_replies_are_read_as_http_1_1_says(chunks: tuple[bytes, ...], expected: tuple) -> None:
    conn, _ = _conn(*chunks)
    assert conn.request("GET", "/x", {}, None) == expected


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        ((), http.client.RemoteDisconnected),
        ((b"HTTP/1.1 200 OK\r\nContent-Le",), http.client.IncompleteRead),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",), http.client.IncompleteRead),
        ((b"SSH-2.0-OpenSSH\r\n\r\n",), http.client.BadStatusLine),
        ((b"HTTP/1.1 abc OK\r\n\r\n",), http.client.BadStatusLine),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",), http.client.HTTPException),
        (
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",),
            http.client.HTTPException,
        ),
        ((b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n",), http.client.HTTPException),
    ],
)
def test_a_broken_or_missing_reply_is_an_http_error(chunks: tuple, error: type) -> None:
    conn, _ = _conn(*chunks)
    with pytest.raises(error):
        conn.request("GET", "/x", {}, None)


def test_a_header_value_with_a_line_break_is_refused_before_sending() -> None:
    conn, sock = _conn()
    with pytest.raises(ValueError, match="invalid HTTP header"):
        conn.request("GET", "/x", {"Authorization": "Bearer a\r\nX-Evil: 1"}, None)
    assert sock.sent == []


def test_the_host_header_names_a_non_default_port(recorder: ThreadingHTTPServer) -> None:
    port = recorder.server_address[1]
    conn = Connection.open("127.0.0.1", port, 5.0, None)
    try:
        assert conn.host_header == f"127.0.0.1:{port}"
        assert conn.request("GET", "/p", {}, None)[0] == 200
        assert _Recorder.seen[0]["Host"] == f"127.0.0.1:{port}"
        assert not conn.dropped()
    finally:
        conn.close()
