"""What the agent's HTTP servers refuse before any route runs: slow or oversized requests,
and bodies that are not plain JSON.

- `guarded_httptools` — uvicorn's httptools protocol with deadlines: a request head must
  arrive within ``head_timeout_s`` of the connection opening (or of its first byte after a
  keep-alive pause), its body within ``body_timeout_s`` of the head; otherwise the
  connection is closed; a head longer than `MAX_HEAD_BYTES` is answered 431 and the
  connection closed (httptools buffers an unfinished head without limit). uvicorn itself
  only times out idle keep-alive connections, so a client that sends half a request would
  hold a connection (and its memory) for ever.
- `BodyGuard` — an ASGI middleware: a body over ``max_body_bytes`` is answered 413 without
  being read further (a ``Content-Length`` over the limit without being read at all); a
  body that is not UTF-8, not JSON, nested deeper than `MAX_DEPTH`, or that holds a lone
  surrogate (``"\\ud800"``: valid JSON, but no Unicode text) is answered 422 naming the
  field. Python's JSON parser accepts lone surrogates and would hand them to the routes,
  where they break every encoder downstream (the answer, the ledger's JSON, logs). The
  document it parsed is left in the scope (`JSON_SCOPE_KEY`) for the hot routes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from enforcement.agent.errors import error_response
from qgpu.errors import RuleViolation

MAX_DEPTH = 32
DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 16 * 1024  # as uvicorn's h11 limit (h11_max_incomplete_event_size)
JSON_SCOPE_KEY = "qgpu.json"  # the checked body's JSON document, for the routes


def guarded_httptools(head_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (a C parser: ~0.1 ms less CPU per request than h11's
    pure-Python one) with the two deadlines, for ``uvicorn.Config(http=...)``.

    The phases follow the parser's callbacks: the head runs from the connection's opening,
    or from the first byte after a keep-alive pause, to ``on_headers_complete``; the body
    from there to ``on_message_complete``. While the app answers there is no deadline. The
    timer is armed once the bytes at hand are parsed: a request that arrives whole (the
    usual case) costs no timer at all."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None  # the phase whose deadline runs
        _parsed: str | None = None  # where the parser stands
        _head_bytes = 0  # bytes received while the head was incomplete

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._parsed = "head"
            self._enter("head")

        def data_received(self, data: bytes) -> None:
            if self._phase is None:
                self._parsed = "head"  # a new request begins (after a keep-alive pause)
            super().data_received(data)
            if self._parsed == "head" and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse_head()
            self._enter(None if self.transport.is_closing() else self._parsed)

        def _refuse_head(self) -> None:
            """431 and close: a head that does not end within `MAX_HEAD_BYTES` (the parser
            would keep buffering it until the deadline)."""
            rule = f"a request head must end within {MAX_HEAD_BYTES} bytes"
            answer = error_response(
                431, "too-large", [RuleViolation("head", f"{self._head_bytes} bytes", rule)]
            )
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                + f"content-length: {len(answer.body)}\r\n\r\n".encode()
                + bytes(answer.body)
            )
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._parsed = "head"  # also a pipelined request behind the one just read
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._parsed = "body"

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._parsed = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._parsed = None
            self._enter(None)  # uvicorn's keep-alive timer waits for the next request

        def connection_lost(self, exc: Exception | None) -> None:
            self._enter(None)
            super().connection_lost(exc)

        def _enter(self, phase: str | None) -> None:
            if phase == self._phase:
                return  # the deadline runs from the start of the phase, not the last byte
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:
                delay = head_timeout_s if phase == "head" else body_timeout_s
                self._timer = self.loop.call_later(delay, self._expired)

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request %s is late", self._phase)
                self.transport.close()

    return GuardedHttpToolsProtocol


def json_violation(body: bytes) -> RuleViolation | None:
    """Why `body` is not acceptable JSON text, or None."""
    return parse_json(body)[1]


def parse_json(body: bytes) -> tuple[Any, RuleViolation | None]:
    """`body`'s JSON document, or why it is not acceptable JSON text."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, RuleViolation("body", f"byte {exc.start}", "must be JSON encoded as UTF-8")
    try:
        doc = json.loads(text)
    except RecursionError:
        return None, RuleViolation("body", None, f"must not nest deeper than {MAX_DEPTH} levels")
    except ValueError as exc:
        where = getattr(exc, "msg", None)
        detail = f" ({where} at line {exc.lineno} column {exc.colno})" if where else ""  # type: ignore[attr-defined]
        return None, RuleViolation("body", None, f"must be valid JSON{detail}")
    return doc, _walk(doc, "", 0)


def _walk(node: Any, path: str, depth: int) -> RuleViolation | None:
    if depth > MAX_DEPTH:
        return RuleViolation(path or "body", None, f"must not nest deeper than {MAX_DEPTH} levels")
    if isinstance(node, str):
        return _text(node, path)
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else key
            bad = _text(key, f"{where} (a key)") or _walk(value, where, depth + 1)
            if bad is not None:
                return bad
    elif isinstance(node, list):
        for i, value in enumerate(node):
            bad = _walk(value, f"{path}[{i}]" if path else f"[{i}]", depth + 1)
            if bad is not None:
                return bad
    return None


def _text(text: str, path: str) -> RuleViolation | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return RuleViolation(
            _printable(path) or "body",
            text,
            "must be Unicode text: a lone surrogate escape such as \\ud800 is not a character",
        )
    return None


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


class BodyGuard:
    """ASGI middleware: size limit and JSON checks of request bodies (see the module)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY) -> None:
        self.app = app
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            await self._too_large(length, scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left (or its body was late): nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._too_large(size, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            doc, bad = parse_json(body)
            if bad is not None:
                await error_response(422, "invalid", [bad])(scope, receive, send)
                return
            scope[JSON_SCOPE_KEY] = doc  # parsed once: the hot routes take it from here
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        rule = f"a request body must be at most {self.max_body} bytes"
        response = error_response(
            413, "too-large", [RuleViolation("body", f"{size} bytes or more", rule)]
        )
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the disconnect, when it comes

    return replay


__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEAD_TIMEOUT_S",
    "DEFAULT_MAX_BODY",
    "JSON_SCOPE_KEY",
    "MAX_DEPTH",
    "MAX_HEAD_BYTES",
    "BodyGuard",
    "guarded_httptools",
    "json_violation",
    "parse_json",
]
