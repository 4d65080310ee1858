"""A lean HTTP transport to the apiserver for the extender's per-bind calls.

The official client's request path (argument validation, parameter serialization, urllib3's
pool and retry machinery) costs about twice the CPU of `http.client` for a small JSON call,
and the extender makes one to three such calls per pod. `LeanTransport` sends them over
keep-alive `http.client` connections (one per thread) built from the *same*
`kubernetes.client.Configuration`: host and scheme, CA bundle or ``verify_ssl=False``,
client certificate, and the bearer token through the configuration's own
``auth_settings()`` (so a refreshed in-cluster token is picked up). A configuration it does
not cover -- an HTTP proxy, basic auth, ``assert_hostname``, ``tls_server_name`` -- makes
`for_configuration` return None and the bridge keeps the official client for everything.

It never retries: a write whose answer did not come back may have happened, so the caller
decides (the bind reads the pod). A kept-alive connection the server has closed meanwhile
is detected before reuse (as urllib3 does) and replaced, so no request is sent on it.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 30.0


class LeanTransport:
    """Keep-alive `http.client` connections to one apiserver, one per calling thread."""

    def __init__(self, configuration: Any, timeout_s: float = TIMEOUT_S) -> None:
        url = urlsplit(configuration.host)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"unsupported apiserver host {configuration.host!r}")
        self.cfg = configuration
        self.https = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.https else 80)
        self.base = url.path.rstrip("/")
        self.timeout_s = timeout_s
        self.context = self._ssl_context() if self.https else None
        self._local = threading.local()
        self._default_headers = {"Accept": "application/json", "User-Agent": "qgpu-extender"}

    @classmethod
    def for_configuration(cls, configuration: Any) -> LeanTransport | None:
        """A transport for this configuration, or None when it needs what we do not cover."""
        if (
            getattr(configuration, "proxy", None)
            or getattr(configuration, "username", None)
            or getattr(configuration, "assert_hostname", None) is not None
            or getattr(configuration, "tls_server_name", None)
        ):
            return None
        try:
            return cls(configuration)
        except (ValueError, OSError, ssl.SSLError):
            return None

    def _ssl_context(self) -> ssl.SSLContext:
        cfg = self.cfg
        ctx = ssl.create_default_context(
            cafile=cfg.ssl_ca_cert or None, cadata=getattr(cfg, "ca_cert_data", None) or None
        )
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        return ctx

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = dict(self._default_headers)
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and _dropped(conn):
            conn.close()
            conn = None
        if conn is None:
            if self.https:
                conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self.context
                )
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, bytes]:
        """(HTTP status, body). Raises OSError / http.client.HTTPException when no answer
        came back; the connection is then dropped."""
        conn = self._connection()
        try:
            conn.request(method, self.base + path, body, self._headers(content_type))
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        if resp.will_close:
            conn.close()
            self._local.conn = None
        return resp.status, data


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Did the server close (or write to) this idle keep-alive connection?"""
    sock = conn.sock
    if sock is None:
        return False  # not connected yet: http.client connects on the first request
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
