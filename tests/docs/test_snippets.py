"""Every shell and Python snippet of README.md and docs/*.md runs as written, so the docs
cannot drift from the code.

How the docs are read (the conventions a doc writer follows):

- Every fenced block names its language. ``bash``/``sh``/``shell`` blocks and ``python``
  blocks are snippets; anything else (``text`` for output and usage synopses, ``yaml``,
  ``json``, ``promql``) is not run.
- A snippet that cannot run here (it needs a Kubernetes cluster, a GPU, root, or minutes)
  has a visible marker on the line before its fence, which says why::

      <!-- snippet: skip: needs a Kubernetes cluster -->

  Skipped snippets are still checked for syntax (``bash -n``, ``compile``) and reported as
  skipped with their file, line and reason.
- A snippet for the nodes of a cluster (``qgpu agent &`` and ``qgpu-ray start`` on every
  node) names the machines it runs on::

      <!-- snippet: on: head -->
      <!-- snippet: on: worker, head -->

  The blocks of a file so marked run, in order, on machines that are Linux namespaces of
  this host (tests/docs/machines.py: each its own network address, processes, hostname,
  ``/run``, ``/var/lib`` and ``/tmp``), as root inside an unprivileged user namespace, one
  bash session per machine (``$!`` carries over); a block naming several machines runs on
  each in the order named. There, the venv's ``bin`` IS on the PATH (the nodes have qgpu
  installed), ``HEAD`` holds the address of the first machine the file names (the reader
  sets it), and ``QGPU_SIM_SPEC=2xH100-80GB`` (the machines have no GPU). Python blocks
  run with the venv's python on their machine. After the last block, nothing may be left
  running on any machine but its shell. Where user namespaces are not allowed, the test
  is skipped with the error.
- The shell snippets of one file run in order in ONE bash session, command by command, as
  if pasted line by line into a terminal at the repository root: a background job started
  in one block (``qgpu agent ... &``) is there for the next block, and ``$!`` names it.
  Python snippets run with the venv's python from the repository root, in order, between
  the shell commands. ``.venv/bin`` is NOT on the PATH, so a snippet that says ``python``
  where it needs the venv's fails here as it would for a reader.
- A command must exit 0, unless its line ends with a comment ``# exit N`` (then it must exit
  N). Comment lines right after a command that start with ``#`` and two spaces are its
  expected output: each must appear in what the command printed (spaces normalised). In a
  Python snippet, such lines (at the start of a line) must appear in what the snippet
  printed, and it must exit 0.
- Paths under ``/tmp/`` are moved into a private temporary directory, so runs never meet
  each other or a reader's files.

A failure names the file and line of the snippet, the command, and its output.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.machines import SUBNET, Machines
from tests.docs.machines import problem as machines_problem

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
NOT_RUN = {"text", "yaml", "json", "promql", "toml", "ini", "dockerfile", "console-output"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<kind>skip|on):\s*(?P<value>.+?)\s*-->$")
EXIT = re.compile(r"\s#\s*exit\s+(?P<code>\d+)\b")
EXPECTED = re.compile(r"^#  (?P<text>\S.*)$")
COMMAND_TIMEOUT = 180.0
SIM_SPEC = "2xH100-80GB"  # the GPUs each machine of a cluster snippet simulates


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first line inside the fence
    lang: str
    text: str
    skip: str | None
    on: tuple[str, ...] = ()  # the machines of a cluster snippet; () = this machine

    @property
    def where(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with their language and skip marker."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), m.group("info").strip().split(" ")[0].lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(prev)
        kind, value = (marker.group("kind"), marker.group("value")) if marker else ("", "")
        body = "\n".join(line[len(m.group("indent")) :] for line in lines[i + 1 : j])
        skip = value if kind == "skip" else None
        on = tuple(n.strip() for n in value.split(",")) if kind == "on" else ()
        out.append(Block(path, i + 2, lang, body, skip, on))
        i = j + 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
SNIPPETS = [b for b in ALL if b.lang in SHELL | PYTHON]


@dataclass
class Command:
    line: int  # 1-based line in the markdown file
    text: str
    expected_exit: int
    expected_output: list[str]


def commands(block: Block) -> list[Command]:
    """A shell block cut into complete commands (continuation lines and multi-line quotes
    joined), each with its expected exit code and output."""
    out: list[Command] = []
    lines = block.text.splitlines()
    pending: list[str] = []
    start = 0
    for n, line in enumerate(lines):
        stripped = line.strip()
        if not pending:
            expected = EXPECTED.match(stripped)
            if expected and out:
                out[-1].expected_output.append(expected.group("text"))
                continue
            if not stripped or stripped.startswith("#"):
                continue
            start = n
        pending.append(line)
        text = "\n".join(pending)
        if line.endswith("\\") or not _complete(text):
            continue
        code = EXIT.search(text)
        out.append(Command(block.line + start, text, int(code.group("code")) if code else 0, []))
        pending = []
    assert not pending, f"{block.where}: the block ends inside a command: {pending[0]!r}"
    return out


def _complete(text: str) -> bool:
    check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    return check.returncode == 0


def _private(text: str, tmp: Path) -> str:
    return text.replace("/tmp/", f"{tmp}/")


def _normalised(text: str) -> str:
    return " ".join(text.split())


class Session:
    """One bash session at the repository root, fed one command at a time: a new one, or
    a machine's shell (`proc`), whose private ``/tmp`` is `tmp` here."""

    def __init__(
        self, tmp: Path, env: dict[str, str], proc: subprocess.Popen[str] | None = None
    ) -> None:
        self.tmp = tmp
        self.inner = Path("/tmp") if proc is not None else tmp  # `tmp` as the shell sees it
        self.n = 0
        self.proc = proc or subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its background jobs go with it at the end
        )

    def private(self, text: str) -> str:
        """`text` with its ``/tmp/`` paths moved into `tmp` (a machine's /tmp is its own)."""
        return text if self.inner != self.tmp else _private(text, self.tmp)

    def run(self, text: str) -> tuple[int | None, str]:
        """Run one command; its exit status (None: it did not end in time) and everything
        it printed. Its stdin is /dev/null: it must not read the commands that follow."""
        self.n += 1
        out, err, rc = (self.tmp / f".{kind}.{self.n}" for kind in ("out", "err", "rc"))
        i_out, i_err, i_rc = (self.inner / p.name for p in (out, err, rc))
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            f"{{ {text}\n}} >{i_out} 2>{i_err} </dev/null\necho $? >{i_rc}.part\n"
        )
        self.proc.stdin.write(f"mv {i_rc}.part {i_rc}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not rc.exists() and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        code = int(rc.read_text()) if rc.exists() else None
        printed = "".join(p.read_text(errors="replace") for p in (out, err) if p.exists())
        return code, printed

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _environment(tmp: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH=path, HOME=os.environ.get("HOME", str(tmp)), RAY_TMPDIR=str(tmp / "ray"))
    return env


def _run_python(block: Block, tmp: Path, env: dict[str, str]) -> None:
    (tmp / "ray").mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _private(block.text, tmp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    _check_python(block, proc.returncode, proc.stdout + proc.stderr)


def _check_python(block: Block, code: int | None, printed: str) -> None:
    ended = f"exited {code}" if code is not None else f"ran over {COMMAND_TIMEOUT:g} s"
    assert code == 0, f"{block.where}: the Python snippet {ended}:\n{printed[-4000:]}"
    for line in block.text.splitlines():
        expected = EXPECTED.match(line)
        if expected:
            assert _normalised(expected.group("text")) in _normalised(printed), (
                f"{block.where}: the Python snippet did not print what the docs show:\n"
                f"  expected: {expected.group('text')}\n  printed: {printed[-4000:]}"
            )


def _run_shell(block: Block, session: Session) -> None:
    for cmd in commands(block):
        code, printed = session.run(session.private(cmd.text))
        where = f"{block.path.relative_to(ROOT)}:{cmd.line}"
        ended = f"exited {code}" if code is not None else f"ran over {COMMAND_TIMEOUT:g} s"
        assert code == cmd.expected_exit, (
            f"{where}: `{cmd.text}` {ended}, the docs expect exit {cmd.expected_exit}:\n"
            f"{printed[-4000:]}"
        )
        for expected in cmd.expected_output:
            assert _normalised(expected) in _normalised(printed), (
                f"{where}: `{cmd.text}` did not print what the docs show:\n"
                f"  expected: {expected}\n  printed: {printed[-4000:]}"
            )


def test_every_fenced_block_names_its_language() -> None:
    known = SHELL | PYTHON | NOT_RUN
    unnamed = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in known]
    assert not unnamed, (
        "fenced blocks must name a language (bash/sh, python, or text for output and "
        "synopses) so that this test knows whether to run them: " + ", ".join(unnamed)
    )


RUN_FILES = sorted({b.path for b in SNIPPETS if b.skip is None and not b.on})


@pytest.mark.slow  # the README's tour starts a Ray cluster; docs/dask.md a Dask one
@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_snippets_of_a_file_run_as_written(path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="qgpu-doc-", dir="/tmp"))  # short: unix sockets
    env = _environment(tmp)
    session = Session(tmp, env)
    try:
        for block in (b for b in SNIPPETS if b.path == path and b.skip is None and not b.on):
            if block.lang in SHELL:
                _run_shell(block, session)
            else:
                _run_python(block, tmp, env)
    finally:
        session.close()
        shutil.rmtree(tmp, ignore_errors=True)


CLUSTER_FILES = sorted({b.path for b in SNIPPETS if b.on and b.skip is None})


def _machine_environment(tmp: Path, head: str) -> dict[str, str]:
    env = {k: v for k, v in _environment(tmp).items() if not k.startswith(("RAY_", "QGPU_"))}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),
        HOME="/tmp",  # each machine's /tmp is its own
        HEAD=head,
        QGPU_SIM_SPEC=SIM_SPEC,
    )
    return env


def _left_running(machines: Machines, name: str) -> list[str]:
    """The processes of machine `name` other than its shell (PID 1 there)."""
    shell = machines.shell_pid(name)
    ns = os.readlink(f"/proc/{shell}/ns/pid")
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == shell:
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "pid") == ns:
                args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"{entry.name}: {args.strip()[:200]}")
    return left


@pytest.mark.slow  # two machines, each with an agent and a Ray node
@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cluster_snippets_of_a_file_run_as_written_on_machines(path: Path) -> None:
    problem = machines_problem()
    if problem is not None:  # these machines (and CI's) allow them: a missing one is a defect
        pytest.fail(f"{problem}; the docs' cluster recipes run on namespace machines")
    cluster = [b for b in SNIPPETS if b.path == path and b.on and b.skip is None]
    names = list(dict.fromkeys(n for b in cluster for n in b.on))
    tmp = Path(tempfile.mkdtemp(prefix="qgpu-doc-", dir="/tmp"))
    machines: Machines | None = None
    try:
        head = f"{SUBNET}.1"  # Machines numbers its machines in the order given
        machines = Machines(names, tmp, _machine_environment(tmp, head), ROOT)
        assert machines.address[names[0]] == head
        sessions = {n: Session(tmp / n, {}, machines.proc[n]) for n in names}
        for block in cluster:
            for name in block.on:
                session = sessions[name]
                if block.lang in SHELL:
                    _run_shell(block, session)
                    continue
                script = session.tmp / f".snippet.{block.line}.py"
                script.write_text(block.text)
                code, printed = session.run(f"{sys.executable} {session.inner / script.name}")
                _check_python(block, code, printed)
        deadline = time.monotonic() + 20
        left = {n: _left_running(machines, n) for n in names}
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            left = {n: _left_running(machines, n) for n in names}
        assert not any(left.values()), (
            f"{path.relative_to(ROOT)}: after its last block, still running: {left}"
        )
    finally:
        if machines is not None:
            machines.close()
        shutil.rmtree(tmp, ignore_errors=True)


SKIPPED = [b for b in SNIPPETS if b.skip is not None]


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.where)
def test_a_marked_snippet_is_valid_and_says_why_it_is_skipped(block: Block) -> None:
    if block.lang in SHELL:
        check = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        assert check.returncode == 0, f"{block.where}: not valid shell: {check.stderr}"
    else:
        compile(block.text, block.where, "exec")
    pytest.skip(f"{block.where}: {block.skip}")


def test_the_parser_reads_the_conventions(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- snippet: skip: needs a cluster -->\n"
        "```sh\nkubectl get nodes\n```\n\n"
        "```bash\n# a comment\nqgpu validate --core 150 \\\n  --memory 8   # exit 2\n"
        "#  error: --core 150\necho 'two\nlines'\n```\n"
    )
    first, second = blocks(doc)
    assert (first.skip, first.line, second.skip, second.line) == ("needs a cluster", 3, None, 7)
    validate, echo = commands(second)
    assert (validate.line, validate.expected_exit) == (8, 2)
    assert validate.expected_output == ["error: --core 150"]
    assert (echo.line, echo.text, echo.expected_exit) == (11, "echo 'two\nlines'", 0)


def test_a_python_snippet_must_print_what_the_docs_show(tmp_path: Path) -> None:
    doc = tmp_path / "y.md"
    doc.write_text("```python\nprint('same GPU:', 1 == 1)\n#  same GPU: True\n```\n")
    (block,) = blocks(doc)
    _run_python(block, tmp_path, _environment(tmp_path))
    doc.write_text("```python\nprint('same GPU:', 1 == 2)\n#  same GPU: True\n```\n")
    (block,) = blocks(doc)
    with pytest.raises(AssertionError, match="did not print what the docs show"):
        _run_python(block, tmp_path, _environment(tmp_path))


def test_the_parser_reads_which_machines_a_snippet_runs_on(tmp_path: Path) -> None:
    doc = tmp_path / "z.md"
    doc.write_text(
        "<!-- snippet: on: head -->\n```bash\nqgpu agent &\n```\n\n"
        "<!-- snippet: on: worker, head -->\n```bash\nray stop\n```\n\n"
        "```bash\necho here\n```\n"
    )
    head, both, here = blocks(doc)
    assert (head.on, both.on, here.on) == (("head",), ("worker", "head"), ())
    assert head.skip is both.skip is here.skip is None
