/* Memory hard cap: every device allocation is charged to the slice ledger before the real
 * call (so concurrent processes cannot overshoot together) and released on its free.
 * Over the cap the call returns CUDA_ERROR_OUT_OF_MEMORY without reaching the driver;
 * ledger_reserve counts each such refusal in the slice ledger (oom_refusals). */
#include "hook.h"

static qgpu_table_t allocs = QGPU_TABLE_INIT;

void mem_track(uint64_t key, uint64_t size) {
    if (qgpu_table_put(&allocs, key, size, 0) != 0) ledger_release(size);
}

static void untrack(uint64_t key) {
    uint64_t size;
    if (qgpu_table_take(&allocs, key, &size, NULL) == 0) ledger_release(size);
}

#define CHARGE(bytes)                                                                        \
    do {                                                                                     \
        if ((bytes) == 0) break;                                                             \
        if (ledger_reserve(bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;                     \
    } while (0)

#define SETTLE(r, bytes, key)                                                                \
    do {                                                                                     \
        if ((r) == CUDA_SUCCESS)                                                             \
            mem_track((uint64_t)(key), bytes);                                               \
        else if (bytes)                                                                      \
            ledger_release(bytes);                                                           \
    } while (0)

QGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    HOOK_ENTER(cuMemAlloc_v2, dptr, size);
    CHARGE(size);
    CUresult r = REAL(cuMemAlloc_v2)(dptr, size);
    SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);
    return r;
}

QGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem) {
    HOOK_ENTER(cuMemAllocPitch_v2, dptr, pitch, width, height, elem);
    /* the driver picks the pitch: charge the unpadded size first, then the padding */
    uint64_t guess = (uint64_t)width * height;
    CHARGE(guess);
    CUresult r = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem);
    if (r != CUDA_SUCCESS) {
        if (guess) ledger_release(guess);
        return r;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > guess && ledger_reserve(actual - guess) != 0) {
        if (HAVE_REAL(cuMemFree_v2)) REAL(cuMemFree_v2)(*dptr);
        ledger_release(guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < guess) ledger_release(guess - actual);
    mem_track(*dptr, actual);
    return r;
}

QGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    HOOK_ENTER(cuMemAllocManaged, dptr, size, flags);
    CHARGE(size);
    CUresult r = REAL(cuMemAllocManaged)(dptr, size, flags);
    SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);
    return r;
}

QGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    HOOK_ENTER(cuMemFree_v2, dptr);
    CUresult r = REAL(cuMemFree_v2)(dptr);
    if (r == CUDA_SUCCESS && dptr) untrack(dptr);
    return r;
}

QGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    HOOK_ENTER(cuMemCreate, handle, size, prop, flags);
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(handle, size, prop, flags); /* host memory is not capped */
    CHARGE(size);
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
    SETTLE(r, size, r == CUDA_SUCCESS ? *handle : 0);
    return r;
}

QGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    HOOK_ENTER(cuMemRelease, handle);
    CUresult r = REAL(cuMemRelease)(handle);
    if (r == CUDA_SUCCESS) untrack(handle);
    return r;
}

#define ALLOC_ASYNC(name)                                                                    \
    QGPU_EXPORT CUresult name(CUdeviceptr *dptr, size_t size, CUstream s) {                  \
        HOOK_ENTER(name, dptr, size, s);                                                     \
        CHARGE(size);                                                                        \
        CUresult r = REAL(name)(dptr, size, s);                                              \
        SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);                                      \
        return r;                                                                            \
    }
ALLOC_ASYNC(cuMemAllocAsync)
ALLOC_ASYNC(cuMemAllocAsync_ptsz)

#define ALLOC_POOL(name)                                                                     \
    QGPU_EXPORT CUresult name(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s) { \
        HOOK_ENTER(name, dptr, size, pool, s);                                               \
        CHARGE(size);                                                                        \
        CUresult r = REAL(name)(dptr, size, pool, s);                                        \
        SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);                                      \
        return r;                                                                            \
    }
ALLOC_POOL(cuMemAllocFromPoolAsync)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz)

#define FREE_ASYNC(name)                                                                     \
    QGPU_EXPORT CUresult name(CUdeviceptr dptr, CUstream s) {                                \
        HOOK_ENTER(name, dptr, s);                                                           \
        CUresult r = REAL(name)(dptr, s);                                                    \
        if (r == CUDA_SUCCESS) untrack(dptr);                                                \
        return r;                                                                            \
    }
FREE_ASYNC(cuMemFreeAsync)
FREE_ASYNC(cuMemFreeAsync_ptsz)

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_ARRAY_FORMAT_UNSIGNED_INT8:
    case CU_ARRAY_FORMAT_SIGNED_INT8: return 1;
    case CU_ARRAY_FORMAT_UNSIGNED_INT16:
    case CU_ARRAY_FORMAT_SIGNED_INT16:
    case CU_ARRAY_FORMAT_HALF: return 2;
    default: return 4;
    }
}

QGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d) {
    HOOK_ENTER(cuArrayCreate_v2, arr, d);
    uint64_t bytes = d ? (uint64_t)d->Width * (d->Height ? d->Height : 1) *
                             format_bytes(d->Format) * d->NumChannels
                       : 0;
    CHARGE(bytes);
    CUresult r = REAL(cuArrayCreate_v2)(arr, d);
    SETTLE(r, bytes, r == CUDA_SUCCESS ? (uintptr_t)*arr : 0);
    return r;
}

QGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    HOOK_ENTER(cuArray3DCreate_v2, arr, d);
    uint64_t bytes = d ? (uint64_t)d->Width * (d->Height ? d->Height : 1) *
                             (d->Depth ? d->Depth : 1) * format_bytes(d->Format) * d->NumChannels
                       : 0;
    CHARGE(bytes);
    CUresult r = REAL(cuArray3DCreate_v2)(arr, d);
    SETTLE(r, bytes, r == CUDA_SUCCESS ? (uintptr_t)*arr : 0);
    return r;
}

QGPU_EXPORT CUresult cuArrayDestroy(CUarray arr) {
    HOOK_ENTER(cuArrayDestroy, arr);
    CUresult r = REAL(cuArrayDestroy)(arr);
    if (r == CUDA_SUCCESS) untrack((uintptr_t)arr);
    return r;
}

/* What the slice sees: total = its cap, free = cap - what the slice holds (never more than
 * the card really has free). */
QGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    HOOK_ENTER(cuMemGetInfo_v2, free_bytes, total);
    CUresult r = REAL(cuMemGetInfo_v2)(free_bytes, total);
    if (r != CUDA_SUCCESS || !free_bytes || !total) return r;
    uint64_t used = ledger_used();
    uint64_t mine = used < g_lim.mem_limit ? g_lim.mem_limit - used : 0;
    if (mine < *free_bytes) *free_bytes = mine;
    *total = g_lim.mem_limit;
    return r;
}

QGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    HOOK_ENTER(cuDeviceTotalMem_v2, bytes, dev);
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r == CUDA_SUCCESS && bytes && g_lim.mem_limit < *bytes) *bytes = g_lim.mem_limit;
    return r;
}
