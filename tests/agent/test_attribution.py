"""Attribution of GPU processes to slices by evidence a process cannot forge, and the
watchdog's rule for processes of no slice (the rules: `enforcement.agent.attribution`).

Real processes, real cgroups (made by the tests in a private subtree, see `tests.cgroups`;
kubelet's layouts faked there), a fake GPU backend that lists them as GPU processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.agent import attribution
from enforcement.agent.attribution import SliceCgroups, is_mps_server, pod_of_path
from enforcement.agent.models import ReserveRequest
from enforcement.agent.reconcile import proc_start_time
from enforcement.agent.service import Agent
from enforcement.agent.watchdog import Watchdog
from enforcement.discovery import GpuProcess
from qgpu.errors import RuleViolation
from qgpu.model import Owner, OwnerKind, SliceRequest
from tests.agent.conftest import FakeBackend, make_agent
from tests.agent.test_watchdog_metrics import samples, value
from tests.cgroups import Sandbox, cgroup_sandbox, cgroupfs_pod, own_cgroup, systemd_pod
from tests.helpers import wait_until

__all__ = ["cgroup_sandbox"]  # a fixture of this module

GIB = 1 << 30
UID = "0f3c2a9e-5b1d-4c7e-9a2f-6d8e1b4c3a70"


class Procs:
    """Processes a test starts (killed at its end)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def sleep(self, claim: str | None = None, argv: list[str] | None = None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "QGPU_SLICE_ID"}
        if claim is not None:
            env["QGPU_SLICE_ID"] = claim
        p = subprocess.Popen(argv or ["sleep", "120"], env=env)
        self.started.append(p)
        return p.pid

    def tree(self, box: Sandbox, where: str, claim: str | None = None) -> tuple[int, int]:
        """A shell (the owner to be) with a child it forked: (shell, child)."""
        pid = self.sleep(claim, ["sh", "-c", "sleep 120 & wait"])
        box.move(pid, where)
        child = wait_until(lambda: _children(pid), timeout=10)[0]
        if own_cgroup(child) != box.path(where):  # forked before the move
            box.move(child, where)
        return pid, child


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    for proc in p.started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture
def cg_agent(cgroup_sandbox: Sandbox, state_dir: Path, backend: FakeBackend) -> Iterator[Agent]:
    a = make_agent(state_dir, backend, slice_cgroups="on")
    yield a
    a.close()


def reserve(agent: Agent, owner: Owner | None = None, memory: int = 4, iso: str = "fs") -> str:
    req = SliceRequest(core=20, memory_gib=memory, isolation=iso)
    return agent.reserve(ReserveRequest(request=req, owner=owner or Owner())).slice_id


def pid_owner(pid: int) -> Owner:
    return Owner(kind=OwnerKind.PID, id=str(pid))


def uuid_of(agent: Agent, sid: str) -> str:
    alloc = agent.ledger.get(sid)
    assert alloc is not None
    return alloc.gpu_uuids[0]


def owners(agent: Agent, procs: list[GpuProcess]) -> dict[int, str | None]:
    by_slice, unowned = agent.attribute(agent.ledger.allocations(agent.node), procs)
    out: dict[int, str | None] = {p.pid: None for p in unowned}
    for sid, mine in by_slice.items():
        out.update({p.pid: sid for p in mine})
    return out


# -- kubelet's cgroup names -----------------------------------------------------------------


@pytest.mark.parametrize("qos", ["guaranteed", "burstable", "besteffort"])
@pytest.mark.parametrize("layout", [systemd_pod, cgroupfs_pod])
def test_kubelet_cgroup_paths_name_their_pod(layout, qos: str) -> None:
    path = "/" + layout(qos, UID, "a" * 64)
    # the components up to the pod's own directory: all but the container's
    assert pod_of_path(path) == (UID, path.count("/"))
    assert pod_of_path("/some/prefix" + path)[0] == UID  # type: ignore[index]


@pytest.mark.parametrize(
    "path",
    [
        # kind / nested kubelets under systemd
        "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-ab.scope",
        # read from inside another pod's cgroup namespace: the common top shows as ..
        f"/../../besteffort/pod{UID}/abc",
        f"/../../../kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}"
        ".slice/cri-containerd-ab.scope",
    ],
)
def test_nested_and_namespaced_kubelet_paths(path: str) -> None:
    found = pod_of_path(path)
    assert found is not None and found[0] == UID


@pytest.mark.parametrize(
    "path",
    [
        "/",
        f"/user.slice/pod{UID}/x",  # no kubepods above it
        "/system.slice/docker-0123.scope",
        f"/kubepods/burstable/pod{UID[:-1]}/x",  # not a UID
    ],
)
def test_other_paths_name_no_pod(path: str) -> None:
    assert pod_of_path(path) is None


# -- the agent's per-slice cgroups ----------------------------------------------------------


def owner_cgroup(box: Sandbox, where: str, pid: int) -> str:
    return box.path(f"{where}/qgpu-pid-{pid}-{proc_start_time(pid)}")


def test_the_owner_and_its_children_move_into_its_cgroup_and_back_at_release(
    cgroup_sandbox: Sandbox, cg_agent: Agent, procs: Procs
) -> None:
    owner, child = procs.tree(cgroup_sandbox, "worker")
    sid = reserve(cg_agent, pid_owner(owner))
    mine = owner_cgroup(cgroup_sandbox, "worker", owner)
    assert cg_agent.cgroups.path_of(sid) == mine
    assert own_cgroup(owner) == own_cgroup(child) == mine
    later = procs.sleep()  # not a child: stays where it is
    assert own_cgroup(later) != mine
    assert (cg_agent.config.state_dir / "cgroups" / sid).read_text().strip() == mine
    assert cg_agent.release(sid).released
    assert own_cgroup(owner) == own_cgroup(child) == cgroup_sandbox.path("worker")
    assert not cgroup_sandbox.mount.joinpath(mine.lstrip("/")).exists()
    assert cg_agent.cgroups.path_of(sid) is None


def test_an_owners_slices_share_its_cgroup_until_the_last_and_a_restart_keeps_them(
    cgroup_sandbox: Sandbox, cg_agent: Agent, backend: FakeBackend, procs: Procs
) -> None:
    """A unit of the node that happens to be named like the agent's cgroups is still only
    the base. One cgroup per owner: a Dask cluster's client holds all its workers' slices."""
    w = "qgpu-ray.service"
    owner, child = procs.tree(cgroup_sandbox, w)
    first = reserve(cg_agent, pid_owner(owner))
    second = reserve(cg_agent, pid_owner(owner))
    mine = owner_cgroup(cgroup_sandbox, w, owner)
    assert own_cgroup(owner) == own_cgroup(child) == mine
    # a second owner started by the first: its own cgroup, beside the first's
    inner = procs.sleep()
    cgroup_sandbox.move(inner, mine.removeprefix(cgroup_sandbox.path("") + "/"))
    third = reserve(cg_agent, pid_owner(inner))
    assert own_cgroup(inner) == owner_cgroup(cgroup_sandbox, w, inner)
    cg_agent.close()
    again = make_agent(cg_agent.config.state_dir, backend, slice_cgroups="on")
    try:
        assert again.cgroups.paths() == {
            first: mine,
            second: mine,
            third: owner_cgroup(cgroup_sandbox, w, inner),
        }
        again.release(first)
        assert own_cgroup(owner) == mine  # its second slice still holds it
        again.release(second)
        again.release(third)
        assert again.cgroups.paths() == {}
        assert own_cgroup(owner) == own_cgroup(inner) == cgroup_sandbox.path(w)
    finally:
        again.close()


def test_slice_cgroups_on_refuses_to_start_without_cgroup_v2(
    state_dir: Path, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attribution, "find_cgroup_v2", lambda: None)
    with pytest.raises(RuleViolation) as err:
        make_agent(state_dir, backend, slice_cgroups="on")
    assert err.value.field == "slice_cgroups" and "not mounted" in str(err.value)
    assert not SliceCgroups(state_dir / "cg", "auto", privileged=True).enabled


# -- the rule -------------------------------------------------------------------------------


def test_a_claim_that_contradicts_the_cgroup_is_never_believed(
    cgroup_sandbox: Sandbox, cg_agent: Agent, procs: Procs
) -> None:
    """A process in slice A's owner's cgroup that names slice B, a manual slice whose only
    evidence is the environment: A's. A tenant cgroup named like A's is not A's."""
    owner, _ = procs.tree(cgroup_sandbox, "a")
    a = reserve(cg_agent, pid_owner(owner))
    b = reserve(cg_agent)  # manual: no process, no pod, no cgroup
    gpu = uuid_of(cg_agent, a)
    assert uuid_of(cg_agent, b) == gpu
    mine = cg_agent.cgroups.path_of(a)
    assert mine is not None
    framer = procs.sleep(claim=b)
    cgroup_sandbox.move(framer, mine.removeprefix(cgroup_sandbox.path("") + "/"))
    believed = procs.sleep(claim=b)
    fake = procs.sleep(claim=b)
    cgroup_sandbox.move(fake, "tenant/" + mine.rpartition("/")[2])  # a delegated user could
    found = owners(cg_agent, [GpuProcess(gpu, p, GIB) for p in (framer, believed, fake)])
    assert found == {framer: a, believed: b, fake: b}


FAMILY = """
import os, subprocess, sys, time
kids = []
for claim in sys.argv[1:]:
    env = {k: v for k, v in os.environ.items() if k != "QGPU_SLICE_ID"}
    if claim != "-":
        env["QGPU_SLICE_ID"] = claim
    kids.append(subprocess.Popen(["sleep", "120"], env=env))
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("cgroups", ["on", "off"])
def test_an_owner_of_several_slices_is_one_tenant_whose_environment_picks(
    cgroup_sandbox: Sandbox, state_dir: Path, backend: FakeBackend, procs: Procs, cgroups: str
) -> None:
    """A Dask SliceCluster's client process owns every worker's slice and the workers are
    its children: each worker's QGPU_SLICE_ID picks among its owner's slices, never one of
    another owner's (then, as with none, the first of its owner's)."""
    agent = make_agent(state_dir, backend, slice_cgroups=cgroups)
    s1, s2, theirs = (f"s-{uuid.uuid4().hex[:12]}" for _ in range(3))
    claims = [s1, s2, theirs, "-"]
    client = subprocess.Popen(
        [sys.executable, "-c", FAMILY, *claims], stdout=subprocess.PIPE, text=True
    )
    procs.started.append(client)  # type: ignore[arg-type]
    assert client.stdout is not None
    kids = [int(x) for x in client.stdout.readline().split()]
    try:
        cgroup_sandbox.move(client.pid, "client")
        for kid in kids:
            cgroup_sandbox.move(kid, "client")
        other, _ = procs.tree(cgroup_sandbox, "other")
        for sid, owner in ((s1, client.pid), (s2, client.pid), (theirs, other)):
            req = SliceRequest(core=20, memory_gib=4, isolation="fs")
            agent.reserve(ReserveRequest(request=req, owner=pid_owner(owner), slice_id=sid))
        gpu = uuid_of(agent, s1)
        assert uuid_of(agent, s2) == uuid_of(agent, theirs) == gpu
        if cgroups == "on":
            assert {own_cgroup(k) for k in kids} == {agent.cgroups.path_of(s1)}
        found = owners(agent, [GpuProcess(gpu, k, GIB) for k in kids])
        first = min(s1, s2)
        assert found == dict(zip(kids, [s1, s2, first, first], strict=True))
    finally:
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        agent.close()


def test_without_cgroups_descent_from_the_owner_decides(
    agent: Agent, procs: Procs, cgroup_sandbox: Sandbox
) -> None:
    assert not agent.cgroups.enabled  # --test-mode: auto makes none
    owner, child = procs.tree(cgroup_sandbox, "x")
    a = reserve(agent, pid_owner(owner))
    gpu = uuid_of(agent, a)
    stranger = procs.sleep(claim=a)  # names the pid-owned slice: not its descendant
    found = owners(agent, [GpuProcess(gpu, p, GIB) for p in (owner, child, stranger)])
    assert found == {owner: a, child: a, stranger: None}


def test_a_pod_process_is_its_pods_and_a_forged_pod_cgroup_is_nobodys(
    cgroup_sandbox: Sandbox, agent: Agent, procs: Procs
) -> None:
    gpu = agent.inventory.gpus[0].uuid
    pod_a, pod_b = str(uuid.uuid4()), str(uuid.uuid4())

    def record(pod: str, container: str) -> str:
        from enforcement.agent.models import RecordRequest

        body = RecordRequest(
            slice_id=f"{pod}.{container}",
            request=SliceRequest(core=10, memory_gib=4, isolation="fs"),
            device_uuids=[gpu],
            owner=Owner(kind=OwnerKind.POD, id=pod, meta={"container": container}),
        )
        return agent.record(body).slice_id

    a_main, a_side, b_main = record(pod_a, "main"), record(pod_a, "side"), record(pod_b, "main")
    in_a = procs.sleep(claim=b_main)  # names another pod's slice
    cgroup_sandbox.move(in_a, systemd_pod("burstable", pod_a, "c1"))
    side = procs.sleep(claim=a_side)  # its own pod's second container
    cgroup_sandbox.move(side, systemd_pod("burstable", pod_a, "c2"))
    forged = procs.sleep(claim=b_main)
    where = cgroupfs_pod("besteffort", pod_b, "c3")
    cgroup_sandbox.move(forged, where)
    os.chown(cgroup_sandbox.root / where.rsplit("/", 1)[0], 65534, 65534)  # not kubelet's
    host = procs.sleep(claim=b_main)  # on the host, naming a pod's slice
    other_gpu = agent.inventory.gpus[1].uuid
    listed = [GpuProcess(gpu, p, GIB) for p in (in_a, side, forged, host)]
    listed.append(GpuProcess(other_gpu, in_a, GIB))  # pod A's process on a GPU not its own
    by_slice, unowned = agent.attribute(agent.ledger.allocations(agent.node), listed)
    # pod A's process naming pod B's slice: pod A's (its first slice on that GPU)
    assert {s: [p.pid for p in v] for s, v in by_slice.items()} == {a_main: [in_a], a_side: [side]}
    assert [(p.device_uuid, p.pid) for p in unowned] == [
        (gpu, forged),
        (gpu, host),
        (other_gpu, in_a),
    ]


# -- processes of no slice ------------------------------------------------------------------


def test_a_process_of_no_slice_is_killed_after_the_grace_where_a_guarded_slice_is(
    agent: Agent, backend: FakeBackend, procs: Procs, caplog: pytest.LogCaptureFixture
) -> None:
    fixed = reserve(agent, iso="fs")
    gpu, other = uuid_of(agent, fixed), agent.inventory.gpus[1].uuid
    assert gpu != other
    hiding, elsewhere = procs.sleep(), procs.sleep()
    backend.procs = [GpuProcess(gpu, hiding, 5 * GIB), GpuProcess(other, elsewhere, 5 * GIB)]
    now = [0.0]
    wd = Watchdog(agent, kill="share", grace_s=5, unowned="kill", clock=lambda: now[0])
    seen = []
    with caplog.at_level(logging.WARNING, logger="qgpu.agent.watchdog"):
        for at in (0.0, 4.9, 5.0):
            now[0] = at
            seen.append({(u.pid, u.action) for u in wd.scan().unowned_actions})
    assert seen[0] == seen[1] == {(hiding, "reported"), (elsewhere, "reported")}
    assert seen[2] == {(hiding, "killed"), (elsewhere, "reported")}  # GPU 1: no slice
    assert procs.started[0].wait(timeout=10) == -9
    assert procs.started[1].poll() is None
    events = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(e["pid"], e["action"]) for e in events] == [
        (hiding, "reported"),
        (elsewhere, "reported"),
        (hiding, "killed"),
    ]
    found = samples(agent)
    assert value(found, "qgpu_watchdog_unowned_kills_total", device_uuid=gpu) == 1


@pytest.mark.parametrize(
    ("kill", "unowned", "iso"),
    [("share", "report", "fs"), ("off", "kill", "fs"), ("share", "kill", "be")],
)
def test_processes_of_no_slice_are_only_reported(
    agent: Agent, backend: FakeBackend, procs: Procs, kill: str, unowned: str, iso: str
) -> None:
    """With --watchdog-unowned report, with kills off, and on a GPU whose slices the kill
    policy does not cover (best-effort under ``share``)."""
    gpu = uuid_of(agent, reserve(agent, iso=iso))
    backend.procs = [GpuProcess(gpu, procs.sleep(), 5 * GIB)]
    wd = Watchdog(agent, kill=kill, grace_s=0, unowned=unowned)  # type: ignore[arg-type]
    assert [u.action for u in wd.scan().unowned_actions] == ["reported"]
    assert procs.started[0].poll() is None


def test_nvidias_mps_server_is_never_unowned_and_a_namesake_is(
    agent: Agent, backend: FakeBackend, procs: Procs, tmp_path: Path
) -> None:
    """The MPS server holds memory for its clients: recognised by its executable and its
    parent, root's MPS control daemon. A tenant's binary of the same name is not it."""
    control, server = tmp_path / "nvidia-cuda-mps-control", tmp_path / "nvidia-cuda-mps-server"
    shutil.copy(shutil.which("sh") or "/bin/sh", control)
    shutil.copy(shutil.which("sleep") or "/bin/sleep", server)
    daemon = procs.sleep(argv=[str(control), "-c", f"{server} 120 & wait"])
    real = wait_until(lambda: _children(daemon), timeout=10)[0]
    wait_until(lambda: os.readlink(f"/proc/{real}/exe") == str(server), timeout=10)
    namesake = procs.sleep(argv=[str(server), "120"])
    assert is_mps_server(real) and not is_mps_server(namesake)
    gpu = uuid_of(agent, reserve(agent))
    backend.procs = [GpuProcess(gpu, real, GIB), GpuProcess(gpu, namesake, GIB)]
    wd = Watchdog(agent, kill="all", grace_s=0, unowned="kill")
    assert [(u.pid, u.action) for u in wd.scan().unowned_actions] == [(namesake, "killed")]
    time.sleep(0.1)
    assert procs.started[0].poll() is None and Path(f"/proc/{real}").exists()


def test_the_node_defaults_kill_processes_of_no_slice() -> None:
    from enforcement.agent.cli import config_from_args
    from tests.agent.test_cli import _agent_args

    cfg = config_from_args(_agent_args("--state-dir", "/tmp/x"))
    assert (cfg.watchdog_kill, cfg.watchdog_unowned, cfg.slice_cgroups) == ("all", "kill", "auto")
    cfg = config_from_args(
        _agent_args(
            "--state-dir", "/tmp/x", "--watchdog-unowned", "Report", "--slice-cgroups", "OFF"
        )
    )
    assert (cfg.watchdog_unowned, cfg.slice_cgroups) == ("report", "off")


# -- finding an owner's descendants (each reservation of a process-owned slice) -----------


def _fake_proc(root: Path, parents: dict[int, int], *, children_lists: bool) -> str:
    """A /proc with `parents` (pid -> ppid), each process one thread; with or without the
    kernel's task/<tid>/children lists. The caller's own pid is there too (the probe)."""
    me = os.getpid()
    for pid, ppid in {**parents, me: 1}.items():
        (root / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} 1 1 0\n")
        if children_lists:
            kids = [str(c) for c, p in parents.items() if p == pid]
            (root / str(pid) / "task" / str(pid) / "children").write_text(" ".join(kids))
    return str(root)


@pytest.mark.parametrize("children_lists", [True, False])
def test_descendants_from_children_lists_or_from_every_parent(
    tmp_path: Path, children_lists: bool
) -> None:
    tree = {10: 1, 11: 10, 12: 10, 13: 11, 14: 13, 20: 1, 21: 20}
    proc = _fake_proc(tmp_path, tree, children_lists=children_lists)
    attribution._CHILDREN_LISTS.pop(proc, None)
    assert attribution._children_lists(proc) is children_lists
    assert sorted(attribution._descendants(10, proc)) == [11, 12, 13, 14]
    assert attribution._descendants(14, proc) == []
    assert attribution._descendants(99, proc) == []  # gone


def test_descendants_of_a_real_process_tree() -> None:
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & (sleep 60 & wait) & wait"])
    try:
        wait_until(lambda: len(attribution._descendants(sh.pid)) == 4, timeout=10)
        kids = attribution._descendants(sh.pid)
        assert all(attribution.parent_pid(k) is not None for k in kids)
        assert sh.pid not in kids and len(set(kids)) == 4  # 2 sleeps, a subshell, its sleep
    finally:
        for pid in [*attribution._descendants(sh.pid), sh.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sh.wait()
