"""The simulated driver's modules, libraries and linker against what NVIDIA documents: a
cubin's data is allocated at load and given back at unload; a cubin runs only on its own
major architecture; PTX needs a JIT compiler this driver does not have; libraries load into a
context eagerly or lazily as CUDA_MODULE_LOADING says; a library's module cannot be unloaded
alone. The images are built here with nvcc (the test fails without the toolkit, like the
adversarial corpus)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from enforcement.native import sim_library_dir
from enforcement.sim import write_sim_config

from .adversarial.conftest import cuda_include
from .conftest import GIB, Sim
from .test_interpose import compile_c

SOURCE = r"""
__device__ char big[3ULL << 30];
__device__ int counter = 5;
__constant__ float table[256] = {1.0f};
extern "C" __global__ void touch(char *p) {
    counter++;
    if (p) p[0] = big[counter & 1023] + (char)table[counter & 255];
}
"""


def nvcc() -> str:
    found = shutil.which("nvcc") or str(cuda_include().parent / "bin" / "nvcc")
    if not Path(found).is_file():
        pytest.fail("nvcc (the CUDA toolkit) is needed to build device code")
    return found


PROGRAM = r"""
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) exit(3);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = calloc(1, n + 1);
    if (fread(b, 1, n, f) != (size_t)n) exit(3);
    fclose(f);
    *len = n;
    return b;
}

static long long used(void) {
    size_t f, t;
    cuMemGetInfo(&f, &t);
    return (long long)(t - f);
}

int main(int argc, char **argv) {
    size_t n75, n90, nptx;
    void *c75 = slurp(argv[1], &n75), *c90 = slurp(argv[2], &n90), *ptx = slurp(argv[3], &nptx);
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod, other;
    CUlibrary lib;
    cuInit(0);
    cuDeviceGet(&dev, 0);
    cuDevicePrimaryCtxRetain(&ctx, dev);
    cuCtxSetCurrent(ctx);
    CUmoduleLoadingMode mode;
    cuModuleGetLoadingMode(&mode);
    printf("mode %d\n", (int)mode);
    long long base = used();
    printf("sm90 %d\n", cuModuleLoadData(&other, c90));
    printf("ptx %d\n", cuModuleLoadData(&other, ptx));
    printf("garbage %d\n", cuModuleLoadData(&other, "\x01\x02\x03\x04 not an image"));
    printf("load %d\n", cuModuleLoadData(&mod, c75));
    printf("took %lld\n", used() - base);
    CUdeviceptr p, q;
    size_t bytes = 0;
    CUresult r = cuModuleGetGlobal(&p, &bytes, mod, "big");
    printf("big %d %zu\n", r, bytes);
    r = cuModuleGetGlobal(&q, &bytes, mod, "counter");
    printf("counter %d %zu\n", r, bytes);
    printf("apart %d\n", p != q);
    printf("noglobal %d\n", cuModuleGetGlobal(&p, &bytes, mod, "nosuch"));
    CUfunction f, g;
    printf("touch %d\n", cuModuleGetFunction(&f, mod, "touch"));
    cuModuleGetFunction(&g, mod, "touch");
    printf("same %d\n", f == g);
    printf("nofunc %d\n", cuModuleGetFunction(&g, mod, "nosuch"));
    printf("unload %d\n", cuModuleUnload(mod));
    printf("after %lld\n", used() - base);
    printf("libload %d\n", cuLibraryLoadData(&lib, c75, NULL, NULL, 0, NULL, NULL, 0));
    printf("libtook %lld\n", used() - base);
    CUkernel k;
    printf("kernel %d\n", cuLibraryGetKernel(&k, lib, "touch"));
    printf("nokernel %d\n", cuLibraryGetKernel(&k, lib, "nosuch"));
    printf("getmodule %d\n", cuLibraryGetModule(&mod, lib));
    printf("used %lld\n", used() - base);
    printf("libmodunload %d\n", cuModuleUnload(mod));
    printf("libunload %d\n", cuLibraryUnload(lib));
    printf("libafter %lld\n", used() - base);
    CUlinkState st;
    void *out = NULL;
    size_t outn;
    cuLinkCreate(0, NULL, NULL, &st);
    printf("linkptx %d\n", cuLinkAddData(st, CU_JIT_INPUT_PTX, ptx, nptx, "p", 0, NULL, NULL));
    printf("link1 %d\n", cuLinkAddData(st, CU_JIT_INPUT_CUBIN, c75, n75, "a", 0, NULL, NULL));
    printf("linked %d\n", cuLinkComplete(st, &out, &outn));
    printf("linkload %d\n", cuModuleLoadData(&mod, out));
    printf("link2 %d\n", cuLinkAddData(st, CU_JIT_INPUT_CUBIN, c75, n75, "b", 0, NULL, NULL));
    printf("linked2 %d\n", cuLinkComplete(st, &out, &outn));
    cuLinkDestroy(st);
    return 0;
}
"""

NO_BINARY_FOR_GPU, JIT_COMPILER_NOT_FOUND, INVALID_IMAGE = 209, 221, 200
NOT_FOUND, NOT_PERMITTED, NOT_SUPPORTED = 500, 800, 801
EAGER, LAZY = 1, 2


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    out = tmp_path_factory.mktemp("simmod")
    src = out / "big.cu"
    src.write_text(SOURCE)
    built = (out / "big75.cubin", out / "big90.cubin", out / "big.ptx")
    for cmd in (
        [nvcc(), "-cubin", "-arch=sm_75", "-o", str(built[0]), str(src)],
        [nvcc(), "-cubin", "-arch=sm_90", "-o", str(built[1]), str(src)],
        [nvcc(), "-ptx", "-arch=compute_75", "-o", str(built[2]), str(src)],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return built


@pytest.fixture
def t4(short_tmp: Path) -> Sim:
    cfg = write_sim_config(short_tmp / "t4.conf", "T4-16GB", node=f"t4-{short_tmp.name}")
    return Sim(cfg, short_tmp / "ledgers")


def run(sim: Sim, short_tmp: Path, images: tuple[Path, Path, Path], **env: str) -> dict[str, str]:
    exe = short_tmp / "modprog"
    if not exe.exists():
        compile_c(short_tmp, "modprog", PROGRAM, f"-I{cuda_include()}",
                  f"-L{sim_library_dir()}", "-lcuda")  # fmt: skip
    e = sim.base_env()
    e.update(env)
    done = subprocess.run([str(exe), *map(str, images)], env=e, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_a_cubin_takes_its_data_at_load_and_gives_it_back(
    t4: Sim, short_tmp: Path, images: tuple[Path, Path, Path]
) -> None:
    out = run(t4, short_tmp, images)  # compute 7.5
    assert out["sm90"] == str(NO_BINARY_FOR_GPU)  # sm_90 SASS does not run on 7.5
    assert out["ptx"] == str(JIT_COMPILER_NOT_FOUND)  # no JIT compiler in the simulator
    assert out["garbage"] == str(INVALID_IMAGE)
    assert out["load"] == "0"
    assert 3 * GIB <= int(out["took"]) < 3 * GIB + (1 << 20)
    assert out["big"] == f"0 {3 * GIB}" and out["counter"] == "0 4" and out["apart"] == "1"
    assert out["noglobal"] == str(NOT_FOUND) and out["nofunc"] == str(NOT_FOUND)
    assert out["touch"] == "0" and out["same"] == "1"
    assert out["unload"] == "0" and out["after"] == "0"


def test_libraries_load_lazily_unless_told_eager(
    t4: Sim, short_tmp: Path, images: tuple[Path, Path, Path]
) -> None:
    lazy = run(t4, short_tmp, images)
    assert lazy["mode"] == str(LAZY)  # NVIDIA's default since CUDA 12.2
    assert lazy["libload"] == "0" and lazy["libtook"] == "0"  # nothing until it is needed
    assert lazy["kernel"] == "0" and lazy["nokernel"] == str(NOT_FOUND)
    assert lazy["getmodule"] == "0" and int(lazy["used"]) >= 3 * GIB  # now in this context
    assert lazy["libmodunload"] == str(NOT_PERMITTED)  # only cuLibraryUnload unloads it
    assert lazy["libunload"] == "0" and lazy["libafter"] == "0"
    eager = run(t4, short_tmp, images, CUDA_MODULE_LOADING="EAGER")
    assert eager["mode"] == str(EAGER)
    assert int(eager["libtook"]) >= 3 * GIB  # into every context at once


def test_the_linker_takes_one_cubin_and_refuses_what_it_cannot_model(
    t4: Sim, short_tmp: Path, images: tuple[Path, Path, Path]
) -> None:
    out = run(t4, short_tmp, images)
    assert out["linkptx"] == str(JIT_COMPILER_NOT_FOUND)
    assert out["link1"] == "0" and out["linked"] == "0" and out["linkload"] == "0"
    assert out["link2"] == "0" and out["linked2"] == str(NOT_SUPPORTED)


def test_sm90_code_loads_on_an_h100(
    sim: Sim, short_tmp: Path, images: tuple[Path, Path, Path]
) -> None:
    out = run(sim, short_tmp, images)  # H100s: compute 9.0
    assert out["sm90"] == "0"  # and the sm_75 cubin does not run on compute 9.0
    assert out["load"] == str(NO_BINARY_FOR_GPU)
