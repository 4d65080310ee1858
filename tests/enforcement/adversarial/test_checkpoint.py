"""The checkpoint API between slices (our addition). cuCheckpointProcessLock, Checkpoint,
Restore and Unlock (CUDA 12.8) name a process by its pid, and the driver lets any process of
the same user use them; Ray and Dask workers of different slices are one user. Before the
hook wrapped them, both attacks below won on the simulator, whose checkpoint API does what
cuda.h says the driver does (the work runs in the target's restore thread; a checkpoint
releases the target's device memory; a restore with gpuPairs takes it again on the GPUs
named):

- a tenant locked and checkpointed another slice's process: the victim's 512 MiB context
  vanished from its GPU's accounting and its next CUDA call would block for ever;
- a tenant checkpointed its own child and restored it with gpuPairs onto another slice's
  GPU: 2.5 GiB of the tenant on GPU 1, and GPU 1's owner short of its 16 GiB.

Two simulated 16 GiB GPUs (the `two_gpus` arena): the hostile 4 GiB slice on GPU 0, a victim
slice of the whole of GPU 1. The ground truth is the simulator's own accounting, asserted
before the victim is asked anything (a locked victim would not answer)."""

from __future__ import annotations

import contextlib
import os
import signal

from enforcement.sim import process_memory

from ..conftest import GIB
from .conftest import CTX, Arena, Programs

NOT_PERMITTED = 800
INVALID_DEVICE = 101
CHECKPOINTED = 2  # CU_PROCESS_STATE_CHECKPOINTED
ILLEGAL_STATE = 401


def test_a_tenant_cannot_freeze_or_evict_another_slices_process(
    two_gpus: Arena, programs: Programs
) -> None:
    victim = two_gpus.victim
    status, _ = victim.alloc("alloc", 4 * GIB)
    assert status == "ok"
    held = process_memory(two_gpus.sim.config, 1)[victim.pid]
    assert held == CTX + 4 * GIB
    h = two_gpus.start([programs.c("checkpoint"), "victim", str(victim.pid)])
    after = process_memory(two_gpus.sim.config, 1).get(victim.pid, 0)
    assert after == held, f"the victim's memory went from {held} to {after} bytes: {h.lines}"
    assert h.one("state") == NOT_PERMITTED
    assert h.one("lock") == NOT_PERMITTED
    assert h.one("lock_getproc") == NOT_PERMITTED
    assert h.all("checkpoint") == []  # never locked, so never tried
    # the victim is neither locked nor short: its calls go on, up to its whole GPU
    status, rest = victim.alloc("alloc", 16 * GIB - CTX - 4 * GIB)
    assert status == "ok", f"GPU 1's owner lost memory it was promised (CUresult {rest})"
    assert "cuCheckpointProcessLock(pid" in h.finish()


def test_a_tenant_cannot_restore_its_own_process_onto_another_gpu(
    two_gpus: Arena, programs: Programs
) -> None:
    env = two_gpus.hostile_env(gpu=0)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every GPU of the node, as a bare process sees
    h = two_gpus.start([programs.c("checkpoint"), "child", two_gpus.sim.uuid(1)], env)
    child = h.one("child")
    try:
        on_other = process_memory(two_gpus.sim.config, 1).get(child, 0)
        assert on_other == 0, f"the tenant holds {on_other / GIB:.2f} GiB on GPU 1: {h.lines}"
        # its own process, its own GPU: lock, checkpoint and restore work as the driver's
        assert h.one("lock") == 0 and h.one("checkpoint") == 0
        assert h.one("restore_other") == INVALID_DEVICE
        assert h.one("state_after_other") == CHECKPOINTED  # refused before the driver saw it
        assert h.one("restore_own") == 0 and h.one("unlock") == 0
        own = process_memory(two_gpus.sim.config, 0).get(child, 0)
        assert own == CTX + 2 * GIB  # back where it was, on its slice's GPU
        status, ident = two_gpus.victim.alloc("alloc", 16 * GIB - CTX)
        assert status == "ok", f"GPU 1's owner lost memory it was promised (CUresult {ident})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert "onto " + two_gpus.sim.uuid(1) in h.finish()


def test_outside_a_slice_the_checkpoint_api_is_the_drivers(
    two_gpus: Arena, programs: Programs
) -> None:
    """The node's operator (no slice, no hook: `cuda-checkpoint` on the host) keeps the whole
    API, and the simulator does to the victim what the driver would: locked, its memory
    released on its GPU, and a second lock refused for the state it is in."""
    victim = two_gpus.victim
    assert victim.alloc("alloc", 4 * GIB)[0] == "ok"
    h = two_gpus.start(
        [programs.c("checkpoint"), "victim", str(victim.pid)], two_gpus.sim.base_env()
    )
    assert (h.one("state"), h.one("lock"), h.one("checkpoint")) == (0, 0, 0)
    assert h.one("lock_getproc") == ILLEGAL_STATE
    assert process_memory(two_gpus.sim.config, 1).get(victim.pid, 0) == 0
    h.finish()
