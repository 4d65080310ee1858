"""The slice files' short paths (issue 18, agent speed): a new slice's objects are made with
their modes instead of being made, inspected and changed; a GPU's roster is searched, not
unpacked entry by entry, and the agent keeps it open between edits; a released slice's
directory goes by name. Each must end exactly where the careful path ended."""

from __future__ import annotations

import errno
import os
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from enforcement.gpu_roster import ROSTER_MAX, WRITER_AGENT, WRITER_PLUGIN, RosterEntry, read_roster
from enforcement.limits import read_limits_file, write_limits_file
from enforcement.state_tree import Identity, StateTree, gpu_dir
from qgpu.model import IsolationPolicy
from tests.agent.conftest import REPO, h100

FS = IsolationPolicy.FIXED_SHARE
ME = Identity.current()
UUID = h100(0).uuid


def _modes(root: Path, sid: str) -> dict[str, int]:
    d = root / sid
    paths = {
        "dir": d,
        "limits": d / "limits.conf",
        "ledger dir": d / "ledger",
        "ledger": d / "ledger" / f"slice-{sid}.ledger",
        "activity": gpu_dir(root, UUID) / f"{sid}.activity",
    }
    return {k: stat.S_IMODE(p.lstat().st_mode) for k, p in paths.items()}


DOCUMENTED = {
    "dir": 0o750,
    "limits": 0o440,
    "ledger dir": 0o700,
    "ledger": 0o600,
    "activity": 0o640,
}


def _make(tree: StateTree, sid: str) -> None:
    tree.create(sid, ME)
    tree.write_limits(sid, {"QGPU_SLICE_ID": sid, "QGPU_CORE_LIMIT": "30"}, ME)
    tree.join_gpu(UUID, sid, ME, FS, 30, WRITER_AGENT)


@pytest.mark.parametrize("keep", [False, True])
def test_a_new_slice_gets_the_documented_modes_and_no_temporary_file(
    tmp_path: Path, keep: bool
) -> None:
    tree = StateTree(tmp_path, privileged=False, keep_rosters=keep)
    tree.prepare()
    _make(tree, "s-1")
    assert _modes(tmp_path, "s-1") == DOCUMENTED
    assert sorted(p.name for p in (tmp_path / "s-1").iterdir()) == ["ledger", "limits.conf"]
    assert read_limits_file(tmp_path / "s-1" / "limits.conf")["QGPU_CORE_LIMIT"] == "30"
    tree.close()


def test_modes_hold_under_a_umask_that_would_take_bits(tmp_path: Path) -> None:
    """The short path gives modes at creation; a umask of 077 (which would make the slice
    directory 0700, its limits file 0400 and its activity file 0600: the workload's group
    could read none of them) is detected and the modes are set after all."""
    script = (
        "import os, sys\n"
        "os.umask(0o077)\n"
        "from pathlib import Path\n"
        "from tests.agent.test_slice_files import _make, _modes\n"
        "from enforcement.state_tree import StateTree\n"
        "root = Path(sys.argv[1])\n"
        "tree = StateTree(root, privileged=False, keep_rosters=True)\n"
        "tree.prepare()\n"
        "_make(tree, 's-u')\n"
        "print(sorted(_modes(root, 's-u').items()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == str(sorted(DOCUMENTED.items()))


def test_an_existing_limits_file_is_replaced_whole_not_rewritten_in_place(tmp_path: Path) -> None:
    """Only a directory made by this tree gets its limits file written in place; a slice
    whose directory existed (a restart repairing it) gets a new file by rename, so a process
    reading the old one never sees half of the new one."""
    tree = StateTree(tmp_path, privileged=False)
    _make(tree, "s-1")
    limits = tmp_path / "s-1" / "limits.conf"
    before = limits.stat().st_ino
    again = StateTree(tmp_path, privileged=False)  # a restarted agent
    again.create("s-1", ME)
    again.write_limits("s-1", {"QGPU_SLICE_ID": "s-1", "QGPU_CORE_LIMIT": "40"}, ME)
    assert limits.stat().st_ino != before
    assert read_limits_file(limits)["QGPU_CORE_LIMIT"] == "40"
    assert stat.S_IMODE(limits.stat().st_mode) == 0o440


def test_a_new_limits_file_never_replaces_one_and_is_whole_or_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from enforcement import limits as mod

    values = {"QGPU_CORE_LIMIT": "30"}
    existing = tmp_path / "a.conf"
    existing.write_text("kept\n")
    with pytest.raises(FileExistsError):
        write_limits_file(existing, values, new=True)
    assert existing.read_text() == "kept\n"
    link = tmp_path / "link.conf"
    link.symlink_to(tmp_path / "target.conf")
    with pytest.raises(FileExistsError):
        write_limits_file(link, values, new=True)
    assert not (tmp_path / "target.conf").exists()

    def fail(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mod.os, "write", fail)
    with pytest.raises(OSError):
        write_limits_file(tmp_path / "b.conf", values, new=True)
    assert not (tmp_path / "b.conf").exists()


def test_a_released_slice_s_directory_goes_with_whatever_its_workload_left(tmp_path: Path) -> None:
    tree = StateTree(tmp_path, privileged=False)
    _make(tree, "s-1")
    (tmp_path / "s-1" / "ledger" / "core.1234").write_text("x")  # the workload's own file
    (tmp_path / "s-1" / "ledger" / "sub").mkdir()
    tree.remove("s-1")
    assert not (tmp_path / "s-1").exists()
    # a symlink in a slice's place goes alone: what it points to is untouched
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "limits.conf").write_text("x")
    (victim / "ledger").mkdir()
    (tmp_path / "s-2").symlink_to(victim)
    tree.remove("s-2")
    assert not (tmp_path / "s-2").is_symlink()
    assert (victim / "limits.conf").exists() and (victim / "ledger").is_dir()


@pytest.mark.parametrize("keep", [False, True])
def test_roster_edits_match_a_model(tmp_path: Path, keep: bool) -> None:
    """Random puts and removes (ids that are prefixes of one another, updates of policy and
    share, entries of another writer) leave exactly the entries a plain dictionary says."""
    tree = StateTree(tmp_path, privileged=False, keep_rosters=keep)
    tree.ensure_gpu(UUID)
    rng = random.Random(18)
    ids = ["a", "ab", "abc", "b", "a.b", "a-b", "x" * 64, "x" * 63, "s-1", "s-10", "s-100"]
    ids += [f"p{i}" for i in range(ROSTER_MAX)]
    model: dict[str, RosterEntry] = {}
    for _ in range(2000):
        sid = rng.choice(ids)
        if rng.random() < 0.55 and (sid in model or len(model) < ROSTER_MAX):
            e = RosterEntry(sid, rng.randint(0, 2), rng.randint(1, 100), rng.choice([1, 2]))
            tree._edit(UUID, lambda r, e=e: r.put(e))
            model[sid] = e
        else:
            removed: list[bool] = []
            tree._edit(UUID, lambda r, s=sid, out=removed: out.append(r.remove(s)))
            assert removed == [sid in model]
            model.pop(sid, None)
        if rng.random() < 0.05:
            on_file = {e.slice_id: e for e in read_roster(gpu_dir(tmp_path, UUID) / "roster")}
            assert on_file == model
    on_file = {e.slice_id: e for e in read_roster(gpu_dir(tmp_path, UUID) / "roster")}
    assert on_file == model
    tree.close()


def test_a_kept_roster_that_was_replaced_is_opened_again(tmp_path: Path) -> None:
    tree = StateTree(tmp_path, privileged=False, keep_rosters=True)
    tree.ensure_gpu(UUID)
    _make(tree, "s-1")
    roster = gpu_dir(tmp_path, UUID) / "roster"
    roster.unlink()  # an operator (or a restore) put a new file there
    tree.ensure_gpu(UUID)
    _make(tree, "s-2")
    assert [e.slice_id for e in read_roster(roster)] == ["s-2"]
    tree.leave_gpu(UUID, "s-2")
    assert read_roster(roster) == []
    tree.close()


def test_threads_sharing_a_kept_roster_lose_no_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept descriptor's flock does not exclude threads of one process (they share it):
    the tree's own lock must, or two puts could take the same free entry. Each thread lists
    and unlists its own slices; every unlisting must find what its thread listed. (Each
    search for a free entry gives the other threads their turn.)"""
    from enforcement.gpu_roster import RosterEdit

    free_index = RosterEdit._free_index

    def yielding(self: RosterEdit) -> int | None:
        found = free_index(self)
        time.sleep(0)
        return found

    monkeypatch.setattr(RosterEdit, "_free_index", yielding)
    tree = StateTree(tmp_path, privileged=False, keep_rosters=True)
    tree.ensure_gpu(UUID)
    lost: list[str] = []
    start = threading.Barrier(3)

    def churn(prefix: str) -> None:
        start.wait()
        for _cycle in range(30):
            ids = [f"{prefix}{k}" for k in range(40)]
            for sid in ids:
                e = RosterEntry(sid, 1, 10, WRITER_PLUGIN)
                tree._edit(UUID, lambda r, e=e: r.put(e))
            for sid in ids:
                found: list[bool] = []
                tree._edit(UUID, lambda r, s=sid, out=found: out.append(r.remove(s)))
                if found != [True]:
                    lost.append(sid)

    threads = [threading.Thread(target=churn, args=(p,)) for p in ("t1-", "t2-", "t3-")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lost == []
    assert read_roster(gpu_dir(tmp_path, UUID) / "roster") == []
    tree.close()


def test_the_agent_closes_its_kept_rosters(tmp_path: Path) -> None:
    before = sorted(os.listdir("/proc/self/fd"))
    tree = StateTree(tmp_path, privileged=False, keep_rosters=True)
    _make(tree, "s-1")
    assert len(os.listdir("/proc/self/fd")) > len(before)  # the roster stays open
    tree.close()
    assert sorted(os.listdir("/proc/self/fd")) == before
