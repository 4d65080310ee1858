/* Code loaded lazily: under CUDA's lazy loading a function's code reaches the GPU at its
 * first launch (cuda.h: cuFuncIsLoaded, cuFuncLoad), through no allocation call. The
 * simulator's built-in image has a kernel qgpu_sim_code_<bytes>_<n> of <bytes> of code for
 * any n. 100 functions of 64 MiB each (6.25 GiB in all), each used once, in one of the ways
 * argv[1] picks: launch (cuLaunchKernel), graph (a kernel node of it), load (the
 * application's own cuFuncLoad, then a launch), attr / cache / occupancy (cuFuncSetAttribute,
 * cuFuncSetCacheConfig or cuOccupancyMaxActiveBlocksPerMultiprocessor first, which may load
 * it, then a launch). Reports "used N" and the CUresult that ended
 * it ("last"); with argv[2] "unload", the module is unloaded afterwards and 512 MiB chunks
 * are taken ("grab"). */
#include "hostile.h"

#define FUNCS 100

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    setup();
    CUmodule mod;
    if (cuModuleLoadData(&mod, "qgpu-sim-module")) return 3;
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    CUgraph g;
    cuGraphCreate(&g, 0);
    int used = 0;
    CUresult last = CUDA_SUCCESS;
    for (; used < FUNCS && last == CUDA_SUCCESS; used++) {
        char name[64];
        snprintf(name, sizeof name, "qgpu_sim_code_%llu_%d", 64 * MIB, used);
        CUfunction f;
        if (cuModuleGetFunction(&f, mod, name)) return 4;
        if (!strcmp(mode, "graph")) {
            last = add_kernel_node(g, f);
        } else {
            int blocks;
            if (!strcmp(mode, "load")) last = cuFuncLoad(f);
            if (!strcmp(mode, "attr"))
                last = cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 0);
            if (!strcmp(mode, "cache")) last = cuFuncSetCacheConfig(f, CU_FUNC_CACHE_PREFER_L1);
            if (!strcmp(mode, "occupancy"))
                last = cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 128, 0);
            if (last == CUDA_SUCCESS) last = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        }
        if (last != CUDA_SUCCESS) break;
    }
    say("used", used);
    say("last", last);
    cuStreamSynchronize(s);
    if (argc > 2 && !strcmp(argv[2], "unload")) {
        cuGraphDestroy(g);
        say("unload", cuModuleUnload(mod));
        grab(512 * MIB, 16);
    }
    hold();
    return 0;
}
