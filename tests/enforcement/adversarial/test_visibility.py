"""What a tenant can see of the others, and what the hook binary needs of the system:
NVML's process lists, memory, utilisation and accounting views through every version and
on every GPU of the node, and the glibc versions the interposer requires (it must load on
glibc 2.17 and later)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from enforcement.native import hook_library_path
from enforcement.sim import MODELS, write_sim_config

from ..conftest import GIB, Sim, Worker, finish, start_burn, wait_ready
from .conftest import CTX, HOOK_OVERRIDE, HOSTILE_CAP, Arena, Hostile, Programs

NVML_NOT_SUPPORTED, NVML_NO_PERMISSION, NVML_NOT_FOUND = 3, 4, 6


def test_nvml_shows_a_tenant_only_its_own_slice(arena: Arena, programs: Programs) -> None:
    status, _ = arena.victim.alloc("alloc", 2 * GIB)
    assert status == "ok"
    h = arena.start([programs.c("nvml_lists")])
    assert h.one("calls") >= 7 * h.one("devices")  # the versions the simulated NVML has
    assert set(h.all("pid")) == {h.pid}, "a process list showed another slice's process"
    used = CTX + GIB
    assert (h.one("total"), h.one("used"), h.one("free")) == (HOSTILE_CAP, used, HOSTILE_CAP - used)
    assert (h.one("total2"), h.one("used2"), h.one("free2")) == (
        HOSTILE_CAP,
        used,
        HOSTILE_CAP - used,
    )


def test_nvml_lists_of_other_gpus_show_no_tenant(short_tmp: Path, programs: Programs) -> None:
    """NVML ignores CUDA_VISIBLE_DEVICES: a tenant can ask about every GPU of the node, and
    must not see who runs on the others."""
    cfg = write_sim_config(short_tmp / "two.conf", "2xT4-16GB", node=f"adv2-{short_tmp.name}")
    sim = Sim(cfg, short_tmp / "ledgers2")
    other = Worker(sim.slice_env("other-gpu", gpu=1, memory=8 * GIB))
    try:
        other.start()
        assert other.alloc("alloc", GIB)[0] == "ok"
        arena = Arena(sim, other)
        h = arena.start([programs.c("nvml_lists")])
        assert h.one("devices") == 2
        assert set(h.all("pid")) == {h.pid}
        h.finish()
    finally:
        other.kill()


@dataclass
class Node:
    """Two simulated H100s (the detail process list is Hopper's) with NVML accounting mode on
    (as an administrator may set it): on GPU 0 a victim slice holding 2 GiB and running
    kernels flat out, on GPU 1 another tenant doing the same; the hostile slice (4 GiB) is on
    GPU 0 beside the victim."""

    arena: Arena
    burners: list[subprocess.Popen[str]]
    busy: list[int] = field(default_factory=list)  # the neighbours' pids (what `ps` shows)

    def hostile(self) -> Hostile:
        return self.arena.python("nvml_views.py", *map(str, self.busy))


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    cfg = write_sim_config(
        short_tmp / "node.conf", "2xH100-80GB", node=f"views-{short_tmp.name}", accounting=True
    )
    sim = Sim(cfg, short_tmp / "ledgers")
    victim = Worker(sim.slice_env("victim", gpu=0, memory=12 * GIB))
    other = Worker(sim.slice_env("other", gpu=1, memory=12 * GIB))
    n = Node(Arena(sim, victim), [])
    try:
        n.burners += [
            start_burn(sim.slice_env("victim", gpu=0, memory=12 * GIB), depth=4),
            start_burn(sim.slice_env("other", gpu=1, memory=12 * GIB), depth=4),
        ]
        for w in (victim, other):
            w.start()
            assert w.alloc("alloc", 2 * GIB)[0] == "ok"
        wait_ready(n.burners)
        time.sleep(1.2)  # NVML's device utilisation looks back about a second
        n.busy = [victim.pid, other.pid, *(b.pid for b in n.burners)]
        yield n
    finally:
        for proc in [*n.burners, *(h.proc for h in n.arena.hostiles)]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        victim.kill()
        other.kill()


def test_nvml_shows_a_tenant_no_neighbour_s_processes_memory_or_activity(node: Node) -> None:
    """Every other NVML view of the neighbours, with NVIDIA's pynvml: the detail process
    list, versioned per-process utilisation, accounting pids and stats, device utilisation
    and its samples, BAR1, and the memory of another GPU."""
    h = node.hostile()
    assert h.one("devices") == 2
    assert set(h.all("pid")) <= {h.pid}, "an NVML view named a neighbour's process"
    assert set(h.all("stats")) <= {h.pid}, "accounting stats of a neighbour's process"
    for gpu in (0, 1):  # asked for each neighbour's pid on each GPU: never seen
        assert h.all(f"err_stats{gpu}") == [NVML_NOT_FOUND] * len(node.busy), h.lines
    # activity: its own (it runs nothing), not the busy GPU's
    assert h.one("util0") <= 5 and h.one("sample0") <= 5, h.lines
    assert (h.one("util1"), h.one("sample1")) == (0, 0)
    # BAR1 maps every context of the GPU: not the slice's to see
    assert (h.one("bar1err0"), h.one("bar1err1")) == (NVML_NOT_SUPPORTED, NVML_NOT_SUPPORTED)
    # its own GPU is its slice; another GPU's memory is not its to see
    used = MODELS["h100-80gb"].context_memory + GIB  # one context on this node's H100
    assert (h.one("total0"), h.one("used0"), h.one("used2_0")) == (HOSTILE_CAP, used, used)
    assert h.one("memerr1") == NVML_NO_PERMISSION


def test_nvml_utilisation_is_the_slice_s_own_share(node: Node) -> None:
    """A slice running flat out beside the busy victim sees the share of the GPU its own
    processes get (about half on the time-sliced GPU), not the GPU's 100 %."""
    env = node.arena.hostile_env()
    burner = start_burn(env, depth=4)
    node.burners.append(burner)
    wait_ready([burner])
    time.sleep(1.2)
    h = node.hostile()
    assert abs(h.one("util0") - 50) <= 10 and abs(h.one("sample0") - 50) <= 15, h.lines
    assert {burner.pid} <= set(h.all("pid")) <= {h.pid, burner.pid}
    h.finish()
    finish([burner])


def test_nvml_read_around_the_loader_is_not_filtered(arena: Arena, programs: Programs) -> None:
    """The limit of an in-process view (docs/enforcement.md, Not covered yet): the real
    NVML entry point read from libnvidia-ml's symbol table lists the victim. Everything that
    goes through the loader (linking, dlsym, dlvsym, ctypes) is filtered."""
    status, _ = arena.victim.alloc("alloc", 2 * GIB)
    assert status == "ok"
    h = arena.start([programs.c("nvml_raw")])
    assert set(h.all("hooked")) == {h.pid} and set(h.all("versioned")) <= {h.pid}
    assert h.one("found") == 1
    assert arena.victim.pid in h.all("raw")  # no hook can stop it


def required_glibc(library: Path) -> list[tuple[int, ...]]:
    """The GLIBC_x.y versions a shared library needs (its .gnu.version_r, via readelf)."""
    out = subprocess.run(
        ["readelf", "--version-info", "--wide", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    needed = out.split("Version needs section", 1)
    assert len(needed) == 2, out
    return sorted(
        {tuple(int(x) for x in m.split(".")) for m in re.findall(r"GLIBC_([0-9.]+)", needed[1])}
    )


def test_the_hook_loads_on_glibc_2_17() -> None:
    versions = required_glibc(Path(os.environ.get(HOOK_OVERRIDE) or hook_library_path()))
    assert versions, "the hook must link against libc"
    assert max(versions) <= (2, 17), f"the hook needs GLIBC_{'.'.join(map(str, max(versions)))}"
