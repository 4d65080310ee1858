"""Escapes a framework reaches through NVIDIA's cuda-bindings (every driver function
resolved through cuGetProcAddress): size overflow, VMM map-then-release, pools, graph
memory from stream capture, stream-ordered frees, and pointer identity."""

from __future__ import annotations

import pytest

from .conftest import CTX, GIB, HOSTILE_CAP, OOM, Arena

OVERFLOW_APIS = ("alloc", "managed", "pitch", "create", "async", "array3d", "heap")


@pytest.mark.parametrize("api", OVERFLOW_APIS)
def test_size_overflow_never_resets_the_count(arena: Arena, api: str) -> None:
    h = arena.python("overflow.py", api)
    assert all(code != 0 for code in h.all("attempt")), h.lines
    # 3 GiB fits once under the 4 GiB cap (with the context); the next four are refused
    assert h.all("grab") == [0, OOM, OOM, OOM, OOM]
    arena.contained(h)


def test_vmm_release_while_mapped_keeps_the_charge(arena: Arena) -> None:
    h = arena.python("vmm_release.py")
    assert h.all("create") == [0, OOM, OOM, OOM, OOM]
    assert h.all("release") == [0]
    arena.contained(h)


def test_runtime_resolution_through_cuGetProcAddress_is_capped(arena: Arena) -> None:
    h = arena.python("getproc.py")
    assert h.all("grab") == [0, OOM]
    assert h.one("total") == HOSTILE_CAP
    assert h.one("free") == HOSTILE_CAP - CTX - 3 * GIB
    arena.contained(h)


@pytest.mark.parametrize("mode", ["threshold", "setpool", "frompool"])
def test_memory_a_pool_keeps_stays_charged(arena: Arena, mode: str) -> None:
    h = arena.python("pools.py", mode)
    assert h.all("pool") == [0]
    assert h.all("free") == [0] and h.all("sync") == [0]
    assert h.all("grab") == [OOM]
    arena.contained(h)


def test_pool_growth_is_capped(arena: Arena) -> None:
    h = arena.python("pools.py", "grow")
    assert h.all("pool") == [0, OOM]
    arena.contained(h)


def test_pool_import_takes_no_memory_of_its_own(arena: Arena) -> None:
    """cuMemPoolImportPointer into a pool of the process's own: only a pool imported from
    another process's descriptor takes imported pointers, and the driver refuses this one
    (pools shared between processes: test_shared_pools.py)."""
    h = arena.python("pools.py", "import")
    assert h.one("import") != 0
    assert h.all("grab") == [0]
    arena.contained(h)


def test_stream_ordered_free_is_credited_when_the_stream_reaches_it(arena: Arena) -> None:
    h = arena.python("freeasync.py")
    assert h.all("pool") == [0] and h.all("launch") == [0] and h.all("free") == [0]
    assert h.all("grab") == [OOM]
    arena.contained(h)


@pytest.mark.parametrize("run", ["launch", "upload"])
def test_allocation_captured_in_a_graph_is_charged_when_it_runs(arena: Arena, run: str) -> None:
    h = arena.python("capture.py", run)
    assert h.all("grab") == [0]
    assert h.all("captured") == [0]
    assert h.all("run") == [OOM]
    arena.contained(h)


def test_zeroing_the_ledger_does_not_reset_a_process_s_own_count(arena: Arena) -> None:
    """The process-local second check: what this process holds is counted by the hook in its
    own memory, so after zeroing the shared ledger it still cannot take 3 GiB more."""
    h = arena.python("ledger_zero.py", "one")
    assert h.one("zeroed") == 1
    assert h.all("grab") == [0, OOM]
    arena.contained(h)
