"""Python clients of the node agent (sync and asyncio), for the CLI and the adapters.

``AgentClient(socket_path=...)`` talks over the unix socket; ``AgentClient(url=...,
token=...)`` over loopback TCP with the bearer token. Answers are the API's pydantic
models. A 4xx/5xx answer raises `AgentError` carrying the agent's field, value and rule
(and ``reasons`` for a no-fit); a connection failure raises `AgentUnavailable`.

``reserve`` and ``record`` are idempotent: ``reserve`` always sends a ``slice_id`` (a new
random one unless the caller names one), and both retry with the same id when the answer
is lost (a timeout, a broken connection) or the agent is briefly unavailable (503), so a
retry returns the slice the first attempt made instead of a second one. ``expires_s``
asks for a lease the holder keeps with ``renew`` (the agent releases the slice when it
runs out); ``renew(slice_id, None)`` ends the lease.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Self

import httpx

from enforcement.agent.config import DEFAULT_SOCKET, SOCKET_ENV
from enforcement.agent.models import (
    DeviceList,
    Health,
    NodeInfo,
    ReleaseResult,
    Reservation,
    SliceList,
)
from qgpu.errors import QgpuError, RuleViolation
from qgpu.model import Owner, SliceRequest, new_slice_id

UDS_BASE_URL = "http://qgpu-agent"
WRITE_ATTEMPTS = 4
RETRY_BACKOFF_S = 0.25


class AgentError(QgpuError):
    """The agent refused a request; `field`, `value`, `rule` say why."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        self.error = str(body.get("error", "error"))
        self.field = str(body.get("field", "request"))
        self.value = body.get("value")
        self.rule = str(body.get("rule", body))
        self.reasons: dict[str, int] = dict(body.get("reasons") or {})
        self.violations: list[dict[str, Any]] = list(body.get("violations") or [])
        super().__init__(
            f"agent answered {status} {self.error}: {self.field}={self.value!r}: {self.rule}"
        )

    @property
    def is_no_fit(self) -> bool:
        return self.status == 409

    def as_violation(self) -> RuleViolation:
        return RuleViolation(self.field, self.value, self.rule)


class AgentUnavailable(QgpuError):
    """The agent could not be reached (not running, wrong socket, no permission)."""


def default_socket() -> Path:
    return Path(os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


def _request_json(request: SliceRequest | dict[str, Any]) -> dict[str, Any]:
    if isinstance(request, SliceRequest):
        return request.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    return dict(request)


def _reserve_body(
    request: SliceRequest | dict[str, Any],
    owner: Owner | dict[str, Any] | None,
    slice_id: str,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"request": _request_json(request), "slice_id": slice_id}
    if owner is not None:
        body["owner"] = owner.model_dump(mode="json") if isinstance(owner, Owner) else dict(owner)
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _retryable(exc: QgpuError) -> bool:
    """Worth repeating with the same slice id: the answer was lost, or the agent said 503."""
    return isinstance(exc, AgentUnavailable) or (isinstance(exc, AgentError) and exc.status == 503)


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = {"error": "error", "field": "response", "rule": response.text[:500]}
        if not isinstance(body, dict):
            body = {"error": "error", "field": "response", "rule": str(body)[:500]}
        raise AgentError(response.status_code, body)
    return response


def _connection(
    socket_path: str | os.PathLike[str] | None, url: str | None, token: str | None
) -> tuple[str, dict[str, str], str | None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if url is not None:
        return url.rstrip("/"), headers, None
    return UDS_BASE_URL, headers, str(socket_path or default_socket())


class AgentClient:
    """Blocking client. Thread-safe (httpx.Client is); use one per process."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        base, headers, uds = _connection(socket_path, url, token)
        self.where = uds or base
        # plain HTTP over a unix socket: no TLS, so no CA bundle to load (~30 ms of CPU in
        # every Ray worker that records its slice)
        transport = httpx.HTTPTransport(uds=uds, verify=False) if uds else None
        self._http = httpx.Client(
            base_url=base, headers=headers, timeout=timeout, transport=transport
        )

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return _check(self._http.request(method, path, **kw))
        except httpx.TransportError as exc:
            raise AgentUnavailable(f"cannot reach the qgpu agent at {self.where}: {exc}") from exc

    def node(self) -> NodeInfo:
        return NodeInfo.model_validate_json(self._call("GET", "/v1/node").content)

    def devices(self) -> DeviceList:
        return DeviceList.model_validate_json(self._call("GET", "/v1/devices").content)

    def _idempotent(self, path: str, body: dict[str, Any]) -> Reservation:
        """POST `body` (which names its slice) until an answer comes, at most
        `WRITE_ATTEMPTS` times."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                return Reservation.model_validate_json(self._call("POST", path, json=body).content)
            except (AgentUnavailable, AgentError) as exc:
                if not _retryable(exc) or attempt == WRITE_ATTEMPTS - 1:
                    raise
            time.sleep(RETRY_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def reserve(
        self,
        request: SliceRequest | dict[str, Any],
        owner: Owner | dict[str, Any] | None = None,
        slice_id: str | None = None,
        *,
        expires_s: float | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> Reservation:
        """Reserve a slice (idempotent: see the module); `expires_s` asks for a lease."""
        body = _reserve_body(
            request, owner, slice_id or new_slice_id(), expires_s=expires_s, uid=uid, gid=gid
        )
        return self._idempotent("/v1/slices", body)

    def record(
        self,
        slice_id: str,
        request: SliceRequest | dict[str, Any],
        device_uuids: list[str],
        owner: Owner | dict[str, Any] | None = None,
        *,
        expires_s: float | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> Reservation:
        """Have the agent account for and enforce a slice placed elsewhere (idempotent)."""
        body = _reserve_body(request, owner, slice_id, expires_s=expires_s, uid=uid, gid=gid)
        body["device_uuids"] = list(device_uuids)
        return self._idempotent("/v1/slices/record", body)

    def renew(self, slice_id: str, expires_s: float | None) -> Reservation:
        """Renew the slice's lease for `expires_s` seconds from now (None: end the lease)."""
        response = self._call("POST", f"/v1/slices/{slice_id}/lease", json={"expires_s": expires_s})
        return Reservation.model_validate_json(response.content)

    def get(self, slice_id: str) -> Reservation:
        return Reservation.model_validate_json(self._call("GET", f"/v1/slices/{slice_id}").content)

    def release(self, slice_id: str) -> ReleaseResult:
        return ReleaseResult.model_validate_json(
            self._call("DELETE", f"/v1/slices/{slice_id}").content
        )

    def slices(self) -> SliceList:
        return SliceList.model_validate_json(self._call("GET", "/v1/slices").content)

    def health(self) -> Health:
        return Health.model_validate_json(self._call("GET", "/v1/health").content)

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAgentClient:
    """asyncio client with the same methods (for many concurrent calls)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 60.0,
        max_connections: int = 100,
    ) -> None:
        base, headers, uds = _connection(socket_path, url, token)
        self.where = uds or base
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        transport = (
            httpx.AsyncHTTPTransport(uds=uds, limits=limits, verify=False) if uds else None
        )  # plain HTTP over a unix socket: no TLS
        self._http = httpx.AsyncClient(
            base_url=base, headers=headers, timeout=timeout, transport=transport, limits=limits
        )

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return _check(await self._http.request(method, path, **kw))
        except httpx.TransportError as exc:
            raise AgentUnavailable(f"cannot reach the qgpu agent at {self.where}: {exc}") from exc

    async def node(self) -> NodeInfo:
        return NodeInfo.model_validate_json((await self._call("GET", "/v1/node")).content)

    async def devices(self) -> DeviceList:
        return DeviceList.model_validate_json((await self._call("GET", "/v1/devices")).content)

    async def reserve(
        self,
        request: SliceRequest | dict[str, Any],
        owner: Owner | dict[str, Any] | None = None,
        slice_id: str | None = None,
        *,
        expires_s: float | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> Reservation:
        """Reserve a slice (idempotent, retried with the same slice id)."""
        body = _reserve_body(
            request, owner, slice_id or new_slice_id(), expires_s=expires_s, uid=uid, gid=gid
        )
        for attempt in range(WRITE_ATTEMPTS):
            try:
                response = await self._call("POST", "/v1/slices", json=body)
                return Reservation.model_validate_json(response.content)
            except (AgentUnavailable, AgentError) as exc:
                if not _retryable(exc) or attempt == WRITE_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    async def renew(self, slice_id: str, expires_s: float | None) -> Reservation:
        response = await self._call(
            "POST", f"/v1/slices/{slice_id}/lease", json={"expires_s": expires_s}
        )
        return Reservation.model_validate_json(response.content)

    async def release(self, slice_id: str) -> ReleaseResult:
        response = await self._call("DELETE", f"/v1/slices/{slice_id}")
        return ReleaseResult.model_validate_json(response.content)

    async def slices(self) -> SliceList:
        return SliceList.model_validate_json((await self._call("GET", "/v1/slices")).content)

    async def health(self) -> Health:
        return Health.model_validate_json((await self._call("GET", "/v1/health")).content)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AgentClient", "AgentError", "AgentUnavailable", "AsyncAgentClient", "default_socket"]
