"""Device memory that loading device code takes: the driver allocates a module's
``__device__`` globals and constant banks itself when it loads the module (or a library into
a context), through no allocation call the hook charges. The hostile tenant compiles
``__device__ char big[3 GiB]`` with nvcc (here, at test time, for the arena's T4: sm_75) and
loads it twice, every way NVIDIA's driver offers; a second 3 GiB does not fit a 4 GiB slice.
The ground truth is the simulator's accounting, which now allocates what a cubin declares."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..test_sim_modules import SOURCE, nvcc
from .conftest import GIB, HOSTILE_CAP, OOM, Arena, Programs

BIG = 3 * GIB


@dataclass
class DeviceCode:
    cubin: Path
    fatbin: Path
    fatbin_zstd: Path


@pytest.fixture(scope="session")
def device_code(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceCode]:
    out = tmp_path_factory.mktemp("modules")
    src = out / "big.cu"
    src.write_text(SOURCE)
    code = DeviceCode(out / "big.cubin", out / "big.fatbin", out / "big-zstd.fatbin")
    sass = ["-gencode", "arch=compute_75,code=sm_75"]  # the arena's T4 is compute 7.5
    for cmd in (
        [nvcc(), "-cubin", "-arch=sm_75", "-o", str(code.cubin), str(src)],
        [nvcc(), "-fatbin", *sass, "--no-compress", "-o", str(code.fatbin), str(src)],
        [nvcc(), "-fatbin", *sass, "-Xfatbin", "-compress-all", "-o", str(code.fatbin_zstd),
         str(src)],
    ):  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    yield code


EAGER = {"CUDA_MODULE_LOADING": "EAGER"}

# way -> (what the program does, which image, extra environment)
WAYS = {
    "load": ("load", "cubin", {}),
    "data": ("data", "cubin", {}),
    "dataex": ("dataex", "cubin", {}),
    "fatbinary": ("fatbinary", "fatbin", {}),
    "data-fatbin-zstd": ("data", "fatbin_zstd", {}),
    "link": ("link", "cubin", {}),
    "link-file": ("link-file", "cubin", {}),
    "library": ("library", "cubin", EAGER),
    "library-file": ("library-file", "cubin", EAGER),
    "lazy-module": ("lazy-module", "cubin", {}),
    "lazy-global": ("lazy-global", "cubin", {}),
    "lazy-kernel": ("lazy-kernel", "cubin", {}),
    "lazy-launch": ("lazy-launch", "cubin", {}),
    "lazy-graph": ("lazy-graph", "cubin", {}),
    "lazy-graph-node": ("lazy-graph-node", "cubin", {}),
    "lazy-stream": ("lazy-stream", "cubin", {}),
    "lazy-graph-kern": ("lazy-graph-kern", "cubin", {}),
    "lazy-graph-kern-ctx": ("lazy-graph-kern-ctx", "cubin", {}),
    "lazy-node-set": ("lazy-node-set", "cubin", {}),
    "lazy-node-set-kern": ("lazy-node-set-kern", "cubin", {}),
    "lazy-exec-node-set": ("lazy-exec-node-set", "cubin", {}),
    "lazy-generic-set": ("lazy-generic-set", "cubin", {}),
    "lazy-exec-generic-set": ("lazy-exec-generic-set", "cubin", {}),
    "lazy-update": ("lazy-update", "cubin", {}),
    "contexts": ("contexts", "fatbin", EAGER),
}


SECOND_CONTEXT = ("lazy-stream", "lazy-graph-kern-ctx")
# a CUkernel reaching a graph other than by a kernel node's func at creation (cuda.h allows
# each: the kern field, the node parameter setters, an update)
GRAPH_NODE_WAYS = [
    w
    for w in WAYS
    if w.startswith(("lazy-graph-kern", "lazy-node", "lazy-exec", "lazy-generic", "lazy-update"))
]


@pytest.mark.parametrize("way", list(WAYS))
def test_what_loading_device_code_takes_is_charged(
    arena: Arena, programs: Programs, device_code: DeviceCode, way: str
) -> None:
    mode, image, extra = WAYS[way]
    env = arena.hostile_env()
    env.update(extra)
    h = arena.start([programs.c("modules"), mode, getattr(device_code, image)], env)
    loads = h.all("load")
    assert len(loads) == 2, h.lines
    if way in SECOND_CONTEXT:  # its second context (512 MiB) leaves no room for even one
        assert loads[-1] == OOM, h.lines
    else:
        assert loads == [0, OOM], h.lines
    arena.contained(h)
    h.finish()


@pytest.mark.parametrize("back", ["module", "library", "context"])
def test_what_a_load_took_comes_back_when_it_is_unloaded(
    arena: Arena, programs: Programs, device_code: DeviceCode, back: str
) -> None:
    """Loaded and given back three times (cuModuleUnload, cuLibraryUnload, the context's
    destruction), then 3 GiB of cuMemAlloc: each load's charge came back."""
    h = arena.start([programs.c("modules"), "cycle", device_code.cubin, "3", back])
    assert h.all("load") == [0, 0, 0] and h.all("unload") == [0, 0, 0], h.lines
    assert h.all("grab") == [0], h.lines
    assert arena.held(h.pid) <= HOSTILE_CAP
    h.finish()


def test_the_simulator_allocates_what_a_cubin_declares(
    arena: Arena, programs: Programs, device_code: DeviceCode
) -> None:
    """Without the hook: the simulated driver itself takes the module's 3 GiB at load and
    refuses when the card is full (what makes the escape visible at all)."""
    env = arena.sim.base_env()
    h = arena.start([programs.c("modules"), "data", device_code.cubin, "6"], env)
    loads = h.all("load")  # two contexts (victim's, its own) leave room for four
    assert loads[:4] == [0] * 4 and loads[-1] == OOM, h.lines
    assert arena.held(h.pid) >= 4 * BIG
    h.finish()


@pytest.mark.parametrize("way", GRAPH_NODE_WAYS)
def test_the_simulator_loads_a_library_where_a_kernel_node_names_its_kernel(
    arena: Arena, programs: Programs, device_code: DeviceCode, way: str
) -> None:
    """Without the hook: a CUkernel named by a kernel node's `kern` field, or set into a node
    (of a graph or an executable graph) by the parameter setters, is accepted as cuda.h
    documents, and its library is loaded into the node's context then (3 GiB each time)."""
    env = arena.sim.base_env()
    h = arena.start([programs.c("modules"), way, device_code.cubin], env)
    assert h.all("load") == [0, 0], h.lines
    assert arena.held(h.pid) >= 2 * BIG
    h.finish()


def test_a_free_racing_the_load_does_not_hide_it(
    arena: Arena, programs: Programs, device_code: DeviceCode
) -> None:
    """Another thread of the process frees 3 GiB while the module loads: measured across
    the free, the load would look free of charge. The hook's memory lock keeps every free
    out of a measured load; never more than the cap, in any of the rounds."""
    h = arena.start([programs.c("modules"), "race", device_code.cubin, "200"])
    assert h.one("escaped") == 0, h.lines
    assert h.one("loaded") > 0, h.lines  # the loads that came after the free did fit
    arena.contained(h)
    h.finish()
