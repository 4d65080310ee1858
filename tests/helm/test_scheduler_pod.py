"""qgpu-scheduler's processes started with the chart's own commands, configuration and
certificate, driven as the apiserver and kube-scheduler would drive them.

- the webhook container's argv (only the port and the certificate directory moved to this
  machine) serves the chart-generated certificate; a client that trusts only the chart's
  caBundle and names the Service (as the apiserver does) gets the examples/pod.yaml
  AdmissionReview answered with the patch to `qgpu-scheduler`;
- the extender container's argv (port and certificate directory moved, pointed at the
  in-repo fake apiserver) is called at the KubeSchedulerConfiguration's urlPrefix over
  HTTPS with its tlsConfig (the chart's client certificate) and its filter / prioritize /
  bind verbs and Go field names, and binds the pod with its GPU assignment; without that
  certificate it answers 401 (only /healthz is open).
kube-scheduler itself cannot run here: the calls it would make are made by this test.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helm.chart import Rendered, command, containers, render
from tests.helpers import stop_processes

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str]) -> subprocess.Popen[str]:
    assert argv[0] == "qgpu"  # the console script is qgpu.cli:main
    return subprocess.Popen(
        [sys.executable, "-m", "qgpu.cli", *argv[1:]],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _with(argv: list[str], **flags: str) -> list[str]:
    """argv with --flag=value replaced (or added)."""
    out = [a for a in argv if a.split("=", 1)[0].lstrip("-") not in flags]
    return out + [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]


class _ServiceConnection(http.client.HTTPSConnection):
    """HTTPS to a Service name (SNI, Host, certificate check) reached on 127.0.0.1."""

    def __init__(self, service_host: str, port: int, context: ssl.SSLContext) -> None:
        super().__init__(service_host, port, context=context, timeout=10)
        self._ctx = context

    def connect(self) -> None:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.sock = self._ctx.wrap_socket(raw, server_hostname=self.host)


def _wait(ready: Any, proc: subprocess.Popen[str], what: str, timeout: float = 45) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if ready():
                return
        except (OSError, httpx.TransportError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready")


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return render()


@pytest.fixture(scope="module")
def scheduler_pod(rendered: Rendered) -> Iterator[dict[str, Any]]:
    from tests.fakes.apiserver import FakeApiserver
    from tests.k8s.helpers import gpu, publish_node

    cs = containers(rendered.scheduler)
    secret = rendered.get("Secret", "qgpu-scheduler-webhook-tls")
    certs = Path(tempfile.mkdtemp(prefix="qgpu-webhook-"))
    for key in ("tls.crt", "tls.key"):
        (certs / key).write_bytes(base64.b64decode(secret["data"][key]))
    ext_secret = rendered.get("Secret", "qgpu-scheduler-extender-tls")
    for key, data in ext_secret["data"].items():
        (certs / key).write_bytes(base64.b64decode(data))
    key = rendered.get("Secret", "qgpu-assignment-key")["data"]["key"]
    (certs / "assignment.key").write_bytes(base64.b64decode(key))
    hook_port, ext_port = _free_port(), _free_port()
    srv = FakeApiserver().start()
    publish_node(srv, "gpu-node-1", [gpu("gpu-node-1", 0, gib=16), gpu("gpu-node-1", 1, gib=16)])
    hook_argv = _with(
        command(cs["webhook"]),
        port=str(hook_port),
        host="127.0.0.1",
        tls_cert=str(certs / "tls.crt"),
        tls_key=str(certs / "tls.key"),
    )
    ext_argv = _with(
        command(cs["extender"]),
        port=str(ext_port),
        host="127.0.0.1",
        apiserver=srv.url,
        tls_cert=str(certs / "server.crt"),
        tls_key=str(certs / "server.key"),
        client_ca=str(certs / "ca.crt"),
        assignment_key_file=str(certs / "assignment.key"),
        assignment_previous_key_file=str(certs / "no-previous-key"),
    )
    procs = [_start(hook_argv), _start(ext_argv)]
    try:
        # kubelet's probe: HTTPS without a client certificate (and without checking ours)
        probe = ssl.create_default_context()
        probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
        _wait(
            lambda: httpx.get(f"https://127.0.0.1:{ext_port}/healthz", verify=probe).json()[
                "nodes"
            ]
            == 1,
            procs[1],
            "extender",
        )
        yield {
            "srv": srv,
            "hook_port": hook_port,
            "ext_port": ext_port,
            "procs": procs,
            "certs": certs,
        }
    finally:
        stop_processes(procs)
        srv.stop()
        for f in certs.iterdir():
            f.unlink()
        certs.rmdir()


def _admission(rendered: Rendered, port: int, pod: dict[str, Any]) -> dict[str, Any]:
    (hook,) = rendered.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    ref = hook["clientConfig"]["service"]
    ctx = ssl.create_default_context(
        cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    )
    conn = _ServiceConnection(f"{ref['name']}.{ref['namespace']}.svc", port, ctx)
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "review-1", "operation": "CREATE", "object": pod},
    }
    deadline = time.monotonic() + 45
    while True:
        try:
            conn.request(
                "POST", ref["path"], json.dumps(review), {"Content-Type": "application/json"}
            )
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            conn.close()
            time.sleep(0.2)
    resp = conn.getresponse()
    assert resp.status == 200
    body = json.loads(resp.read())
    conn.close()
    return body["response"]


def test_webhook_serves_the_chart_certificate_and_routes_the_example_pod(
    rendered: Rendered, scheduler_pod: dict[str, Any]
) -> None:
    pod = yaml.safe_load((ROOT / "examples" / "pod.yaml").read_text())
    del pod["spec"]["schedulerName"]
    answer = _admission(rendered, scheduler_pod["hook_port"], pod)
    assert answer["uid"] == "review-1" and answer["allowed"] is True
    assert json.loads(base64.b64decode(answer["patch"])) == [
        {"op": "add", "path": "/spec/schedulerName", "value": "qgpu-scheduler"}
    ]


def test_webhook_certificate_is_refused_for_another_name(
    rendered: Rendered, scheduler_pod: dict[str, Any]
) -> None:
    (hook,) = rendered.get("MutatingWebhookConfiguration", "qgpu-scheduler")["webhooks"]
    ctx = ssl.create_default_context(
        cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    )
    _admission(rendered, scheduler_pod["hook_port"], {"spec": {"containers": []}})  # up
    conn = _ServiceConnection("qgpu-scheduler.other.svc", scheduler_pod["hook_port"], ctx)
    with pytest.raises(ssl.SSLCertVerificationError):
        conn.request("GET", "/healthz")
    conn.close()


def test_extender_binds_the_example_pod_through_the_configured_verbs(
    rendered: Rendered, scheduler_pod: dict[str, Any]
) -> None:
    from k8s_bridge.protocol import load_assignment
    from k8s_bridge.resources import Names

    srv = scheduler_pod["srv"]
    cfg = rendered.scheduler_config()
    (ext,) = cfg["extenders"]
    assert ext["nodeCacheCapable"] is True  # so kube-scheduler sends NodeNames, not Nodes
    assert ext["enableHTTPS"] is True and ext["urlPrefix"].startswith("https://")
    base = ext["urlPrefix"].replace(":8888", f":{scheduler_pod['ext_port']}")
    pod = yaml.safe_load((ROOT / "examples" / "pod.yaml").read_text())
    pod["metadata"]["namespace"] = "default"
    created = srv.store.create("pods", pod)
    args = {"Pod": created, "Nodes": None, "NodeNames": ["gpu-node-1"]}
    with httpx.Client(
        base_url=base, timeout=30, verify=_scheduler_tls(ext, scheduler_pod["certs"])
    ) as http:
        filtered = http.post(f"/{ext['filterVerb']}", json=args).json()
        assert filtered["NodeNames"] == ["gpu-node-1"], filtered
        scores = http.post(f"/{ext['prioritizeVerb']}", json=args).json()
        assert [s["Host"] for s in scores] == ["gpu-node-1"]
        assert 0 <= scores[0]["Score"] <= 10
        bound = http.post(
            f"/{ext['bindVerb']}",
            json={
                "PodName": created["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": created["metadata"]["uid"],
                "Node": "gpu-node-1",
            },
        ).json()
        assert not bound.get("Error"), bound
    stored = srv.store.get("pods", "default", created["metadata"]["name"])
    assert stored["spec"]["nodeName"] == "gpu-node-1"
    names = Names()
    assignment = load_assignment(stored["metadata"]["annotations"][names.assignment_annotation])
    (slice_,) = assignment.containers.values()
    assert (slice_.core, slice_.memory_gib, slice_.isolation.value) == (30, [8], "fixed-share")
    # signed with the chart's key, as the device plugin (which mounts it too) checks
    from k8s_bridge.assignment_mac import AssignmentKeys

    ann = stored["metadata"]["annotations"]
    keys = AssignmentKeys((scheduler_pod["certs"] / "assignment.key").read_bytes())
    mac = ann[names.assignment_mac_annotation]
    text = ann[names.assignment_annotation]
    assert keys.check(stored["metadata"]["uid"], "gpu-node-1", text, mac) is None


def _scheduler_tls(ext: dict[str, Any], certs: Path, with_cert: bool = True) -> ssl.SSLContext:
    """kube-scheduler's side of the extender's TLS, as its tlsConfig names it (the files
    of the chart's Secret, moved to `certs`)."""
    tls = ext["tlsConfig"]
    ctx = ssl.create_default_context(cafile=str(certs / Path(tls["caFile"]).name))
    if with_cert:
        ctx.load_cert_chain(
            str(certs / Path(tls["certFile"]).name), str(certs / Path(tls["keyFile"]).name)
        )
    return ctx


def test_extender_refuses_callers_without_the_chart_client_certificate(
    rendered: Rendered, scheduler_pod: dict[str, Any]
) -> None:
    (ext,) = rendered.scheduler_config()["extenders"]
    base = ext["urlPrefix"].replace(":8888", f":{scheduler_pod['ext_port']}")
    bind = {"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": "gpu-node-1"}
    no_cert = _scheduler_tls(ext, scheduler_pod["certs"], with_cert=False)
    with httpx.Client(base_url=base, timeout=30, verify=no_cert) as http:
        r = http.post(f"/{ext['bindVerb']}", json=bind)
        assert r.status_code == 401 and "client certificate" in r.json()["Error"]
        assert http.get("/healthz").status_code == 200  # probes stay open
    # a client certificate of another CA (the webhook's) fails the TLS handshake
    with pytest.raises(httpx.TransportError):  # refused in the handshake (or its end)
        webhook_cert = ssl.create_default_context(
            cafile=str(scheduler_pod["certs"] / "ca.crt")
        )
        webhook_cert.load_cert_chain(
            str(scheduler_pod["certs"] / "tls.crt"), str(scheduler_pod["certs"] / "tls.key")
        )
        httpx.post(f"{base}/{ext['bindVerb']}", json=bind, verify=webhook_cert, timeout=30)
