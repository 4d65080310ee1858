"""The extender against hostile callers: client-certificate authentication, bind only of
its own pods as the apiserver has them, names that cannot leave their URL segment, bodies
that are refused with a 4xx (never a 500), request limits, and node locks after restarts."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_bridge.extender.app import create_app
from k8s_bridge.extender.models import ExtenderBindingArgs
from k8s_bridge.extender.service import Extender, ExtenderConfig
from k8s_bridge.http_serving import ServerLimits
from k8s_bridge.kube import GONE_CHECK_S, HolderPod, Kube, NodeLockError, current_lock
from k8s_bridge.peer_auth import ServerTLS
from tests.fakes.apiserver import FakeApiserver
from tests.fakes.certs import TestPKI
from tests.k8s.helpers import NAMES, ServedApp, gpu, pod_object, publish_node

SCHEDULER_CN = "qgpu-kube-scheduler"


@pytest.fixture
def cluster(apiserver: FakeApiserver) -> FakeApiserver:
    for n in ("n0", "n1"):
        publish_node(apiserver, n, [gpu(n, 0), gpu(n, 1)])
    return apiserver


@pytest.fixture
def ext(cluster: FakeApiserver) -> Iterator[Extender]:
    e = Extender(Kube(cluster.client(), NAMES), ExtenderConfig(watch=False))
    e.start()
    yield e
    e.stop()


def _bind_args(srv: FakeApiserver, name: str, node: str = "n0", **over: str) -> dict[str, str]:
    uid = srv.store.get("pods", "default", name)["metadata"]["uid"]
    return {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node, **over}


def _bound(srv: FakeApiserver, name: str) -> str | None:
    return srv.store.get("pods", "default", name)["spec"].get("nodeName")


# --- authentication ------------------------------------------------------------------------


def _client(pki: TestPKI, url: str, issued: Any = None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    if issued is not None:
        ctx.load_cert_chain(issued.cert, issued.key)
    return httpx.Client(base_url=url, verify=ctx, timeout=10)


@pytest.fixture
def tls_ext(pki: TestPKI, cluster: FakeApiserver, ext: Extender) -> Iterator[str]:
    server = pki.issue("extender", "qgpu-extender", ("127.0.0.1", "localhost"))
    tls = ServerTLS(
        cert=server.cert,
        key=server.key,
        client_ca=pki.ca_file,
        client_names=frozenset({SCHEDULER_CN}),
    )
    served = ServedApp(create_app(ext), tls=tls).start()
    yield served.url
    served.stop()


def test_without_the_client_certificate_nothing_is_filtered_or_bound(
    pki: TestPKI, cluster: FakeApiserver, tls_ext: str
) -> None:
    pod = cluster.store.create("pods", pod_object("p", [(30, 4)]))
    filter_body = {"Pod": pod, "NodeNames": ["n0", "n1"]}
    wrong = pki.issue("intruder", "system:anonymous", client=True)  # the right CA, wrong name
    for issued, status in ((None, 401), (wrong, 403)):
        with _client(pki, tls_ext, issued) as http:
            assert http.get("/healthz").status_code == 200  # kubelet's probes need no cert
            for path, body in (("/filter", filter_body), ("/bind", _bind_args(cluster, "p"))):
                r = http.post(path, json=body)
                assert r.status_code == status, (path, r.text)
                assert "client certificate" in r.json()["Error"]
    assert _bound(cluster, "p") is None
    with _client(pki, tls_ext, pki.issue("sched", SCHEDULER_CN, client=True)) as http:
        assert http.post("/filter", json=filter_body).json()["NodeNames"] == ["n0", "n1"]
        assert http.post("/bind", json=_bind_args(cluster, "p")).json()["Error"] == ""
    assert _bound(cluster, "p") == "n0"


def test_a_certificate_of_another_ca_fails_the_handshake(
    pki: TestPKI, tls_ext: str, tmp_path: Path
) -> None:
    other = TestPKI(tmp_path / "other")
    with (
        _client(pki, tls_ext, other.issue("sched", SCHEDULER_CN, client=True)) as http,
        pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)),  # TLS 1.2 / 1.3
    ):
        http.post("/bind", json={})


# --- what bind accepts -----------------------------------------------------------------------


def test_bind_refuses_pods_that_are_not_its_own(cluster: FakeApiserver, ext: Extender) -> None:
    cluster.store.create("pods", pod_object("other", [(30, 4)], scheduler_name=None))
    plain = pod_object("plain")
    plain["spec"]["schedulerName"] = "qgpu-scheduler"
    cluster.store.create("pods", plain)
    cluster.store.create("pods", pod_object("mine", [(30, 4)]))
    cases = {
        "other": ("other", {}, "schedulerName 'default-scheduler'"),
        "plain": ("plain", {}, "asks for no qgpu resources"),
        "uid": ("mine", {"PodUID": "not-the-uid"}, "has UID"),
    }
    for what, (name, over, reason) in cases.items():
        args = ExtenderBindingArgs(**_bind_args(cluster, name, **over))
        error = ext.bind(args).error
        assert reason in error, (what, error)
        assert _bound(cluster, name) is None, what


def test_a_forged_filter_body_does_not_make_a_pod_bindable(
    cluster: FakeApiserver, ext: Extender, serve: Any
) -> None:
    """filter/prioritize see what the caller sends; bind reads the pod from the apiserver."""
    real = cluster.store.create("pods", pod_object("victim", scheduler_name=None))
    forged = pod_object("victim", [(30, 4)])
    forged["metadata"].update(uid=real["metadata"]["uid"], resourceVersion="1")
    url = serve(create_app(ext))
    with httpx.Client(base_url=url, timeout=10) as http:
        body = {"Pod": forged, "NodeNames": ["n0"]}
        assert http.post("/filter", json=body).json()["NodeNames"] == ["n0"]
        http.post("/prioritize", json=body)
        reply = http.post("/bind", json=_bind_args(cluster, "victim")).json()
    assert "schedulerName" in reply["Error"] and _bound(cluster, "victim") is None


@pytest.mark.parametrize(
    "override",
    [
        {"PodNamespace": "../.."},
        {"PodNamespace": "kube-system/pods/x"},
        {"PodNamespace": "%2e%2e"},
        {"PodName": "../../nodes/n0"},
        {"PodName": "p?dryRun=All"},
        {"Node": "n0/status"},
        {"Node": ".."},
        {"PodNamespace": "UPPER"},
        {"PodName": "x" * 300},
    ],
)
def test_names_that_could_leave_their_url_segment_are_400(
    cluster: FakeApiserver, ext: Extender, serve: Any, override: dict[str, str]
) -> None:
    cluster.store.create("pods", pod_object("p", [(30, 4)]))
    url = serve(create_app(ext))
    before = dict(cluster.requests)
    with httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/bind", json=_bind_args(cluster, "p", **override))
    assert r.status_code == 400, r.text
    field = next(iter(override))
    assert r.json()["field"] == field and r.json()["rule"]
    assert cluster.requests == before  # nothing reached the apiserver


def test_malformed_bodies_are_4xx_with_the_field(
    cluster: FakeApiserver, ext: Extender, serve: Any
) -> None:
    pod = cluster.store.create("pods", pod_object("p", [(30, 4)]))
    huge = pod_object("huge", [(30, 2**31)])
    cluster.store.create("pods", huge)
    url = serve(create_app(ext))
    with httpx.Client(base_url=url, timeout=10) as http:
        for path in ("/filter", "/prioritize"):
            for nodes in ({"items": [{}]}, {"items": [{"metadata": {"name": 7}}]}, {"items": 3}):
                r = http.post(path, json={"Pod": pod, "Nodes": nodes})
                assert r.status_code == 400 and r.json()["field"].startswith("Nodes"), r.text
            for body in ({"Pod": "x"}, {"Pod": pod, "NodeNames": [1]}, [], "x", {}):
                r = http.post(path, json=body)
                assert r.status_code == 400 and r.json()["rule"], (path, body, r.text)
            # memory >= 2^31: a rule, not an overflow
            r = http.post(path, json={"Pod": huge, "NodeNames": ["n0"]})
            assert r.status_code == 200, r.text
        failed = http.post("/filter", json={"Pod": huge, "NodeNames": ["n0"]}).json()
        assert "at most 65536 GiB" in failed["FailedAndUnresolvableNodes"]["n0"]
        r = http.post("/bind", json=_bind_args(cluster, "huge"))
        assert r.status_code == 200 and "at most 65536 GiB" in r.json()["Error"]
        for body in ({"PodName": 5}, {"PodName": "p", "PodNamespace": "default"}, [1]):
            r = http.post("/bind", json=body)
            assert r.status_code == 400 and r.json()["field"], r.text
    assert _bound(cluster, "huge") is None


# --- request limits --------------------------------------------------------------------------

LIMITS = ServerLimits(
    header_timeout_s=0.5, body_timeout_s=0.5, max_head_bytes=4096, max_body_bytes=64 * 1024
)


@pytest.fixture
def limited(ext: Extender) -> Iterator[int]:
    served = ServedApp(create_app(ext), limits=LIMITS).start()
    yield served.port
    served.stop()


def _raw(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data`, then read until the server closes (or `wait` runs out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out + b"<still open>"
        return out


def test_half_open_requests_are_closed_after_the_header_timeout(limited: int) -> None:
    socks = [socket.create_connection(("127.0.0.1", limited)) for _ in range(50)]
    t = time.monotonic()
    for s in socks:
        s.sendall(b"POST /bind HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    answers = []
    for s in socks:
        s.settimeout(5)
        answers.append(s.recv(4096))
        s.close()
    assert time.monotonic() - t < 3
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0]


def test_a_body_that_stops_coming_is_408(limited: int) -> None:
    out = _raw(limited, b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert out.startswith(b"HTTP/1.1 408 ") and not out.endswith(b"<still open>")


def test_oversized_heads_and_bodies_are_refused(limited: int) -> None:
    head = b"POST /bind HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n"
    assert _raw(limited, head).startswith(b"HTTP/1.1 431 ")
    declared = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 10485760\r\n\r\n{"
    assert _raw(limited, declared).startswith(b"HTTP/1.1 413 ")
    chunked = (
        b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"8000\r\n" + b"[" * 0x8000 + b"\r\n"
    ) * 1
    chunked += (b"8000\r\n" + b"[" * 0x8000 + b"\r\n") * 3
    assert _raw(limited, chunked).startswith(b"HTTP/1.1 413 ")


def test_a_kept_alive_connection_gets_a_fresh_head_timeout(limited: int) -> None:
    with socket.create_connection(("127.0.0.1", limited), timeout=5) as s:
        for _ in range(3):
            time.sleep(0.3)  # under the 0.5 s head timeout each time, 0.9 s in all
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")


# --- node locks after restarts ---------------------------------------------------------------


def _extender(srv: FakeApiserver, holder: str, pod: HolderPod | None) -> Extender:
    cfg = ExtenderConfig(
        watch=False, holder=holder, holder_pod=pod, lock_timeout_s=0.5, lock_linger_s=60
    )
    e = Extender(Kube(srv.client(), NAMES), cfg)
    e.start()
    return e


def _crash_holding_the_lock(srv: FakeApiserver, e: Extender, pod: str) -> None:
    srv.store.create("pods", pod_object(pod, [(10, 2)]))
    assert e.bind(ExtenderBindingArgs(**_bind_args(srv, pod))).error == ""
    assert e.held_locks() == ["n0"]  # lingering: the lock stays on the node
    lock = current_lock(srv.store.get("nodes", "", "n0"), NAMES)
    assert lock is not None and lock.holder == e.cfg.holder
    # the process dies: nothing is released (no stop())


def _holder_pod(srv: FakeApiserver, name: str) -> HolderPod:
    obj = srv.store.create("pods", pod_object(name, namespace="kube-system"))
    return HolderPod("kube-system", name, obj["metadata"]["uid"])


def test_a_restarted_extender_takes_its_own_lock_back(cluster: FakeApiserver) -> None:
    me = _holder_pod(cluster, "qgpu-scheduler-a")
    _crash_holding_the_lock(cluster, _extender(cluster, "qgpu-extender/a", me), "p0")
    again = _extender(cluster, "qgpu-extender/a", me)  # same pod, new process
    cluster.store.create("pods", pod_object("p1", [(10, 2)]))
    t = time.monotonic()
    assert again.bind(ExtenderBindingArgs(**_bind_args(cluster, "p1"))).error == ""
    assert time.monotonic() - t < 0.5  # not the 30 s of the lock's lifetime
    again.stop()


def test_a_lock_of_a_gone_pod_is_taken_over_and_a_live_one_is_not(
    cluster: FakeApiserver,
) -> None:
    old = _holder_pod(cluster, "qgpu-scheduler-old")
    _crash_holding_the_lock(cluster, _extender(cluster, "qgpu-extender/old", old), "p0")
    new = _extender(cluster, "qgpu-extender/new", _holder_pod(cluster, "qgpu-scheduler-new"))
    cluster.store.create("pods", pod_object("p1", [(10, 2)]))
    with pytest.raises(NodeLockError):  # its holder's pod still exists: wait, then give up
        new.locker.acquire("n0", timeout_s=0.3)
    cluster.store.delete("pods", "kube-system", "qgpu-scheduler-old")
    time.sleep(GONE_CHECK_S)  # a holder found alive is not asked about again for this long
    t = time.monotonic()
    assert new.bind(ExtenderBindingArgs(**_bind_args(cluster, "p1"))).error == ""
    assert time.monotonic() - t < 0.5
    lock = current_lock(cluster.store.get("nodes", "", "n0"), NAMES)
    assert lock is not None and lock.holder == "qgpu-extender/new"
    assert lock.pod == "kube-system/qgpu-scheduler-new"
    new.stop()


def test_a_lock_whose_pod_name_was_reused_by_another_pod_is_taken_over(
    cluster: FakeApiserver,
) -> None:
    old = _holder_pod(cluster, "qgpu-scheduler-0")
    _crash_holding_the_lock(cluster, _extender(cluster, "qgpu-extender/x", old), "p0")
    cluster.store.delete("pods", "kube-system", "qgpu-scheduler-0")
    _holder_pod(cluster, "qgpu-scheduler-0")  # same name, new UID (a StatefulSet's pod)
    other = _extender(cluster, "qgpu-extender/y", None)
    cluster.store.create("pods", pod_object("p1", [(10, 2)]))
    assert other.bind(ExtenderBindingArgs(**_bind_args(cluster, "p1"))).error == ""
    other.stop()
