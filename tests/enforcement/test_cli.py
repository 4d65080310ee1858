"""``qgpu run``: the handler (entry point group qgpu.commands) and the console script."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enforcement.cli import register_run
from enforcement.native import hook_library_path

from .conftest import GIB

PROBE = (
    "import os\n"
    "from enforcement.simcuda import open_driver\n"
    "d = open_driver()\n"
    "free, total = d.mem_get_info()\n"
    "print(os.environ['CUDA_VISIBLE_DEVICES'], d.device_uuid(0), total, "
    "os.environ['QGPU_CORE_LIMIT'], os.environ['QGPU_ISOLATION'], "
    "d.try_mem_alloc(total + 1)[0])\n"
    "raise SystemExit(7)\n"
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qgpu")
    register_run(parser.add_subparsers())
    return parser.parse_args(argv)


def run_handler(argv: list[str]) -> int:
    args = parse(argv)
    return int(args.func(args))


def test_runs_the_command_in_a_simulated_slice(
    short_tmp: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    code = run_handler(
        [
            "run", "--core", "30", "--memory", "4Gi", "--isolation", "fs", "--sim", "2xA10-24GB",
            "--state-dir", str(short_tmp), "--", sys.executable, "-c", PROBE,
        ]
    )  # fmt: skip
    out = capfd.readouterr()
    assert code == 7, out.err  # the command's exit code
    visible, uuid, total, core, policy, over = out.out.split()
    assert visible == uuid
    assert (int(total), core, policy, over) == (4 * GIB, "30", "fixed-share", "2")


def test_device_choice_and_preload_chain(
    short_tmp: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from enforcement.sim import load_sim_config

    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/other-preload.so")
    code = run_handler(
        ["run", "--core", "50", "--memory", "2", "--sim", "2xT4", "--state-dir", str(short_tmp),
         "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES|$LD_PRELOAD"']
    )  # fmt: skip
    assert code == 0
    first = capfd.readouterr().out.strip()
    confs = list((short_tmp / "sim").glob("*.conf"))
    cfg = load_sim_config(confs[0])
    assert first == f"{cfg.gpus[0].uuid}|{hook_library_path()} /usr/lib/other-preload.so"
    code = run_handler(
        ["run", "--core", "50", "--memory", "2", "--sim", "2xT4", "--state-dir", str(short_tmp),
         "--device", cfg.gpus[1].uuid, "--", "sh", "-c", "echo $QGPU_DEVICE_UUID"]
    )  # fmt: skip
    assert code == 0
    assert capfd.readouterr().out.strip() == cfg.gpus[1].uuid


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--core", "0", "--memory", "4"], "--core 0: must be 1..99"),
        (["--core", "150", "--memory", "4"], "--core 150: is a share split over 2 GPUs"),
        (["--core", "30"], "--memory: is required for a share"),
        (["--core", "30", "--memory", "40"], "--memory 40: must not exceed the card"),
        (["--core", "30", "--memory", "4", "--device", "GPU-nope"], "--device GPU-nope: must be"),
    ],
)
def test_invalid_requests_exit_2_with_a_message(
    short_tmp: Path, capfd: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = run_handler(
        ["run", *argv, "--sim", "A10-24GB", "--state-dir", str(short_tmp), "--", "true"]
    )
    err = capfd.readouterr().err
    assert code == 2
    assert err.startswith("qgpu run: ") and message in err, err


@pytest.mark.parametrize("flag", ["--isolation", "--policy"])
def test_an_unknown_isolation_is_a_usage_error_naming_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from qgpu.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["run", "--core", "30", "--memory", "4", flag, "turbo", "--", "true"])
    assert exited.value.code == 2
    assert f"qgpu run: error: argument {flag}: 'turbo' must be one of" in capsys.readouterr().err


def test_whole_gpu_gets_devices_without_caps(
    short_tmp: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = run_handler(
        ["run", "--core", "200", "--sim", "3xT4", "--state-dir", str(short_tmp), "--",
         "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES|${LD_PRELOAD:-none}|${QGPU_MEMORY_LIMIT:-none}"']
    )  # fmt: skip
    assert code == 0
    devices, preload, mem = capfd.readouterr().out.strip().split("|")
    assert len(devices.split(",")) == 2
    assert mem == "none"
    assert str(hook_library_path()) not in preload


def test_missing_command(short_tmp: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_handler(["run", "--core", "30", "--memory", "4", "--sim", "T4"]) == 2
    assert "no command" in capfd.readouterr().err


def test_signal_exit_code(short_tmp: Path) -> None:
    code = run_handler(
        ["run", "--core", "30", "--memory", "4", "--sim", "T4", "--state-dir", str(short_tmp),
         "--", "sh", "-c", "kill -TERM $$"]
    )  # fmt: skip
    assert code == 128 + 15


def test_console_script(short_tmp: Path) -> None:
    """Through the real ``qgpu`` command and its entry-point group."""
    qgpu = shutil.which("qgpu", path=str(Path(sys.executable).parent))
    assert qgpu, "the qgpu console script is installed with the project"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("QGPU_SIM_CONFIG", None)
    out = subprocess.run(
        [qgpu, "run", "--core", "25", "--memory", "3", "--sim", "H100-80GB", "--state-dir",
         str(short_tmp), "--", sys.executable, "-c", PROBE],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 7, out.stderr
    assert out.stdout.split()[2:] == [str(3 * GIB), "25", "best-effort", "2"]


def test_qgpu_run_caps_compute(short_tmp: Path) -> None:
    """End to end: a saturating workload under `qgpu run --isolation fs` gets its share."""
    from enforcement.sim import busy_share, load_sim_config, read_gpu_state

    qgpu = shutil.which("qgpu", path=str(Path(sys.executable).parent))
    assert qgpu
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("QGPU_SIM_CONFIG", None)
    proc = subprocess.Popen(
        [qgpu, "run", "--core", "35", "--memory", "4", "--isolation", "fs", "--sim", "L4",
         "--state-dir", str(short_tmp), "--", sys.executable, "-m", "enforcement.simcuda",
         "burn"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout and proc.stdout.readline().strip() == "ready"
        cfg = load_sim_config(next((short_tmp / "sim").glob("*.conf")))
        time.sleep(0.5)
        before = read_gpu_state(cfg, 0)
        time.sleep(1.5)
        share = 100 * busy_share(before, read_gpu_state(cfg, 0))
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert abs(share - 35) <= 5, share
