"""The agent's read-only metrics listener: ``GET /metrics`` on a TCP port, nothing else.

The agent's API (unix socket, optional loopback TCP with a token) can reserve and release
slices; Prometheus must not need that. This listener serves the same registry as the API's
``/metrics`` (the `enforcement.agent.metrics` collector and the request histogram) from
prometheus-client's own WSGI exposition, behind a guard that answers 404 for every other
path and 405 for every method but GET and HEAD: no slice can be changed through it, whatever
is sent to it. It runs in its own thread (prometheus-client's threading WSGI server), so a
slow scrape never holds the API's event loop.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

METRICS_PATH = "/metrics"
READ_METHODS = ("GET", "HEAD")

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def read_only_metrics_app(registry: CollectorRegistry) -> Wsgi:
    """WSGI app: the registry's exposition at GET/HEAD /metrics; 404/405 otherwise."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if path != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only GET /metrics is served on this port\n"]
        if method not in READ_METHODS:
            start_response(
                "405 Method Not Allowed",
                [("Content-Type", "text/plain"), ("Allow", ", ".join(READ_METHODS))],
            )
            return [b"the metrics port is read-only: GET /metrics\n"]
        return metrics(environ, start_response)

    return app


class MetricsListener:
    """A running metrics listener; `close()` stops it and frees the port."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        self.server: WSGIServer = make_server(
            host, port, read_only_metrics_app(registry), server_class, handler_class=_SilentHandler
        )
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="qgpu-metrics", daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


__all__ = ["METRICS_PATH", "MetricsListener", "read_only_metrics_app"]
