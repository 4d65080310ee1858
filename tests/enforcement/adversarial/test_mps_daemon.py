"""A tenant's own MPS daemon: no other slice's process may become its client.

NVIDIA's driver makes every CUDA process the client of the MPS control daemon in its
``CUDA_MPS_PIPE_DIRECTORY`` (``/tmp/nvidia-mps`` when unset). On a host where slices run as
one user a tenant can start ``nvidia-cuda-mps-control -d`` there; every other slice's process
that names no pipe directory would then join it, and the tenant would set its thread
percentage and memory limit and see it in the client list, in a server whose context no
slice is charged for. The simulated
driver models a daemon as a FIFO ``control`` in the pipe directory and a client joining as
its pid appended to ``clients`` (docs/enforcement.md, "The simulated driver"); the arena's
default pipe directory is its own, so the tests never touch ``/tmp/nvidia-mps``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import HOSTILE_CAP, Arena, Programs, make_arena


@pytest.fixture
def mps_arena(short_tmp: Path) -> Iterator[tuple[Arena, Path]]:
    default = short_tmp / "nvidia-mps"  # the arena's stand-in for /tmp/nvidia-mps
    for a in make_arena(short_tmp, mps_pipe_directory=default):
        yield a, default


def _start_daemon(pipe_dir: Path) -> Path:
    """What `nvidia-cuda-mps-control -d` leaves in its pipe directory: the control FIFO."""
    pipe_dir.mkdir(mode=0o700, exist_ok=True)
    os.mkfifo(pipe_dir / "control", 0o600)
    return pipe_dir / "clients"


def _clients(clients: Path) -> set[int]:
    return set(_client_caps(clients))


def _client_caps(clients: Path) -> dict[int, tuple[str, str]]:
    """Each client's pid -> the thread percentage and pinned memory limit it asked for."""
    if not clients.exists():
        return {}
    rows = (line.split() for line in clients.read_text().splitlines() if line.strip())
    return {int(pid): (pct, mem) for pid, pct, mem in rows}


def test_the_simulated_driver_joins_a_daemon_at_the_default_directory(
    mps_arena: tuple[Arena, Path], programs: Programs
) -> None:
    """The attack, against a process without the hook: it joins the tenant's daemon."""
    arena, default = mps_arena
    clients = _start_daemon(default)
    plain = arena.start([programs.c("mps_probe")], arena.sim.base_env())
    assert _clients(clients) == {plain.one("pid")}


def test_a_slice_never_joins_a_tenants_mps_daemon(
    mps_arena: tuple[Arena, Path], programs: Programs, short_tmp: Path
) -> None:
    arena, default = mps_arena
    clients = _start_daemon(default)
    # a slice's process that names no pipe directory: the driver's default is the tenant's
    victim = arena.start([programs.c("mps_probe")], arena.sim.slice_env("late-victim"))
    assert victim.one("pid") > 0  # it runs, without MPS
    assert _clients(clients) == set()
    # the daemon is still there for a process outside any slice
    plain = arena.start([programs.c("mps_probe")], arena.sim.base_env())
    assert _clients(clients) == {plain.one("pid")}


def test_a_pipe_directory_the_environment_names_is_kept(
    mps_arena: tuple[Arena, Path], programs: Programs, short_tmp: Path
) -> None:
    """Whoever starts a slice's process may name a daemon for it (the agent's MPS backend
    does); only the unnamed default, which any tenant can occupy, is taken away."""
    arena, default = mps_arena
    default_clients = _start_daemon(default)
    named_dir = short_tmp / "named-mps"
    named_clients = _start_daemon(named_dir)
    env = arena.hostile_env()
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(named_dir)
    named = arena.start([programs.c("mps_probe")], env)
    assert _clients(named_clients) == {named.one("pid")}
    assert _clients(default_clients) == set()
    env["CUDA_MPS_PIPE_DIRECTORY"] = ""  # empty: the driver's default, so taken away too
    empty = arena.start([programs.c("mps_probe")], env)
    assert empty.one("pid") > 0 and _clients(default_clients) == set()


def test_a_slice_under_the_mps_backend_cannot_raise_its_own_mps_caps(
    mps_arena: tuple[Arena, Path], programs: Programs, short_tmp: Path
) -> None:
    """The agent's MPS backend: MPS takes a client's caps from its environment and lets that
    only lower the daemon's, so a tenant that asks for 100 % of the threads and no memory
    limit in its own environment would get them. With the slice's MPS daemon in its limits
    (QGPU_MPS_PIPE_DIRECTORY), the hook sets the caps from the limits before the driver
    reads them: the daemon hears 30 % and 4 GiB, not what the tenant asked for. (That a
    root-owned limits file wins over QGPU_* variables the tenant sets is
    test_native_paths.py::test_environment_cannot_override_a_trusted_limits_file.)"""
    arena, _ = mps_arena
    agent_dir = short_tmp / "agent-mps"
    clients = _start_daemon(agent_dir)
    env = arena.hostile_env(core=30, policy="fixed-share")
    env["QGPU_MPS_PIPE_DIRECTORY"] = str(agent_dir)
    env.update(  # what the tenant asks for itself
        CUDA_MPS_PIPE_DIRECTORY=str(agent_dir),
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
    )
    env.pop("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", None)
    h = arena.start([programs.c("mps_probe")], env)
    assert _client_caps(clients)[h.one("pid")] == ("30", f"0={HOSTILE_CAP >> 20}M")
    # the attack, as the MPS backend's slices ran before (no interposer): it gets its way
    bare = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    b = arena.start([programs.c("mps_probe")], bare)
    assert _client_caps(clients)[b.one("pid")] == ("100", "-")
