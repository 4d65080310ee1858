"""/etc/ld.so.preload mode: the hook is loaded into every process of a container, so in a
process that never touches CUDA it must do nothing: no output, no files, no changed exit
code, even with limits (good or bad) in its environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.native import hook_library_path

from .conftest import Sim

PROGRAMS = [
    ["/bin/true"],
    ["/bin/sh", "-c", "echo hi; exit 3"],
    ["ls", "/"],
    [sys.executable, "-c", "import ctypes, json; print(json.dumps({'ok': 1}))"],
]


@pytest.mark.parametrize("limits", ["none", "good", "bad"])
def test_non_cuda_programs_are_untouched(sim: Sim, limits: str) -> None:
    env = sim.slice_env("preload-safe", core=30, policy="fixed-share")
    if limits == "none":
        for key in ("QGPU_SLICE_ID", "QGPU_MEMORY_LIMIT", "QGPU_CORE_LIMIT"):
            env.pop(key)
    elif limits == "bad":
        env["QGPU_ISOLATION"] = "nonsense"
        env["QGPU_LIMITS_FILE"] = "/nonexistent/limits.conf"
    plain_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    for cmd in PROGRAMS:
        hooked = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        plain = subprocess.run(cmd, env=plain_env, capture_output=True, text=True, timeout=60)
        assert (hooked.returncode, hooked.stdout, hooked.stderr) == (
            plain.returncode,
            plain.stdout,
            plain.stderr,
        ), cmd
    assert not sim.state_dir.exists()  # no work at load time: no ledger was created


def test_the_hook_is_really_loaded(sim: Sim) -> None:
    env = sim.slice_env("preload-maps")
    out = subprocess.run(
        ["cat", "/proc/self/maps"], env=env, capture_output=True, text=True, timeout=60
    )
    assert str(hook_library_path()) in out.stdout


def test_dlsym_heavy_program_still_works(sim: Sim) -> None:
    """ctypes resolves every attribute through dlsym: our dlsym must forward faithfully."""
    script = (
        "import ctypes, ctypes.util\n"
        "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
        "assert libc.getpid() > 0\n"
        "try:\n"
        "    libc.no_such_function_qgpu\n"
        "except AttributeError:\n"
        "    print('missing ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=sim.slice_env("preload-dlsym"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "missing ok\n"


def test_no_driver_installed_gives_an_error_not_a_crash(sim: Sim, short_tmp: Path) -> None:
    """A CUDA program on a node without a driver, with the hook preloaded: a clean error."""
    env = sim.slice_env("preload-nodriver")
    env["QGPU_REAL_LIBCUDA"] = str(short_tmp / "libcuda-missing.so.1")
    script = (
        "import ctypes, sys\n"
        f"hook = ctypes.CDLL({str(hook_library_path())!r})\n"
        "print(hook.cuInit(0))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"  # CUDA_ERROR_NOT_INITIALIZED
    assert "cannot load the CUDA driver" in out.stderr
