/* cuGetProcAddress of the simulated driver, by NVIDIA's rules: the (name, cudaVersion,
 * flags) -> exported symbol table generated from the toolkit's headers
 * (common/procaddr.c), limited to the configured driver version. Like a real driver, it
 * hands out internal entry points, not the exported symbols: each is a small jump stub in an
 * executable page, so its address differs from what dlsym returns (config `procaddr =
 * exported` turns that off). A known entry point the simulator does not implement returns
 * CUDA_ERROR_NOT_SUPPORTED when called. QGPU_SIM_TRACE_PROCADDR=1 prints every look-up on
 * stderr. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "driver.h"

#define SIM_FUNCS(X) \
    X(cuArray3DCreate) X(cuArray3DCreate_v2) X(cuArrayCreate) X(cuArrayCreate_v2) \
    X(cuArrayDestroy) X(cuCheckpointProcessCheckpoint) X(cuCheckpointProcessGetRestoreThreadId) \
    X(cuCheckpointProcessGetState) X(cuCheckpointProcessLock) X(cuCheckpointProcessRestore) \
    X(cuCheckpointProcessUnlock) X(cuCtxCreate) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4) \
    X(cuCtxDestroy) X(cuCtxDestroy_v2) X(cuCtxFromGreenCtx) X(cuCtxGetApiVersion) \
    X(cuCtxGetCurrent) X(cuCtxGetDevice) X(cuCtxGetFlags) X(cuCtxGetLimit) X(cuCtxPopCurrent) \
    X(cuCtxPopCurrent_v2) X(cuCtxPushCurrent) X(cuCtxPushCurrent_v2) X(cuCtxSetCurrent) \
    X(cuCtxSynchronize_v2) \
    X(cuCtxSetLimit) X(cuCtxSynchronize) X(cuDevResourceGenerateDesc) X(cuDeviceGet) \
    X(cuDeviceGetAttribute) X(cuDeviceGetCount) X(cuDeviceGetDefaultMemPool) \
    X(cuDeviceGetDevResource) X(cuDeviceGetGraphMemAttribute) X(cuDeviceGetMemPool) \
    X(cuDeviceGetName) X(cuDeviceGetPCIBusId) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) \
    X(cuDeviceGraphMemTrim) X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxRelease) \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset) X(cuDevicePrimaryCtxReset_v2) \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxSetFlags) X(cuDevicePrimaryCtxSetFlags_v2) \
    X(cuDeviceSetGraphMemAttribute) X(cuDeviceSetMemPool) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuDriverGetVersion) \
    X(cuEventCreate) X(cuEventDestroy) X(cuEventDestroy_v2) X(cuEventElapsedTime) \
    X(cuEventElapsedTime_v2) X(cuEventQuery) X(cuEventRecord) X(cuEventRecordWithFlags) \
    X(cuEventRecord_ptsz) X(cuEventSynchronize) X(cuFuncGetAttribute) X(cuFuncGetModule) X(cuFuncIsLoaded) X(cuFuncLoad) X(cuFuncSetAttribute) X(cuFuncSetBlockShape) X(cuFuncSetCacheConfig) X(cuOccupancyMaxActiveBlocksPerMultiprocessor) X(cuGetErrorName) \
    X(cuGetErrorString) X(cuGetExportTable) X(cuGraphAddKernelNode) X(cuGraphAddKernelNode_v2) \
    X(cuGraphAddMemAllocNode) X(cuGraphAddMemFreeNode) X(cuGraphAddNode) X(cuGraphAddNode_v2) \
    X(cuGraphAddChildGraphNode) X(cuGraphAddEmptyNode) X(cuGraphChildGraphNodeGetGraph) \
    X(cuGraphClone) X(cuGraphConditionalHandleCreate) X(cuGraphCreate) X(cuGraphDestroy) \
    X(cuGraphDestroyNode) X(cuGraphExecChildGraphNodeSetParams) X(cuGraphExecNodeSetParams) \
    X(cuGraphExecUpdate) X(cuGraphExecUpdate_v2) X(cuGraphGetNodes) \
    X(cuGraphMemAllocNodeGetParams) X(cuGraphMemFreeNodeGetParams) X(cuGraphNodeGetType) \
    X(cuGraphNodeSetParams) X(cuGraphKernelNodeSetParams) X(cuGraphKernelNodeSetParams_v2) \
    X(cuGraphExecKernelNodeSetParams) X(cuGraphExecKernelNodeSetParams_v2) \
    X(cuGraphExecDestroy) X(cuGraphInstantiate) X(cuGraphInstantiateWithFlags) \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz) \
    X(cuGraphInstantiate_v2) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuGraphUpload) \
    X(cuGraphUpload_ptsz) X(cuGreenCtxCreate) X(cuGreenCtxDestroy) X(cuInit) \
    X(cuIpcCloseMemHandle) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) \
    X(cuLaunch) \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernelMultiDevice) \
    X(cuLaunchCooperativeKernel_ptsz) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuLaunchKernel) \
    X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) X(cuLaunchKernel_ptsz) X(cuMemAddressFree) \
    X(cuMemAddressReserve) X(cuMemAlloc) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemAllocManaged) \
    X(cuMemAdvise) X(cuMemAdvise_v2) \
    X(cuMemAllocPitch) X(cuMemAllocPitch_v2) X(cuMemAlloc_v2) X(cuMemCreate) X(cuMemFree) X(cuMemGetDefaultMemPool) X(cuMemGetMemPool) \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemFree_v2) X(cuMemGetAllocationGranularity) \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) \
    X(cuMemGetAllocationPropertiesFromHandle) X(cuMemGetAddressRange) X(cuMemGetAddressRange_v2) \
    X(cuMemGetInfo) X(cuMemGetInfo_v2) X(cuMemMap) X(cuMemPoolCreate) X(cuMemPoolDestroy) \
    X(cuMemPoolExportPointer) X(cuMemPoolExportToShareableHandle) X(cuMemPoolGetAttribute) \
    X(cuMemPoolImportFromShareableHandle) X(cuMemPoolImportPointer) \
    X(cuMemPoolSetAttribute) X(cuMemPoolTrimTo) X(cuMemRelease) X(cuMemRetainAllocationHandle) \
    X(cuMemPrefetchAsync) X(cuMemPrefetchAsync_ptsz) X(cuMemPrefetchAsync_v2) \
    X(cuMemPrefetchAsync_v2_ptsz) X(cuMemPrefetchBatchAsync) X(cuMemPrefetchBatchAsync_ptsz) \
    X(cuMemDiscardBatchAsync) X(cuMemDiscardBatchAsync_ptsz) \
    X(cuMemDiscardAndPrefetchBatchAsync) X(cuMemDiscardAndPrefetchBatchAsync_ptsz) \
    X(cuMemRangeGetAttribute) X(cuMemRangeGetAttributes) \
    X(cuMemSetAccess) X(cuMemUnmap) X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy) \
    X(cuMipmappedArrayGetLevel) X(cuModuleGetFunction) X(cuModuleLoadData) X(cuModuleUnload) \
    X(cuModuleLoad) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary) X(cuModuleGetGlobal_v2) \
    X(cuModuleGetLoadingMode) X(cuLibraryLoadData) X(cuLibraryLoadFromFile) X(cuLibraryUnload) \
    X(cuLibraryGetModule) X(cuLibraryGetKernel) X(cuLibraryGetKernelCount) \
    X(cuLibraryEnumerateKernels) X(cuLibraryGetGlobal) X(cuLibraryGetManaged) \
    X(cuKernelGetAttribute) X(cuKernelGetFunction) X(cuKernelGetLibrary) X(cuLinkCreate) X(cuLinkCreate_v2) \
    X(cuLinkAddData) X(cuLinkAddData_v2) X(cuLinkAddFile) X(cuLinkAddFile_v2) X(cuLinkComplete) \
    X(cuLinkDestroy) X(cuStreamGetCtx) X(cuStreamGetCtx_ptsz) X(cuStreamGetCtx_v2) \
    X(cuStreamGetCtx_v2_ptsz) \
    X(cuParamSetSize) X(cuParamSeti) X(cuParamSetv) X(cuStreamBeginCapture) \
    X(cuStreamBeginCapture_ptsz) X(cuStreamBeginCapture_v2) X(cuStreamBeginCapture_v2_ptsz) \
    X(cuStreamBeginCaptureToGraph) X(cuStreamBeginCaptureToGraph_ptsz) \
    X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy) X(cuStreamDestroy_v2) \
    X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz) X(cuStreamGetCaptureInfo) \
    X(cuStreamGetCaptureInfo_ptsz) X(cuStreamGetCaptureInfo_v2) X(cuStreamGetCaptureInfo_v2_ptsz) \
    X(cuStreamGetCaptureInfo_v3) X(cuStreamGetCaptureInfo_v3_ptsz) X(cuStreamIsCapturing) \
    X(cuStreamIsCapturing_ptsz) X(cuStreamQuery) X(cuStreamQuery_ptsz) X(cuStreamSynchronize) \
    X(cuStreamSynchronize_ptsz)

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
#define NFUNCS (sizeof table / sizeof table[0])

static CUresult not_supported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

/* ---- internal entry points: one jump stub per function ---- */

#define STUB_SIZE 16
static unsigned char *stubs;
static pthread_once_t stubs_once = PTHREAD_ONCE_INIT;

static int write_stub(unsigned char *s, void *target) {
    uint64_t a = (uint64_t)(uintptr_t)target;
#if defined(__x86_64__)
    s[0] = 0x49; /* movabs r11, imm64 */
    s[1] = 0xbb;
    memcpy(s + 2, &a, 8);
    s[10] = 0x41; /* jmp r11 */
    s[11] = 0xff;
    s[12] = 0xe3;
    s[13] = s[14] = s[15] = 0xcc;
    return 0;
#elif defined(__aarch64__)
    uint32_t ldr = 0x58000050u; /* ldr x16, #8 */
    uint32_t br = 0xd61f0200u;  /* br x16 */
    memcpy(s, &ldr, 4);
    memcpy(s + 4, &br, 4);
    memcpy(s + 8, &a, 8);
    return 0;
#else
    (void)s;
    (void)a;
    return -1;
#endif
}

static void make_stubs(void) {
    size_t len = (NFUNCS + 1) * STUB_SIZE;
    unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    for (size_t i = 0; i < NFUNCS; i++) {
        if (write_stub(p + i * STUB_SIZE, table[i].fn) != 0) {
            munmap(p, len);
            return;
        }
    }
    write_stub(p + NFUNCS * STUB_SIZE, (void *)not_supported);
    if (mprotect(p, len, PROT_READ | PROT_EXEC) != 0) {
        munmap(p, len);
        return;
    }
    __builtin___clear_cache((char *)p, (char *)p + len);
    stubs = p;
}

static void *entry_point(size_t i) {
    int internal = !sim_config_loaded() || g_sim_cfg.procaddr == SIM_PROCADDR_INTERNAL;
    if (internal) {
        pthread_once(&stubs_once, make_stubs);
        if (stubs) return stubs + i * STUB_SIZE;
    }
    return i < NFUNCS ? table[i].fn : (void *)not_supported;
}

static size_t lookup_exact(const char *name) {
    for (size_t i = 0; i < NFUNCS; i++)
        if (strcmp(table[i].name, name) == 0) return i;
    return NFUNCS; /* the not-supported stub */
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn || (flags & ~(cuuint64_t)3)) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int driver = sim_config_loaded() ? g_sim_cfg.cuda_version : 13000, st = 0;
    const char *name = qgpu_procaddr_symbol(symbol, version, flags, driver, &st);
    if (status) *status = (CUdriverProcAddressQueryResult)st;
    if (getenv("QGPU_SIM_TRACE_PROCADDR")) /* how docs/enforcement.md records NVIDIA's runtime */
        fprintf(stderr, "qgpu-sim: cuGetProcAddress %s %d %llu -> %s\n", symbol, version,
                (unsigned long long)flags, name ? name : st == 1 ? "SYMBOL_NOT_FOUND"
                                                                 : "VERSION_NOT_SUFFICIENT");
    if (!name) return CUDA_ERROR_NOT_FOUND;
    *pfn = entry_point(lookup_exact(name));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                                     cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
