/* One very long kernel through the ordinary (hooked) cuLaunchKernel (our addition). The
 * compute gate debits a kernel's device time only once the kernel has ended, so the first
 * launch passes with the bucket's credit and then holds its time slices of the device for
 * the whole run: argv[1] nanoseconds on the simulator (a kernel that "never ends" is one
 * longer than the test). Prints the launch's CUresult, then holds until stdin closes. */
#include "hostile.h"

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    unsigned long long ns = strtoull(argv[1], NULL, 10);
    setup();
    CUmodule mod;
    CUfunction f;
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "qgpu_sim_busy"))
        return 4;
    void *params[] = {&ns};
    say("launch", cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
    hold();
    return 0;
}
