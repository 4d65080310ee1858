"""Interposition paths, with C programs compiled here: dlopen + dlsym, cuGetProcAddress
(including cuGetProcAddress itself), a program linked directly against libcuda, and
dlsym(RTLD_NEXT, ...) of other preloaded libraries still meaning "after the caller"."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from enforcement.native import hook_library_path, sim_library_dir

from .conftest import CTX, GIB, REPO, Sim

LOOKUP_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*init_t)(unsigned);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*retain_t)(void **, int);
typedef CUresult (*setctx_t)(void *);

static const char *owner(void *p) {
    Dl_info i;
    return p && dladdr(p, &i) && i.dli_fname ? i.dli_fname : "none";
}

int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("dlopen failed\n"); return 1; }
    gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    void *f_init, *f_alloc, *f_retain, *f_set;
    int st = -1;
    if (argc > 1 && strcmp(argv[1], "getproc") == 0) {
        void *self = NULL, *name = NULL, *ptsz = NULL;
        gpa("cuGetProcAddress", &self, 12040, 0, &st);
        printf("self %s\n", owner(self));
        gpa = (gpa_t)self; /* keep resolving through the pointer cuGetProcAddress gave */
        gpa("cuInit", &f_init, 12040, 0, &st);
        gpa("cuMemAlloc", &f_alloc, 12040, 0, &st);
        gpa("cuDevicePrimaryCtxRetain", &f_retain, 12040, 0, &st);
        gpa("cuCtxSetCurrent", &f_set, 12040, 0, &st);
        gpa("cuDeviceGetName", &name, 12040, 0, &st);
        gpa("cuLaunchKernel", &ptsz, 12040, 2 /* per-thread default stream */, &st);
        printf("unwrapped %s\nptsz %s\nstatus %d\n", owner(name), owner(ptsz), st);
    } else {
        f_init = dlsym(h, "cuInit");
        f_alloc = dlsym(h, "cuMemAlloc_v2");
        f_retain = dlsym(h, "cuDevicePrimaryCtxRetain");
        f_set = dlsym(h, "cuCtxSetCurrent");
    }
    printf("getproc %s\nalloc %s\n", owner((void *)gpa), owner(f_alloc));
    printf("init %d\n", ((init_t)f_init)(0));
    void *ctx = NULL;
    ((retain_t)f_retain)(&ctx, 0);
    ((setctx_t)f_set)(ctx);
    CUdeviceptr p;
    printf("over %d\n", ((alloc_t)f_alloc)(&p, (size_t)3 << 30));
    printf("under %d\n", ((alloc_t)f_alloc)(&p, (size_t)1 << 30));
    return 0;
}
"""

LINKED_C = r"""
#include <stdio.h>
#include <stddef.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
int main(void) {
    void *ctx;
    CUdeviceptr p;
    size_t free_b, total;
    printf("init %d\n", cuInit(0));
    cuDevicePrimaryCtxRetain(&ctx, 0);
    cuCtxSetCurrent(ctx);
    printf("over %d\n", cuMemAlloc_v2(&p, (size_t)3 << 30));
    printf("under %d\n", cuMemAlloc_v2(&p, (size_t)1 << 30));
    cuMemGetInfo_v2(&free_b, &total);
    printf("info %zu %zu\n", free_b, total);
    return 0;
}
"""

WRAP_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int puts(const char *s) {
    static int (*next)(const char *);
    if (!next) next = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    char buf[256];
    snprintf(buf, sizeof buf, "wrapped: %s", s);
    return next(buf);
}
"""

MAIN_C = r"""
#include <stdio.h>
int main(void) { puts("hello"); return 0; }
"""


def compile_c(directory: Path, name: str, source: str, *args: str) -> Path:
    src = directory / f"{name}.c"
    src.write_text(source)
    out = directory / name
    subprocess.run(["cc", "-O1", "-o", str(out), str(src), *args], check=True, timeout=60)
    return out


def run(cmd: list[str], env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines())


@pytest.mark.parametrize("mode", ["dlsym", "getproc"])
def test_wrappers_are_handed_out(sim: Sim, short_tmp: Path, mode: str) -> None:
    prog = compile_c(short_tmp, "lookup", LOOKUP_C, "-ldl")
    out = run([str(prog), mode], sim.slice_env(f"ip-{mode}", memory=2 * GIB))
    hook = str(hook_library_path())
    assert out["getproc"] == hook
    assert out["alloc"] == hook
    assert out["init"] == "0"
    assert out["over"] == "2"  # CUDA_ERROR_OUT_OF_MEMORY
    assert out["under"] == "0"
    if mode == "getproc":
        assert out["self"] == hook  # cuGetProcAddress asked for itself
        assert out["ptsz"] == hook
        # not wrapped: the driver's own entry point, which (like a real driver's) is not the
        # exported symbol dlsym would give
        assert out["unwrapped"] != hook
        assert out["status"] == "0"


def test_without_preload_lookups_reach_the_driver(sim: Sim, short_tmp: Path) -> None:
    prog = compile_c(short_tmp, "lookup", LOOKUP_C, "-ldl")
    out = run([str(prog), "getproc"], sim.slice_env("ip-none", memory=2 * GIB, hook=False))
    assert out["alloc"] != str(hook_library_path())  # the driver's internal entry point
    assert out["over"] == "0"


def test_program_linked_against_libcuda(sim: Sim, short_tmp: Path) -> None:
    lib_dir = str(sim_library_dir())
    prog = compile_c(short_tmp, "linked", LINKED_C, f"-L{lib_dir}", "-lcuda")
    out = run([str(prog)], sim.slice_env("ip-linked", memory=2 * GIB))
    assert out["init"] == "0"
    assert out["over"] == "2"
    assert out["under"] == "0"
    assert out["info"] == f"{GIB - CTX} {2 * GIB}"  # 1 GiB and the context


def test_rtld_next_of_other_preloaded_libraries(sim: Sim, short_tmp: Path) -> None:
    """A second preloaded library wrapping puts() with dlsym(RTLD_NEXT) must get libc's puts,
    not its own (which would recurse forever), even though our dlsym sits in between."""
    wrap = short_tmp / "libwrap.so"
    (short_tmp / "wrap.c").write_text(WRAP_C)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(wrap), str(short_tmp / "wrap.c"), "-ldl"],
        check=True,
        timeout=60,
    )
    prog = compile_c(short_tmp, "hello", MAIN_C)
    env = sim.base_env()
    env["LD_PRELOAD"] = f"{hook_library_path()} {wrap}"
    proc = subprocess.run([str(prog)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "wrapped: hello\n"


def exported_symbols(library: Path) -> set[str]:
    """The defined dynamic symbols of a shared library (readelf)."""
    out = subprocess.run(
        ["readelf", "--dyn-syms", "--wide", str(library)], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    return {
        f[7].split("@")[0]
        for line in out.splitlines()
        if len(f := line.split()) >= 8 and f[6] != "UND"
    }


def test_every_abi_form_of_a_wrapped_entry_point_is_wrapped() -> None:
    """cuGetProcAddress hands out, by (name, version, flags), whichever form NVIDIA's table
    says: a name the hook wraps in one form (cuMemPrefetchAsync, cuCtxSynchronize, ...) must
    be wrapped in every form, or a caller of another CUDA version gets the raw driver."""
    table = (REPO / "enforcement/native/include/qgpu_procaddr_table.h").read_text()
    forms: dict[str, set[str]] = {}
    for name, symbol in re.findall(r'\{"(\w+)", \d, \d+, "(\w+)"\}', table):
        forms.setdefault(name, set()).add(symbol)
    hook = exported_symbols(hook_library_path())
    missing = {n: sorted(s - hook) for n, s in forms.items() if s & hook and s - hook}
    assert not missing, f"wrapped in some forms only: {missing}"
