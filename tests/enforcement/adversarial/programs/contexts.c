/* Context memory (issue 17): every CUDA context costs device memory (hundreds of MiB on
 * real cards; 512 MiB on the simulated one), and so do raised context limits. On top of the
 * primary context, the tenant creates ten more contexts one way (argv[1]): under a 4 GiB
 * cap seven fit. v1/v2/v3/v4: cuCtxCreate (v1 by name, the others as cuda.h maps them);
 * green: green contexts; primary: ten rounds of reset + retain of the primary context, then
 * 3 GiB and 1 GiB allocations; heap / stack: cuCtxSetLimit of the malloc heap (6 GiB) or the
 * per-thread stack (128 KiB x every thread the device holds). The device runtime's
 * reservations, raised step by step until refused ("limit"), then 512 MiB chunks ("grab"):
 * pending: CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT by 65536 launches a step; sync_depth:
 * CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH by one level a step (3..24; compute capability < 9.0);
 * devrt_fits: both raised a little (16384 pending launches more, depth 4), then lowered back
 * to their defaults ("back"), then grab. hold: only the primary context ("ctx 0"), held, so
 * that a test can start many such processes in one slice. */
#include "hostile.h"

typedef CUresult (*create_v1_t)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*create_v2_t)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*create_v3_t)(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice);

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    CUcontext primary = setup();
    CUdevice dev;
    cuDeviceGet(&dev, 0);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!strcmp(mode, "hold")) {
        say("ctx", 0);
    } else if (!strcmp(mode, "pending") || !strcmp(mode, "sync_depth")) {
        int pending = !strcmp(mode, "pending");
        for (int i = 1; i <= (pending ? 64 : 22); i++) {
            size_t v = pending ? 2048 + (size_t)i * 65536 : 2 + (size_t)i;
            CUresult r = cuCtxSetLimit(pending ? CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT
                                               : CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH, v);
            say("limit", r);
            if (r != CUDA_SUCCESS) break;
        }
        grab(512 * MIB, 8);
    } else if (!strcmp(mode, "devrt_fits")) {
        say("limit", cuCtxSetLimit(CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, 2048 + 16384));
        say("limit", cuCtxSetLimit(CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH, 4));
        say("back", cuCtxSetLimit(CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, 2048));
        say("back", cuCtxSetLimit(CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH, 2));
        grab(512 * MIB, 8);
    } else if (!strcmp(mode, "heap")) {
        say("limit", cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 6 * GIB));
        grab(GIB, 4);
    } else if (!strcmp(mode, "stack")) {
        say("limit", cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 128 << 10));
        grab(GIB, 4);
    } else if (!strcmp(mode, "primary")) {
        for (int i = 0; i < 10; i++) {
            say("reset", cuDevicePrimaryCtxReset(dev));
            say("ctx", cuDevicePrimaryCtxRetain(&primary, dev));
            cuDevicePrimaryCtxRelease(dev); /* keep one reference: setup()'s */
        }
        cuCtxSetCurrent(primary);
        grab(3 * GIB, 1);
        grab(GIB, 1);
    } else {
        for (int i = 0; i < 10; i++) {
            CUcontext c = NULL;
            CUresult r;
            if (!strcmp(mode, "v1"))
                r = ((create_v1_t)dlsym(lib, "cuCtxCreate"))(&c, 0, dev);
            else if (!strcmp(mode, "v2"))
                r = ((create_v2_t)dlsym(lib, "cuCtxCreate_v2"))(&c, 0, dev);
            else if (!strcmp(mode, "v3"))
                r = ((create_v3_t)dlsym(lib, "cuCtxCreate_v3"))(&c, NULL, 0, 0, dev);
            else if (!strcmp(mode, "v4"))
                r = cuCtxCreate(&c, NULL, 0, dev);
            else {
                CUdevResource res;
                CUdevResourceDesc desc;
                CUgreenCtx g;
                cuDeviceGetDevResource(dev, &res, CU_DEV_RESOURCE_TYPE_SM);
                cuDevResourceGenerateDesc(&desc, &res, 1);
                r = cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
            }
            say("ctx", r);
        }
    }
    hold();
    return 0;
}
