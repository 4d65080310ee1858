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

from .conftest import Arena, Programs, make_arena


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
    return {int(x) for x in clients.read_text().split()} if clients.exists() else set()


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
