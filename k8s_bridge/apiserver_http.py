"""Raw JSON calls to the apiserver over the official client's own urllib3 connection pool.

The official client's request path (argument checks, parameter serialization, its model
layer) costs about twice the CPU of the HTTP call itself, and the extender makes one to
three small calls per pod. `ApiserverHTTP` makes those calls on the *same*
`urllib3.PoolManager` the official `kubernetes.client.ApiClient` built from its
configuration -- so the TLS settings are the client's by construction (CA file or data,
``verify_ssl``, client certificate and key, ``assert_hostname``, ``tls_server_name``, a
proxy) and the keep-alive connections are shared with it -- and sends the configuration's
credentials (``auth_settings()``: the bearer token, refreshed by the configuration's hook
as the client does, or basic auth) with every call.

It never retries and never follows redirects: a write whose answer did not come back may
have happened, so the caller decides (the bind reads the pod). A kept-alive connection the
server closed meanwhile is detected by urllib3 before reuse and replaced. Failures to get an
answer are `urllib3.exceptions.HTTPError` or `OSError`.

Paths are built by `api_path`, which escapes every segment (``quote(segment, safe="")``):
a name can never add a segment or climb out of its collection.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import urllib3

TIMEOUT_S = 30.0
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")  # what quote(safe="") leaves as it is


def api_path(*segments: str) -> str:
    """``/seg1/seg2/...`` with each segment percent-escaped (``/``, ``.`` runs, ``?``, ``%``
    included), e.g. ``api_path("api", "v1", "namespaces", ns, "pods", name)``."""
    out = []
    for seg in segments:
        if not seg or seg in (".", ".."):
            raise ValueError(f"invalid path segment {seg!r}")
        out.append(seg if _UNRESERVED.fullmatch(seg) else quote(seg, safe=""))
    return "/" + "/".join(out)


class ApiserverHTTP:
    """One apiserver, its client's connection pool and credentials; JSON bytes in and out."""

    def __init__(self, api_client: Any, timeout_s: float = TIMEOUT_S) -> None:
        self.cfg = api_client.configuration
        self.pool: urllib3.PoolManager = api_client.rest_client.pool_manager
        self.base = str(self.cfg.host).rstrip("/")
        self.timeout = urllib3.Timeout(connect=timeout_s, read=timeout_s)
        self._headers = {"Accept": "application/json", "User-Agent": "qgpu-extender"}

    def _auth_headers(self) -> dict[str, str]:
        headers = dict(self._headers)
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, bytes]:
        """(HTTP status, body) of one call; `path` from `api_path`."""
        headers = self._auth_headers()
        if content_type:
            headers["Content-Type"] = content_type
        resp = self.pool.request(
            method,
            self.base + path,
            body=body,
            headers=headers,
            timeout=self.timeout,
            retries=False,
            redirect=False,
            preload_content=True,
        )
        return resp.status, resp.data
