"""Each GPU's roster (``slices/.gpu-<uuid>/roster``) lists exactly the slices placed on it,
with their policy and share, through reservations, releases and restarts; each listed slice
has its activity file; the agent's busy list (``.gpu-<uuid>/busy``) is made with the
directory and emptied at each start; the layout of older versions (one writable
``gpu-<uuid>.region`` per GPU, a ``gpu-<uuid>.busy`` beside it) is removed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from enforcement.busy_view import BusySlice, BusyView
from enforcement.gpu_roster import (
    ROSTER_MAX,
    WRITER_AGENT,
    WRITER_PLUGIN,
    RosterEntry,
    RosterFull,
    read_roster,
)
from enforcement.state_tree import Identity, StateTree, activity_file, busy_file, gpu_dir
from qgpu.model import IsolationPolicy, SliceRequest
from tests.agent.conftest import FakeBackend, h100, make_agent

FS = IsolationPolicy.FIXED_SHARE


def listed(agent: Agent, gpu: int = 0) -> dict[str, tuple[int, int, int]]:
    roster = gpu_dir(agent.config.slices_dir, h100(gpu).uuid) / "roster"
    return {e.slice_id: (e.policy, e.core, e.writer) for e in read_roster(roster)}


def test_reserve_lists_release_unlists(agent: Agent) -> None:
    a = agent.reserve(
        ReserveRequest(request=SliceRequest(core=30, memory_gib=4, isolation="fs"), slice_id="a")
    )
    b = agent.reserve(
        ReserveRequest(request=SliceRequest(core=20, memory_gib=4, isolation="bs"), slice_id="b")
    )
    on = {a.device_uuid: {}, b.device_uuid: {}}
    on[a.device_uuid]["a"] = (1, 30, WRITER_AGENT)
    on[b.device_uuid]["b"] = (2, 20, WRITER_AGENT)
    for gpu in (0, 1):
        assert listed(agent, gpu) == on.get(h100(gpu).uuid, {})
    root = agent.config.slices_dir
    assert activity_file(root, a.device_uuid, "a").is_file()
    agent.release("a")
    assert "a" not in listed(agent, [h100(0).uuid, h100(1).uuid].index(a.device_uuid))
    assert not activity_file(root, a.device_uuid, "a").exists()
    assert activity_file(root, b.device_uuid, "b").is_file()


def test_a_restart_lists_exactly_the_agent_s_slices(state_dir: Path, backend: FakeBackend) -> None:
    agent = make_agent(state_dir, backend, gpu_placement="binpack")
    agent.reserve(
        ReserveRequest(request=SliceRequest(core=30, memory_gib=4, isolation="fs"), slice_id="a")
    )
    agent.close()
    root = state_dir / "slices"
    uuid = h100(0).uuid
    tree = StateTree(root, privileged=False)
    # a crash left an entry of the agent's for a slice it no longer holds, the device
    # plugin listed a pod's slice, and an older version left its region and busy files
    tree.join_gpu(uuid, "gone", Identity.current(), FS, 10, WRITER_AGENT)
    tree.join_gpu(uuid, "pod.c0", Identity.current(), FS, 10, WRITER_PLUGIN)
    (root / f"gpu-{uuid}.region").write_bytes(b"\0" * 64)
    (root / f"gpu-{uuid}.busy").write_bytes(b"\0" * 64)
    again = make_agent(state_dir, backend)
    try:
        assert listed(again) == {"a": (1, 30, WRITER_AGENT), "pod.c0": (1, 10, WRITER_PLUGIN)}
        assert not activity_file(root, uuid, "gone").exists()
        assert activity_file(root, uuid, "pod.c0").exists()
        assert not (root / f"gpu-{uuid}.region").exists()
        assert not (root / f"gpu-{uuid}.busy").exists()
    finally:
        again.close()


def test_the_busy_list_is_made_with_the_gpu_s_directory_and_emptied_at_start(
    state_dir: Path, backend: FakeBackend
) -> None:
    """Every GPU gets .gpu-<uuid>/busy (0640: only the agent writes it, the GPU's workloads
    read it with the directory they are given); a list left by an earlier run (or from
    before a reboot, whose monotonic clock started again) names nobody after a start."""
    agent = make_agent(state_dir, backend)
    root = state_dir / "slices"
    agent.close()
    for gpu in (0, 1):
        path = busy_file(root, h100(gpu).uuid)
        assert path.parent == gpu_dir(root, h100(gpu).uuid)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
        view = BusyView(path)
        view.write([BusySlice("stale", 50)], 3600.0)
        view.close()
    again = make_agent(state_dir, backend)
    try:
        for gpu in (0, 1):
            view = BusyView(busy_file(root, h100(gpu).uuid))
            assert view.read() == ([], 0)
            view.close()
    finally:
        again.close()


def test_a_full_roster_refuses_and_idle_plugin_entries_make_room(tmp_path: Path) -> None:
    tree = StateTree(tmp_path, privileged=False)
    uuid = h100(0).uuid
    me = Identity.current()
    for i in range(ROSTER_MAX):
        tree.join_gpu(uuid, f"s{i}", me, FS, 1, WRITER_PLUGIN if i % 2 else WRITER_AGENT)
    with pytest.raises(RosterFull):
        tree.join_gpu(uuid, "one-more", me, FS, 1, WRITER_PLUGIN)
    assert tree.evict_idle(uuid, WRITER_PLUGIN, 3600.0) == []  # just made: not idle
    gone = tree.evict_idle(uuid, WRITER_PLUGIN, 0.0)
    assert sorted(gone) == sorted(f"s{i}" for i in range(1, ROSTER_MAX, 2))
    tree.join_gpu(uuid, "one-more", me, FS, 1, WRITER_PLUGIN)
    entries = {e.slice_id: e for e in tree.gpu_entries(uuid)}
    assert entries["one-more"] == RosterEntry("one-more", 1, 1, WRITER_PLUGIN)
    assert len(entries) == ROSTER_MAX // 2 + 1
