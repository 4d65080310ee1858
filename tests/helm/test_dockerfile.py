"""The Dockerfile the chart's image comes from (no Docker engine here: it is parsed, not built).

The Dockerfile is read by BuildKit's own parser (PyPI `dockerfile`, the Go parser); the
build context is computed from `.dockerignore` with Docker's matching rules (patterns are
paths relative to the context root, `*` stays inside one path element, `**` spans any,
a matched directory excludes its contents, `!` re-includes, the last matching line wins).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helm.chart import command, containers, render

dockerfile = pytest.importorskip("dockerfile", reason="needs dockerfile (dev extra)")

ROOT = Path(__file__).resolve().parents[2]


def _stages() -> dict[str, list[object]]:
    stages: dict[str, list[object]] = {}
    current = ""
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if cmd.cmd.upper() == "FROM":
            value = list(cmd.value)
            assert len(value) == 3 and value[1].upper() == "AS", cmd.original
            current = value[2]
            stages[current] = [cmd]
        elif current:
            stages[current].append(cmd)
    return stages


def _pattern(line: str) -> re.Pattern[str]:
    out = ""
    i = 0
    line = line.strip("/")
    while i < len(line):
        if line.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif line.startswith("**", i):
            out += ".*"
            i += 2
        elif line[i] == "*":
            out += "[^/]*"
            i += 1
        elif line[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(line[i])
            i += 1
    return re.compile(out + "$")


def _context(paths: list[str]) -> set[str]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((_pattern(line.lstrip("!")), negate))
    kept = set()
    for path in paths:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        excluded = False
        for pat, negate in rules:
            if any(pat.match(p) for p in prefixes):
                excluded = not negate
        if not excluded:
            kept.add(path)
    return kept


def _git(*args: str) -> list[str]:
    out = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def _repo_files() -> list[str]:
    """What a checkout holds: tracked and new files, plus what a local build left in the
    package directories (the native libraries that must not reach the image)."""
    files = _git("ls-files", "--cached", "--others", "--exclude-standard")
    files += _git("ls-files", "--others", "--ignored", "--exclude-standard", "--", "enforcement")
    return files


def test_two_stages_and_the_runtime_stage_is_the_default_target() -> None:
    stages = _stages()
    assert list(stages) == ["build", "qgpu"]  # the last stage is what `docker build` makes
    build_runs = " ".join(c.value[0] for c in stages["build"] if c.cmd.upper() == "RUN")
    assert re.search(r"pip install [^&]*\"\.\[k8s\]\"", build_runs)
    assert "hook_library_path()" in build_runs  # the build fails without the interposer
    copies = [c for c in stages["qgpu"] if c.cmd.upper() == "COPY"]
    assert [(c.flags, c.value) for c in copies] == [(("--from=build",), ("/opt/qgpu", "/opt/qgpu"))]


def test_the_chart_commands_resolve_in_the_image() -> None:
    """Every qgpu container runs `qgpu ...` or `python -c ...`: both live in the venv the
    runtime stage puts first on PATH (pip installs the `qgpu` console script there)."""
    env = [c for c in _stages()["qgpu"] if c.cmd.upper() == "ENV"]
    values = dict(zip(env[0].value[::2], env[0].value[1::2], strict=True))
    assert values["PATH"].split(":")[0] == "/opt/qgpu/bin"
    rendered = render()
    programs = {
        command(c)[0]
        for w in (rendered.manager, rendered.scheduler)
        for init in (False, True)
        for c in containers(w, init=init).values()
        if "kube-scheduler" not in c["image"]
    }
    assert programs == {"qgpu", "python"}


def test_build_context_has_the_package_sources_and_nothing_built_here() -> None:
    files = _repo_files()
    context = _context(files)
    needed = {"pyproject.toml", "setup.py", "README.md"}
    for p in files:
        top = p.split("/")[0]
        if top in ("qgpu", "enforcement", "k8s_bridge", "qgpu_ray", "qgpu_dask") and re.search(
            r"\.(py|c|h|proto|json)$", p
        ):
            needed.add(p)
    assert any(p.endswith(".c") for p in needed)
    assert "k8s_bridge/deviceplugin/v1beta1/api.proto" in needed
    missing = sorted(needed - context)
    assert missing == []
    leaked = sorted(
        p
        for p in context
        if re.search(r"\.so(\.\d+)*$|\.pyc$", p) or p.split("/")[0] in (".git", ".venv", "tests")
    )
    assert leaked == []
