"""What a tenant can see of the others, and what the hook binary needs of the system:
NVML's process lists and memory views through every version, and the glibc versions the
interposer requires (it must load on glibc 2.17 and later)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from enforcement.native import hook_library_path
from enforcement.sim import write_sim_config

from ..conftest import GIB, Sim, Worker
from .conftest import CTX, HOOK_OVERRIDE, HOSTILE_CAP, Arena, Programs


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
