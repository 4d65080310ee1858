"""The limits contract as the interposer reads it: bad configurations give one clear stderr
line and a refusal (the host program keeps running), a root-owned read-only limits file wins
over the environment, no slice means pass-through, and limits are read at cuInit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from enforcement.simcuda import CUDA_SUCCESS

from .conftest import CTX, GIB, Sim, Worker

MIB = 1 << 20


def refused(env: dict[str, str]) -> tuple[list[str], list[str], int, str]:
    """Run a worker: cuInit, then an allocation; returns the replies, exit code, stderr."""
    w = Worker(env)
    try:
        init = w.ask("init")
        alloc = w.ask("alloc alloc 1048576")
        code, err = w.quit()
    finally:
        w.kill()
    return init, alloc, code, err


def assert_one_clear_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("qgpu: invalid limits: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("QGPU_ISOLATION", "turbo", "must be one of best-effort"),
        ("QGPU_CORE_LIMIT", "150", "1..100"),
        ("QGPU_CORE_LIMIT", "0", "1..100"),
        ("QGPU_MEMORY_LIMIT", "4GiB", "integer number of bytes"),
        ("QGPU_MEMORY_LIMIT", "0", "> 0"),
        ("QGPU_SLICE_ID", "bad/slice", "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
        ("QGPU_SLICE_ID", "..", "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),  # names a directory
        ("QGPU_SLICE_ID", ".hidden", "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
        ("QGPU_DEVICE_UUID", "not-a-uuid", "GPU UUID"),
    ],
)
def test_bad_value_in_environment(sim: Sim, key: str, value: str, rule: str) -> None:
    env = sim.slice_env("cfg-bad")
    env[key] = value
    init, alloc, code, err = refused(env)
    assert init[0] == "ok" and int(init[1]) != CUDA_SUCCESS
    assert alloc[0] == "err"
    assert code == 0
    assert_one_clear_line(err, f"{key}={value}", "from environment", rule)


def test_memory_limit_above_the_card(sim: Sim) -> None:
    env = sim.slice_env("cfg-big", memory=100 * GIB)  # the simulated H100 has 80 GiB
    init, alloc, code, err = refused(env)
    assert int(init[1]) != CUDA_SUCCESS
    assert alloc[0] == "err"
    assert code == 0
    assert_one_clear_line(err, f"QGPU_MEMORY_LIMIT={100 * GIB}", "exceeds the card")


def test_device_uuid_not_visible(sim: Sim) -> None:
    env = sim.slice_env("cfg-uuid", gpu=0)
    env["QGPU_DEVICE_UUID"] = sim.uuid(1)  # CUDA_VISIBLE_DEVICES still names GPU 0
    init, _, code, err = refused(env)
    assert int(init[1]) != CUDA_SUCCESS
    assert code == 0
    assert_one_clear_line(err, f"QGPU_DEVICE_UUID={sim.uuid(1)}", "no visible device")


def test_missing_limits_file(sim: Sim, short_tmp: Path) -> None:
    env = sim.slice_env("cfg-missing")
    env["QGPU_LIMITS_FILE"] = str(short_tmp / "nope.conf")
    init, alloc, code, err = refused(env)
    assert int(init[1]) != CUDA_SUCCESS
    assert alloc[0] == "err"
    assert code == 0
    assert_one_clear_line(err, f"QGPU_LIMITS_FILE={short_tmp / 'nope.conf'}", "does not exist")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("QGPU_SLICE_ID=x\nthis line is garbage\n", "line 2"),
        ("QGPU_SLICE_ID=x\nQGPU_MEMORY_LIMT=5\n", "unknown key 'QGPU_MEMORY_LIMT'"),
        ("QGPU_SLICE_ID=x\nQGPU_MEMORY_LIMIT=lots\n", "QGPU_MEMORY_LIMIT=lots"),
    ],
)
def test_garbled_limits_file(sim: Sim, short_tmp: Path, text: str, needle: str) -> None:
    path = short_tmp / "limits.conf"
    path.write_text(text)
    path.chmod(0o444)
    env = sim.slice_env("cfg-garbled")
    env["QGPU_LIMITS_FILE"] = str(path)
    init, alloc, code, err = refused(env)
    assert int(init[1]) != CUDA_SUCCESS
    assert alloc[0] == "err"
    assert code == 0
    assert_one_clear_line(err, needle)


def test_root_owned_read_only_file_wins_over_environment(sim: Sim, short_tmp: Path) -> None:
    path = short_tmp / "limits.conf"
    path.write_text(
        f"QGPU_SLICE_ID=cfg-file\nQGPU_DEVICE_UUID={sim.uuid(0)}\n"
        f"QGPU_MEMORY_LIMIT={2 * GIB}\nQGPU_STATE_DIR={sim.state_dir}\n"
    )
    path.chmod(0o444)
    env = sim.slice_env("cfg-env", memory=8 * GIB)  # the workload asks for more
    env["QGPU_LIMITS_FILE"] = str(path)
    w = Worker(env)
    try:
        w.start()
        free, total = w.meminfo()
    finally:
        w.kill()
    if os.geteuid() == 0:  # the file is root-owned and not group/other-writable: it wins
        assert total == 2 * GIB
    else:  # a file the workload's user owns has only the environment's authority
        assert total == 8 * GIB
    assert free == total - CTX  # its context


def test_writable_file_does_not_override_environment(sim: Sim, short_tmp: Path) -> None:
    path = short_tmp / "limits.conf"
    path.write_text(f"QGPU_SLICE_ID=cfg-file2\nQGPU_MEMORY_LIMIT={2 * GIB}\n")
    path.chmod(0o666)  # anyone could have written it: the environment wins per key
    env = sim.slice_env("cfg-env2", memory=8 * GIB)
    env["QGPU_LIMITS_FILE"] = str(path)
    w = Worker(env)
    try:
        w.start()
        assert w.meminfo()[1] == 8 * GIB
    finally:
        w.kill()


def test_no_slice_is_pass_through(sim: Sim) -> None:
    env = sim.slice_env("unused")
    for key in ("QGPU_SLICE_ID", "QGPU_MEMORY_LIMIT", "QGPU_CORE_LIMIT", "QGPU_ISOLATION"):
        env.pop(key)
    w = Worker(env)
    try:
        w.start()
        assert w.alloc("alloc", 20 * GIB)[0] == "ok"
        assert w.meminfo()[1] == 80 * GIB
        code, err = w.quit()
    finally:
        w.kill()
    assert code == 0 and err == ""
    assert not sim.state_dir.exists() or not any(sim.state_dir.iterdir())


def test_whole_gpu_slice_has_no_memory_cap(sim: Sim) -> None:
    env = sim.slice_env("cfg-whole", memory=None)
    w = Worker(env)
    try:
        w.start()
        assert w.alloc("alloc", 70 * GIB)[0] == "ok"
        assert w.meminfo() == (10 * GIB - CTX, 80 * GIB)
    finally:
        w.kill()


LATE_SCRIPT = """
import os
from enforcement.simcuda import Driver
drv = Driver()                       # the driver and the hook are loaded; no limits yet
os.environ.update(QGPU_SLICE_ID="cfg-late", QGPU_MEMORY_LIMIT=str(1 << 30),
                  QGPU_DEVICE_UUID=os.environ["CUDA_VISIBLE_DEVICES"])
drv.init()                           # limits are read here
drv.context(drv.device(0))
print(drv.mem_get_info()[1], drv.try_mem_alloc(2 << 30)[0])
"""


def test_limits_are_read_at_cuinit_not_at_load(sim: Sim) -> None:
    env = sim.slice_env("unused")
    for key in ("QGPU_SLICE_ID", "QGPU_MEMORY_LIMIT", "QGPU_DEVICE_UUID"):
        env.pop(key)
    out = subprocess.run(
        [sys.executable, "-c", LATE_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(GIB), "2"]


def build_hook_with_default(directory: Path, default_file: Path) -> Path:
    """A copy of the interposer whose default limits file is ``default_file`` (the real
    default, /etc/qgpu/limits.conf, is not ours to write in a test)."""
    native = Path(__file__).resolve().parents[2] / "enforcement" / "native"
    sources = sorted(str(p) for p in (native / "hook").glob("*.c"))
    sources += sorted(str(p) for p in (native / "common").glob("*.c"))
    out = directory / "libqgpu_hook_test.so"
    subprocess.run(
        ["cc", "-std=gnu11", "-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-Bsymbolic",
         f'-DQGPU_DEFAULT_LIMITS_FILE="{default_file}"', "-o", str(out), *sources, "-ldl",
         "-lpthread"],
        check=True, timeout=120,
    )  # fmt: skip
    return out


def test_trusted_default_file_cannot_be_redirected(sim: Sim, short_tmp: Path) -> None:
    """QGPU_LIMITS_FILE pointing elsewhere (and no slice in the environment) does not escape
    a root-owned, read-only file at the default path."""
    default = short_tmp / "etc-limits.conf"
    default.write_text(
        f"QGPU_SLICE_ID=cfg-default\nQGPU_DEVICE_UUID={sim.uuid(0)}\n"
        f"QGPU_MEMORY_LIMIT={2 * GIB}\nQGPU_STATE_DIR={sim.state_dir}\n"
    )
    default.chmod(0o444)
    hook = build_hook_with_default(short_tmp, default)
    env = sim.slice_env("unused", memory=8 * GIB)
    for key in ("QGPU_SLICE_ID", "QGPU_MEMORY_LIMIT"):
        env.pop(key)
    env["LD_PRELOAD"] = str(hook)  # env QGPU_LIMITS_FILE still names the neutral file
    w = Worker(env)
    try:
        w.start()
        total = w.meminfo()[1]
    finally:
        w.kill()
    assert total == (2 * GIB if os.geteuid() == 0 else 80 * GIB)
