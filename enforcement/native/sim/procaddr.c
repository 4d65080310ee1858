/* cuGetProcAddress for the simulated driver: base names ("cuMemAlloc") resolve to the newest
 * exported version ("cuMemAlloc_v2"); "cuGetProcAddress" itself resolves to the _v2 entry
 * for cudaVersion >= 12000. Exact exported names are accepted too. */
#include <stdio.h>
#include <string.h>

#include "driver.h"

#define SIM_FUNCS(X)                                                                         \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)    \
    X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute) \
    X(cuDeviceGetPCIBusId) X(cuCtxCreate_v2) X(cuCtxDestroy_v2) X(cuCtxSetCurrent)          \
    X(cuCtxGetCurrent) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice)        \
    X(cuCtxSynchronize) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2)          \
    X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuGetErrorString)         \
    X(cuGetErrorName) X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged)            \
    X(cuMemFree_v2) X(cuMemGetInfo_v2) X(cuMemCreate) X(cuMemRelease)                        \
    X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap)  \
    X(cuMemUnmap) X(cuMemSetAccess) X(cuMemPoolCreate) X(cuMemPoolDestroy)                   \
    X(cuMemAllocAsync) X(cuMemAllocFromPoolAsync) X(cuMemFreeAsync) X(cuArrayCreate_v2)      \
    X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuLaunchKernel) X(cuLaunchCooperativeKernel)   \
    X(cuLaunchKernelEx) X(cuStreamCreate) X(cuStreamDestroy_v2) X(cuStreamSynchronize)       \
    X(cuStreamQuery) X(cuStreamIsCapturing) X(cuEventCreate) X(cuEventDestroy_v2) X(cuEventRecord) X(cuEventQuery)  \
    X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventElapsedTime_v2) X(cuGraphCreate)    \
    X(cuGraphDestroy) X(cuGraphAddKernelNode) X(cuGraphAddKernelNode_v2)                     \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiate_v2) X(cuGraphExecDestroy)            \
    X(cuGraphLaunch)

#define DECLARE(name) extern void name(void);
SIM_FUNCS(DECLARE)
#undef DECLARE
SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status);
SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                     cuuint64_t flags);

static const struct {
    const char *name;
    void *fn;
} table[] = {
#define ENTRY(name) {#name, (void *)name},
    SIM_FUNCS(ENTRY)
#undef ENTRY
    {"cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
};

static void *lookup_exact(const char *name) {
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(table[i].name, name) == 0) return table[i].fn;
    return NULL;
}

static void *lookup(const char *symbol, int version) {
    char buf[256];
    if (strcmp(symbol, "cuGetProcAddress") == 0)
        return lookup_exact(version >= 12000 ? "cuGetProcAddress_v2" : "cuGetProcAddress");
    static const char *suffixes[] = {"_v3", "_v2", ""};
    for (size_t i = 0; i < 3; i++) {
        snprintf(buf, sizeof buf, "%s%s", symbol, suffixes[i]);
        void *fn = lookup_exact(buf);
        if (fn) return fn;
    }
    return NULL;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    (void)flags; /* the simulator has no per-thread-default-stream variants */
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = lookup(symbol, version);
    if (status) *status = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                     cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
