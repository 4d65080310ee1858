"""The qgpu CLI: validate exit codes and messages, plan tables and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from qgpu.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_validate_rejects_150_naming_the_flag_and_the_rule(capsys):
    assert main(["validate", "--core", "150", "--memory", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --core 150: ") and "multiple of 100" in err
    assert err.count("\n") == 1


def test_validate_accepts_and_normalises(capsys):
    assert main(["validate", "--core", "30", "--memory", "8192Mi", "--isolation", "fs"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"core": 30, "memory_gib": 8, "isolation": "fixed-share"}


def test_the_old_policy_flag_still_works_with_a_one_line_warning(capsys):
    assert main(["validate", "--core", "30", "--memory", "8", "--policy", "FS"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["isolation"] == "fixed-share"
    assert captured.err.splitlines() == [
        "qgpu validate: warning: --policy is deprecated and will be removed in the next "
        "release; use --isolation"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--core", "0", "--memory", "8"], "--core 0: must be 1..99"),
        (["--core", "250", "--memory", "8"], "--core 250: must be 1..99"),
        (["--core", "30", "--memory", "abc"], "--memory abc: must be a whole number"),
        (["--core", "30", "--memory", "-1"], "--memory -1: must be a whole number"),
        (["--core", "30"], "--memory: is required for a share"),
        (
            ["--core", "30", "--memory", "90", "--card-memory", "80"],
            "--memory 90: must not exceed the card (80 GiB, --card-memory)",
        ),
    ],
)
def test_validate_rejections_name_the_flag(args, message, capsys):
    assert main(["validate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "None" not in err and "qgpu-" not in err.split(":")[0], err


@pytest.mark.parametrize(
    "args",
    [
        ["--isolation", "hard"],
        ["--placement", "pack"],
    ],
)
def test_bad_enumerated_values_are_one_usage_line(args, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["validate", "--core", "30", "--memory", "8", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {args[0]}: {args[1]!r} must be one of" in err


@pytest.mark.parametrize("spelling", ["BinPack", " binpack ", "BINPACK"])
def test_one_case_rule_for_placement_in_validate_and_plan(spelling, capsys):
    assert main(["validate", "--core", "30", "--memory", "8", "--placement", spelling]) == 0
    assert json.loads(capsys.readouterr().out)["placement"] == "binpack"
    nodes, reqs = str(EXAMPLES / "nodes.yaml"), str(EXAMPLES / "requests.yaml")
    plan = ["plan", "--nodes", nodes, "--requests", reqs, "--placement", spelling, "--json"]
    assert main(plan) == 0
    assert json.loads(capsys.readouterr().out)["placed"]


def test_validate_as_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "qgpu.cli", "validate", "--core", "150", "--memory", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "--core 150" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_plan_examples_json(policy, capsys):
    args = [
        "plan",
        "--nodes",
        str(EXAMPLES / "nodes.yaml"),
        "--requests",
        str(EXAMPLES / "requests.yaml"),
        "--placement",
        policy,
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    placed = {p["name"]: p for p in out["placed"]}
    assert placed["t4-only"]["node"] == "node-b"
    if policy == "binpack":
        assert placed["llm-small-0"]["gpus"] == placed["llm-small-2"]["gpus"]
        assert out["unplaced"] == []
    else:
        assert len({placed[f"llm-small-{i}"]["gpus"][0] for i in range(3)}) == 3


def test_plan_table_shows_unplaced_reason(tmp_path, capsys):
    reqs = tmp_path / "r.yaml"
    reqs.write_text("requests:\n  - {name: huge, core: 800}\n  - {name: ok, core: 10, memory: 1}\n")
    nodes = str(EXAMPLES / "nodes.yaml")
    assert main(["plan", "--nodes", nodes, "--requests", str(reqs), "--unplaced-exit", "3"]) == 3
    out = capsys.readouterr().out
    assert "Did not fit" in out and "huge" in out and "8 whole GPU(s)" in out
    assert "Per-GPU use" in out


def test_plan_bad_request_file_names_the_entry(tmp_path, capsys):
    reqs = tmp_path / "r.yaml"
    reqs.write_text("requests:\n  - {name: ok, core: 10, memory: 1}\n  - {core: 250, memory: 2}\n")
    assert main(["plan", "--nodes", str(EXAMPLES / "nodes.yaml"), "--requests", str(reqs)]) == 2
    err = capsys.readouterr().err
    assert f"--requests {reqs}: requests[1].qgpu-core=250: must be 1..99" in err


def test_plan_missing_file(capsys):
    assert main(["plan", "--nodes", "/nonexistent.yaml", "--requests", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --nodes /nonexistent.yaml: cannot be read: No such file or directory\n"


def test_plan_table_names_a_whole_gpu_request_without_a_memory_none(tmp_path, capsys):
    reqs = tmp_path / "r.yaml"
    reqs.write_text("requests:\n  - {name: huge, core: 800}\n")
    assert main(["plan", "--nodes", str(EXAMPLES / "nodes.yaml"), "--requests", str(reqs)]) == 0
    out = capsys.readouterr().out
    assert "qgpu-core=800" in out and "None" not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"qgpu {version('qgpu')}"


def test_help_offers_only_commands_that_exist(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "serve" not in out
    for command in ("validate", "plan", "run", "agent", "status"):
        assert f"    {command}" in out


def test_json_into_a_pipe_closed_early_ends_quietly():
    """``qgpu plan --json | true``: the reader is gone before the first write."""
    args = ["plan", "--nodes", str(EXAMPLES / "nodes.yaml"), "--requests"]
    script = (
        f"{sys.executable} -m qgpu.cli {' '.join(args)} {EXAMPLES / 'requests.yaml'} --json "
        "| (exec 0<&-; sleep 0); echo ${PIPESTATUS[0]} >&2"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "141"  # like any filter killed by SIGPIPE
