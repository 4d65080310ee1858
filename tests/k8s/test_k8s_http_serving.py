"""Serving with one socket write per response (`k8s_bridge.http_serving`): what an app sends
in one turn of the event loop leaves as one write; close and abort behave as the transport's."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from k8s_bridge.http_serving import CoalescingTransport
from tests.k8s.helpers import ServedApp


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8888) if name == "sockname" else default


def test_writes_in_one_turn_leave_as_one_write() -> None:
    async def main() -> RecordingTransport:
        real = RecordingTransport()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"")
        t.writelines([b"o", b"k"])
        assert real.writes == [] and t.get_write_buffer_size() == 40
        await asyncio.sleep(0)  # the end of this turn
        assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
        t.write(b"next")
        await asyncio.sleep(0)
        assert t.get_extra_info("sockname") == ("127.0.0.1", 8888)  # everything else: as is
        return real

    real = asyncio.run(main())
    assert real.writes[1:] == [b"next"]


def test_close_sends_what_is_gathered_first_and_abort_drops_it() -> None:
    async def main() -> tuple[RecordingTransport, RecordingTransport]:
        loop = asyncio.get_running_loop()
        closing, aborting = RecordingTransport(), RecordingTransport()
        a, b = CoalescingTransport(closing, loop), CoalescingTransport(aborting, loop)
        a.write(b"last words")
        a.close()
        b.write(b"never sent")
        b.abort()
        await asyncio.sleep(0)  # the scheduled flush finds nothing (or a closed transport)
        return closing, aborting

    closing, aborting = asyncio.run(main())
    assert closing.writes == [b"last words"] and closing.closed
    assert aborting.writes == [] and aborting.aborted


async def _echo_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _reply(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[
            1
        ]
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0] + b"|" + body


def test_uvicorn_serves_keep_alive_requests_through_it() -> None:
    served = ServedApp(_echo_app).start()
    try:
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            for body in (b"one", b"x" * 200_000, b"three"):  # a large body: flow control
                sock.sendall(
                    b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                assert _reply(sock) == b"HTTP/1.1 200 OK|" + body
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert _reply(sock) == b"HTTP/1.1 200 OK|"
            assert sock.recv(1) == b""  # the server closed after answering
    finally:
        served.stop()
