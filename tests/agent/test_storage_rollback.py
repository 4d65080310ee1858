"""A reservation whose slice files cannot be made leaves nothing behind — even when the
disk is read-only for the ledger too, so that a committed row could not be deleted again.

The agent makes a new slice's files inside the ledger transaction that records it, before
the commit (`Ledger.reserve(prepare=...)`): files that cannot be made roll the transaction
back, which SQLite does without writing anything. The in-process tests below make the
file system and SQLite fail with the errors a read-only disk gives (``EROFS``, "attempt to
write a readonly database"); tests/agent/test_readonly_state.py does it on a real
read-only mount.
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from enforcement.agent.app import create_app
from enforcement.agent.service import Agent
from tests.agent.conftest import FakeBackend, make_agent, slice_dirs


def _rows_and_dirs(agent: Agent, state_dir: Path) -> tuple[set[str], set[str]]:
    rows = {a.slice_id for a in agent.ledger.allocations("node-a")}
    dirs = slice_dirs(state_dir)
    return rows, dirs


def _read_only(*_a: object, **_k: object) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


def _readonly_db(*_a: object, **_k: object) -> bool:
    raise sqlite3.OperationalError("attempt to write a readonly database")


@pytest.mark.parametrize("path", ["/v1/slices", "/v1/slices/record"])
def test_files_failing_on_a_read_only_disk_leave_no_orphan_row(
    agent: Agent,
    backend: FakeBackend,
    state_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    client = TestClient(create_app(agent), raise_server_exceptions=False)
    kept = client.post("/v1/slices", json={"request": {"core": 30, "memory": 8}})
    assert kept.status_code == 201, kept.text
    kept_id = kept.json()["slice_id"]

    # the disk turns read-only: the slice's files fail, and so would any ledger write after
    monkeypatch.setattr(agent.tree, "create", _read_only)
    monkeypatch.setattr(agent.ledger, "release", _readonly_db)
    body: dict[str, object] = {"request": {"core": 20, "memory": 4}, "slice_id": "s-ro"}
    if path.endswith("record"):
        body["device_uuids"] = [backend.gpus[1].uuid]
    r = client.post(path, json=body)
    assert r.status_code == 503, r.text
    assert r.json()["field"] == "state_dir" and "read-only" in r.json()["rule"]
    assert client.get("/v1/slices/s-ro").status_code == 404
    monkeypatch.undo()

    # nothing was committed: a restart finds only the kept slice, and no directory of s-ro
    agent.close()
    again = make_agent(state_dir, backend)
    try:
        assert _rows_and_dirs(again, state_dir) == ({kept_id}, {kept_id})
        # the id is free: a retry once the disk works makes the slice whole
        retried = TestClient(create_app(again)).post(path, json=body)
        assert retried.status_code == 201, retried.text
        assert _rows_and_dirs(again, state_dir) == ({kept_id, "s-ro"}, {kept_id, "s-ro"})
    finally:
        again.close()


def test_a_repeated_reservation_whose_files_fail_keeps_its_slice(
    agent: Agent, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeat of an acknowledged reservation never undoes it, whatever its files do."""
    client = TestClient(create_app(agent), raise_server_exceptions=False)
    body = {"request": {"core": 20, "memory": 4}, "slice_id": "s-1"}
    assert client.post("/v1/slices", json=body).status_code == 201
    monkeypatch.setattr(agent.tree, "create", _read_only)
    r = client.post("/v1/slices", json=body)
    assert r.status_code == 503, r.text
    monkeypatch.undo()
    assert _rows_and_dirs(agent, state_dir) == ({"s-1"}, {"s-1"})
    assert client.post("/v1/slices", json=body).status_code == 201
