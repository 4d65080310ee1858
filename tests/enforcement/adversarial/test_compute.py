"""Legacy launches (issue 17): cuLaunch, cuLaunchGrid, cuLaunchGridAsync and
cuLaunchCooperativeKernelMultiDevice go through the same compute gate as cuLaunchKernel:
a fixed-share 30 % slice launching through them as fast as it can stays at its share."""

from __future__ import annotations

import pytest

from ..conftest import measure_shares
from .conftest import Arena, Programs

LEGACY = ["cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchCooperativeKernelMultiDevice"]


@pytest.mark.slow
@pytest.mark.parametrize("api", LEGACY)
def test_legacy_launches_are_gated(arena: Arena, programs: Programs, api: str) -> None:
    env = arena.hostile_env(core=30, policy="fixed-share")
    h = arena.start([programs.c("legacy_launch"), api, "2000000"], env)
    (share,) = measure_shares(arena.sim, [(0, h.proc)], warmup=0.5, window=1.5)
    h.finish()
    assert h.proc.returncode == 0, h.lines
    assert 25 <= share <= 35, f"{api}: {share:.1f} % of the device under a 30 % cap"
