"""Memory that outlives the interposer's charge through shared handles (our addition).

On NVIDIA's driver a VMM allocation exported to a POSIX file descriptor is freed only when
every handle, mapping and descriptor of it, in every process, is gone; memory opened
through a legacy IPC handle may be kept by the importer after the exporter freed it or
died. A hook that gives a handle's charge back when its own process lets go of it is then
credited for memory that is still held. Each attack below took the victim's memory against
the hook as it was before this work (run with ``QGPU_ADVERSARIAL_HOOK``, see conftest).

Ground truth is the simulator's per-process view: a shared allocation is charged to one
live process holding a reference to it (the creator first, then an importer), and to no
process (``unowned``, still in the GPU's used memory) while only descriptors keep it."""

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
SIZE_MIB = 3072  # each shared allocation: 3 GiB


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A unix socket pair to pass descriptors and IPC handles over (message boundaries)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def sharer(arena: Arena, exe: Path, mode: str, sock: socket.socket, *args: str,
           env: dict[str, str] | None = None) -> Hostile:  # fmt: skip
    fd = sock.fileno()
    return arena.start([exe, mode, str(fd), *args], env, pass_fds=(fd,))


def slice_holds(arena: Arena, *procs: Hostile) -> int:
    return sum(arena.held(p.pid) for p in procs)


def kill(h: Hostile) -> None:
    os.kill(h.pid, signal.SIGKILL)
    h.proc.wait(timeout=30)


def test_export_import_then_release_the_original(arena: Arena, programs: Programs) -> None:
    """(a) One process: create 3 GiB, export, import, release the original; four times.
    The hook credited each release while the imported handle kept the memory: 12 GiB."""
    h = arena.start([programs.c("shareable"), "loop", "4", str(SIZE_MIB)])
    arena.contained(h)
    assert h.all("create") == [0] * 4
    assert h.all("export") == [NOT_PERMITTED] * 4 and h.all("import") == []
    assert "cuMemExportToShareableHandle refused in slice hostile" in h.finish()


@pytest.mark.parametrize("importer", ["same-slice", "other-slice"])
def test_descriptors_passed_to_another_process(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket], importer: str
) -> None:
    """(b) The exporter sends each descriptor over a unix socket (SCM_RIGHTS) and releases
    its handle; a process of the same slice (or of another, 1 GiB slice) imports them.
    Before: the exporter was credited at each release, the importer charged nothing."""
    exe = programs.c("shareable")
    send = sharer(arena, exe, "send", pair[0], "4", str(SIZE_MIB), "release")
    env = (
        arena.hostile_env() if importer == "same-slice" else arena.hostile_env("other", memory=GIB)
    )
    recv = sharer(arena, exe, "recv", pair[1], str(SIZE_MIB), env=env)
    if importer == "same-slice":
        assert slice_holds(arena, send, recv) <= HOSTILE_CAP
    else:
        arena.contained(recv, cap=GIB)
    arena.contained(send)
    assert send.all("export") == [NOT_PERMITTED] * 4 and recv.all("import") == []


def test_exporter_killed_while_the_importer_holds(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """(c) The exporter keeps its handle until SIGKILL, the importer (same slice) maps the
    memory; the exporter's charge left with it, the memory stayed, and the importer took
    3 GiB more: 6.5 GiB held in a 4 GiB slice."""
    exe = programs.c("shareable")
    send = sharer(arena, exe, "send", pair[0], "1", str(SIZE_MIB), "keep")
    recv = sharer(arena, exe, "recv", pair[1], str(SIZE_MIB))
    kill(send)
    recv.command(f"grab {SIZE_MIB}")
    arena.contained(recv)
    assert send.all("export") == [NOT_PERMITTED] and recv.all("import") == []


def test_descriptor_parked_in_a_process_that_never_calls_cuda(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The descriptor itself keeps the memory: the exporter sends it to a process with no
    CUDA at all (here the test itself), releases and exits. Charging the exporter until it
    exits would not help: 12 GiB stayed, charged to no process and no slice."""
    send = sharer(arena, programs.c("shareable"), "send", pair[0], "4", str(SIZE_MIB), "release")
    parked: list[int] = []
    while True:
        msg, fds, _, _ = socket.recv_fds(pair[1], 1, 1)
        parked += fds
        if msg != b"F":
            break
    try:
        send.finish()
        arena.victim_gets_its_promise()
        assert read_gpu_state(arena.sim.config).unowned == 0
        assert send.all("export") == [NOT_PERMITTED] * 4 and parked == []
    finally:
        for fd in parked:
            os.close(fd)


def test_import_from_outside_the_slice_is_charged_to_the_importer(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A descriptor made outside any slice (a process the hook does not confine) imported by
    the tenant: the imported 3 GiB count against its cap while it holds them, and come back
    when it releases them. Before: the import was free, and 1 GiB more fitted beside it."""
    exe = programs.c("shareable")
    outside = sharer(arena, exe, "send", pair[0], "1", str(SIZE_MIB), "release",
                     env=arena.sim.base_env())  # fmt: skip
    recv = sharer(arena, exe, "recv", pair[1], str(SIZE_MIB))
    assert outside.all("export") == [0] and recv.all("import") == [0] and recv.all("map") == [0]
    outside.finish()  # the exporter is gone: the tenant's handle alone keeps the memory
    recv.command("grab 1024")
    arena.contained(recv)
    assert recv.all("grab") == [OOM]
    assert arena.held(recv.pid) == CTX + SIZE_MIB * (1 << 20)
    recv.command("release")  # unmapped and released: the memory and the charge go
    recv.command(f"grab {SIZE_MIB}")
    assert recv.all("release") == [0] and recv.all("grab") == [OOM, 0]
    arena.contained(recv)


def test_import_that_does_not_fit_is_refused(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    exe = programs.c("shareable")
    outside = sharer(arena, exe, "send", pair[0], "1", str(SIZE_MIB), "release",
                     env=arena.sim.base_env())  # fmt: skip
    recv = sharer(arena, exe, "recv", pair[1], str(SIZE_MIB), env=arena.hostile_env(memory=2 * GIB))
    outside.finish()  # nobody else holds the memory any more
    arena.contained(recv, cap=2 * GIB)
    assert recv.all("import") == [OOM]
    assert read_gpu_state(arena.sim.config).mem_used == 2 * CTX  # the victim's and the tenant's


# ---- legacy IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle) ----


def test_ipc_importer_keeps_what_the_exporter_freed(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Two processes of the slice: the exporter frees 3 GiB another process has open (cuda.h:
    undefined behaviour, which a driver may resolve by keeping the memory) and allocates
    3 GiB again. Before: 7 GiB held in a 4 GiB slice."""
    exe = programs.c("shareable")
    send = sharer(arena, exe, "ipc_send", pair[0], str(SIZE_MIB))
    recv = sharer(arena, exe, "ipc_recv", pair[1])
    send.command("free")
    send.command(f"grab {SIZE_MIB}")
    assert slice_holds(arena, send, recv) <= HOSTILE_CAP
    arena.contained(send)
    assert send.all("gethandle") == [0]
    assert recv.all("open") == [OOM]  # 3 GiB more than the slice has left
    assert send.all("free") == [0] and send.all("grab") == [0]


def test_ipc_exporter_killed_while_the_importer_holds(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    exe = programs.c("shareable")
    send = sharer(arena, exe, "ipc_send", pair[0], str(SIZE_MIB))
    recv = sharer(arena, exe, "ipc_recv", pair[1])
    kill(send)
    recv.command(f"grab {SIZE_MIB}")
    arena.contained(recv)
    assert recv.all("open") == [OOM]
    assert recv.all("grab") == [0]  # the exporter's memory went with it: room again


def test_ipc_handle_opened_in_another_slice(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """(d) A process of another slice (1 GiB) opens the tenant's 3 GiB, the tenant frees it
    and takes 3 GiB again. An open mapping is charged to the slice that opened it: this one
    does not fit there. Before: the other slice held 3.5 GiB under its 1 GiB cap."""
    exe = programs.c("shareable")
    send = sharer(arena, exe, "ipc_send", pair[0], str(SIZE_MIB))
    other = sharer(arena, exe, "ipc_recv", pair[1], env=arena.hostile_env("other", memory=GIB))
    send.command("free")
    send.command(f"grab {SIZE_MIB}")
    arena.contained(other, cap=GIB)
    arena.contained(send)
    assert other.all("open") == [OOM] and send.all("grab") == [0]


def test_ipc_share_that_fits_is_charged_and_given_back_on_close(
    arena: Arena, programs: Programs, pair: tuple[socket.socket, socket.socket]
) -> None:
    """What legitimate users keep: 512 MiB shared between two processes of the slice is
    charged to both while both hold it (2 GiB with their contexts), and the importer's share
    comes back when it closes the mapping."""
    exe = programs.c("shareable")
    send = sharer(arena, exe, "ipc_send", pair[0], "512")
    recv = sharer(arena, exe, "ipc_recv", pair[1])
    assert send.all("gethandle") == [0] and recv.all("open") == [0]
    recv.command("grab 2560")
    assert recv.all("grab") == [OOM]  # 0.5 + 0.5 + 0.5 + 0.5 + 2.5 > 4
    recv.command("close")
    recv.command("grab 2560")
    assert recv.all("close") == [0] and recv.all("grab") == [OOM, 0]
    assert slice_holds(arena, send, recv) <= HOSTILE_CAP
    arena.contained(recv)
