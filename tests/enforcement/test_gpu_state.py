"""The GPU's shared state as the interposer makes it where no agent runs (``qgpu run``):
``<QGPU_STATE_DIR>/.gpu-<uuid>/`` private to the user, a roster the user's own hooks write,
one activity file per slice. Slices of processes that are gone give their roster entry
back, and a directory others may write is not believed."""

from __future__ import annotations

import os
import stat

from enforcement.gpu_roster import WRITER_HOOK, read_roster
from enforcement.state_tree import gpu_dir

from .conftest import Sim, Worker, measure_shares, start_burn, wait_ready


def test_the_hook_lists_its_slice_and_gives_back_entries_of_dead_slices(sim: Sim) -> None:
    d = gpu_dir(sim.state_dir, sim.uuid())
    for sid in ("gone-a", "gone-b"):
        w = Worker(sim.slice_env(sid, core=40, policy="fixed-share")).start()
        assert {e.slice_id for e in read_roster(d / "roster")} >= {sid}
        w.quit()
    live = Worker(sim.slice_env("live", core=30, policy="bs")).start()
    try:
        entries = {e.slice_id: e for e in read_roster(d / "roster")}
        assert set(entries) == {"live"}, entries  # the dead slices' entries were given back
        assert (entries["live"].policy, entries["live"].core) == (2, 30)
        assert entries["live"].writer == WRITER_HOOK
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(d / "roster").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(d / "live.activity").st_mode) == 0o600
    finally:
        live.quit()


def test_a_gpu_directory_others_may_write_is_not_believed(sim: Sim) -> None:
    """Anyone could have listed slices there: the hook reads none and, as on a GPU it knows
    nothing of, a burst-share slice alone stays at its share instead of borrowing."""
    d = gpu_dir(sim.state_dir, sim.uuid())
    sim.state_dir.mkdir(parents=True, exist_ok=True)
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    burst = start_burn(sim.slice_env("bs-open", core=30, policy="burst-share"), depth=20)
    wait_ready([burst])
    (share,) = measure_shares(sim, [(0, burst)], warmup=0.3, window=1.0)
    _, err = burst.communicate(timeout=60)  # closes its stdin: it ends
    assert burst.returncode == 0, err
    assert "others may write it" in err, err
    assert share < 40, share  # at its 30 %, not the ~100 % of an idle GPU
