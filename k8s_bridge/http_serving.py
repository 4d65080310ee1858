"""Serving the bridge's ASGI apps with uvicorn: one socket write per response, request limits,
and the TLS client's certificate in the request scope.

uvicorn writes a response's status line and headers to the transport when the app sends
``http.response.start``, and the body in a second write. With ``TCP_NODELAY`` (set on
every connection) each write is its own ``send`` system call and its own TCP segment,
and the client wakes for each. For the extender, answering kube-scheduler three times per
pod over loopback, those extra writes were about a sixth of its CPU.

`CoalescingHttpProtocol` is uvicorn's own HTTP protocol (httptools when installed, else
h11) and adds three things, nothing else about uvicorn changes (its parsing, keep-alive,
flow control and timeouts are its own):
- it writes through `CoalescingTransport`, which gathers what is written in one turn of the
  event loop and hands it to the real transport once, at the end of that turn, or at once
  before the connection is closed;
- it enforces `ServerLimits`, which uvicorn lacks: a request's head must arrive within
  ``header_timeout_s`` of the connection opening (or of the previous response) and be at
  most ``max_head_bytes``; its body must arrive within ``body_timeout_s`` more and be at
  most ``max_body_bytes``. A request over a limit gets 408, 413 or 431 (JSON) and the
  connection is closed (after a short lingering read, so the client sees the answer rather
  than a reset), so half-open or endless requests cannot pile up;
- on a TLS connection it puts the ASGI TLS extension in every request's scope
  (``scope["extensions"]["tls"]``: ``client_cert_name``, the verified client certificate's
  subject, or None), plus ``client_cert_common_name`` for `k8s_bridge.peer_auth`.

`serve()` runs an app with this protocol, optionally over TLS with client certificates
(`k8s_bridge.peer_auth.ServerTLS`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


@dataclass(frozen=True)
class ServerLimits:
    """How long and how large one request may be (see the module docstring)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_body_bytes: int = 8 * 1024 * 1024


DEFAULT_LIMITS = ServerLimits()
_REASONS = {408: "Request Timeout", 413: "Content Too Large", 431: "Header Fields Too Large"}
LINGER_S = 2.0  # after a refusal, unread input is read and dropped this long before closing


class CoalescingTransport:
    """A transport whose ``write``s made in one event-loop turn leave as one write.

    Everything but ``write``, ``writelines``, ``close`` and ``abort`` is the wrapped
    transport's own (flow control, extra info, reading).
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what is gathered to the real transport (nothing when already flushed)."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def tls_extension(transport: Any) -> dict[str, Any] | None:
    """The ASGI TLS extension for a connection (None when it is not TLS)."""
    sslobj = transport.get_extra_info("ssl_object")
    if sslobj is None:
        return None
    cert = transport.get_extra_info("peercert") or {}  # only a *verified* certificate
    rdns = [(k, v) for rdn in cert.get("subject", ()) for k, v in rdn]
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU"}
    name = ",".join(f"{short.get(k, k)}={v}" for k, v in reversed(rdns)) if rdns else None
    return {
        "server_cert": None,
        "client_cert_chain": [],
        "client_cert_name": name,
        "client_cert_error": None,
        "tls_version": None,
        "cipher_suite": None,
        "client_cert_common_name": next((v for k, v in rdns if k == "commonName"), None),
    }


def _with_tls(app: Any, tls: dict[str, Any]) -> Any:
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        extensions = scope.setdefault("extensions", {})
        extensions["tls"] = tls
        await app(scope, receive, send)

    return wrapped


class CoalescingHttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, writing through a `CoalescingTransport`, enforcing
    `ServerLimits` (``config.qgpu_limits``) and adding the TLS extension to the scope."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        self._limits: ServerLimits = getattr(self.config, "qgpu_limits", DEFAULT_LIMITS)
        self._timer: asyncio.TimerHandle | None = None
        self._lingering = False
        tls = tls_extension(transport)
        super().connection_made(CoalescingTransport(transport, loop))  # type: ignore[arg-type]
        if tls is not None:
            self.app = _with_tls(self.app, tls)
        self._next_request()

    # -- limits -------------------------------------------------------------------------

    def _next_request(self) -> None:
        """A new request may begin: count its bytes and time its head from now."""
        self._seen = 0
        self._tail = b""  # the last bytes of the head so far (its end may be split)
        self._before = self.cycle  # the cycle of the previous request (None at first)
        self._length_checked = False
        self._arm(self._limits.header_timeout_s, self._head_deadline)

    def _arm(self, delay: float, callback: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay, callback)

    def _started(self) -> bool:
        return self.cycle is not None and self.cycle is not self._before

    def _head_deadline(self) -> None:
        if self.transport.is_closing():
            return
        if not self._started():
            self._refuse(408, f"no complete request head within {self._limits.header_timeout_s} s")
        elif self.cycle.more_body:
            self._arm(self._limits.body_timeout_s, self._body_deadline)

    def _body_deadline(self) -> None:
        if not self.transport.is_closing() and self._started() and self.cycle.more_body:
            self._refuse(408, "the request body did not arrive within the time allowed")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with a JSON error and close, whatever the app is doing."""
        body = json.dumps({"error": message}).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's own answer, if any, goes nowhere
            self.cycle.message_event.set()
        self.transport.write(head + body)
        self._linger()

    def _linger(self) -> None:
        """Close after a refusal without losing the answer: closing a TCP socket with unread
        input sends RST, and the client's kernel then drops our reply unread. So send FIN,
        read and drop what still comes for up to `LINGER_S`, then close (TLS cannot half-close:
        it closes at once)."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self.transport.write_eof()
        self._arm(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.transport.is_closing():
            return
        limits = self._limits
        before = self._seen
        self._seen += len(data)
        if not self._started() and self._seen > limits.max_head_bytes:
            if self._head_end(before, data) > limits.max_head_bytes:
                self._refuse(431, f"the request head is over {limits.max_head_bytes} bytes")
                return
        elif not self._started():
            self._tail = (self._tail + data)[-3:]
        if self._seen > limits.max_head_bytes + limits.max_body_bytes:
            self._refuse(413, f"the request body is over {limits.max_body_bytes} bytes")
            return
        super().data_received(data)
        if self._started() and not self._length_checked and not self.transport.is_closing():
            self._length_checked = True
            declared = dict(self.cycle.scope["headers"]).get(b"content-length", b"0")
            try:
                too_big = int(declared) > limits.max_body_bytes
            except ValueError:
                too_big = False  # the parser has refused it already
            if too_big:
                self._refuse(413, f"the request body is over {limits.max_body_bytes} bytes")

    def _head_end(self, before: int, data: bytes) -> int:
        """Bytes of the request up to the end of its head (CRLF CRLF), counting from its
        first byte; past the limit when the head does not end within `data`."""
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        if end < 0:
            return self._seen + 1
        return before - len(self._tail) + end + 4

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._lingering and not self.transport.is_closing():
            self._next_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)


def json_body_openapi(model: Any) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body raw: the pydantic model's schema
    (aliases, ``$defs`` inlined so the OpenAPI document resolves), for clients and fuzzers."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


def config(
    app: Any,
    host: str,
    port: int,
    limits: ServerLimits = DEFAULT_LIMITS,
    tls: Any = None,
    **kwargs: Any,
) -> uvicorn.Config:
    """A uvicorn configuration with `CoalescingHttpProtocol`, `limits` and, with `tls` (a
    `k8s_bridge.peer_auth.ServerTLS`), HTTPS that asks for client certificates."""
    kwargs.setdefault("log_level", "warning")
    # no proxy stands in front of these servers: a client's X-Forwarded-For is not believed
    kwargs.setdefault("proxy_headers", False)
    if tls is not None:
        kwargs.update(tls.uvicorn_settings())
        app = tls.guard(app)
    cfg = uvicorn.Config(app, host=host, port=port, http=CoalescingHttpProtocol, **kwargs)
    cfg.qgpu_limits = limits  # type: ignore[attr-defined]  # read by the protocol
    return cfg


def serve(
    app: Any,
    host: str,
    port: int,
    limits: ServerLimits = DEFAULT_LIMITS,
    tls: Any = None,
    **kwargs: Any,
) -> None:
    """Serve `app` until stopped (see `config`)."""
    uvicorn.Server(config(app, host, port, limits, tls, **kwargs)).run()


__all__ = [
    "DEFAULT_LIMITS",
    "CoalescingHttpProtocol",
    "CoalescingTransport",
    "ServerLimits",
    "config",
    "json_body_openapi",
    "serve",
]
