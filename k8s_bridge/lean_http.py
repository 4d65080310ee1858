"""A lean HTTP transport to the apiserver for the extender's per-bind calls.

The official client's request path (argument validation, parameter serialization, urllib3's
pool and retry machinery) costs about twice the CPU of `http.client` for a small JSON call,
and the extender makes one to three such calls per pod. `http.client` itself still sends the
head and the body of a request in two system calls (two TCP segments), and parses every
reply's headers with the ``email`` package. So `LeanTransport` speaks HTTP/1.1 itself over
keep-alive sockets (one per thread): a request leaves in one write, and the reply's status,
headers and body (``Content-Length``, chunked, or up to the close) are read by hand.

The sockets are built from the *same* `kubernetes.client.Configuration`: host and scheme,
CA bundle or ``verify_ssl=False``, client certificate, and the bearer token through the
configuration's own ``auth_settings()`` (so a refreshed in-cluster token is picked up). A
configuration it does not cover -- an HTTP proxy, basic auth, ``assert_hostname``,
``tls_server_name`` -- makes `for_configuration` return None and the bridge keeps the
official client for everything.

It never retries: a write whose answer did not come back may have happened, so the caller
decides (the bind reads the pod). A kept-alive connection the server has closed meanwhile
is detected before reuse (as urllib3 does) and replaced, so no request is sent on it.
Failures are `OSError` (connect, TLS, timeouts, resets) or `http.client.HTTPException`
(a malformed or cut-off reply), as with `http.client`.
"""

from __future__ import annotations

import http.client
import select
import socket
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

    def _connection(self) -> Connection:
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.dropped():
            conn.close()
            conn = None
        if conn is None:
            conn = Connection.open(self.host, self.port, self.timeout_s, self.context)
            self._local.conn = conn
        return conn

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, bytes]:
        """(HTTP status, body). Raises OSError / http.client.HTTPException when no answer
        came back; the connection is then dropped."""
        headers = self._headers(content_type)
        conn = self._connection()
        try:
            status, data, keep = conn.request(method, self.base + path, headers, body)
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        if not keep:
            conn.close()
            self._local.conn = None
        return status, data


MAX_HEAD = 65536  # status line and headers of one reply, bytes
MAX_HEADERS = 100  # as http.client


class Connection:
    """One keep-alive HTTP/1.1 client connection (plain or TLS), one request at a time."""

    def __init__(self, sock: socket.socket, host_header: str) -> None:
        self.sock = sock
        self.host_header = host_header
        self._buf = b""

    @classmethod
    def open(
        cls, host: str, port: int, timeout_s: float, context: ssl.SSLContext | None
    ) -> Connection:
        sock = socket.create_connection((host, port), timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        name = f"[{host}]" if ":" in host else host
        default = 443 if context is not None else 80
        return cls(sock, name if port == default else f"{name}:{port}")

    def close(self) -> None:
        self._buf = b""
        self.sock.close()

    def dropped(self) -> bool:
        """Did the server close (or write to) this idle connection?"""
        if self._buf:
            return True  # bytes nobody asked for
        try:
            if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                return True
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def request(
        self, method: str, target: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, bytes, bool]:
        """Send one request in one write; (status, body, whether the connection stays open)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host_header}"]
        for key, value in headers.items():
            if _bad_header_text(key) or _bad_header_text(value):
                raise ValueError(f"invalid HTTP header {key!r}: {value!r}")
            lines.append(f"{key}: {value}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._buf = b""
        self.sock.sendall(head + body if body else head)
        while True:
            version, status, fields = self._read_head()
            if not 100 <= status < 200:
                break  # 1xx answers are informational: the real one follows
        keep = _keep_alive(version, fields)
        if method == "HEAD" or status in (204, 304):
            return status, b"", keep
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return status, self._read_chunked(), keep
        if "content-length" in fields:
            try:
                length = int(fields["content-length"])
            except ValueError:
                raise http.client.HTTPException(
                    f"bad Content-Length {fields['content-length']!r}"
                ) from None
            if length < 0:
                raise http.client.HTTPException(f"bad Content-Length {length}")
            return status, self._take(length), keep
        return status, self._read_to_close(), False

    def _recv(self) -> bytes:
        return self.sock.recv(262144)

    def _fill_until(self, marker: bytes, limit: int) -> int:
        """Read until `marker` is in the buffer; its offset."""
        while (at := self._buf.find(marker)) < 0:
            if len(self._buf) > limit:
                raise http.client.LineTooLong(f"reply head over {limit} bytes")
            chunk = self._recv()
            if not chunk:
                if not self._buf:
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response"
                    )
                raise http.client.IncompleteRead(self._buf)
            self._buf += chunk
        return at

    def _read_head(self) -> tuple[str, int, dict[str, str]]:
        at = self._fill_until(b"\r\n\r\n", MAX_HEAD)
        head, self._buf = self._buf[:at].decode("latin-1"), self._buf[at + 4 :]
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise http.client.BadStatusLine(status_line)
        try:
            status = int(parts[1])
        except ValueError:
            raise http.client.BadStatusLine(status_line) from None
        if not 100 <= status <= 999:
            raise http.client.BadStatusLine(status_line)
        if len(lines) > MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {MAX_HEADERS} headers")
        fields: dict[str, str] = {}
        for line in lines:
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip().lower()
            fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
        return parts[0], status, fields

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._recv()
            if not chunk:
                raise http.client.IncompleteRead(self._buf, n - len(self._buf))
            self._buf += chunk
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            at = self._fill_until(b"\r\n", MAX_HEAD)
            size_text = self._buf[:at].split(b";", 1)[0].strip()
            self._buf = self._buf[at + 2 :]
            try:
                size = int(size_text, 16)
            except ValueError:
                raise http.client.HTTPException(f"bad chunk size {size_text!r}") from None
            if size == 0:
                break
            parts.append(self._take(size))
            if self._take(2) != b"\r\n":
                raise http.client.HTTPException("a chunk does not end with CRLF")
        while True:  # trailer fields, then the empty line
            at = self._fill_until(b"\r\n", MAX_HEAD)
            self._buf = self._buf[at + 2 :]
            if at == 0:
                return b"".join(parts)

    def _read_to_close(self) -> bytes:
        parts = [self._buf]
        self._buf = b""
        while chunk := self._recv():
            parts.append(chunk)
        return b"".join(parts)


def _bad_header_text(text: str) -> bool:
    return "\r" in text or "\n" in text or "\0" in text


def _keep_alive(version: str, fields: dict[str, str]) -> bool:
    tokens = {t.strip().lower() for t in fields.get("connection", "").split(",")}
    if version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens
