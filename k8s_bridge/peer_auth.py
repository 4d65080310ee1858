"""Who may call the bridge's HTTP servers: TLS client certificates, checked per request.

kube-scheduler calls an extender through a Go ``http.Transport`` built from the extender's
``tlsConfig`` (``certFile``/``keyFile``/``caFile`` or their ``*Data`` forms, ``serverName``,
``insecure``) and ``enableHTTPS``: a client certificate is the one credential it can
present -- it sends no bearer token and no custom header. So the extender authenticates its
caller by a client certificate:

- `ServerTLS` serves HTTPS with the server certificate and asks every client for a
  certificate signed by ``client_ca`` (``CERT_OPTIONAL``: a client without one still
  completes the handshake, so kubelet's probes reach ``/healthz`` and anyone else gets a
  readable 401 instead of a TLS alert; a certificate that does not verify fails the
  handshake);
- `ClientCertificateAuth` (its ``guard``) answers 401 to a request without a verified
  client certificate and 403 to one whose certificate's common name is not in
  ``client_names``; only ``open_paths`` (``/healthz``) are served to anyone. The verbs
  are never reached without the credential: no filter, no assumption, no bind.

The certificate's identity comes from `k8s_bridge.http_serving` (the ASGI TLS extension).
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

OPEN_PATHS = frozenset({"/healthz"})


class ServerTLS(BaseModel):
    """HTTPS settings of a server, with client-certificate authentication when
    ``client_ca`` is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert: Path = Field(description="the server certificate (PEM)")
    key: Path = Field(description="its private key (PEM)")
    client_ca: Path | None = Field(
        default=None, description="CA whose client certificates are accepted (PEM)"
    )
    client_names: frozenset[str] = Field(
        default=frozenset(),
        description="common names accepted (empty: any certificate the CA signed)",
    )
    open_paths: frozenset[str] = OPEN_PATHS

    @model_validator(mode="after")
    def _files(self) -> ServerTLS:
        for field in ("cert", "key", "client_ca"):
            path = getattr(self, field)
            if path is not None and not path.is_file():
                raise ValueError(f"{field}={str(path)!r}: no such file")
        if self.client_names and self.client_ca is None:
            raise ValueError("client_names need client_ca (the CA that signs them)")
        return self

    def uvicorn_settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.client_ca is not None:
            out["ssl_ca_certs"] = str(self.client_ca)
            out["ssl_cert_reqs"] = ssl.CERT_OPTIONAL
        return out

    def guard(self, app: Any) -> Any:
        """`app` behind client-certificate checks (unchanged without ``client_ca``)."""
        if self.client_ca is None:
            return app
        return ClientCertificateAuth(app, self.client_names, self.open_paths)


class ClientCertificateAuth:
    """ASGI middleware: a verified client certificate (with an accepted common name) or
    401 / 403, except on `open_paths`."""

    def __init__(
        self, app: Any, names: frozenset[str], open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.names = names
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        tls = (scope.get("extensions") or {}).get("tls") or {}
        if not tls.get("client_cert_name"):
            await _deny(send, 401, "a client certificate signed by the configured CA is required")
            return
        cn = tls.get("client_cert_common_name")
        if self.names and cn not in self.names:
            allowed = ", ".join(sorted(self.names))
            await _deny(send, 403, f"client certificate CN={cn!r} is not one of: {allowed}")
            return
        await self.app(scope, receive, send)


async def _deny(send: Any, status: int, message: str) -> None:
    body = json.dumps({"Error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
