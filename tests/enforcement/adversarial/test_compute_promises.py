"""Compute escapes that break a neighbour's promise, and the watchdog rules that end them.

The compute gate runs inside the tenant's own process and debits a kernel's device time only
after the kernel ends. So a tenant that launches through the raw ``cuLaunchKernel`` from
libcuda's symbol table, or that launches one kernel longer than the test (through the
ordinary, hooked path), holds its time slices of a time-sliced GPU for good: about half the
device beside one saturating neighbour. The promises this breaks (docs): a burst-share slice
is guaranteed its share and falls back to it when others need the GPU; a best-effort slice
gets only what the busy guaranteed slices leave.

Each test reserves a hostile slice (25 %) and a victim (75 %) from a real ``qgpu agent`` on
a simulated 16 GiB GPU with the default kill policy, a 0.3 s watchdog interval and a 1 s
grace. Ground truth is the simulator's own per-process accounting. The other side is tested
too: a slice bursting while its neighbours are idle is never killed, and a tenant that hides
its own work from the hook cannot get a well-behaved neighbour killed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from enforcement.agent.client import AgentClient
from enforcement.sim import busy_share, read_gpu_state
from tests.agent.conftest import start_agent, stop_agent

from ..conftest import Worker, start_burn, wait_ready
from .conftest import Hostile, Programs, spawn

pytestmark = pytest.mark.slow

INTERVAL = 0.3
GRACE = 1.0
COMPUTE_BOUND = INTERVAL * 3 + GRACE  # as test_backstop: two new samples over the grace
SLACK = 10.0  # this shared 2-core machine can stall a process for seconds
NEVER_ENDS = 3_600_000_000_000  # a one-hour kernel: longer than any test
QUIET = COMPUTE_BOUND * 3  # how long a slice that must not be killed is watched


@dataclass
class Pair:
    """A 25 % slice (`small`, the hostile one in the attacks) and a 75 % one (`big`, the
    victim) on one simulated GPU, watched by an agent."""

    client: AgentClient
    config: str
    small_env: dict[str, str]
    big_env: dict[str, str]
    small_slice: str
    big_slice: str
    log: Path
    started: list[subprocess.Popen[str]] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    def start(self, argv: list[str | Path]) -> Hostile:
        proc = spawn(argv, self.small_env)
        self.started.append(proc)
        return Hostile(proc).read_until_ready()

    def burn(self, env: dict[str, str]) -> subprocess.Popen[str]:
        """A saturating, well-behaved (hooked) workload."""
        proc = start_burn(env)
        self.started.append(proc)
        wait_ready([proc])
        return proc

    def idle(self, env: dict[str, str]) -> Worker:
        """A process of a slice that holds a context on the GPU and launches nothing."""
        w = Worker(env).start()
        self.workers.append(w)
        return w

    def share(self, pid: int, seconds: float) -> float:
        """Percent of the device `pid` had over the next `seconds` (the simulator's books)."""
        before = read_gpu_state(self.config)
        time.sleep(seconds)
        return 100 * busy_share(before, read_gpu_state(self.config), pid)

    def counted(self, name: str, slice_id: str) -> float:
        total = 0.0
        for line in self.client.metrics().splitlines():
            if line.startswith(f"{name}{{") and f'slice="{slice_id}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def killed_within(self, hostile: Hostile, bound: float) -> None:
        try:
            code = hostile.proc.wait(timeout=bound + SLACK)
        except subprocess.TimeoutExpired:
            code = None
        assert code == -9, f"not killed within {bound + SLACK} s: {hostile.finish()}"

    def events(self) -> list[str]:
        """The watchdog's compute events in the agent's log."""
        return [line for line in self.log.read_text().splitlines() if "over_core" in line]

    def nobody_killed_for(self, seconds: float, never_over: list[str]) -> None:
        """Nothing is killed for `seconds`; the slices `never_over` are not even reported."""
        time.sleep(seconds)
        alive = [p.poll() is None for p in self.started]
        assert all(alive), f"killed: {[p.returncode for p in self.started]} {self.events()}"
        for sid in (self.small_slice, self.big_slice):
            assert self.counted("qgpu_watchdog_kills_total", sid) == 0, self.events()
        for sid in never_over:
            assert self.counted("qgpu_watchdog_over_core_total", sid) == 0, self.events()


PairFactory = Callable[[str, str], Pair]


@pytest.fixture
def pair(short_tmp: Path) -> Iterator[PairFactory]:
    made: list[tuple[subprocess.Popen, AgentClient, Pair]] = []

    def make(small_iso: str, big_iso: str) -> Pair:
        state = short_tmp / "agent"
        state.mkdir()
        agent = start_agent(
            state,
            "--sim", "T4-16GB",
            "--watchdog-interval", str(INTERVAL),
            "--watchdog-grace", str(GRACE),
        )  # fmt: skip
        client = AgentClient(state / "agent.sock")
        small = client.reserve({"core": 25, "memory": 4, "isolation": small_iso})
        big = client.reserve({"core": 75, "memory": 12, "isolation": big_iso})
        assert small.device_uuid == big.device_uuid
        p = Pair(
            client,
            small.env["QGPU_SIM_CONFIG"],
            {**os.environ, **small.env},
            {**os.environ, **big.env},
            small.slice_id,
            big.slice_id,
            state / "agent.log",
        )
        made.append((agent, client, p))
        return p

    yield make
    for agent, client, p in made:
        for proc in p.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for w in p.workers:
            w.kill()
        client.close()
        stop_agent(agent)


def hostile_argv(programs: Programs, how: str) -> list[str | Path]:
    if how == "raw":  # the raw cuLaunchKernel from libcuda's symbol table, 20 ms kernels
        # (4-8 in flight: a process the loaded machine does not schedule for a while still
        # keeps the device busy)
        return [programs.c("raw_launch"), "20000000"]
    return [programs.c("long_kernel"), str(NEVER_ENDS)]  # one kernel, hooked, never ends


def escape_is_ended(p: Pair, programs: Programs, how: str) -> None:
    """The victim saturates the GPU; the hostile tenant escapes its promise (measured before
    the grace can end it: >= 35 % where it may have 25); the watchdog kills it; the victim
    then gets at least its 75 % back."""
    victim = p.burn(p.big_env)
    h = p.start(hostile_argv(programs, how))
    assert h.lines[0] in (("found", 1), ("launch", 0)), h.lines
    escaped = p.share(h.pid, 0.6)  # shorter than the grace: no kill can come before this
    assert escaped >= 35, f"the hostile slice got only {escaped:.1f} % (the escape did not work)"
    p.killed_within(h, COMPUTE_BOUND)
    assert p.counted("qgpu_watchdog_kills_total", p.small_slice) == 1
    got = p.share(victim.pid, 1.5)
    assert got >= 72, f"victim got {got:.1f} % of its 75 % after the kill"
    assert victim.poll() is None


@pytest.mark.parametrize("how", ["raw", "long"])
@pytest.mark.parametrize("victim_iso", ["fs", "bs"])
def test_a_burst_share_slice_over_its_share_beside_a_busy_neighbour_is_killed(
    pair: PairFactory, programs: Programs, how: str, victim_iso: str
) -> None:
    escape_is_ended(pair("bs", victim_iso), programs, how)


@pytest.mark.parametrize("how", ["raw", "long"])
def test_a_best_effort_slice_over_what_the_guaranteed_slices_leave_is_killed(
    pair: PairFactory, programs: Programs, how: str
) -> None:
    escape_is_ended(pair("be", "fs"), programs, how)


def test_a_never_ending_kernel_in_a_fixed_share_slice_is_killed(
    pair: PairFactory, programs: Programs
) -> None:
    """The long kernel in a fixed-share slice: the fixed-share core check already sees it."""
    escape_is_ended(pair("fs", "fs"), programs, "long")


@pytest.mark.parametrize("iso", ["bs", "be"])
def test_a_slice_running_flat_out_beside_idle_neighbours_is_never_killed(
    pair: PairFactory, programs: Programs, iso: str
) -> None:
    """Bursting while every other slice idles is the promise of burst-share and best-effort:
    even ungated (raw) launches that take (nearly) the whole GPU for several graces are left
    alone while the other slice on the GPU (reserved, with a process holding a context) is
    idle."""
    p = pair(iso, "fs")
    p.idle(p.big_env)
    h = p.start(hostile_argv(programs, "raw"))
    got = p.share(h.pid, 0.6)
    assert got >= 80, f"a slice alone got only {got:.1f} % of an idle GPU"
    p.nobody_killed_for(QUIET, never_over=[p.small_slice, p.big_slice])
    assert p.share(h.pid, 0.6) >= 80


@pytest.mark.parametrize("iso", ["bs", "be"])
def test_a_tenant_hiding_its_work_cannot_get_a_well_behaved_neighbour_killed(
    pair: PairFactory, programs: Programs, iso: str
) -> None:
    """A 75 % burst-share tenant launches through the raw driver, so the hook's shared view
    (its activity file: launches through the hook) never shows it busy. A well-behaved (hooked)
    25 % neighbour must still fall back to its share (burst-share) or to what the
    guaranteed slice leaves (best-effort), so that neither is killed and the well-behaved
    one is never even reported; the hidden tenant, within its own share, keeps it (it may
    be reported while the neighbour starts: it bursts alone until then)."""
    p = pair(iso, "bs")
    hidden = spawn(hostile_argv(programs, "raw"), p.big_env)
    p.started.append(hidden)
    Hostile(hidden).read_until_ready()
    well_behaved = p.burn(p.small_env)
    p.nobody_killed_for(QUIET, never_over=[p.small_slice])
    got = p.share(well_behaved.pid, 1.5)
    assert got <= 25 + 10, f"the well-behaved 25 % slice took {got:.1f} % from a busy neighbour"
