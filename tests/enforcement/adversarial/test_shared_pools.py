"""Memory pools shared between processes (our addition): a pool exported to a POSIX file
descriptor (cuMemPoolExportToShareableHandle) keeps its memory while the exporter's pool, a
descriptor, a pool imported from one or a pointer imported into one exists, in any process
(the simulator keeps what cuda.h allows a driver to keep, see sim/pool.c). A hook that gives
the pool's charge back when the exporter lets go, or that charges nothing for an import, is
credited for memory still held. Each attack below took the victim's memory against the hook
as it was before this work (commit 3c7e4ee, run with ``QGPU_ADVERSARIAL_HOOK``).

Ground truth is the simulator's per-process view: a shared pool's memory is charged to one
live process holding it (the exporter first, then an importer), and to no process
(``unowned``, still in the GPU's used memory) while only descriptors keep it."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcement.sim import read_gpu_state

from .conftest import CTX, GIB, HOSTILE_CAP, OOM, Arena, Hostile, Programs

NOT_PERMITTED = 800  # CUDA_ERROR_NOT_PERMITTED
SIZE_MIB = 3072  # each shared pool: 3 GiB allocated from it
EXPORT_DATA = 64  # sizeof(CUmemPoolPtrExportData)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def pool_program(arena: Arena, exe: Path, mode: str, sock: socket.socket, *args: str,
                 env: dict[str, str] | None = None) -> Hostile:  # fmt: skip
    fd = sock.fileno()
    return arena.start([exe, mode, str(fd), *args], env, pass_fds=(fd,))


def kill(h: Hostile) -> None:
    os.kill(h.pid, signal.SIGKILL)
    h.proc.wait(timeout=30)


def test_pool_descriptors_parked_after_their_exporters_exit(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Four processes of the slice one after the other: each allocates 3 GiB from a pool of
    its own, exports the pool, sends the descriptor to a process with no CUDA at all (here
    the test itself) and exits. Before: each exporter's charge left with it while its
    descriptor kept the pool: 12 GiB held by no process and no slice."""
    exe = programs.c("shared_pool")
    parked: list[int] = []
    senders = []
    try:
        for _ in range(4):
            senders.append(pool_program(arena, exe, "send", pair[0], str(SIZE_MIB), "exit"))
            senders[-1].proc.wait(timeout=30)
            _, fds, _, _ = socket.recv_fds(pair[1], EXPORT_DATA, 1)
            parked += fds
        arena.victim_gets_its_promise()
        assert read_gpu_state(arena.sim.config).unowned == 0
        assert [s.one("export") for s in senders] == [NOT_PERMITTED] * 4 and parked == []
        assert [s.one("alloc") for s in senders] == [0] * 4
    finally:
        for fd in parked:
            os.close(fd)


@pytest.mark.parametrize("importer", ["same-slice", "other-slice"])
def test_an_importer_keeps_the_pool_after_its_exporter_is_killed(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket], importer: str
) -> None:
    """The exporter keeps its pool until SIGKILL; a process of the same slice (or of another,
    1 GiB slice) imports the pool and the pointer. The exporter's charge left with it, the
    importer (charged nothing for the import) held the 3 GiB and took 3 GiB more: 6.5 GiB in
    the 4 GiB slice, or 3.5 GiB in the 1 GiB one."""
    exe = programs.c("shared_pool")
    send = pool_program(arena, exe, "send", pair[0], str(SIZE_MIB), "hold")
    cap = HOSTILE_CAP if importer == "same-slice" else GIB
    slice_id = "hostile" if importer == "same-slice" else "other"
    env = arena.hostile_env(slice_id, memory=cap)
    recv = pool_program(arena, exe, "recv", pair[1], env=env)
    kill(send)
    recv.command(f"grab {SIZE_MIB}")
    arena.contained(recv, cap=cap)
    assert send.all("export") == [NOT_PERMITTED] and recv.all("descriptor") == [0]
    if importer == "same-slice":
        assert recv.all("grab") == [0]  # the exporter's memory went with it: room again


def test_pool_import_from_outside_the_slice_is_charged_to_the_importer(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A pool exported by a process outside any slice, imported with a pointer by the tenant:
    the pool's 3 GiB count against its cap while it holds the imported pool or pointer, and
    come back when it lets go of both. Before: the import was free, and 1 GiB more fitted
    beside it (4.5 GiB held once the exporter exited)."""
    exe = programs.c("shared_pool")
    outside = pool_program(arena, exe, "send", pair[0], str(SIZE_MIB), "hold",
                           env=arena.sim.base_env())  # fmt: skip
    recv = pool_program(arena, exe, "recv", pair[1])
    assert outside.all("export") == [0] and outside.all("exportptr") == [0]
    assert recv.all("import") == [0] and recv.all("importptr") == [0]
    outside.finish()  # the exporter is gone: the tenant's imported pool keeps the memory
    recv.command("grab 1024")
    arena.contained(recv)
    assert recv.all("grab") == [OOM]
    assert arena.held(recv.pid) == CTX + SIZE_MIB * (1 << 20)
    recv.command("release")  # pointer freed, pool destroyed: the memory and the charge go
    recv.command(f"grab {SIZE_MIB}")
    assert recv.all("free") == [0] and recv.all("destroy") == [0]
    assert recv.all("grab") == [OOM, 0]
    arena.contained(recv)


def test_pool_import_that_does_not_fit_is_refused(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    exe = programs.c("shared_pool")
    outside = pool_program(arena, exe, "send", pair[0], str(SIZE_MIB), "hold",
                           env=arena.sim.base_env())  # fmt: skip
    recv = pool_program(arena, exe, "recv", pair[1], env=arena.hostile_env(memory=2 * GIB))
    outside.finish()  # nobody else holds the pool any more
    arena.contained(recv, cap=2 * GIB)
    assert recv.all("import") == [OOM] and recv.all("importptr") == []
    assert read_gpu_state(arena.sim.config).mem_used == 2 * CTX  # the victim's and the tenant's


def test_an_imported_pointer_freed_in_stream_order_is_credited_when_the_stream_reaches_it(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The imported pool destroyed first, its last pointer freed with cuMemFreeAsync behind a
    1 s kernel: the pool's memory stays until the stream reaches the free, and so does the
    charge (3 GiB more is refused until then, and fits after a synchronisation)."""
    exe = programs.c("shared_pool")
    outside = pool_program(arena, exe, "send", pair[0], str(SIZE_MIB), "hold",
                           env=arena.sim.base_env())  # fmt: skip
    recv = pool_program(arena, exe, "recv", pair[1])
    outside.finish()
    recv.command("drop")  # the pointer alone keeps the pool now
    recv.command(f"grab {SIZE_MIB}")
    recv.command(f"freeasync {1_000_000_000}")
    recv.command(f"grab {SIZE_MIB}")  # the stream has not reached the free yet
    arena.contained(recv)
    recv.command("sync")
    recv.command(f"grab {SIZE_MIB}")
    assert recv.all("destroy") == [0] and recv.all("launch") == [0] and recv.all("free") == [0]
    assert recv.all("grab") == [OOM, OOM, 0]
    arena.contained(recv)
