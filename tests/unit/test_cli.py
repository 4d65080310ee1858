"""The qgpu CLI: validate exit codes and messages, plan tables and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qgpu.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_validate_rejects_150_naming_core_and_rule(capsys):
    assert main(["validate", "--core", "150", "--memory", "8"]) == 2
    err = capsys.readouterr().err
    assert "qgpu-core" in err and "150" in err and "multiple of 100" in err


def test_validate_accepts_and_normalises(capsys):
    assert main(["validate", "--core", "30", "--memory", "8192Mi", "--policy", "fs"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"core": 30, "memory_gib": 8, "isolation": "fixed-share"}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--core", "0", "--memory", "8"], "qgpu-core"),
        (["--core", "250", "--memory", "8"], "qgpu-core"),
        (["--core", "30", "--memory", "abc"], "qgpu-memory"),
        (["--core", "30", "--memory", "-1"], "qgpu-memory"),
        (["--core", "30"], "qgpu-memory"),
        (["--core", "30", "--memory", "8", "--isolation", "hard"], "isolation"),
        (["--core", "30", "--memory", "90", "--card-memory", "80"], "qgpu-memory"),
    ],
)
def test_validate_rejections(args, field, capsys):
    assert main(["validate", *args]) == 2
    assert field in capsys.readouterr().err


def test_validate_as_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "qgpu.cli", "validate", "--core", "150", "--memory", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "qgpu-core" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_plan_examples_json(policy, capsys):
    args = [
        "plan",
        "--nodes",
        str(EXAMPLES / "nodes.yaml"),
        "--requests",
        str(EXAMPLES / "requests.yaml"),
        "--policy",
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
    assert "requests[1].qgpu-core" in err


def test_plan_missing_file(capsys):
    assert main(["plan", "--nodes", "/nonexistent.yaml", "--requests", "x.yaml"]) == 2
    assert "cannot be read" in capsys.readouterr().err
