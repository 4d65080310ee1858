"""The per-bind apiserver transports over HTTPS, against the fake apiserver served with TLS.

Both transports (the lean one and the official client's urllib3 pool) are built from one
`kubernetes.client.Configuration` and must honour it as the official client does: the CA
(file or inline data), the client certificate and key, the bearer token, host name checks,
and ``verify_ssl=False`` (skip verification). The official client itself is called with the
same configuration, so a configuration that works for one works for all.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from k8s_bridge.kube import Kube, KubeError
from tests.fakes.apiserver import FakeApiserver
from tests.fakes.certs import TestPKI
from tests.k8s.helpers import NAMES, pod_object, publish_node

TOKEN = "s3cret-token"


def _server_context(pki: TestPKI, *hosts: str) -> ssl.SSLContext:
    issued = pki.issue(f"apiserver-{'-'.join(hosts)}", "kube-apiserver", hosts)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(issued.cert, issued.key)
    ctx.load_verify_locations(pki.ca_file)
    ctx.verify_mode = ssl.CERT_OPTIONAL  # client certificates are one way to authenticate
    return ctx


@pytest.fixture(scope="module")
def https(pki: TestPKI) -> Iterator[FakeApiserver]:
    srv = FakeApiserver(tls=_server_context(pki, "127.0.0.1", "localhost"), token=TOKEN).start()
    publish_node(srv, "n0", [])
    try:
        yield srv
    finally:
        srv.stop()


def _config(srv: FakeApiserver, **settings: object) -> client.Configuration:
    cfg = client.Configuration()
    cfg.host = srv.url
    for key, value in settings.items():
        setattr(cfg, key, value)
    return cfg


def _round_trip(srv: FakeApiserver, cfg: client.Configuration, transport: str, name: str) -> None:
    """get pod, patch node and Binding over the transport; a list over the official client."""
    kube = Kube(client.ApiClient(cfg), NAMES, transport=transport)
    pod = srv.store.create("pods", pod_object(name, [(10, 1)]))
    assert kube.get_pod("default", name)["metadata"]["uid"] == pod["metadata"]["uid"]
    node = kube.patch_node("n0", {"metadata": {"labels": {"seen": name}}})
    assert node["metadata"]["labels"]["seen"] == name
    kube.bind("default", name, pod["metadata"]["uid"], "n0", annotations={"a": name})
    assert srv.store.get("pods", "default", name)["spec"]["nodeName"] == "n0"
    nodes, _ = kube.list_nodes()  # the official client, same configuration
    assert [n["metadata"]["name"] for n in nodes] == ["n0"]


TRANSPORTS = ["lean", "library"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ca_file_and_bearer_token(https: FakeApiserver, pki: TestPKI, transport: str) -> None:
    cfg = _config(
        https,
        ssl_ca_cert=str(pki.ca_file),
        api_key={"authorization": TOKEN},
        api_key_prefix={"authorization": "Bearer"},
    )
    _round_trip(https, cfg, transport, f"token-{transport}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inline_ca_and_client_certificate(
    https: FakeApiserver, pki: TestPKI, transport: str
) -> None:
    issued = pki.issue(f"client-{transport}", "system:qgpu-extender", client=True)
    cfg = _config(
        https,
        ca_cert_data=pki.ca_file.read_text(),
        cert_file=str(issued.cert),
        key_file=str(issued.key),
    )
    _round_trip(https, cfg, transport, f"cert-{transport}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_credential_is_401(https: FakeApiserver, pki: TestPKI, transport: str) -> None:
    kube = Kube(client.ApiClient(_config(https, ssl_ca_cert=str(pki.ca_file))), NAMES, transport)
    with pytest.raises(KubeError) as err:
        kube.get_pod("default", "anything")
    assert err.value.status == 401


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_certificate_of_another_ca_is_refused(
    https: FakeApiserver, transport: str, tmp_path: Path
) -> None:
    other = TestPKI(tmp_path / "other")
    cfg = _config(
        https,
        ssl_ca_cert=str(other.ca_file),
        api_key={"authorization": f"Bearer {TOKEN}"},
    )
    kube = Kube(client.ApiClient(cfg), NAMES, transport=transport)
    with pytest.raises(KubeError) as err:
        kube.get_pod("default", "anything")
    assert err.value.status == 0 and "CERTIFICATE_VERIFY_FAILED" in str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_certificate_for_another_host_is_refused(pki: TestPKI, transport: str) -> None:
    with FakeApiserver(tls=_server_context(pki, "apiserver.example"), token=TOKEN) as srv:
        cfg = _config(
            srv,
            ssl_ca_cert=str(pki.ca_file),
            api_key={"authorization": f"Bearer {TOKEN}"},
        )
        kube = Kube(client.ApiClient(cfg), NAMES, transport=transport)
        with pytest.raises(KubeError) as err:
            kube.get_pod("default", "anything")
        assert err.value.status == 0 and "CERTIFICATE_VERIFY_FAILED" in str(err.value)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_verify_ssl_off_skips_verification(https: FakeApiserver, transport: str) -> None:
    cfg = _config(https, verify_ssl=False, api_key={"authorization": f"Bearer {TOKEN}"})
    _round_trip(https, cfg, transport, f"insecure-{transport}")
