/* Many contexts, all busy (our addition). NVIDIA's driver time-slices a GPU between
 * contexts, not processes, so a process that keeps work queued in k contexts holds k time
 * slices per round. The tenant creates argv[1] contexts (cuCtxCreate) and runs a thread per
 * context that launches qgpu_sim_busy kernels of argv[2] ns back to back, synchronising
 * every eight. Reports "contexts <n>" (how many it got), then holds until stdin closes. */
#include <pthread.h>

#include "hostile.h"

static long long kernel_ns;

static void *run(void *arg) {
    CUcontext ctx = arg;
    cuCtxSetCurrent(ctx);
    CUmodule mod;
    CUfunction f;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "qgpu_sim_busy"))
        return NULL;
    unsigned long long ns = (unsigned long long)kernel_ns;
    void *params[] = {&ns};
    for (unsigned long n = 0;; n++) {
        if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) return NULL;
        if (n % 8 == 7) cuCtxSynchronize();
    }
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int want = atoi(argv[1]);
    kernel_ns = atoll(argv[2]);
    if (cuInit(0)) return 2;
    CUdevice dev;
    cuDeviceGet(&dev, 0);
    int got = 0;
    for (int i = 0; i < want; i++) {
        CUcontext ctx;
        if (cuCtxCreate(&ctx, NULL, 0, dev)) break;
        pthread_t t;
        if (pthread_create(&t, NULL, run, ctx)) break;
        got++;
    }
    say("contexts", got);
    hold();
    return 0;
}
