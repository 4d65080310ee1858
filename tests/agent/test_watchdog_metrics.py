"""Watchdog (over-cap and unowned GPU processes) and the Prometheus metrics it feeds."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from enforcement.agent.app import create_app
from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from enforcement.agent.watchdog import Watchdog
from enforcement.busy_view import BusySlice, BusyView
from enforcement.discovery import GpuProcess, UtilSample
from enforcement.state_tree import busy_file
from qgpu.model import Owner, OwnerKind, SliceRequest
from tests.agent.conftest import FakeBackend

GIB = 1 << 30


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def spawn(children: list[subprocess.Popen], slice_id: str | None) -> int:
    env = dict(os.environ)
    env.pop("QGPU_SLICE_ID", None)
    if slice_id:
        env["QGPU_SLICE_ID"] = slice_id
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    children.append(p)
    return p.pid


def share(agent: Agent, core: int = 20, memory: int = 4, owner: Owner | None = None) -> str:
    req = ReserveRequest(request=SliceRequest(core=core, memory_gib=memory), owner=owner or Owner())
    return agent.reserve(req).slice_id


def samples(agent: Agent, client: TestClient | None = None) -> dict[str, list]:
    text = (client or TestClient(create_app(agent))).get("/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(found: dict[str, list], name: str, **labels: str) -> float:
    for s in found[name.removesuffix("_total")]:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name} {labels}")


def test_over_cap_process_is_reported_once_with_a_json_line(
    agent: Agent, backend: FakeBackend, children: list, caplog: pytest.LogCaptureFixture
) -> None:
    sid = share(agent, memory=4)
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    good, bypass = spawn(children, sid), spawn(children, sid)
    backend.procs = [GpuProcess(uuid, good, 1 * GIB), GpuProcess(uuid, bypass, 5 * GIB)]
    wd = agent.watchdog
    assert wd is not None
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        report = wd.scan()
        wd.scan()
    assert {(e.pid, e.action) for e in report.over_cap} == {
        (good, "reported"),
        (bypass, "reported"),
    }
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    over = [x for x in lines if x["event"] == "qgpu.watchdog.over_cap"]
    assert len(over) == 2  # once per process, not once per scan
    assert over[0]["slice"] == sid and over[0]["limit_bytes"] == 4 * GIB
    assert over[0]["slice_used_bytes"] == 6 * GIB
    found = samples(agent)
    assert value(found, "qgpu_watchdog_over_cap_total", slice=sid, device_uuid=uuid) == 2
    assert value(found, "qgpu_watchdog_over_cap_processes", slice=sid) == 2
    assert all(c.poll() is None for c in children)  # not configured to kill


def test_kill_removes_the_largest_until_under_the_cap(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    sid = share(agent, memory=4)
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    small, big = spawn(children, sid), spawn(children, sid)
    backend.procs = [GpuProcess(uuid, small, 2 * GIB), GpuProcess(uuid, big, 3 * GIB)]
    report = Watchdog(agent, kill="all").scan()
    actions = {e.pid: e.action for e in report.over_cap}
    assert actions == {big: "killed", small: "reported"}
    children[1].wait(timeout=10)
    assert children[1].returncode == -9
    assert children[0].poll() is None
    assert agent.counters.watchdog_kills[(uuid, sid)] == 1


@pytest.mark.parametrize("kill", ["default", "share"])
def test_share_slices_over_their_memory_cap_are_killed_after_the_grace_period(
    agent: Agent,
    backend: FakeBackend,
    children: list,
    caplog: pytest.LogCaptureFixture,
    kill: str,
) -> None:
    """By default (`all`) a fixed-share and a best-effort slice over their 4 GiB caps are
    both killed once the grace has passed: memory is a hard cap whatever the isolation.
    With `share` the best-effort one is only reported."""
    fixed = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="fs"))
    ).slice_id
    best = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="be"))
    ).slice_id
    uuid = agent.ledger.get(fixed).gpu_uuids[0]
    assert agent.ledger.get(best).gpu_uuids[0] == uuid
    hostile, bypass = spawn(children, fixed), spawn(children, best)
    backend.procs = [GpuProcess(uuid, hostile, 5 * GIB), GpuProcess(uuid, bypass, 5 * GIB)]
    now = [100.0]
    policy = agent.config.watchdog_kill if kill == "default" else kill
    assert agent.config.watchdog_kill == "all"  # the node's default
    wd = Watchdog(agent, kill=policy, grace_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        first = {e.pid: e.action for e in wd.scan().over_cap}
        now[0] += 9.9
        within = {e.pid: e.action for e in wd.scan().over_cap}
        now[0] += 0.1
        after = {e.pid: e.action for e in wd.scan().over_cap}
    assert first == within == {hostile: "reported", bypass: "reported"}
    killed = [hostile, bypass] if policy == "all" else [hostile]
    assert after == {p: "killed" if p in killed else "reported" for p in (hostile, bypass)}
    for child in children[: len(killed)]:
        child.wait(timeout=10)
    assert [c.returncode for c in children] == [-9 if c.pid in killed else None for c in children]
    events = [json.loads(r.getMessage()) for r in caplog.records]
    kills = [e for e in events if e["action"] == "killed"]
    slices = {hostile: fixed, bypass: best}
    assert sorted((e["pid"], e["slice"]) for e in kills) == sorted((p, slices[p]) for p in killed)
    assert value(samples(agent), "qgpu_watchdog_kills_total", slice=fixed) == 1
    if policy == "all":
        assert value(samples(agent), "qgpu_watchdog_kills_total", slice=best) == 1
    else:
        with pytest.raises(AssertionError, match="no sample"):
            value(samples(agent), "qgpu_watchdog_kills_total", slice=best)


def test_the_grace_period_restarts_when_a_slice_comes_back_under_its_cap(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    sid = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="bs"))
    ).slice_id
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    pid = spawn(children, sid)
    now = [0.0]
    wd = Watchdog(agent, kill="share", grace_s=5, clock=lambda: now[0])
    seen = []
    for used, at in ((5, 0.0), (3, 4.0), (5, 8.0), (5, 12.0), (5, 13.0)):
        now[0] = at
        backend.procs = [GpuProcess(uuid, pid, used * GIB)]
        seen.append([e.action for e in wd.scan().over_cap])
    # over at 0, under at 4: the 5 s are counted again from 8, so the kill comes at 13
    assert seen == [["reported"], [], ["reported"], ["reported"], ["killed"]]
    children[0].wait(timeout=10)


def test_kill_off_only_reports(agent: Agent, backend: FakeBackend, children: list) -> None:
    sid = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="fs"))
    ).slice_id
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    backend.procs = [GpuProcess(uuid, spawn(children, sid), 5 * GIB)]
    assert [e.action for e in Watchdog(agent, kill="off").scan().over_cap] == ["reported"]


def test_processes_within_cap_and_owner_pid_attribution(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    owner_pid = spawn(children, None)
    sid = share(agent, memory=8, owner=Owner(kind=OwnerKind.PID, id=str(owner_pid)))
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    stranger = spawn(children, None)
    backend.procs = [GpuProcess(uuid, owner_pid, 3 * GIB), GpuProcess(uuid, stranger, GIB)]
    backend.util = {(uuid, owner_pid): UtilSample(17, 1)}
    report = agent.watchdog.scan()
    assert report.over_cap == []
    assert [p.pid for p in report.unowned] == [stranger]
    info = agent.slices().slices[0]
    assert info.usage.memory_used_bytes == 3 * GIB
    assert info.usage.pids == [owner_pid]
    assert info.usage.core_used_percent == 17
    found = samples(agent)
    assert value(found, "qgpu_watchdog_unowned_processes", device_uuid=uuid) == 1
    assert value(found, "qgpu_slice_memory_used_bytes", slice=sid) == 3 * GIB
    assert value(found, "qgpu_slice_core_used_percent", slice=sid) == 17


def test_whole_gpu_slices_have_no_cap(agent: Agent, backend: FakeBackend, children: list) -> None:
    sid = agent.reserve(ReserveRequest(request=SliceRequest(core=100))).slice_id
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    backend.procs = [GpuProcess(uuid, spawn(children, sid), 70 * GIB)]
    assert agent.watchdog.scan().over_cap == []


def test_metrics_names_labels_and_counters(agent: Agent, backend: FakeBackend) -> None:
    client = TestClient(create_app(agent))
    sid = client.post(
        "/v1/slices",
        json={"request": {"core": 30, "memory": 8, "isolation": "bs"}, "owner": {"id": "job"}},
    ).json()["slice_id"]
    client.post("/v1/slices", json={"request": {"core": 130, "memory": 8}})
    big = {"request": {"core": 99, "memory": 80}}
    assert [client.post("/v1/slices", json=big).status_code for _ in range(3)] == [201, 409, 409]
    client.delete(f"/v1/slices/{sid}")
    client.delete(f"/v1/slices/{sid}")
    found = samples(agent, client)
    assert all(name.startswith("qgpu_") for name in found)
    node = "node-a"
    assert value(found, "qgpu_agent_reservations_total", node=node, result="ok") == 2
    assert value(found, "qgpu_agent_reservations_total", result="invalid") == 1
    assert value(found, "qgpu_agent_reservations_total", result="no-fit") == 2
    assert value(found, "qgpu_agent_releases_total", reason="request") == 1
    assert value(found, "qgpu_agent_releases_total", reason="already-gone") == 1
    uuid0, uuid1 = backend.gpus[0].uuid, backend.gpus[1].uuid
    assert value(found, "qgpu_device_memory_total_bytes", device_uuid=uuid0) == 80 * GIB
    assert value(found, "qgpu_device_core_committed_percent", device_uuid=uuid0) == 0
    assert value(found, "qgpu_device_core_committed_percent", device_uuid=uuid1) == 99
    assert value(found, "qgpu_device_memory_committed_bytes", device_uuid=uuid1) == 80 * GIB
    assert value(found, "qgpu_device_healthy", device_uuid=uuid0) == 1
    live = agent.slices().slices[0]
    labels = {"slice": live.slice_id, "device_uuid": live.device_uuid, "owner": "manual:"}
    assert value(found, "qgpu_slice_memory_limit_bytes", **labels) == 80 * GIB
    assert value(found, "qgpu_slice_core_limit_percent", **labels) == 99
    assert value(found, "qgpu_slice_info", policy="best-effort", enforcement="interposer") == 1
    assert found["qgpu_agent_errors"] == []
    timing = {
        (x.labels["method"], x.labels["route"], x.labels["status"]): x.value
        for x in found["qgpu_agent_request_duration_seconds"]
        if x.name.endswith("_count")
    }
    assert timing[("POST", "/v1/slices", "201")] == 2
    assert timing[("POST", "/v1/slices", "409")] == 2
    assert timing[("DELETE", "/v1/slices/{slice_id}", "200")] == 2


def test_a_fixed_share_slice_over_its_core_is_killed_after_the_grace(
    agent: Agent, backend: FakeBackend, children: list, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML's samples of a 20 % fixed-share slice: over 20 + 15 in every new sample for the
    grace (and at least two samples) -> its busiest process is killed, the other one left
    because what remains fits. A scan that finds no new sample judges nothing."""
    sid = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="fs"))
    ).slice_id
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    busy, quiet = spawn(children, sid), spawn(children, sid)
    backend.procs = [GpuProcess(uuid, busy, GIB), GpuProcess(uuid, quiet, GIB)]
    now = [0.0]
    wd = Watchdog(agent, kill="share", grace_s=5, clock=lambda: now[0])
    seen = []
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        for at, sample_us in ((0.0, 1), (3.0, 1), (4.0, 2), (5.0, 2), (6.0, 3)):
            now[0] = at
            backend.util = {
                (uuid, busy): UtilSample(40, sample_us),
                (uuid, quiet): UtilSample(10, sample_us),
            }
            seen.append({e.pid: e.action for e in wd.scan().over_core})
    assert seen[0] == seen[2] == {busy: "reported", quiet: "reported"}
    assert seen[1] == seen[3] == {}  # the same sample again: nothing new to judge
    assert seen[4] == {busy: "killed", quiet: "reported"}  # 50 - 40 fits 20 + 15
    children[0].wait(timeout=10)
    assert children[0].returncode == -9 and children[1].poll() is None
    events = [json.loads(r.getMessage()) for r in caplog.records]
    over = [e for e in events if e["event"] == "qgpu.watchdog.over_core"]
    assert [(e["pid"], e["action"]) for e in over] == [
        (busy, "reported"),
        (quiet, "reported"),
        (busy, "killed"),
    ]  # each process reported once per episode, then the kill
    assert over[0]["slice_util_percent"] == 50 and over[0]["core_percent"] == 20
    found = samples(agent)
    assert value(found, "qgpu_watchdog_over_core_total", slice=sid) == 3
    assert value(found, "qgpu_watchdog_kills_total", slice=sid) == 1


def reserve(agent: Agent, iso: str, core: int = 20) -> str:
    req = ReserveRequest(request=SliceRequest(core=core, memory_gib=4, isolation=iso))
    return agent.reserve(req).slice_id


def scan_core(
    wd: Watchdog, backend: FakeBackend, now: list[float], uuid: str, at: float, use: dict[int, int]
) -> list[tuple[str, str]]:
    """One scan at `at` with a new NVML sample per pid; the compute events it produced."""
    now[0] = at
    backend.util = {(uuid, pid): UtilSample(u, int(at * 10) + 1) for pid, u in use.items()}
    return [(e.slice_id, e.action) for e in wd.scan().over_core]


def test_the_fixed_share_check_restarts_under_the_margin(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    fixed, burst, best = (reserve(agent, iso) for iso in ("fs", "bs", "be"))
    uuid = agent.ledger.get(fixed).gpu_uuids[0]
    pids = {sid: spawn(children, sid) for sid in (fixed, burst, best)}
    backend.procs = [GpuProcess(uuid, pid, GIB) for pid in pids.values()]
    now = [0.0]
    wd = Watchdog(agent, kill="all", grace_s=2, core_margin=10, clock=lambda: now[0])
    seen = []
    # the fixed-share slice at 31 (over 20 + 10), 30 (within), then over again from t=3;
    # its neighbours idle: a fixed-share slice is held to its core whatever they do
    for at, util in ((0.0, 31), (1.0, 30), (3.0, 31), (4.0, 31), (5.0, 31)):
        use = {pids[fixed]: util, pids[burst]: 0, pids[best]: 0}
        seen.append(scan_core(wd, backend, now, uuid, at, use))
    assert seen == [
        [(fixed, "reported")],
        [],
        [(fixed, "reported")],
        [(fixed, "reported")],
        [(fixed, "killed")],
    ]
    assert all(children[i].poll() is None for i in (1, 2))


def test_a_burst_share_slice_is_held_to_its_share_only_while_a_neighbour_is_busy(
    agent: Agent, backend: FakeBackend, children: list, caplog: pytest.LogCaptureFixture
) -> None:
    """A 20 % burst-share slice at 60 %: nothing while its neighbour idles (it may borrow
    idle compute), nothing at the first scan that sees the neighbour busy (the interposer
    learns of it from that scan), then over 20 + 10 until the grace ends it. Under the
    default policy (share)."""
    burst, fixed = reserve(agent, "bs"), reserve(agent, "fs")
    uuid = agent.ledger.get(burst).gpu_uuids[0]
    b, f = spawn(children, burst), spawn(children, fixed)
    backend.procs = [GpuProcess(uuid, b, GIB), GpuProcess(uuid, f, GIB)]
    now = [0.0]
    wd = Watchdog(agent, kill="share", grace_s=2, core_margin=10, clock=lambda: now[0])
    plan = [(0.0, 0), (1.0, 0), (2.0, 10), (3.0, 10), (4.0, 0), (5.0, 10), (6.0, 10), (7.0, 10),
            (8.0, 10)]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        seen = [scan_core(wd, backend, now, uuid, at, {b: 60, f: n}) for at, n in plan]
    assert seen == [
        [], [], [],  # neighbour idle, idle, busy for the first time
        [(burst, "reported")],
        [],  # the neighbour idles again: the episode ends
        [], [(burst, "reported")], [(burst, "reported")],
        [(burst, "killed")],  # 2 s over since t=6
    ]  # fmt: skip
    children[0].wait(timeout=10)
    assert children[0].returncode == -9 and children[1].poll() is None
    events = [json.loads(r.getMessage()) for r in caplog.records]
    over = [e for e in events if e["event"] == "qgpu.watchdog.over_core"]
    assert over[-1]["action"] == "killed"
    assert over[-1]["isolation"] == "burst-share"
    assert over[-1]["allowed_percent"] == 20 and over[-1]["busy_slices"] == [fixed]
    assert value(samples(agent), "qgpu_watchdog_kills_total", slice=burst) == 1


def test_best_effort_slices_take_only_what_the_busy_guaranteed_slices_leave(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    """A busy 30 % fixed-share slice leaves 70 %, split between the busy best-effort slices:
    one alone may use 70 + 10, two 35 + 10 each. Best-effort slices alone on the GPU are
    never judged. The default policy (share) kills them: they took a share slice's promise."""
    fixed = reserve(agent, "fs", core=30)
    be1, be2 = reserve(agent, "be"), reserve(agent, "be")
    uuid = agent.ledger.get(fixed).gpu_uuids[0]
    f, e1, e2 = spawn(children, fixed), spawn(children, be1), spawn(children, be2)
    backend.procs = [GpuProcess(uuid, pid, GIB) for pid in (f, e1, e2)]
    now = [0.0]
    wd = Watchdog(agent, kill="share", grace_s=2, core_margin=10, clock=lambda: now[0])
    plan = [
        (0.0, {f: 0, e1: 100, e2: 0}),  # nobody guaranteed busy: a best-effort slice may burst
        (1.0, {f: 20, e1: 80, e2: 0}),  # busy now, not before: not judged yet
        (2.0, {f: 20, e1: 80, e2: 0}),  # 80 <= 70 + 10
        (3.0, {f: 20, e1: 81, e2: 0}),  # over
        (4.0, {f: 20, e1: 45, e2: 45}),  # two busy best-effort slices: 35 + 10 each
        (5.0, {f: 20, e1: 46, e2: 46}),
        (6.0, {f: 20, e1: 46, e2: 46}),
        (7.0, {f: 20, e1: 46, e2: 46}),
    ]
    seen = [scan_core(wd, backend, now, uuid, at, use) for at, use in plan]
    assert seen == [
        [], [], [],
        [(be1, "reported")],
        [],
        [(be1, "reported"), (be2, "reported")],
        [(be1, "reported"), (be2, "reported")],
        [(be1, "killed"), (be2, "killed")],
    ]  # fmt: skip
    assert children[0].poll() is None


def test_the_watchdog_publishes_the_busy_slices_for_the_interposer(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    burst, fixed, idle = reserve(agent, "bs"), reserve(agent, "fs", core=30), reserve(agent, "be")
    uuid = agent.ledger.get(burst).gpu_uuids[0]
    assert {agent.ledger.get(s).gpu_uuids[0] for s in (fixed, idle)} == {uuid}
    pids = [spawn(children, sid) for sid in (burst, fixed, idle)]
    backend.procs = [GpuProcess(uuid, pid, GIB) for pid in pids]
    backend.util = {(uuid, pid): UtilSample(u, 5) for pid, u in zip(pids, (40, 25, 0), strict=True)}
    wd = Watchdog(agent, kill="share", interval_s=2)
    wd.scan()
    views = {g.uuid: BusyView(busy_file(agent.tree.root, g.uuid)) for g in agent.inventory.gpus}
    try:
        listed, until = views[uuid].read()
        assert sorted(listed, key=lambda b: b.slice_id) == sorted(
            [BusySlice(burst, 40), BusySlice(fixed, 25)], key=lambda b: b.slice_id
        )
        assert 0 < until - time.monotonic_ns() <= int(7e9)  # 3 intervals + 1 s
        other = next(u for u in views if u != uuid)
        assert views[other].read()[0] == []
        st = os.stat(busy_file(agent.tree.root, uuid))
        assert stat.S_IMODE(st.st_mode) == 0o640  # only the agent writes it
        backend.util = {}
        backend.procs = []
        wd.scan()
        assert views[uuid].read()[0] == []  # nobody busy any more
    finally:
        for v in views.values():
            v.close()


def test_kill_off_reports_a_slice_over_its_core_without_killing(
    agent: Agent, backend: FakeBackend, children: list
) -> None:
    sid = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="fs"))
    ).slice_id
    uuid = agent.ledger.get(sid).gpu_uuids[0]
    pid = spawn(children, sid)
    backend.procs = [GpuProcess(uuid, pid, GIB)]
    now = [0.0]
    wd = Watchdog(agent, kill="off", grace_s=0, clock=lambda: now[0])
    for at in range(4):
        now[0] = float(at)
        backend.util = {(uuid, pid): UtilSample(90, at + 1)}
        assert [e.action for e in wd.scan().over_core] == ["reported"]
    assert children[0].poll() is None


def test_changed_gpu_settings_are_set_back_and_counted(
    agent: Agent, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU's compute mode and accounting mode stay what the first scan found: a change
    (root going around the interposer) is set back at the next scan, logged and counted;
    one the agent cannot set back is logged once, not once per scan."""
    uuid = backend.gpus[0].uuid
    backend.settings = {uuid: {"compute_mode": 0, "accounting_mode": 1}}
    wd = Watchdog(agent)
    assert wd.scan().settings == []  # the first scan only records
    backend.settings[uuid] = {"compute_mode": 2, "accounting_mode": 0}  # PROHIBITED, off
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        changed = wd.scan().settings
    assert {(c.setting, c.found, c.expected, c.action) for c in changed} == {
        ("compute_mode", 2, 0, "restored"),
        ("accounting_mode", 0, 1, "restored"),
    }
    assert backend.settings[uuid] == {"compute_mode": 0, "accounting_mode": 1}
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert {x["setting"] for x in lines if x["event"] == "qgpu.watchdog.gpu_setting"} == {
        "compute_mode",
        "accounting_mode",
    }
    found = samples(agent)
    restored = "qgpu_watchdog_gpu_settings_restored_total"
    assert value(found, restored, device_uuid=uuid, setting="compute_mode") == 1
    assert wd.scan().settings == []  # set back: nothing more to do
    backend.settings[uuid]["compute_mode"] = 3
    backend.refuse_settings = "Insufficient Permissions"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        first, second = wd.scan().settings, wd.scan().settings
    assert first[0].action == second[0].action == "not_restored: Insufficient Permissions"
    assert len(caplog.records) == 1
    assert value(samples(agent), restored, device_uuid=uuid, setting="compute_mode") == 1
