"""Time slices per context (our addition). NVIDIA's driver time-slices a GPU between
contexts (each is its own channel group), so a process with work queued in four contexts
holds four slices per round against a neighbour's one; the simulator does the same. The
first test pins that model; the second is the attack on it: a 25 % fixed-share tenant that
spreads its work over eight contexts, beside a saturating neighbour, to take the slices its
share does not cover."""

from __future__ import annotations

import pytest

from ..conftest import measure_shares, start_burn, wait_ready
from .conftest import Arena, Programs

pytestmark = pytest.mark.slow

KERNEL_NS = "2000000"


def test_the_simulator_slices_the_gpu_per_context(arena: Arena, programs: Programs) -> None:
    """No hook: four busy contexts in one process against one in another take ~4/5."""
    env = arena.sim.base_env()
    many = arena.start([programs.c("ctx_burn", "-lpthread"), "4", KERNEL_NS], env)
    assert many.one("contexts") == 4
    one = start_burn(env, ns=2_000_000)
    try:
        wait_ready([one])
        many_share, one_share = measure_shares(arena.sim, [(0, many.proc), (0, one)])
    finally:
        one.kill()
        one.wait()
    many.finish()
    assert 70 <= many_share <= 90 and 10 <= one_share <= 30, (many_share, one_share)


@pytest.mark.parametrize("policy", ["fixed-share", "best-effort"])
def test_more_contexts_take_nothing_of_a_neighbours_share(
    arena: Arena, programs: Programs, policy: str
) -> None:
    """Beside a saturating 75 % fixed-share neighbour: a 25 % fixed-share tenant stays at
    its share, a best-effort one at what the neighbour leaves, with eight busy contexts."""
    neighbour_env = arena.sim.slice_env("victim", memory=None, core=75, policy="fixed-share")
    victim = start_burn(neighbour_env, ns=2_000_000)
    env = arena.hostile_env(core=25, policy=policy)
    try:
        wait_ready([victim])
        h = arena.start([programs.c("ctx_burn", "-lpthread"), "8", KERNEL_NS], env)
        assert h.one("contexts") == 8  # 8 x 512 MiB: the whole 4 GiB cap
        hostile, neighbour = measure_shares(arena.sim, [(0, h.proc), (0, victim)], window=2.0)
        h.finish()
    finally:
        victim.kill()
        victim.wait()
    assert hostile <= 30, f"{hostile:.1f} % of the GPU for a 25 % {policy} slice"
    assert neighbour >= 70, f"the 75 % neighbour got {neighbour:.1f} % ({policy}: {hostile:.1f})"
