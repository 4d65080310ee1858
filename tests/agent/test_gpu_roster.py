"""Each GPU's roster (``slices/.gpu-<uuid>/roster``) lists exactly the slices placed on it,
with their policy and share, through reservations, releases and restarts; each listed slice
has its activity file; the layout of older versions (one writable ``gpu-<uuid>.region``
per GPU) is removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from enforcement.gpu_roster import (
    ROSTER_MAX,
    WRITER_AGENT,
    WRITER_PLUGIN,
    RosterEntry,
    RosterFull,
    read_roster,
)
from enforcement.state_tree import Identity, StateTree, activity_file, gpu_dir
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
    # plugin listed a pod's slice, and an older version left its region file
    tree.join_gpu(uuid, "gone", Identity.current(), FS, 10, WRITER_AGENT)
    tree.join_gpu(uuid, "pod.c0", Identity.current(), FS, 10, WRITER_PLUGIN)
    (root / f"gpu-{uuid}.region").write_bytes(b"\0" * 64)
    again = make_agent(state_dir, backend)
    try:
        assert listed(again) == {"a": (1, 30, WRITER_AGENT), "pod.c0": (1, 10, WRITER_PLUGIN)}
        assert not activity_file(root, uuid, "gone").exists()
        assert activity_file(root, uuid, "pod.c0").exists()
        assert not (root / f"gpu-{uuid}.region").exists()
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
