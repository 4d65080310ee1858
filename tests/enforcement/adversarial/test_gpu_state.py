"""What the slices of one GPU tell each other, attacked by a tenant of another user.

Burst-share borrows only while the GPU's other slices are idle, and best-effort is gated to
what the active guaranteed slices leave: each slice's hook decides that from the state the
slices of its GPU share. A node agent (root, ``--workload-gid``) lays that state out as it
does in production; the victim's workloads run as root, the hostile tenant is another user
in the workload group (a forked child that drops to it) with a slice of its own. It writes
whatever false state it can: a fake 99 % fixed-share neighbour that is always active, a fake
active neighbour of a burst-share slice, the victim's own policy and share rewritten, the
shared files truncated under the victim's mapping. The victim's compute is measured on the
simulated GPU's own timeline (as tests/enforcement/test_compute.py does).

Then what a tenant can still say, about itself only: that it is active when it is idle (no
worse for its neighbours than being active), that it is idle when it is busy (only the liar
may lose by it: the agent's watchdog lists the slices NVML saw run in the GPU's busy list,
which the interposer counts as active whatever their activity files say), and a truncated
file of its own (crashes nobody).

Needs root (other users); skips without it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from enforcement.agent.config import AgentConfig
from enforcement.agent.models import ReserveRequest
from enforcement.agent.service import Agent
from enforcement.agent.watchdog import Watchdog
from enforcement.busy_view import BusySlice, BusyView
from enforcement.discovery import GpuProcess, UtilSample
from enforcement.gpu_roster import WRITER_AGENT, RosterEdit, RosterEntry, edit_roster
from enforcement.native import hook_library_path
from enforcement.sim import (
    SimConfig,
    SimProcess,
    read_gpu_state,
    sim_environment,
    write_sim_config,
)
from enforcement.state_tree import busy_file, gpu_dir
from qgpu.model import GpuDevice, SliceRequest

from ..conftest import REPO, Sim, finish, measure_shares, start_burn, wait_ready

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

WORKLOAD_GID = 40100  # the agent's --workload-gid: every tenant of the GPUs is in it
HOSTILE_UID = 40102
TOLERANCE = 5.0
FAR_FUTURE = (1 << 62) - 1  # a launch time no clock reaches: "active forever"

# The legacy shared region (gpu-<uuid>.region, "QGPUREG2"): one 128-byte entry per process
REGION_MAGIC = 0x3247455255504751
REGION_ENTRY = struct.Struct("<72sqiiiiQq")  # slice, last launch, policy, core, pid, gated, ...
REGION_HEADER, REGION_SLOTS, REGION_SLOT_SIZE = 128, 128, 128
# A slice's activity file ("QGPUACT1", enforcement/native/hook/region.c): its public part
ACT_MAGIC = 0x3154434155504751
ACT_PUBLIC = struct.Struct("<QIIqqiI")  # magic, version, procs, last launch, pending, gated
ACT_SIZE = 128 + 64 * 32
FS, BS, BE = 1, 2, 0
WATCH_INTERVAL = 0.3  # the watchdog's scans, where a test runs one


@dataclass
class SimBackend:
    """The node agent's view of one simulated T4 (no NVML loaded into the test process):
    its processes and their SM-utilisation samples read from the simulator's own books, as
    the simulated NVML computes them."""

    config: SimConfig
    kind: str = "sim"
    workload_env: dict[str, str] = field(default_factory=dict)

    def devices(self) -> list[GpuDevice]:
        g = self.config.gpus[0]
        return [
            GpuDevice(
                uuid=g.uuid,
                index=0,
                model="T4-16GB",
                memory_mib=g.memory_bytes // (1 << 20),
                sm_count=g.sms,
            )
        ]

    def telemetry(self) -> list[object]:
        return []

    def _state(self) -> list[SimProcess]:
        if not self.config.state_path(0).exists():  # no process has opened the GPU yet
            return []
        return list(read_gpu_state(self.config).processes)

    def processes(self) -> list[GpuProcess]:
        uuid = self.config.gpus[0].uuid
        return [GpuProcess(uuid, p.pid, p.mem_used) for p in self._state()]

    def process_utilization(self) -> dict[tuple[str, int], UtilSample]:
        uuid = self.config.gpus[0].uuid
        return {
            (uuid, p.pid): UtilSample(p.sm_util, p.sm_util_at_ns // 1000)
            for p in self._state()
            if p.sm_util_at_ns
        }

    def gpu_settings(self) -> dict[str, dict[str, int]]:
        return {}  # the compute tests here keep no settings

    def set_gpu_setting(self, uuid: str, name: str, value: int) -> str | None:
        return "not kept by this backend"

    def close(self) -> None:
        pass


@dataclass
class Node:
    agent: Agent
    sim: Sim

    @property
    def slices(self) -> Path:
        return self.sim.state_dir

    def reserve(self, slice_id: str, core: int, isolation: str, uid: int = 0) -> dict[str, str]:
        """The environment of a new slice's processes (as the agent hands it out)."""
        gid = WORKLOAD_GID if uid else 0
        res = self.agent.reserve(
            ReserveRequest(
                request=SliceRequest(core=core, memory_gib=4, isolation=isolation),
                slice_id=slice_id,
                uid=uid,
                gid=gid,
            )
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("QGPU_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        }
        env.update(res.env)
        env["PYTHONPATH"] = str(REPO)
        return env

    @contextlib.contextmanager
    def watched(self) -> Iterator[Watchdog]:
        """The agent's watchdog scanning every WATCH_INTERVAL s, reporting only (no kill: what
        is tested is how the interposers act on the busy list it writes)."""
        wd = Watchdog(self.agent, kill="off", interval_s=WATCH_INTERVAL)
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                wd.scan()
                stop.wait(WATCH_INTERVAL)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            yield wd
        finally:
            stop.set()
            t.join()

    def wait_listed_busy(self, slice_ids: set[str], timeout: float = 30.0) -> None:
        """Until the GPU's busy list names every slice of `slice_ids`."""
        view = BusyView(busy_file(self.slices, self.sim.uuid()))
        try:
            deadline = time.monotonic() + timeout
            while True:
                listed = {b.slice_id for b in view.read()[0]}
                if slice_ids <= listed:
                    return
                assert time.monotonic() < deadline, f"busy list {listed}, waited for {slice_ids}"
                time.sleep(0.05)
        finally:
            view.close()


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    os.chmod(short_tmp, 0o755)
    cfg = write_sim_config(short_tmp / "sim" / "gpus.conf", "T4", node=f"rg-{short_tmp.name}")
    workload_env = {k: str(v) for k, v in sim_environment(cfg.path).items()}
    backend = SimBackend(cfg, workload_env=workload_env)
    agent = Agent(
        AgentConfig(
            node_name="n",
            state_dir=short_tmp,
            hook_path=hook_library_path(),
            test_mode=False,
            workload_gid=WORKLOAD_GID,
        ),
        backend,  # type: ignore[arg-type]
    )
    try:
        yield Node(agent, Sim(cfg, short_tmp / "slices"))
    finally:
        agent.close()


# -- the hostile tenant: another user, in the workload group ----------------------------


def as_tenant(fn: Callable[[], object]) -> int:
    """Start `fn` in a forked child running as the hostile user; returns its pid (join())."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgroups([WORKLOAD_GID])
            os.setgid(WORKLOAD_GID)
            os.setuid(HOSTILE_UID)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    _pipes[pid] = read
    return pid


_pipes: dict[int, int] = {}


def join(pid: int) -> object:
    with os.fdopen(_pipes.pop(pid)) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "error" not in out, out["error"]
    return out["ok"]


def attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "ok"


def _pid1_start() -> int:
    return int(Path("/proc/1/stat").read_text().rsplit(")", 1)[1].split()[19])


def _legacy_region(node: Node) -> Path:
    """The GPU's region file of the old layout (the slices root is not listable: named)."""
    return node.slices / f"gpu-{node.sim.uuid()}.region"


def _on_legacy_region(node: Node, seen: dict[str, str], write: Callable[[mmap.mmap], str]) -> None:
    path = _legacy_region(node)
    if not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        seen["region"] = errno.errorcode.get(exc.errno or 0, str(exc))
        return
    with mmap.mmap(fd, 0) as m:
        seen["region"] = write(m)
    os.close(fd)


def _region_entries(m: mmap.mmap) -> list[tuple[int, tuple]]:
    out = []
    for i in range(REGION_SLOTS):
        off = REGION_HEADER + i * REGION_SLOT_SIZE
        out.append((off, REGION_ENTRY.unpack_from(m, off)))
    return out


def _write_activity(path: Path, last_launch: int, pending_until: int, gated: int) -> None:
    """What a slice says it does (an activity file, "QGPUACT1": region.c)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        if os.fstat(fd).st_size < ACT_SIZE:
            os.ftruncate(fd, ACT_SIZE)
        os.pwrite(fd, ACT_PUBLIC.pack(ACT_MAGIC, 1, 64, last_launch, pending_until, gated, 0), 0)
    finally:
        os.close(fd)


def _edit_roster(path: Path, change: Callable[[RosterEdit], object]) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        with edit_roster(fd) as r:
            change(r)
    finally:
        os.close(fd)


def forge_fake_neighbour(node: Node, policy: int, core: int) -> dict[str, str]:
    """Say that a slice which does not exist is on the GPU, active forever."""
    seen: dict[str, str] = {}

    def legacy(m: mmap.mmap) -> str:  # an entry whose pid is init's: never reclaimed
        off = REGION_HEADER + (REGION_SLOTS - 1) * REGION_SLOT_SIZE
        REGION_ENTRY.pack_into(m, off, b"ghost", FAR_FUTURE, policy, core, 1, 0, _pid1_start(), 0)
        return "wrote"

    _on_legacy_region(node, seen, legacy)
    d = gpu_dir(node.slices, node.sim.uuid())
    ghost = RosterEntry("ghost", policy, core, WRITER_AGENT)
    seen["roster"] = attempt(lambda: _edit_roster(d / "roster", lambda r: r.put(ghost)))
    seen["ghost activity"] = attempt(
        lambda: _write_activity(d / "ghost.activity", FAR_FUTURE, FAR_FUTURE, 1)
    )
    seen["busy"] = attempt(lambda: _write_busy(d / "busy", ["ghost"]))
    return seen


def _write_busy(path: Path, slice_ids: list[str]) -> None:
    """Name slices in the GPU's busy list, valid for an hour (enforcement.busy_view)."""
    view = BusyView(path)
    try:
        view.write([BusySlice(sid, 100) for sid in slice_ids], 3600.0)
    finally:
        view.close()


def forge_victim(node: Node, victim: str, policy: int, core: int) -> dict[str, str]:
    """Give the victim slice another policy and share, and say it is idle."""
    seen: dict[str, str] = {}

    def legacy(m: mmap.mmap) -> str:
        n = 0
        for off, e in _region_entries(m):
            if e[0].rstrip(b"\0") == victim.encode():
                struct.pack_into("<ii", m, off + 80, policy, core)
                n += 1
        return f"rewrote {n}"

    _on_legacy_region(node, seen, legacy)
    d = gpu_dir(node.slices, node.sim.uuid())
    fake = RosterEntry(victim, policy, core, WRITER_AGENT)
    seen["roster"] = attempt(lambda: _edit_roster(d / "roster", lambda r: r.put(fake)))
    seen["victim activity"] = attempt(
        lambda: _write_activity(d / f"{victim}.activity", 0, 0, 0)
    )
    return seen


# -- attacks on other slices' state ------------------------------------------------------


def test_a_fake_always_active_neighbour_cannot_gate_a_best_effort_slice(node: Node) -> None:
    """Alone on its GPU a best-effort slice takes the whole device. The hostile tenant says
    a 99 % fixed-share slice is active there forever: before the fix the victim was gated
    to 1 % of the device (1.7 % measured)."""
    node.reserve("hostile", 10, "be", uid=HOSTILE_UID)
    victim = start_burn(node.reserve("victim", 50, "be"))
    wait_ready([victim])
    wrote = join(as_tenant(lambda: forge_fake_neighbour(node, FS, 99)))
    (share,) = measure_shares(node.sim, [(0, victim)])
    finish([victim])
    assert share > 100 - 2 * TOLERANCE, f"victim {share:.1f} % alone on its GPU; forged: {wrote}"
    assert "ok" not in wrote.values() and "wrote" not in wrote.values(), wrote


def test_a_fake_neighbour_cannot_stop_a_burst_share_slice_from_borrowing(node: Node) -> None:
    """A burst-share slice alone borrows the idle GPU; a fake active neighbour held it to its
    30 % before the fix (29.7 % measured)."""
    node.reserve("hostile", 10, "be", uid=HOSTILE_UID)
    victim = start_burn(node.reserve("victim", 30, "bs"), depth=20)
    wait_ready([victim])
    wrote = join(as_tenant(lambda: forge_fake_neighbour(node, BE, 100)))
    (share,) = measure_shares(node.sim, [(0, victim)])
    finish([victim])
    assert share > 100 - 2 * TOLERANCE, f"victim {share:.1f} % alone on its GPU; forged: {wrote}"


def test_a_neighbour_cannot_rewrite_a_slice_s_policy_and_share(node: Node) -> None:
    """An 80 % fixed-share victim next to the hostile tenant's own best-effort slice, which
    is gated to the 20 % left. The tenant rewrites the victim to best-effort (and idle): its
    own hook then stopped gating it, and before the fix the two split the device 50/50."""
    victim = start_burn(node.reserve("victim", 80, "fs"))
    hostile = start_burn(node.reserve("hostile", 20, "be", uid=HOSTILE_UID))
    wait_ready([victim, hostile])
    wrote = join(as_tenant(lambda: forge_victim(node, "victim", BE, 100)))
    v, h = measure_shares(node.sim, [(0, victim), (0, hostile)])
    finish([victim, hostile])
    assert abs(v - 80) <= TOLERANCE, f"victim {v:.1f} %, hostile {h:.1f} %; forged: {wrote}"
    assert h <= 20 + TOLERANCE, (v, h, wrote)


def test_truncating_the_shared_state_crashes_no_neighbour(node: Node) -> None:
    """The hostile tenant truncates every file of the GPU's shared state it can open for
    writing, its own activity file included (that one it may): before the fix the victim's
    next launch touched its mapping of the truncated region and died of SIGBUS."""
    node.reserve("hostile", 10, "be", uid=HOSTILE_UID)
    victim = start_burn(node.reserve("victim", 50, "fs"))
    wait_ready([victim])
    d = gpu_dir(node.slices, node.sim.uuid())
    files = [
        _legacy_region(node),
        d / "roster",
        d / "busy",
        d / "victim.activity",
        d / "hostile.activity",
    ]

    def truncate() -> dict[str, str]:
        return {p.name: attempt(lambda p=p: os.truncate(p, 0)) for p in files if p.exists()}

    done = join(as_tenant(truncate))
    (share,) = measure_shares(node.sim, [(0, victim)], warmup=0.3, window=0.7)
    if victim.poll() is not None:
        _, err = victim.communicate()
        pytest.fail(f"the victim died (exit {victim.returncode}) after {done}: {err[-500:]}")
    finish([victim])
    assert share > 50 - TOLERANCE, (share, done)
    assert done.get("hostile.activity") == "ok", done  # its own: it may


def test_what_a_tenant_may_open_of_its_gpu_s_state(node: Node) -> None:
    """Read the roster, the agent's busy list and the others' activity (the workload
    group), write only its own activity file; add, replace or remove nothing in the GPU's
    directory."""
    node.reserve("victim", 50, "fs")
    node.reserve("hostile", 10, "be", uid=HOSTILE_UID)
    d = gpu_dir(node.slices, node.sim.uuid())

    def probe() -> dict[str, str]:
        rw, ro = os.O_RDWR, os.O_RDONLY
        return {
            "read roster": attempt(lambda: os.close(os.open(d / "roster", ro))),
            "write roster": attempt(lambda: os.close(os.open(d / "roster", rw))),
            "read victim": attempt(lambda: os.close(os.open(d / "victim.activity", ro))),
            "write victim": attempt(lambda: os.close(os.open(d / "victim.activity", rw))),
            "write own": attempt(lambda: os.close(os.open(d / "hostile.activity", rw))),
            "add a slice": attempt(lambda: (d / "ghost.activity").write_bytes(b"x")),
            "replace victim": attempt(
                lambda: os.rename(d / "hostile.activity", d / "victim.activity")
            ),
            "remove victim": attempt(lambda: os.unlink(d / "victim.activity")),
            "replace roster": attempt(lambda: os.rename(d / "hostile.activity", d / "roster")),
            "read busy": attempt(lambda: os.close(os.open(d / "busy", ro))),
            "write busy": attempt(lambda: os.close(os.open(d / "busy", rw))),
            "replace busy": attempt(lambda: os.rename(d / "hostile.activity", d / "busy")),
        }

    assert join(as_tenant(probe)) == {
        "read roster": "ok",
        "write roster": "EACCES",
        "read victim": "ok",
        "write victim": "EACCES",
        "write own": "ok",
        "add a slice": "EACCES",
        "replace victim": "EACCES",
        "remove victim": "EACCES",
        "replace roster": "EACCES",
        "read busy": "ok",
        "write busy": "EACCES",
        "replace busy": "EACCES",
    }


# -- a tenant lying about itself ---------------------------------------------------------


def test_claiming_to_be_active_costs_the_neighbours_what_being_active_does(node: Node) -> None:
    """The hostile tenant's 30 % fixed-share slice runs nothing but says it launched just
    now, forever, and has work queued forever. Its neighbours then act as if it were busy:
    the best-effort victim takes what the two guaranteed slices leave (50 %), the honest
    20 % fixed-share slice keeps its share (the lie adds one contender to its time-sliced
    correction, within what the calibration puts right), and nobody gets less than if the
    hostile slice really ran."""
    node.reserve("hostile", 30, "fs", uid=HOSTILE_UID)
    honest = start_burn(node.reserve("honest", 20, "fs"))
    victim = start_burn(node.reserve("victim", 50, "be"))
    wait_ready([honest, victim])
    d = gpu_dir(node.slices, node.sim.uuid())
    lie = as_tenant(lambda: _write_activity(d / "hostile.activity", FAR_FUTURE, FAR_FUTURE, 1))
    join(lie)
    f, v = measure_shares(node.sim, [(0, honest), (0, victim)])
    finish([honest, victim])
    assert abs(f - 20) <= TOLERANCE, (f, v)
    assert v >= 50 - TOLERANCE, (f, v)


def start_hidden_burn(env: dict[str, str], activity: Path, hide: Path) -> subprocess.Popen[str]:
    """A burn whose hook publishes into a private file bound over its slice's activity
    file (a mount namespace of its own): the GPU's other slices see it idle while it runs,
    gated as its own limits say."""
    hide.write_bytes(b"")
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    return start_burn(env, wrap=[*argv, str(hide), str(activity)])


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_claiming_to_be_idle_while_busy_hurts_only_the_liar(node: Node, short_tmp: Path) -> None:
    """The hostile tenant's 30 % fixed-share slice runs flat out through its own compute
    gate while its neighbours see it idle. A 40 % burst-share victim then borrows what it
    thinks is idle: it keeps at least its share; the liar is the one that may lose."""
    d = gpu_dir(node.slices, node.sim.uuid())
    hostile_env = node.reserve("hostile", 30, "fs", uid=HOSTILE_UID)
    liar = start_hidden_burn(hostile_env, d / "hostile.activity", short_tmp / "hidden")
    victim = start_burn(node.reserve("victim", 40, "bs"), depth=20)
    wait_ready([liar, victim])
    h, v = measure_shares(node.sim, [(0, liar), (0, victim)])
    finish([liar, victim])
    assert v >= 40 - TOLERANCE, (h, v)
    assert h <= 30 + TOLERANCE, (h, v)



@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_hiding_activity_next_to_best_effort_hurts_no_fixed_share_slice(
    node: Node, short_tmp: Path
) -> None:
    """The same liar next to a 60 % fixed-share victim and an honest best-effort slice.
    Before the agent's busy list the best-effort slice, told only the victim was active, was
    gated to 40 % instead of 10 %; the device was then asked for 130 % and split it by
    turns, the liar keeping its 30 % (measured: victim 35 %, best-effort 35 %, liar 29 %).
    Now the agent's watchdog (reporting only: nobody is killed) lists the slices NVML saw
    run, the liar among them, and the best-effort slice counts it as active."""
    d = gpu_dir(node.slices, node.sim.uuid())
    hostile_env = node.reserve("hostile", 30, "fs", uid=HOSTILE_UID)
    with node.watched():
        liar = start_hidden_burn(hostile_env, d / "hostile.activity", short_tmp / "hidden")
        victim = start_burn(node.reserve("victim", 60, "fs"))
        other = start_burn(node.reserve("other", 10, "be"), depth=20)
        try:
            wait_ready([liar, victim, other])
            node.wait_listed_busy({"hostile", "victim"})
            h, v, o = measure_shares(node.sim, [(0, liar), (0, victim), (0, other)])
        finally:
            finish([liar, victim, other])
    assert v >= 60 - TOLERANCE, (h, v, o)
    assert o <= 10 + TOLERANCE, (h, v, o)
