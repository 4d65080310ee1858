"""Local memory a kernel's launch grows. cuda.h: CUDA resizes a context's local memory for a
kernel that needs more than the context has (CU_CTX_LMEM_RESIZE_TO_MAX keeps it after the
launch), for every thread the device can hold at once: on the arena's T4 (40 SMs x 1024
threads) a kernel with 128 KiB of local memory per thread takes 5 GiB at its launch, through
no allocation call, and 16.5 GiB on an H100 with 64 KiB. The simulator grows and keeps it
(for kernels of its built-in image, `qgpu_sim_lmem_<bytes>`); the hook reads each kernel's
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES before it is launched or put into a graph and charges the
growth first."""

from __future__ import annotations

import pytest

from .conftest import HOSTILE_CAP, Arena, Programs

SUCCESS, OOM = 0, 2
KIB, MIB = 1 << 10, 1 << 20
THREADS = 40 * 1024  # what the arena's T4 holds at once
STACK_DEFAULT = 1 * KIB


def growth(per_thread: int) -> int:
    return (per_thread - STACK_DEFAULT) * THREADS


def grabs_beside(arena: Arena, per_thread: int) -> list[int]:
    """The 512 MiB chunks a slice gets beside its context and a kernel of `per_thread`."""
    room = HOSTILE_CAP - max(arena.context_cost, 512 * MIB) - growth(per_thread)
    return [SUCCESS] * (room // (512 * MIB)) + [OOM]


@pytest.mark.parametrize("mode", ["launch", "graph", "capture"])
def test_a_kernel_whose_local_memory_passes_the_cap_is_refused(
    arena: Arena, programs: Programs, mode: str
) -> None:
    h = arena.start([programs.c("lmem"), mode, str(128 * KIB)])  # 5 GiB at its launch
    assert h.one("local") == 128 * KIB
    first = h.one("node") if mode != "launch" else h.one("launch")
    assert first == OOM, h.lines  # refused before the driver grew anything
    arena.contained(h)


def test_lowering_the_stack_limit_gives_back_nothing_a_kernel_grew(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("lmem"), "lower", str(48 * KIB)])  # 1.84 GiB at its launch
    assert h.one("launch") == SUCCESS and h.one("lower") == SUCCESS
    assert h.all("grab") == grabs_beside(arena, 48 * KIB)
    arena.contained(h)


def test_a_workload_s_kernel_with_local_memory_runs_and_is_charged_once(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("lmem"), "again", str(16 * KIB)])  # 600 MiB, 100 launches
    assert h.one("launch") == SUCCESS and h.one("sync") == SUCCESS
    assert h.all("grab") == grabs_beside(arena, 16 * KIB)
    arena.contained(h)


def test_the_simulated_driver_grows_local_memory_at_the_launch(
    arena: Arena, programs: Programs
) -> None:
    """The driver alone (no hook): the kernel's launch takes the growth, kept after it."""
    h = arena.start([programs.c("lmem"), "again", str(64 * KIB)], arena.sim.base_env())
    assert h.one("launch") == SUCCESS
    grabbed = sum(1 for r in h.all("grab") if r == SUCCESS) * 512 * MIB
    assert arena.held(h.pid) == arena.context_cost + growth(64 * KIB) + grabbed
