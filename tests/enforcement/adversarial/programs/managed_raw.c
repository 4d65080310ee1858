/* Managed memory past the hook: cuMemAllocManaged read from libcuda's ELF symbol table (no
 * user-space hook can take that away), 10 GiB in a 4 GiB slice, then a kernel that may touch
 * all of it. Each line on stdin launches the kernel again (what fits comes back to the GPU)
 * and says ready; the memory is kept until stdin closes. NVIDIA's NVML leaves managed memory
 * out of its per-process lists, so the watchdog sees only this process's context. */
#include "raw_driver.h"

typedef CUresult (*alloc_managed_t)(CUdeviceptr *, size_t, unsigned int);

static void touch(CUfunction f) {
    say("launch", cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    say("sync", cuCtxSynchronize());
}

int main(void) {
    setup();
    alloc_managed_t raw = (alloc_managed_t)raw_driver_symbol("cuMemAllocManaged");
    say("found", raw != NULL);
    if (!raw) return 3;
    CUdeviceptr p;
    say("managed", raw(&p, 10 * GIB, CU_MEM_ATTACH_GLOBAL));
    CUmodule mod;
    CUfunction f;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "k")) return 4;
    touch(f);
    say("ready", 0);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        touch(f);
        say("ready", 0);
    }
    return 0;
}
