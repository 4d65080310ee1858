"""The video engines' sessions (our addition): NVML lists every process's encoder (NVENC) and
frame-buffer capture (NvFBC) sessions with its pid, frame rate and latency, and averages
them in its statistics. A tenant reading them with NVIDIA's pynvml would see which
processes of other slices encode, and how much. In a slice the lists name only the slice's
own processes and the statistics are its own sessions'; the node's operator, outside any
slice, still sees them all (the simulated driver opens sessions through its stand-in for the
Video Codec and Capture SDKs: docs/enforcement.md, "The simulated driver")."""

from __future__ import annotations

import sys

from ..conftest import GIB
from .conftest import PROGRAMS, Arena, Programs


def test_video_sessions_show_a_tenant_only_its_own(arena: Arena, programs: Programs) -> None:
    victim = arena.start(
        [programs.c("video_session"), "2", "60", "1"],
        arena.sim.slice_env("encoding-victim", memory=4 * GIB),
    )
    own = arena.start([programs.c("video_session"), "1", "24", "0"], arena.hostile_env())
    assert victim.all("encoder") == [0, 0] and victim.all("fbc") == [0]
    assert own.all("encoder") == [0]
    views = [sys.executable, PROGRAMS / "video_views.py"]
    operator = arena.run_to_end(views, arena.sim.base_env())
    assert sorted(operator.all("enc_pid")) == sorted([victim.pid, victim.pid, own.pid])
    assert operator.all("fbc_pid") == [victim.pid]
    assert operator.one("enc_count0") == 3 and operator.one("enc_fps0") == 48  # (60+60+24)/3
    assert operator.one("fbc_count0") == 1
    tenant = arena.run_to_end(views, arena.hostile_env())
    assert tenant.all("enc_pid") == [own.pid] and tenant.all("fbc_pid") == []
    assert tenant.one("enc_count0") == 1 and tenant.one("enc_fps0") == 24
    assert tenant.one("fbc_count0") == 0 and tenant.one("fbc_fps0") == 0
    assert not [k for k, _ in tenant.lines if k.startswith("err_")], tenant.lines
