/* Compute through the raw driver (our addition): the compute gate lives in the hook, in the
 * tenant's own process, so a tenant that finds cuLaunchKernel in libcuda's symbol table
 * (raw_driver_symbol) launches ungated. It loads the simulator's busy kernel through the
 * ordinary (hooked) path, then launches it (argv[1] ns each) through the raw entry point,
 * keeping about `depth` launches queued, until its stdin is closed. */
#include "raw_driver.h" /* first: _GNU_SOURCE before any system header */

#include <pthread.h>

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);

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
    if (argc < 2) return 2;
    unsigned long long ns = strtoull(argv[1], NULL, 10);
    setup();
    launch_t raw = (launch_t)raw_driver_symbol("cuLaunchKernel");
    say("found", raw != NULL);
    if (!raw) return 3;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    CUevent ev[2];
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    cuEventCreate(&ev[0], 0);
    cuEventCreate(&ev[1], 0);
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "qgpu_sim_busy"))
        return 4;
    void *params[] = {&ns};
    pthread_t t;
    pthread_create(&t, NULL, watch_stdin, NULL);
    say("ready", 0);
    /* two batches of 4 in flight: wait for the older batch before queueing the next */
    for (int batch = 0; !stop; batch ^= 1) {
        for (int i = 0; i < 4; i++) {
            CUresult r = raw(f, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
            if (r != CUDA_SUCCESS) {
                say("launch", r);
                return 5;
            }
        }
        cuEventRecord(ev[batch], s);
        cuEventSynchronize(ev[batch ^ 1]);
    }
    return 0;
}
