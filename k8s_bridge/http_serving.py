"""Serving the bridge's ASGI apps with uvicorn, one socket write per response.

uvicorn writes a response's status line and headers to the transport when the app sends
``http.response.start``, and the body in a second write. With ``TCP_NODELAY`` (set on
every connection) each write is its own ``send`` system call and its own TCP segment,
and the client wakes for each. For the extender, answering kube-scheduler three times per
pod over loopback, those extra writes were about a sixth of its CPU.

`CoalescingHttpProtocol` is uvicorn's own HTTP protocol (httptools when installed, else
h11) over `CoalescingTransport`, which gathers what is written in one turn of the event
loop and hands it to the real transport once, at the end of that turn, or at once before
the connection is closed. Nothing else about uvicorn changes: its parsing, keep-alive,
flow control and timeouts are its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


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

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, writing through a `CoalescingTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        super().connection_made(CoalescingTransport(transport, loop))  # type: ignore[arg-type]


def serve(app: Any, host: str, port: int, **config: Any) -> None:
    """``uvicorn.run`` with `CoalescingHttpProtocol`; `config` is passed to uvicorn."""
    config.setdefault("log_level", "warning")
    uvicorn.run(app, host=host, port=port, http=CoalescingHttpProtocol, **config)
