/* Managed memory (cuMemAllocManaged) is charged to the slice when it is allocated, on the
 * slice's GPU; the driver may later move it anywhere the process asks (cuda.h): a prefetch
 * (cuMemPrefetchAsync in its four ABI forms, CUDA 13's cuMemPrefetchBatchAsync and
 * cuMemDiscardAndPrefetchBatchAsync, and their _ptsz forms) migrates it to a GPU or the host,
 * and advice (cuMemAdvise v1/v2) makes a GPU its preferred location or a GPU that maps it
 * where it is, which keeps it there. A slice is one GPU (the device fence): a destination, a
 * preferred location or an accessing device that is another GPU of the node is refused
 * with CUDA_ERROR_INVALID_DEVICE before the driver sees it. The host (CU_DEVICE_CPU, host
 * and host-NUMA locations) and the slice's own GPU pass; advice that names no location
 * (read-mostly, unset preferred location) and UNSET_ACCESSED_BY (it only removes a mapping)
 * pass untouched. Range attribute queries (cuMemRangeGetAttribute(s)) move nothing and are
 * not wrapped. A prefetch moves memory onto or off the slice's GPU and advice can drop
 * read-mostly copies, which changes what NVML shows this process holding: every wrapper here
 * holds the process's memory lock shared (HOOK_MEM_OP, module.c) so that a measured load of
 * device code does not count it. */
#include "hook.h"

/* the v1 forms name a device ordinal, or CU_DEVICE_CPU for the host */
static int foreign_device_or_cpu(CUdevice dev) {
    return dev != CU_DEVICE_CPU && hook_foreign_device(dev);
}

#define PREFETCH_V1(name)                                                                    \
    QGPU_EXPORT CUresult name(CUdeviceptr p, size_t n, CUdevice dst, CUstream s) {           \
        HOOK_ENTER(name, p, n, dst, s);                                                      \
        HOOK_MEM_OP();                                                                       \
        if (foreign_device_or_cpu(dst)) return CUDA_ERROR_INVALID_DEVICE;                    \
        return REAL(name)(p, n, dst, s);                                                     \
    }
PREFETCH_V1(cuMemPrefetchAsync)
PREFETCH_V1(cuMemPrefetchAsync_ptsz)

#define PREFETCH_V2(name)                                                                    \
    QGPU_EXPORT CUresult name(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, \
                              CUstream s) {                                                  \
        HOOK_ENTER(name, p, n, loc, flags, s);                                               \
        HOOK_MEM_OP();                                                                       \
        if (hook_foreign_location(&loc)) return CUDA_ERROR_INVALID_DEVICE;                   \
        return REAL(name)(p, n, loc, flags, s);                                              \
    }
PREFETCH_V2(cuMemPrefetchAsync_v2)
PREFETCH_V2(cuMemPrefetchAsync_v2_ptsz)

/* every location of a batch (the driver reads the same nlocs entries) */
static int foreign_batch(const CUmemLocation *locs, size_t nlocs) {
    for (size_t i = 0; locs && i < nlocs; i++)
        if (hook_foreign_location(&locs[i])) return 1;
    return 0;
}

#define PREFETCH_BATCH(name)                                                                 \
    QGPU_EXPORT CUresult name(CUdeviceptr *dptrs, size_t *sizes, size_t count,               \
                              CUmemLocation *locs, size_t *idxs, size_t nlocs,               \
                              unsigned long long flags, CUstream s) {                        \
        HOOK_ENTER(name, dptrs, sizes, count, locs, idxs, nlocs, flags, s);                  \
        HOOK_MEM_OP();                                                                       \
        if (foreign_batch(locs, nlocs)) return CUDA_ERROR_INVALID_DEVICE;                    \
        return REAL(name)(dptrs, sizes, count, locs, idxs, nlocs, flags, s);                 \
    }
PREFETCH_BATCH(cuMemPrefetchBatchAsync)
PREFETCH_BATCH(cuMemPrefetchBatchAsync_ptsz)
PREFETCH_BATCH(cuMemDiscardAndPrefetchBatchAsync)
PREFETCH_BATCH(cuMemDiscardAndPrefetchBatchAsync_ptsz)

/* the advice whose location places the memory or maps it on a device */
static int places(int advice) {
    return advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION || advice == CU_MEM_ADVISE_SET_ACCESSED_BY;
}

QGPU_EXPORT CUresult cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev) {
    HOOK_ENTER(cuMemAdvise, p, n, advice, dev);
    HOOK_MEM_OP();
    if (places(advice) && foreign_device_or_cpu(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuMemAdvise)(p, n, advice, dev);
}

QGPU_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc) {
    HOOK_ENTER(cuMemAdvise_v2, p, n, advice, loc);
    HOOK_MEM_OP();
    if (places(advice) && hook_foreign_location(&loc)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuMemAdvise_v2)(p, n, advice, loc);
}
