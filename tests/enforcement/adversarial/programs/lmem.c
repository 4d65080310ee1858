/* Local memory a kernel's launch grows (cuda.h, CU_CTX_LMEM_RESIZE_TO_MAX: CUDA resizes a
 * context's local memory for a kernel that needs more, for every thread the device can hold
 * at once), through no allocation call. The simulator's built-in image has a kernel
 * qgpu_sim_lmem_<bytes> for any per-thread size. argv[1] picks the way, argv[2] the bytes per
 * thread:
 *   launch   cuLaunchKernel of it
 *   graph    a graph with a kernel node of it (cuGraphAddKernelNode), instantiated, launched
 *   capture  a launch of it captured into a graph, instantiated, launched
 *   lower    launched, then cuCtxSetLimit(CU_LIMIT_STACK_SIZE) set to 1 KiB (the default)
 *   again    launched 100 times (a workload's loop)
 * then cuMemAlloc of 512 MiB chunks until refused ("grab"). Reports each step's CUresult. */
#include "hostile.h"

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *mode = argv[1];
    char name[64];
    snprintf(name, sizeof name, "qgpu_sim_lmem_%s", argv[2]);
    setup();
    CUmodule mod;
    CUfunction f;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, name)) return 3;
    int local = -1;
    say("attr", cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f));
    say("local", local);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (!strcmp(mode, "graph") || !strcmp(mode, "capture")) {
        CUgraph g;
        if (!strcmp(mode, "graph")) {
            cuGraphCreate(&g, 0);
            say("node", add_kernel_node(g, f));
        } else {
            say("begin", cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
            say("node", cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
            say("end", cuStreamEndCapture(s, &g));
        }
        CUgraphExec e;
        CUresult r = cuGraphInstantiateWithFlags(&e, g, 0);
        say("instantiate", r);
        say("launch", r ? r : cuGraphLaunch(e, s));
    } else {
        int n = !strcmp(mode, "again") ? 100 : 1;
        CUresult r = CUDA_SUCCESS;
        for (int i = 0; i < n && r == CUDA_SUCCESS; i++) r = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        say("launch", r);
        if (!strcmp(mode, "lower")) say("lower", cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1024));
    }
    say("sync", cuStreamSynchronize(s));
    grab(512 * MIB, 16);
    hold();
    return 0;
}
