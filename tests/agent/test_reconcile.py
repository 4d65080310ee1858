"""Reconcile: slices of dead owners are released, live and unknown owners keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enforcement.agent.models import ReserveRequest
from enforcement.agent.reconcile import (
    Liveness,
    OwnerRegistry,
    check_pid,
    default_registry,
    pod_checker,
    proc_start_time,
)
from enforcement.agent.service import Agent
from qgpu.errors import RuleViolation
from qgpu.model import Owner, OwnerKind, SliceRequest
from tests.agent.conftest import FakeBackend, make_agent

SMALL = SliceRequest(core=10, memory_gib=4)


def reserve(agent: Agent, owner: Owner) -> str:
    return agent.reserve(ReserveRequest(request=SMALL, owner=owner)).slice_id


def test_dead_pid_is_released_and_live_pid_kept(agent: Agent) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_slice = reserve(agent, Owner(kind=OwnerKind.PID, id=str(child.pid)))
        live_slice = reserve(agent, Owner(kind=OwnerKind.PID, id=str(os.getpid())))
        limits = agent.config.slices_dir / dead_slice / "limits.conf"
        assert limits.exists()
        assert agent.reconcile() == []  # both alive
        child.kill()
        child.wait()
        assert agent.reconcile() == [dead_slice]
        assert agent.ledger.get(dead_slice) is None
        assert not limits.exists()
        assert agent.ledger.get(live_slice) is not None
        assert agent.counters.reconcile_released == 1
    finally:
        child.kill()


def test_reused_pid_is_dead_by_start_time() -> None:
    me = str(os.getpid())
    started = str(proc_start_time(os.getpid()))
    assert check_pid(Owner(kind=OwnerKind.PID, id=me, meta={"start_time": started})) == "alive"
    other_start = str(int(started) + 12345)
    reused = Owner(kind=OwnerKind.PID, id=me, meta={"start_time": other_start})
    assert check_pid(reused) == Liveness.DEAD


def test_other_pid_namespace_is_unknown() -> None:
    owner = Owner(kind=OwnerKind.PID, id="999999", meta={"pidns": "pid:[1]"})
    assert check_pid(owner) == Liveness.UNKNOWN


def test_zombie_is_dead() -> None:
    child = subprocess.Popen(["true"])
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert check_pid(Owner(kind=OwnerKind.PID, id=str(child.pid))) == Liveness.DEAD
    child.wait()


def test_unknown_kinds_and_failing_checkers_keep_slices(agent: Agent) -> None:
    ray = reserve(agent, Owner(kind=OwnerKind.RAY_ACTOR, id="actor-1"))
    manual = reserve(agent, Owner(kind=OwnerKind.MANUAL, id="me"))

    def broken(owner: Owner) -> Liveness:
        raise RuntimeError("cluster unreachable")

    agent.registry.register(OwnerKind.RAY_ACTOR, broken)
    assert agent.reconcile() == []
    agent.registry.register(OwnerKind.RAY_ACTOR, lambda o: Liveness.DEAD)
    assert agent.reconcile() == [ray]
    assert agent.ledger.get(manual) is not None


def test_pod_checker(tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    check = pod_checker(pods)
    owner = Owner(kind=OwnerKind.POD, id="0b7c6f0e-uid")
    assert check(owner) == Liveness.UNKNOWN  # no kubelet here
    pods.mkdir()
    assert check(owner) == Liveness.DEAD
    (pods / owner.id).mkdir()
    assert check(owner) == Liveness.ALIVE
    assert check(Owner(kind=OwnerKind.POD, id="../etc")) == Liveness.UNKNOWN


def test_dask_worker_uses_its_pid() -> None:
    registry = default_registry(Path("/nonexistent"))
    me = Owner(kind=OwnerKind.DASK_WORKER, id="tcp://10.0.0.1:4000", meta={"pid": str(os.getpid())})
    assert registry.check(me) == Liveness.ALIVE
    gone = Owner(kind=OwnerKind.DASK_WORKER, id="tcp://10.0.0.1:4001", meta={"pid": "999999999"})
    assert registry.check(gone) == Liveness.DEAD
    assert registry.check(Owner(kind=OwnerKind.DASK_WORKER, id="x")) == Liveness.UNKNOWN


def test_registry_kinds() -> None:
    registry = OwnerRegistry()
    assert registry.check(Owner(kind=OwnerKind.PID, id="1")) == Liveness.UNKNOWN
    registry.register("pid", check_pid)
    assert registry.kinds() == ["pid"]


def test_reconcile_on_start_releases_dead_owner(state_dir: Path, backend: FakeBackend) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    first = make_agent(state_dir, backend)
    sid = reserve(first, Owner(kind=OwnerKind.PID, id=str(child.pid)))
    first.close()
    child.kill()
    child.wait()
    second = make_agent(state_dir, backend)
    assert second.ledger.get(sid) is None
    second.close()


def test_dask_worker_owner_records_its_process_and_is_reaped(agent: Agent) -> None:
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = Owner(
            kind=OwnerKind.DASK_WORKER, id="tcp://127.0.0.1:4000", meta={"pid": str(worker.pid)}
        )
        res = agent.reserve(ReserveRequest(request=SMALL, owner=owner))
        assert res.owner.meta["start_time"] == str(proc_start_time(worker.pid))
        assert agent.reconcile() == []
        worker.kill()
        worker.wait()
        assert agent.reconcile() == [res.slice_id]
        gone = Owner(
            kind=OwnerKind.DASK_WORKER, id="tcp://127.0.0.1:4001", meta={"pid": str(worker.pid)}
        )
        with pytest.raises(RuleViolation) as exc:
            agent.reserve(ReserveRequest(request=SMALL, owner=gone))
        assert exc.value.field == "owner.meta.pid"
    finally:
        worker.kill()
