/* Shared by the hostile C programs of the adversarial corpus: report lines ("key value"),
 * the first context, and holding what was taken until the test closes stdin. Programs are
 * written as a tenant would write them: against the CUDA toolkit's cuda.h. */
#ifndef QGPU_HOSTILE_H
#define QGPU_HOSTILE_H
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GIB (1ULL << 30)
#define MIB (1ULL << 20)

__attribute__((unused)) static void say(const char *key, long long value) {
    printf("%s %lld\n", key, value);
    fflush(stdout);
}

/* cuInit and the primary context of device 0, made current */
__attribute__((unused)) static CUcontext setup(void) {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) {
        say("init", r);
        exit(2);
    }
    CUdevice dev;
    CUcontext ctx;
    cuDeviceGet(&dev, 0);
    r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r != CUDA_SUCCESS) {
        say("ctx", r);
        exit(2);
    }
    cuCtxSetCurrent(ctx);
    return ctx;
}

/* A kernel node of `f` (a 1x1x1 grid of one thread, no parameters) added to `g`. */
__attribute__((unused)) static CUresult add_kernel_node(CUgraph g, CUfunction f) {
    CUDA_KERNEL_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.func = f;
    p.gridDimX = p.gridDimY = p.gridDimZ = 1;
    p.blockDimX = p.blockDimY = p.blockDimZ = 1;
    CUgraphNode n;
    return cuGraphAddKernelNode(&n, g, NULL, 0, &p);
}

/* Keep everything until the test closes stdin. */
__attribute__((unused)) static void hold(void) {
    say("ready", 0);
    char buf[256];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
}

/* Allocate `chunk` bytes with cuMemAlloc_v2 until refused (at most `max`): the bytes taken. */
__attribute__((unused)) static unsigned long long grab(unsigned long long chunk, int max) {
    unsigned long long got = 0;
    for (int i = 0; i < max; i++) {
        CUdeviceptr p;
        CUresult r = cuMemAlloc(&p, chunk);
        say("grab", r);
        if (r != CUDA_SUCCESS) break;
        got += chunk;
    }
    return got;
}
#endif
