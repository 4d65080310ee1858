"""Code loaded lazily. Under CUDA's lazy loading (the default since 12.2) a function's code
reaches the GPU at its first launch, not with its module (cuda.h: cuFuncIsLoaded,
cuFuncLoad), through no allocation call: a module of 100 generated kernels of 64 MiB of
code each takes 6.25 GiB as they are launched, whatever the slice. The simulator loads a
function's code at its first launch, graph node or cuFuncLoad (built-in image:
`qgpu_sim_code_<bytes>_<n>`); the hook loads it itself first, measured, and charges it to
the module until it is unloaded. A load cannot be undone: the one that passes the cap is
charged past it and refused, and no code is loaded while the slice is at its cap."""

from __future__ import annotations

import pytest

from .conftest import HOSTILE_CAP, Arena, Programs

SUCCESS, OOM = 0, 2
MIB = 1 << 20
CODE = 64 * MIB


@pytest.mark.parametrize("mode", ["launch", "graph", "load", "attr", "cache", "occupancy"])
def test_code_loaded_lazily_counts_against_the_slice(
    arena: Arena, programs: Programs, mode: str
) -> None:
    h = arena.start([programs.c("lazycode"), mode])
    assert h.one("last") == OOM and h.one("used") < 100, h.lines
    room = HOSTILE_CAP - max(arena.context_cost, 512 * MIB)
    assert h.one("used") >= room // CODE - 1  # a workload's kernels still load up to the cap
    arena.contained(h, cap=HOSTILE_CAP + CODE)  # at most one function's code past it


def test_unloading_the_module_gives_its_code_back(arena: Arena, programs: Programs) -> None:
    h = arena.start([programs.c("lazycode"), "launch", "unload"])
    assert h.one("unload") == SUCCESS
    room = HOSTILE_CAP - max(arena.context_cost, 512 * MIB)
    assert h.all("grab") == [SUCCESS] * (room // (512 * MIB)) + [OOM]
    arena.contained(h)


def test_the_simulated_driver_loads_code_at_the_first_launch(
    arena: Arena, programs: Programs
) -> None:
    """The driver alone (no hook): 100 functions launched hold 6.25 GiB of code."""
    h = arena.start([programs.c("lazycode"), "launch"], arena.sim.base_env())
    assert h.one("used") == 100 and h.one("last") == SUCCESS
    assert arena.held(h.pid) == arena.context_cost + 100 * CODE
