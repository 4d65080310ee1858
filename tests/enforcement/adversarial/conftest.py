"""The arena of the adversarial corpus: one simulated 16 GiB GPU shared by a victim slice
(12 GiB promised) and a hostile slice (4 GiB), so that any byte the hostile tenant takes
beyond its cap is a byte the victim was promised.

Hostile programs live in ``programs/``: C where the escape is native (compiled here with
``cc`` against the CUDA toolkit's ``cuda.h`` and the simulated ``libcuda.so``), Python with
NVIDIA's ``cuda-bindings`` where a framework would do it. Each prints ``key value`` lines
(the CUresult of every attempt, what it holds), then ``ready 0`` once it has taken all it
could, and keeps its memory until its stdin is closed. The ground truth of what a process
holds is the simulated GPU's own per-process accounting, never the hook's ledger.

``QGPU_ADVERSARIAL_HOOK=/path/to/libqgpu_hook.so`` runs the hostile side under another
build of the interposer (e.g. an older commit's) to see which escapes win against it;
``QGPU_ADVERSARIAL_PROCADDR=exported`` makes the simulated cuGetProcAddress hand out the
exported symbols (which such an older hook recognised by pointer identity), so that each
escape is seen on its own rather than behind that one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from enforcement.native import sim_library_dir
from enforcement.sim import MODELS, process_memory, write_sim_config

from ..conftest import GIB, Sim, Worker

MIB = 1 << 20
CTX = MODELS["t4-16gb"].context_memory  # what a context costs on the arena's T4 by default
CONTEXT_CHARGE = 512 * MIB  # the hook's least charge per context (QGPU_CONTEXT_MEMORY default)
CARD = 16 * GIB
HOSTILE_CAP = 4 * GIB
VICTIM_CAP = CARD - HOSTILE_CAP
PROGRAMS = Path(__file__).with_name("programs")
HOOK_OVERRIDE = "QGPU_ADVERSARIAL_HOOK"
PROCADDR_OVERRIDE = "QGPU_ADVERSARIAL_PROCADDR"


def cuda_include() -> Path:
    """The CUDA toolkit's include directory (cuda.h, cudaTypedefs.h)."""
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    candidates += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parents[1]))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda.h").is_file():
            return Path(c) / "include"
    pytest.fail("the CUDA toolkit's cuda.h was not found (CUDA_HOME, /usr/local/cuda*)")


class Programs:
    """Compiles the C hostile programs once per test session."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._built: dict[tuple[str, tuple[str, ...]], Path] = {}

    def c(self, name: str, *extra: str, output: str | None = None) -> Path:
        key = (name, extra)
        if key not in self._built:
            exe = self.out / (output or name)
            cmd = [
                "cc", "-std=gnu11", "-O1", "-Wall", "-o", str(exe), str(PROGRAMS / f"{name}.c"),
                f"-I{cuda_include()}", f"-I{PROGRAMS}", *extra,
            ]  # fmt: skip
            if "-static" not in extra:
                cmd += [f"-L{sim_library_dir()}", "-lcuda"]
            cmd += ["-ldl", "-lpthread"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            self._built[key] = exe
        return self._built[key]

    def static(self, name: str) -> Path:
        """A statically linked program with the simulated driver linked into it: the dynamic
        loader never runs, so LD_PRELOAD and /etc/ld.so.preload never load the hook."""
        key = (name, ("-static",))
        if key not in self._built:
            exe = self.out / f"{name}-static"
            native = sim_library_dir().parent
            driver = [
                str(c) for c in sorted((native / "sim").glob("*.c")) if c.name != "nvml.c"
            ]  # the simulated libcuda's sources, as setup.py builds them, minus NVML
            cmd = [
                "cc", "-std=gnu11", "-O1", "-static", "-o", str(exe), str(PROGRAMS / f"{name}.c"),
                *driver, *map(str, sorted((native / "common").glob("*.c"))),
                f"-I{cuda_include()}", f"-I{PROGRAMS}", f"-I{native / 'include'}",
                f"-I{native / 'common'}", f"-I{native / 'sim'}", "-lpthread", "-ldl", "-lm",
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            self._built[key] = exe
        return self._built[key]

    def shared(self, name: str, *extra: str) -> Path:
        """A plugin library (``lib<name>.so``) linked against libcuda."""
        key = (f"lib{name}.so", extra)
        if key not in self._built:
            lib = self.out / f"lib{name}.so"
            cmd = [
                "cc", "-std=gnu11", "-O1", "-shared", "-fPIC", "-o", str(lib),
                str(PROGRAMS / f"{name}.c"), f"-I{cuda_include()}", f"-I{PROGRAMS}", *extra,
                f"-L{sim_library_dir()}", "-lcuda",
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            self._built[key] = lib
        return self._built[key]


@pytest.fixture(scope="session")
def programs() -> Iterator[Programs]:
    out = Path(tempfile.mkdtemp(prefix="qadv-", dir="/tmp"))
    yield Programs(out)
    shutil.rmtree(out, ignore_errors=True)


def spawn(
    argv: list[str | Path],
    env: dict[str, str],
    stdin: int = subprocess.PIPE,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[str]:
    """A hostile program's process: text pipes for its reports, stdin to hold it (and the
    descriptors in `pass_fds`, e.g. a unix socket to pass handles over)."""
    return subprocess.Popen(
        [str(a) for a in argv],
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
    )


@dataclass
class Hostile:
    """A running hostile program: what it reported, until it said ``ready``."""

    proc: subprocess.Popen[str]
    lines: list[tuple[str, int]] = field(default_factory=list)
    stderr: str = ""

    def read_until_ready(self, timeout_lines: int = 100_000) -> Hostile:
        assert self.proc.stdout is not None
        for _ in range(timeout_lines):
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"hostile program ended early: {self.lines} {err}")
            key, _, value = line.strip().partition(" ")
            if key == "ready":
                return self
            self.lines.append((key, int(value or 0)))
        raise AssertionError("hostile program never became ready")

    def command(self, line: str) -> Hostile:
        """Send a command line to a program that serves commands, wait for its next ready."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read_until_ready()

    def all(self, key: str) -> list[int]:
        return [v for k, v in self.lines if k == key]

    def one(self, key: str) -> int:
        values = self.all(key)
        assert len(values) == 1, (key, self.lines)
        return values[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self) -> str:
        """Close its stdin (it exits); returns its stderr."""
        try:
            _, err = self.proc.communicate(timeout=30)  # closes stdin first
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return err


@dataclass
class Arena:
    sim: Sim
    victim: Worker
    hostiles: list[Hostile] = field(default_factory=list)

    def hostile_env(self, slice_id: str = "hostile", **kw: object) -> dict[str, str]:
        kw.setdefault("memory", HOSTILE_CAP)
        env = self.sim.slice_env(slice_id, **kw)  # type: ignore[arg-type]
        override = os.environ.get(HOOK_OVERRIDE)
        if override and "LD_PRELOAD" in env:
            env["LD_PRELOAD"] = override
        env["PYTHONPATH"] = os.pathsep.join([str(PROGRAMS), env.get("PYTHONPATH", "")])
        return env

    def start(
        self,
        argv: list[str | Path],
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Hostile:
        """Start a hostile program and wait until it has taken what it could."""
        h = Hostile(spawn(argv, env if env is not None else self.hostile_env(), pass_fds=pass_fds))
        self.hostiles.append(h)
        return h.read_until_ready()

    def run_to_end(self, argv: list[str | Path], env: dict[str, str] | None = None) -> Hostile:
        """Run a hostile program that is expected to end on its own (refused or crashed)."""
        proc = spawn(argv, env if env is not None else self.hostile_env(), stdin=subprocess.DEVNULL)
        h = Hostile(proc)
        self.hostiles.append(h)
        out, h.stderr = proc.communicate(timeout=60)
        for line in out.splitlines():
            key, _, value = line.strip().partition(" ")
            h.lines.append((key, int(value or 0)))
        return h

    def python(self, script: str, *args: str, env: dict[str, str] | None = None) -> Hostile:
        return self.start([sys.executable, PROGRAMS / script, *args], env)

    def held(self, pid: int) -> int:
        """What the simulated GPU says `pid` holds (its own accounting, not the hook's)."""
        return process_memory(self.sim.config).get(pid, 0)

    @property
    def context_cost(self) -> int:
        """What a context costs on this arena's GPU (the victim's among them)."""
        return self.sim.config.gpus[0].context_memory

    def victim_gets_its_promise(self) -> None:
        """The victim can still allocate everything it was promised (its context aside)."""
        own = max(self.context_cost, CONTEXT_CHARGE)  # what its context is charged
        status, ident = self.victim.alloc("alloc", VICTIM_CAP - own)
        assert status == "ok", f"victim lost memory it was promised (CUresult {ident})"
        assert self.victim.ask(f"free {ident}") == ["ok"]

    def contained(self, hostile: Hostile, cap: int = HOSTILE_CAP) -> None:
        """The hostile program holds no more than its cap and the victim lost nothing."""
        held = self.held(hostile.pid)
        assert held <= cap, f"hostile holds {held / GIB:.2f} GiB under a {cap / GIB:.0f} GiB cap"
        self.victim_gets_its_promise()


def make_arena(short_tmp: Path, **sim_options: Any) -> Iterator[Arena]:
    """The arena on a simulated T4; `sim_options` go to write_sim_config."""
    cfg = write_sim_config(
        short_tmp / "sim.conf",
        "T4-16GB",
        node=f"adv-{short_tmp.name}",
        procaddr=os.environ.get(PROCADDR_OVERRIDE, "internal"),
        **sim_options,
    )
    sim = Sim(cfg, short_tmp / "ledgers")
    yield from arena_on(sim, sim.slice_env("victim", memory=VICTIM_CAP))


def arena_on(sim: Sim, victim_env: dict[str, str]) -> Iterator[Arena]:
    """An arena on `sim` whose victim worker runs with `victim_env`, started; the victim and
    every hostile program are killed afterwards."""
    victim = Worker(victim_env)
    a = Arena(sim, victim)
    try:
        victim.start()
        yield a
    finally:
        for h in a.hostiles:
            if h.proc.poll() is None:
                h.proc.kill()
                h.proc.wait()
        victim.kill()


@pytest.fixture
def arena(short_tmp: Path) -> Iterator[Arena]:
    yield from make_arena(short_tmp)


@pytest.fixture
def two_gpus(short_tmp: Path) -> Iterator[Arena]:
    """Two simulated 16 GiB GPUs: a victim slice holds the whole of GPU 1 (as another
    tenant's would); hostile slices go on GPU 0 (`Arena.hostile_env(gpu=0)`)."""
    cfg = write_sim_config(short_tmp / "two.conf", "2xT4-16GB", node=f"dev2-{short_tmp.name}")
    sim = Sim(cfg, short_tmp / "ledgers")
    yield from arena_on(sim, sim.slice_env("gpu1-owner", gpu=1, memory=16 * GIB))


OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
