"""The agent's read-only metrics listener (a real TCP server) closes connections that send
nothing or half a request, and still serves scrapes afterwards."""

from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry, Counter

from enforcement.agent.metrics_http import MetricsListener


def test_a_half_sent_request_is_cut_off_and_scrapes_still_work() -> None:
    registry = CollectorRegistry()
    Counter("qgpu_probe", "a probe", registry=registry).inc()
    listener = MetricsListener("127.0.0.1", 0, registry, read_timeout_s=0.5)
    try:
        for partial in (b"", b"GET /metrics HTTP/1.1\r\nhost: x\r\n"):
            with socket.create_connection(listener.address, timeout=10) as s:
                s.sendall(partial)
                started = time.monotonic()
                assert s.recv(100) == b""  # closed by the listener, no answer
                assert time.monotonic() - started < 5
        with socket.create_connection(listener.address, timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nhost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200") and b"qgpu_probe_total 1.0" in data
    finally:
        listener.close()
