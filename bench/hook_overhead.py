"""Interposer overhead on the simulated driver: the same launch and alloc/free loops (a C
program, so Python does not drown the nanoseconds) with and without ``libqgpu_hook.so``
preloaded, in one run. Prints ns per call, the median ns the hook adds and the ratio to the
run without an interposer.

    python bench/hook_overhead.py [--calls 200000] [--rounds 7]

Goal (issue 4): <= 100 ns added per launch in an uncapped slice. The simulated driver's
own cost (a process-shared lock and a clock read per launch) is the baseline; on a real
driver launches cost a few microseconds, so the hook's share would be smaller still.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from enforcement.native import hook_library_path, sim_library_dir
from enforcement.sim import sim_environment, write_sim_config

LOOP_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static int64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
int main(int argc, char **argv) {
    long calls = atol(argv[1]);
    int batches = 9;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = dlsym(h, "cuInit");
    CUresult (*retain)(void **, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*setctx)(void *) = dlsym(h, "cuCtxSetCurrent");
    CUresult (*load)(void **, const void *) = dlsym(h, "cuModuleLoadData");
    CUresult (*getfn)(void **, void *, const char *) = dlsym(h, "cuModuleGetFunction");
    CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void *, void **, void **) = dlsym(h, "cuLaunchKernel");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(h, "cuMemAlloc_v2");
    CUresult (*mfree)(CUdeviceptr) = dlsym(h, "cuMemFree_v2");
    CUresult (*sync)(void) = dlsym(h, "cuCtxSynchronize");
    void *ctx, *mod, *fn;
    if (init(0) || retain(&ctx, 0) || setctx(ctx) || load(&mod, "qgpu-sim-module") ||
        getfn(&fn, mod, "qgpu_sim_busy")) {
        fprintf(stderr, "setup failed\n");
        return 1;
    }
    uint64_t zero = 0; /* kernels of 0 ns: only the launch path is timed */
    void *params[] = {&zero};
    double l[16], a[16];
    for (int b = 0; b < batches; b++) {
        int64_t t0 = now();
        for (long i = 0; i < calls; i++) launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
        int64_t t1 = now();
        sync();
        CUdeviceptr p;
        int64_t t2 = now();
        for (long i = 0; i < calls / 2; i++) {
            alloc(&p, 1 << 20);
            mfree(p);
        }
        int64_t t3 = now();
        l[b] = (double)(t1 - t0) / calls;
        a[b] = (double)(t3 - t2) / (calls / 2);
    }
    qsort(l, batches, sizeof l[0], cmp);
    qsort(a, batches, sizeof a[0], cmp);
    printf("%.1f %.1f\n", l[batches / 2], a[batches / 2]);
    return 0;
}
"""


def build(workdir: Path) -> Path:
    src = workdir / "loop.c"
    src.write_text(LOOP_C)
    exe = workdir / "loop"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src), "-ldl"], check=True)
    return exe


def run_once(exe: Path, env: dict[str, str], calls: int) -> tuple[float, float]:
    out = subprocess.run(
        [str(exe), str(calls)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), float(out[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="launches per batch")
    ap.add_argument("--rounds", type=int, default=7, help="alternating process pairs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgpu-bench-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        cfg = write_sim_config(workdir / "sim.conf", "H100-80GB", node="bench")
        exe = build(workdir)
        uuid = cfg.gpus[0].uuid
        base = {k: v for k, v in os.environ.items() if not k.startswith("QGPU_")}
        base.pop("LD_PRELOAD", None)
        base.update(sim_environment(cfg.path), CUDA_VISIBLE_DEVICES=uuid)
        base["LD_LIBRARY_PATH"] = str(sim_library_dir())
        slice_env = dict(
            base,
            LD_PRELOAD=str(hook_library_path()),
            QGPU_SLICE_ID="bench",
            QGPU_DEVICE_UUID=uuid,
            QGPU_MEMORY_LIMIT=str(64 << 30),
            QGPU_CORE_LIMIT="100",
            QGPU_ISOLATION="best-effort",
            QGPU_STATE_DIR=str(workdir / "ledgers"),
        )
        passthrough_env = dict(base, LD_PRELOAD=str(hook_library_path()))
        configs = {
            "no interposer": base,
            "hook, no slice (pass-through)": passthrough_env,
            "hook, uncapped slice": slice_env,
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        for _ in range(args.rounds):  # alternate, so drift hits every configuration alike
            for name, env in configs.items():
                results[name].append(run_once(exe, env, args.calls))
    base_launch = statistics.median(r[0] for r in results["no interposer"])
    base_alloc = statistics.median(r[1] for r in results["no interposer"])
    print(f"simulated driver, {args.calls} launches x 9 batches, {args.rounds} rounds")
    print(
        f"{'configuration':34} {'launch ns':>10} {'added':>8} {'ratio':>6} "
        f"{'alloc+free ns':>14} {'added':>8} {'ratio':>6}"
    )
    for name, rows in results.items():
        launch = statistics.median(r[0] for r in rows)
        alloc = statistics.median(r[1] for r in rows)
        print(
            f"{name:34} {launch:10.1f} {launch - base_launch:8.1f} {launch / base_launch:6.2f} "
            f"{alloc:14.1f} {alloc - base_alloc:8.1f} {alloc / base_alloc:6.2f}"
        )
    added = statistics.median(r[0] for r in results["hook, uncapped slice"]) - base_launch
    print(
        f"launch overhead in an uncapped slice: {added:.1f} ns (goal <= 100 ns): "
        f"{'met' if added <= 100 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
