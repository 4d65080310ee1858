"""Managed memory taken past the interposer. A tenant that reads cuMemAllocManaged from
libcuda's symbol table is charged nothing by its hook, and NVIDIA's NVML leaves managed
memory out of its per-process lists (nvtop #213, rmm #2259), so the watchdog cannot see it
either: 10 GiB of it in a 4 GiB slice are visible to nobody but the device's used memory.
What holds the victim's promise is NVIDIA's own allocator: it evicts managed memory to the
host to serve the driver's other allocations (the Unified Memory driver registers eviction
callbacks with it for that), which the simulator models since this test; before, its
managed memory was neither evictable nor left out of NVML's lists, so the watchdog's
backstop would have looked like it covered this."""

from __future__ import annotations

from enforcement.sim import read_gpu_state

from .conftest import HOSTILE_CAP, Arena, Programs

GIB = 1 << 30


def test_managed_memory_past_the_hook_keeps_the_victim_from_nothing(
    arena: Arena, programs: Programs
) -> None:
    h = arena.start([programs.c("managed_raw")])
    assert h.one("found") == 1 and h.one("managed") == 0
    assert h.all("launch") == [0] and h.all("sync") == [0]
    before = read_gpu_state(arena.sim.config).process(h.pid)
    assert before is not None and before.managed == 10 * GIB  # on the GPU, past its cap
    assert before.mem_used > HOSTILE_CAP
    own = max(arena.context_cost, 512 << 20)
    status, ident = arena.victim.alloc("alloc", 12 * GIB - own)  # its whole promise
    assert status == "ok", f"the victim lost memory it was promised (CUresult {ident})"
    h.command("touch")  # the tenant's kernels cannot take it back while the victim holds it
    assert h.all("launch") == [0, 0]
    assert arena.held(h.pid) <= HOSTILE_CAP
    assert arena.victim.ask(f"free {ident}") == ["ok"]
    h.command("touch")  # the room is free: its next kernel brings its memory back
    back = read_gpu_state(arena.sim.config).process(h.pid)
    assert back is not None and back.managed == 10 * GIB
    arena.victim_gets_its_promise()  # and the victim's allocation evicts it again
