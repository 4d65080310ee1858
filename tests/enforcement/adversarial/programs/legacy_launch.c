/* Legacy launches (issue 17): cuLaunch, cuLaunchGrid, cuLaunchGridAsync (CUDA 2.x: the
 * parameters set with cuParamSet*, the block shape with cuFuncSetBlockShape) and
 * cuLaunchCooperativeKernelMultiDevice are still exported by real drivers. The tenant
 * launches the simulator's busy kernel (argv[2] ns each) through one of them (argv[1]) as
 * fast as it can, until its stdin is closed; the test measures its share of the device. */
#include <pthread.h>

#include "hostile.h"

static volatile int stop;

static void *watch_stdin(void *arg) {
    (void)arg;
    char buf[64];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
    stop = 1;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *api = argv[1];
    unsigned long long ns = strtoull(argv[2], NULL, 10);
    setup();
    CUmodule mod;
    CUfunction f;
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "qgpu_sim_busy"))
        return 3;
    cuFuncSetBlockShape(f, 1, 1, 1);
    cuParamSetv(f, 0, &ns, sizeof ns);
    cuParamSetSize(f, sizeof ns);
    void *params[] = {&ns};
    CUDA_LAUNCH_PARAMS lp = {f, 1, 1, 1, 1, 1, 1, 0, s, params};
    pthread_t t;
    pthread_create(&t, NULL, watch_stdin, NULL);
    int first = 1;
    while (!stop) {
        CUresult r;
        if (!strcmp(api, "cuLaunch")) r = cuLaunch(f);
        else if (!strcmp(api, "cuLaunchGrid")) r = cuLaunchGrid(f, 1, 1);
        else if (!strcmp(api, "cuLaunchGridAsync")) r = cuLaunchGridAsync(f, 1, 1, s);
        else r = cuLaunchCooperativeKernelMultiDevice(&lp, 1, 0);
        if (r != CUDA_SUCCESS) {
            say("launch", r);
            return 4;
        }
        if (first) {
            say("ready", 0);
            first = 0;
        }
    }
    return 0;
}
