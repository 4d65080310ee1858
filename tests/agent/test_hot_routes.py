"""`HotRoutes` (reserve and release answered without FastAPI's routing and request
handling) must answer exactly as FastAPI does: status, headers and body, for valid
requests and for every kind of refusal. One agent, two apps over it (with and without the
hot routes), the same requests to both; the agent's counters move the same way."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from enforcement.agent.app import create_app
from enforcement.agent.service import Agent

JSON = {"content-type": "application/json"}
OK = {"request": {"core": 10, "memory": 4}}


@pytest.fixture
def clients(agent: Agent) -> Iterator[tuple[TestClient, TestClient]]:
    hot = TestClient(create_app(agent), raise_server_exceptions=False)
    plain = TestClient(create_app(agent, hot_routes=False), raise_server_exceptions=False)
    with hot, plain:
        yield hot, plain


def _answer(client: TestClient, method: str, path: str, body: bytes | None, headers: dict) -> Any:
    r = client.request(method, path, content=body, headers=headers)
    drop = {"date", "server"}
    return r.status_code, sorted((k, v) for k, v in r.headers.items() if k not in drop), r.content


def _same(
    clients: tuple[TestClient, TestClient],
    agent: Agent,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict | None = None,
) -> tuple[int, bytes]:
    """Ask both apps (hot first); the answers and the counters' moves must be equal."""
    hot, plain = clients
    before = _counts(agent)
    headers = JSON if headers is None else headers
    a = _answer(hot, method, path, body, headers)
    moved = _diff(before, _counts(agent))
    before = _counts(agent)
    b = _answer(plain, method, path, body, headers)
    assert a == b, (method, path, body, headers)
    assert moved == _diff(before, _counts(agent))
    return a[0], a[2]


def _counts(agent: Agent) -> dict[str, int]:
    c = agent.counters
    return {
        **{f"r.{k}": v for k, v in c.reservations.items()},
        **{f"l.{k}": v for k, v in c.releases.items()},
        **{f"e.{k}": v for k, v in c.errors.items()},
    }


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


BAD_BODIES: list[tuple[bytes | None, dict[str, str]]] = [
    (None, JSON),
    (b"", JSON),
    (b"null", JSON),
    (b"[]", JSON),
    (b'"x"', JSON),
    (b"{}", JSON),
    (json.dumps(OK).encode(), {"content-type": "text/plain"}),
    (json.dumps(OK).encode(), {}),
    (b"{", JSON),
    (b"\xff\xfe", JSON),
    (b'{"request": {"core": "\\ud800", "memory": 4}}', JSON),
    (b"[" * 100 + b"]" * 100, JSON),
    (json.dumps({**OK, "unknown": 1}).encode(), JSON),
    (json.dumps({"request": {"core": 10**30, "memory": 4}}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4}, "slice_id": ".."}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4}, "slice_id": "a\n"}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4}, "owner": {"kind": "pid"}}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4}, "uid": -1}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4}, "expires_s": -1}).encode(), JSON),
    (json.dumps({"request": {"core": 250, "memory": 4}}).encode(), JSON),
    (json.dumps({"request": {"core": 10, "memory": 4000}}).encode(), JSON),
]


@pytest.mark.parametrize(("body", "headers"), BAD_BODIES)
def test_refused_reservations_are_answered_alike(
    clients: tuple[TestClient, TestClient], agent: Agent, body: bytes | None, headers: dict
) -> None:
    status, _ = _same(clients, agent, "POST", "/v1/slices", body, headers)
    assert 400 <= status < 500
    assert agent.ledger.allocations("node-a") == []


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "application/x+json",
    ],
)
def test_a_reservation_and_its_repeat_are_answered_alike(
    clients: tuple[TestClient, TestClient], agent: Agent, content_type: str
) -> None:
    body = json.dumps({**OK, "slice_id": "s-1", "owner": {"id": "me"}}).encode()
    headers = {"content-type": content_type}
    first = _answer(clients[0], "POST", "/v1/slices", body, headers)
    assert first[0] == 201
    # the repeat (same id and owner: the same slice) through both apps
    status, answer = _same(clients, agent, "POST", "/v1/slices", body, headers)
    assert status == 201 and answer == first[2]
    assert [a.slice_id for a in agent.ledger.allocations("node-a")] == ["s-1"]


def test_releases_are_answered_alike(clients: tuple[TestClient, TestClient], agent: Agent) -> None:
    hot, plain = clients
    for app in (hot, plain):
        r = app.post("/v1/slices", json={**OK, "slice_id": "s-1"})
        assert r.status_code == 201
        assert app.delete("/v1/slices/s-1").json() == {"slice_id": "s-1", "released": True}
    for sid in ["s-1", "never", "record", "a" * 64]:  # already gone: released false
        assert _same(clients, agent, "DELETE", f"/v1/slices/{sid}")[0] == 200
    for sid in [".", "..", ".x", "a" * 65, "a%0A", "-x", "a%2Fb", "a/b", "", "%2e%2e"]:
        assert _same(clients, agent, "DELETE", f"/v1/slices/{sid}")[0] in (404, 405, 422)
    _same(clients, agent, "DELETE", "/v1/slices/s-1/")
    _same(clients, agent, "DELETE", "/v1/slices/s-1?x=1")


def test_agent_refusals_are_answered_alike(
    clients: tuple[TestClient, TestClient], agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = json.dumps({"request": {"core": 60, "memory": 4}}).encode()
    hot, _plain = clients
    assert hot.post("/v1/slices", json={"request": {"core": 60, "memory": 4}}).status_code == 201
    assert hot.post("/v1/slices", json={"request": {"core": 60, "memory": 4}}).status_code == 201
    assert _same(clients, agent, "POST", "/v1/slices", body)[0] == 409  # no GPU has room

    def read_only(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(agent.tree, "create", read_only)
    small = json.dumps(OK).encode()
    assert _same(clients, agent, "POST", "/v1/slices", small)[0] == 503
    monkeypatch.undo()

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(agent, "reserve", broken)
    monkeypatch.setattr(agent, "release", broken)
    assert _same(clients, agent, "POST", "/v1/slices", small)[0] == 500
    assert _same(clients, agent, "DELETE", "/v1/slices/x")[0] == 500


def test_the_hot_routes_skip_fastapi_s_request_handling(
    clients: tuple[TestClient, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Otherwise the comparisons above compare FastAPI with itself."""
    import fastapi.routing

    solved: list[str] = []
    real = fastapi.routing.solve_dependencies

    async def counting(*a: Any, **k: Any) -> Any:
        solved.append(k["request"].url.path)
        return await real(*a, **k)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    hot, plain = clients
    sid = hot.post("/v1/slices", json=OK).json()["slice_id"]
    hot.delete(f"/v1/slices/{sid}")
    assert solved == []
    hot.post("/v1/slices", json={"request": {"core": "x"}})  # invalid: FastAPI answers
    assert solved == ["/v1/slices"]
    sid = plain.post("/v1/slices", json=OK).json()["slice_id"]
    plain.delete(f"/v1/slices/{sid}")
    assert solved == ["/v1/slices", "/v1/slices", f"/v1/slices/{sid}"]


def test_the_openapi_document_is_unchanged(agent: Agent) -> None:
    assert create_app(agent).openapi() == create_app(agent, hot_routes=False).openapi()
