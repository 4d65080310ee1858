"""Memory shared between processes, the way NVIDIA's driver keeps it (the simulator alone, no
interposer): a VMM allocation exported to a POSIX file descriptor lives until every handle,
mapping and descriptor of it, in every process, is gone, whoever made it and whether that
process still lives; memory opened through a legacy IPC handle stays while the exporter or
an importer holds it. What the driver refuses is refused. The per-process view charges a
shared allocation to one live holder (the creator first), and to no process while only
descriptors keep it; the GPU's used memory counts it once while it exists."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcement.sim import process_memory, read_gpu_state

from .conftest import CTX, Sim

SHARER = Path(__file__).with_name("sharer.py")
MIB = 1 << 20
SIZE = 64  # MiB
SUCCESS, INVALID_VALUE, INVALID_CONTEXT, INVALID_HANDLE = 0, 1, 201, 400
NOT_FOUND, NOT_SUPPORTED = 500, 801
POSIX_FD, WIN32, FABRIC = 1, 2, 8


class Sharer:
    """A sharer.py process: one command, one JSON answer."""

    def __init__(self, env: dict[str, str], sock: socket.socket | None = None) -> None:
        fds = (sock.fileno(),) if sock else ()
        self.proc = subprocess.Popen(
            [sys.executable, str(SHARER), *(str(f) for f in fds)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=fds,
        )

    def __call__(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, (
            f"sharer died on {line!r}: {self.proc.stderr.read() if self.proc.stderr else ''}"
        )
        out: dict[str, Any] = json.loads(reply)
        return out

    def ok(self, line: str) -> dict[str, Any]:
        out = self(line)
        assert out["r"] == SUCCESS, (line, out)
        return out

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def sharers(sim: Sim, pair: tuple[socket.socket, socket.socket]) -> Iterator[list[Sharer]]:
    """Two processes of the same GPU joined by a unix socket."""
    procs = [Sharer(sim.base_env(), pair[0]), Sharer(sim.base_env(), pair[1])]
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def held(sim: Sim, pid: int) -> int:
    return process_memory(sim.config).get(pid, 0)


def test_what_the_driver_refuses(sim: Sim) -> None:
    s = Sharer(sim.base_env())
    assert s("attr 103")["value"] == 1  # HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    assert s("attr 128")["value"] == 0  # no fabric handles on this device
    assert s(f"create {SIZE} {POSIX_FD} host")["r"] == INVALID_VALUE  # host: not IPC capable
    assert s(f"create {SIZE} {FABRIC}")["r"] == NOT_SUPPORTED
    assert s(f"create {SIZE} {WIN32}")["r"] == NOT_SUPPORTED
    assert s(f"create {SIZE} 64")["r"] == INVALID_VALUE
    plain = s.ok(f"create {SIZE} 0")["h"]
    assert s(f"export {plain}")["r"] == INVALID_VALUE  # created without the handle type
    h = s.ok(f"create {SIZE} {POSIX_FD}")["h"]
    assert s(f"export {h} {FABRIC}")["r"] == NOT_SUPPORTED
    assert s(f"export {h} 0")["r"] == INVALID_VALUE
    assert s("import 0")["r"] == INVALID_VALUE  # its stdin: not an exported descriptor
    fd = s.ok(f"export {h}")["fd"]
    assert s(f"import {fd} {FABRIC}")["r"] == NOT_SUPPORTED
    s.ok(f"close {fd}")
    assert s(f"import {fd}")["r"] == INVALID_VALUE  # closed: not a descriptor any more
    s.exit()


def test_an_export_outlives_every_handle_until_its_descriptor_closes(sim: Sim) -> None:
    s = Sharer(sim.base_env())
    base = s.ok("used")["used"]
    h = s.ok(f"create {SIZE} {POSIX_FD}")["h"]
    fd = s.ok(f"export {h}")["fd"]
    h2 = s.ok(f"import {fd}")["h"]
    assert h2 != h
    assert s.ok(f"props {h2}") | {"r": 0} == {"r": 0, "type": 1, "types": POSIX_FD, "loc": [1, 0]}
    s.ok(f"release {h}")  # the imported handle keeps it
    assert s.ok("used")["used"] == base + SIZE * MIB
    assert held(sim, s.pid) == CTX + SIZE * MIB
    s.ok(f"release {h2}")  # no handle left, the descriptor keeps it: charged to no process
    assert s.ok("used")["used"] == base + SIZE * MIB
    state = read_gpu_state(sim.config)
    assert state.unowned == SIZE * MIB and state.process(s.pid).mem_used == CTX  # type: ignore[union-attr]
    h3 = s.ok(f"import {fd}")["h"]  # importing it again takes the charge back
    assert held(sim, s.pid) == CTX + SIZE * MIB and read_gpu_state(sim.config).unowned == 0
    s.ok(f"release {h3}")
    s.ok(f"close {fd}")  # the last reference of any kind: freed
    assert s.ok("used")["used"] == base
    assert read_gpu_state(sim.config).unowned == 0
    s.exit()


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_the_importer_keeps_the_memory_after_the_exporter_ends(
    sim: Sim, sharers: list[Sharer], end: str
) -> None:
    exporter, importer = sharers
    h = exporter.ok(f"create {SIZE} {POSIX_FD}")["h"]
    fd = exporter.ok(f"export {h}")["fd"]
    exporter.ok(f"send {fd}")
    got = importer.ok("recv")["fd"]
    h2 = importer.ok(f"import {got}")["h"]
    va = importer.ok(f"map {h2} {SIZE}")["va"]
    importer.ok(f"release {h2}")  # the mapping alone keeps it, in this process
    importer.ok(f"close {got}")
    assert held(sim, exporter.pid) == CTX + SIZE * MIB  # the creator holds the charge
    assert held(sim, importer.pid) == CTX
    exporter.exit() if end == "exit" else exporter.kill()
    assert held(sim, importer.pid) == CTX + SIZE * MIB  # moved to the process that holds it
    assert read_gpu_state(sim.config).mem_used == CTX + SIZE * MIB
    importer.ok(f"unmap {va} {SIZE}")
    assert held(sim, importer.pid) == CTX
    assert read_gpu_state(sim.config).mem_used == CTX


def test_a_descriptor_alone_keeps_the_memory_after_its_exporter_dies(
    sim: Sim, sharers: list[Sharer], pair: tuple[socket.socket, socket.socket]
) -> None:
    """A descriptor in flight or held by a process that never calls CUDA is a reference."""
    exporter, other = sharers
    other.exit()  # the test receives on the other end itself
    h = exporter.ok(f"create {SIZE} {POSIX_FD}")["h"]
    fd = exporter.ok(f"export {h}")["fd"]
    exporter.ok(f"send {fd}")
    exporter.kill()
    _, fds, _, _ = socket.recv_fds(pair[1], 1, 1)
    state = read_gpu_state(sim.config)
    assert state.unowned == SIZE * MIB and state.mem_used == SIZE * MIB
    os.close(fds[0])
    assert read_gpu_state(sim.config).mem_used == 0


def test_legacy_ipc(sim: Sim, sharers: list[Sharer]) -> None:
    exporter, importer = sharers
    p = exporter.ok(f"alloc {SIZE}")["p"]
    ipc = exporter.ok(f"ipcget {p}")["hex"]
    assert exporter.ok(f"ipcget {p}")["hex"] == ipc  # the same handle each time
    assert exporter(f"ipcopen {ipc}")["r"] == INVALID_CONTEXT  # not in the exporting process
    managed = exporter.ok(f"alloc {SIZE} managed")["p"]
    pooled = exporter.ok(f"alloc {SIZE} async")["p"]
    assert exporter(f"ipcget {managed}")["r"] == INVALID_VALUE
    assert exporter(f"ipcget {pooled}")["r"] == INVALID_VALUE
    assert exporter(f"ipcget {p + MIB}")["r"] == INVALID_VALUE  # the base only
    assert importer(f"ipcopen {ipc} 2")["r"] == INVALID_VALUE  # flags
    q = importer.ok(f"ipcopen {ipc}")["p"]
    assert importer.ok(f"ipcopen {ipc}")["p"] == q  # opened again: one more reference
    rng = importer.ok(f"range {q + MIB}")
    assert (rng["base"], rng["size"]) == (q, SIZE * MIB)
    assert held(sim, importer.pid) == CTX
    exporter.ok(f"free {p}")  # undefined by cuda.h: the simulator keeps it for the importer
    assert held(sim, importer.pid) == CTX + SIZE * MIB
    assert held(sim, exporter.pid) == CTX + 2 * SIZE * MIB  # the managed and pool memory
    importer.ok(f"ipcclose {q}")
    assert held(sim, importer.pid) == CTX + SIZE * MIB  # still open once
    importer.ok(f"ipcclose {q}")
    assert held(sim, importer.pid) == CTX
    assert importer(f"ipcclose {q}")["r"] == INVALID_VALUE
    assert importer(f"range {q}")["r"] == NOT_FOUND
    assert importer(f"ipcopen {ipc}")["r"] == INVALID_HANDLE  # freed: the handle is stale


def test_legacy_ipc_memory_stays_while_the_importer_holds_it_after_the_exporter_dies(
    sim: Sim, sharers: list[Sharer]
) -> None:
    exporter, importer = sharers
    p = exporter.ok(f"alloc {SIZE}")["p"]
    q = importer.ok(f"ipcopen {exporter.ok(f'ipcget {p}')['hex']}")["p"]
    exporter.kill()
    assert held(sim, importer.pid) == CTX + SIZE * MIB
    importer.ok(f"ipcclose {q}")
    assert read_gpu_state(sim.config).mem_used == CTX


# ---- memory pools shared between processes (cuMemPoolExportToShareableHandle) ----

RESERVED, USED = 5, 7  # CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, _USED_MEM_CURRENT


def test_what_the_driver_refuses_for_pools(sim: Sim) -> None:
    s = Sharer(sim.base_env())
    assert s(f"pool {FABRIC}")["r"] == NOT_SUPPORTED
    assert s(f"pool {WIN32}")["r"] == NOT_SUPPORTED
    assert s("pool 64")["r"] == INVALID_VALUE
    plain = s.ok("pool 0")["pool"]
    assert s(f"pexport {plain}")["r"] == INVALID_VALUE  # created without the handle type
    p = s.ok(f"palloc {plain} {SIZE}")["p"]
    assert s(f"pexportptr {p}")["r"] == INVALID_VALUE  # its pool is not shared
    pool = s.ok(f"pool {POSIX_FD}")["pool"]
    assert s(f"pexport {pool} {FABRIC}")["r"] == NOT_SUPPORTED
    assert s(f"pexport {pool} 0")["r"] == INVALID_VALUE
    assert s("pimport 0")["r"] == INVALID_VALUE  # its stdin: not an exported descriptor
    fd = s.ok(f"pexport {pool}")["fd"]
    assert s(f"import {fd}")["r"] == INVALID_VALUE  # a pool's descriptor is not a VMM handle's
    h = s.ok(f"create {SIZE} {POSIX_FD}")["h"]
    vmm_fd = s.ok(f"export {h}")["fd"]
    assert s(f"pimport {vmm_fd}")["r"] == INVALID_VALUE  # nor the other way round
    imported = s.ok(f"pimport {fd}")["pool"]
    assert s(f"palloc {imported} {SIZE}")["r"] == INVALID_VALUE  # no allocations of its own
    q = s.ok(f"palloc {pool} {SIZE}")["p"]
    data = s.ok(f"pexportptr {q}")["hex"]
    assert s(f"pimportptr {plain} {data}")["r"] == INVALID_VALUE  # not the pool it came from
    s.exit()


def test_a_pool_descriptor_keeps_the_pool_memory_after_its_exporter_dies(
    sim: Sim, sharers: list[Sharer], pair: tuple[socket.socket, socket.socket]
) -> None:
    exporter, other = sharers
    other.exit()  # the test receives on the other end itself
    pool = exporter.ok(f"pool {POSIX_FD}")["pool"]
    p = exporter.ok(f"palloc {pool} {SIZE}")["p"]
    fd = exporter.ok(f"pexport {pool}")["fd"]
    exporter.ok(f"pfree {p}")
    exporter.ok(f"ptrim {pool} 0")  # nobody else holds it: a trim gives back as before
    assert exporter.ok(f"pattr {pool} {RESERVED}")["value"] == 0
    assert held(sim, exporter.pid) == CTX
    exporter.ok(f"palloc {pool} {SIZE}")  # grows again, shared: the exporter is charged
    assert held(sim, exporter.pid) == CTX + SIZE * MIB
    exporter.ok(f"send {fd}")
    exporter.kill()
    _, fds, _, _ = socket.recv_fds(pair[1], 1, 1)
    state = read_gpu_state(sim.config)
    assert state.unowned == SIZE * MIB and state.mem_used == SIZE * MIB
    os.close(fds[0])
    assert read_gpu_state(sim.config).mem_used == 0


def test_an_imported_pool_and_its_pointers_keep_the_memory(
    sim: Sim, sharers: list[Sharer]
) -> None:
    """The importer's pool and the pointers imported into it keep the exporter's pool
    memory: the exporter's trims give nothing back while they exist, and the memory outlives
    the exporter, charged to the importer, until the last of them goes."""
    exporter, importer = sharers
    pool = exporter.ok(f"pool {POSIX_FD}")["pool"]
    p = exporter.ok(f"palloc {pool} {SIZE}")["p"]
    fd = exporter.ok(f"pexport {pool}")["fd"]
    data = exporter.ok(f"pexportptr {p}")["hex"]
    exporter.ok(f"send {fd}")
    got = importer.ok("recv")["fd"]
    mine = importer.ok(f"pimport {got}")["pool"]
    importer.ok(f"close {got}")
    q = importer.ok(f"pimportptr {mine} {data}")["p"]
    assert importer.ok(f"range {q}") | {"r": 0} == {"r": 0, "base": q, "size": SIZE * MIB}
    assert importer.ok(f"pattr {mine} {RESERVED}")["value"] == SIZE * MIB
    assert importer.ok(f"pattr {mine} {USED}")["value"] == SIZE * MIB
    assert held(sim, exporter.pid) == CTX + SIZE * MIB and held(sim, importer.pid) == CTX
    exporter.ok(f"palloc {pool} {SIZE}")  # the shared pool grows: the importer sees it
    assert importer.ok(f"pattr {mine} {RESERVED}")["value"] == 2 * SIZE * MIB
    exporter.ok(f"pfree {p}")  # before the importer freed it: cuda.h forbids, the memory stays
    exporter.ok(f"ptrim {pool} 0")
    assert exporter.ok(f"pattr {pool} {RESERVED}")["value"] == 2 * SIZE * MIB
    exporter.ok(f"pdestroy {pool}")
    exporter.exit()
    assert held(sim, importer.pid) == CTX + 2 * SIZE * MIB  # moved to the process holding it
    importer.ok(f"free {q}")  # the imported pool still holds it
    assert held(sim, importer.pid) == CTX + 2 * SIZE * MIB
    importer.ok(f"pdestroy {mine}")
    assert held(sim, importer.pid) == CTX
    assert read_gpu_state(sim.config).mem_used == CTX
