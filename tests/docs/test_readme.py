"""The README's tour works as written: its shell commands and its Python example run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from enforcement.sim import CONTEXT_MEMORY

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def test_readme_names_the_two_commands():
    assert "make demo" in README and "make test" in README


def test_validate_lines():
    ok = run(
        [str(BIN / "qgpu"), "validate", "--core", "30", "--memory", "8192Mi", "--policy", "fs"]
    )
    assert ok.returncode == 0, ok.stderr
    bad = run([str(BIN / "qgpu"), "validate", "--core", "150", "--memory", "8"])
    assert bad.returncode == 2
    shown = re.search(r"#  (error: qgpu-core=.*)", README).group(1)
    assert shown in bad.stderr.replace("\n", " ")


def test_plan_line():
    out = run(
        [
            str(BIN / "qgpu"),
            "plan",
            "--nodes",
            "examples/nodes.yaml",
            "--requests",
            "examples/requests.yaml",
            "--policy",
            "frag",
        ]
    )
    assert out.returncode == 0, out.stderr
    assert "Placements" in out.stdout and "Per-GPU use" in out.stdout


def test_run_line():
    line = README[README.index(".venv/bin/qgpu run") :].split("\n\n")[0]
    code = re.search(r'"(from enforcement.*)"', line.replace("\\\n", "")).group(1)
    out = run(
        [
            str(BIN / "qgpu"),
            "run",
            "--sim",
            "1xH100-80GB",
            "--core",
            "30",
            "--memory",
            "4",
            "--policy",
            "fs",
            "--",
            sys.executable,
            "-c",
            code,
        ]
    )
    assert out.returncode == 0, out.stderr
    # the slice less what the process's CUDA context costs on the simulated card
    assert out.stdout.strip() == f"({(4 << 30) - CONTEXT_MEMORY}, {4 << 30})"


def test_agent_and_status_lines():
    state = tempfile.mkdtemp(prefix="qgpu-readme-", dir="/tmp")
    agent = subprocess.Popen(
        [str(BIN / "qgpu"), "agent", "--sim", "2xH100-80GB", "--state-dir", state, "--test-mode"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            out = run(
                [str(BIN / "qgpu"), "status", "--state-dir", state],
                env=dict(os.environ, COLUMNS="200"),
            )
            if out.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert out.returncode == 0, out.stderr
        assert "H100-80GB" in out.stdout
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
def test_python_example_runs():
    block = README[README.index("```python\nimport os\nimport ray") :]
    code = block.split("\n", 1)[1].split("```", 1)[0]
    env = dict(
        os.environ,
        QGPU_BACKEND="sim",
        RAY_TMPDIR=tempfile.mkdtemp(prefix="qgpu-readme-ray-", dir="/tmp"),
    )
    try:
        out = run([sys.executable, "-c", code], env=env)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    found = re.findall(r"\('(GPU-[0-9a-f-]+)', 8\)", last)
    assert len(found) == 3 and found[0] == found[1], last
