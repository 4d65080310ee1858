/* A plugin linked against libcuda, as framework extensions are: it calls the driver by
 * name, so its calls bind wherever the loader resolves them. */
#include <cuda.h>

/* cuInit and a current context in the plugin's own view of the driver (a separate copy of
 * the driver when the plugin was loaded into a new link-map namespace), then cuMemAlloc */
int plugin_alloc(unsigned long long size) {
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p;
    CUresult r = cuInit(0);
    if (r) return r;
    cuDeviceGet(&dev, 0);
    if (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) {
        r = cuDevicePrimaryCtxRetain(&ctx, dev);
        if (r) return r;
        cuCtxSetCurrent(ctx);
    }
    return cuMemAlloc(&p, size);
}
