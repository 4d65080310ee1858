/* Virtual memory management: a physical allocation (cuMemCreate on a device) is charged when
 * it is created and given back only when the driver frees it: when every reference is
 * released (cuMemRelease; cuMemRetainAllocationHandle adds one) AND every mapping of it is
 * unmapped (cuMemMap / cuMemUnmap). Releasing a handle that is still mapped (the pattern of
 * NVIDIA's own samples) keeps the charge until the last unmap. A handle mapped into a sparse
 * array (cuMemMapArrayAsync) keeps its charge until the process exits: the unmap there does
 * not name the handle. Host-located allocations are not device memory and are not charged;
 * one placed on a device other than the slice's GPU is refused.
 *
 * Sharing with other processes. A descriptor from cuMemExportToShareableHandle keeps the
 * memory alive by itself ("once all shareable handles are closed and the allocation is
 * released", cuda.h), in any process it is passed to, including one that never calls CUDA,
 * and after the exporter exits: no charge can follow it, so a slice may not export
 * (CUDA_ERROR_NOT_PERMITTED). A handle imported from a descriptor made outside the slice is
 * charged to the importer like one it created (its size found by probing cuMemMap, which
 * refuses a mapping larger than the allocation), and given back the same way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

typedef struct {
    uint64_t handle, size;
    int refs, maps;
    int pinned; /* mapped into a sparse array: kept until exit */
} vhandle_t;

typedef struct {
    uint64_t va, size, handle;
} vmap_t;

static vhandle_t *handles;
static size_t nhandles, cap_handles;
static vmap_t *vmaps;
static size_t nmaps, cap_maps;
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

static vhandle_t *find(uint64_t h) {
    for (size_t i = 0; i < nhandles; i++)
        if (handles[i].handle == h) return &handles[i];
    return NULL;
}

/* locked: the driver frees the memory now: give the charge back */
static void drop_if_freed(vhandle_t *h) {
    if (h->refs > 0 || h->maps > 0 || h->pinned) return;
    ledger_release(h->size);
    *h = handles[--nhandles];
}

/* track a handle the slice is charged `size` for, holding one reference */
static void track_handle(CUmemGenericAllocationHandle handle, uint64_t size) {
    pthread_mutex_lock(&vmm_lock);
    /* without room to track it the charge is simply never given back */
    if (grow((void **)&handles, &cap_handles, nhandles, sizeof *handles) == 0)
        handles[nhandles++] = (vhandle_t){handle, size, 1, 0, 0};
    pthread_mutex_unlock(&vmm_lock);
}

QGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    HOOK_ENTER(cuMemCreate, handle, size, prop, flags);
    HOOK_MEM_OP();
    if (prop && hook_foreign_location(&prop->location)) return CUDA_ERROR_INVALID_DEVICE;
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(handle, size, prop, flags); /* host memory is not capped */
    if (size && ledger_reserve(size) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        ledger_release(size);
        return r;
    }
    track_handle(*handle, size);
    return r;
}

QGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    HOOK_ENTER(cuMemRelease, handle);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemRelease)(handle);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&vmm_lock);
    vhandle_t *h = find(handle);
    if (h && h->refs > 0) {
        h->refs--;
        drop_if_freed(h);
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

QGPU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    HOOK_ENTER(cuMemRetainAllocationHandle, handle, addr);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemRetainAllocationHandle)(handle, addr);
    if (r != CUDA_SUCCESS || !handle) return r;
    pthread_mutex_lock(&vmm_lock);
    vhandle_t *h = find(*handle);
    if (h) h->refs++;
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

QGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags) {
    HOOK_ENTER(cuMemMap, ptr, size, offset, handle, flags);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemMap)(ptr, size, offset, handle, flags);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&vmm_lock);
    vhandle_t *h = find(handle);
    if (h) {
        if (grow((void **)&vmaps, &cap_maps, nmaps, sizeof *vmaps) == 0) {
            vmaps[nmaps++] = (vmap_t){ptr, size, handle};
            h->maps++;
        } else {
            h->pinned = 1; /* cannot follow this mapping: keep the charge */
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

QGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    HOOK_ENTER(cuMemUnmap, ptr, size);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemUnmap)(ptr, size);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < nmaps;) {
        vmap_t m = vmaps[i];
        if (m.va >= ptr && m.va - ptr < size) {
            vmaps[i] = vmaps[--nmaps];
            vhandle_t *h = find(m.handle);
            if (h) {
                h->maps--;
                drop_if_freed(h);
            }
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* CUarrayMapInfo (cuda.h): memOperationType at 56, memHandleType at 60, memHandle at 64;
 * 96 bytes per entry. */
#define MAPINFO_SIZE 96
#define CU_MEM_OPERATION_TYPE_MAP 1
#define CU_MEM_HANDLE_TYPE_GENERIC 0

static void pin_mapped(void *list, unsigned count) {
    if (!list) return;
    pthread_mutex_lock(&vmm_lock);
    for (unsigned i = 0; i < count; i++) {
        const unsigned char *e = (const unsigned char *)list + (size_t)i * MAPINFO_SIZE;
        int op, type;
        uint64_t handle;
        memcpy(&op, e + 56, sizeof op);
        memcpy(&type, e + 60, sizeof type);
        memcpy(&handle, e + 64, sizeof handle);
        vhandle_t *h = op == CU_MEM_OPERATION_TYPE_MAP && type == CU_MEM_HANDLE_TYPE_GENERIC
                           ? find(handle)
                           : NULL;
        if (h) h->pinned = 1;
    }
    pthread_mutex_unlock(&vmm_lock);
}

QGPU_EXPORT CUresult cuMemMapArrayAsync(void *list, unsigned int count, CUstream s) {
    HOOK_ENTER(cuMemMapArrayAsync, list, count, s);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemMapArrayAsync)(list, count, s);
    if (r == CUDA_SUCCESS) pin_mapped(list, count);
    return r;
}

QGPU_EXPORT CUresult cuMemMapArrayAsync_ptsz(void *list, unsigned int count, CUstream s) {
    HOOK_ENTER(cuMemMapArrayAsync_ptsz, list, count, s);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemMapArrayAsync_ptsz)(list, count, s);
    if (r == CUDA_SUCCESS) pin_mapped(list, count);
    return r;
}

/* ---- sharing with other processes ---- */

QGPU_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
                                                  int type, unsigned long long flags) {
    HOOK_ENTER(cuMemExportToShareableHandle, out, handle, type, flags);
    static int told;
    if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "qgpu: cuMemExportToShareableHandle refused in slice %s "
                "(CUDA_ERROR_NOT_PERMITTED): an exported descriptor keeps the memory alive in "
                "any process it reaches, beyond what the slice's cap can follow. NCCL: set "
                "NCCL_CUMEM_ENABLE=0 (legacy CUDA IPC is supported)\n", g_lim.slice_id);
    return CUDA_ERROR_NOT_PERMITTED;
}

/* The size of an imported allocation: cuda.h has no size query for a generic handle, but
 * cuMemMap refuses (CUDA_ERROR_INVALID_VALUE) a mapping larger than the allocation. A binary
 * search over granules in a scratch reservation, up to one granule past `limit` (mapping
 * that much means "larger than the limit"). 0 and *size, or -1 when the driver answered
 * anything else (the import is then refused rather than guessed). */
static int imported_size(CUmemGenericAllocationHandle h, const CUmemAllocationProp *prop,
                         uint64_t limit, uint64_t *size) {
    size_t gran = 0;
    if (!HAVE_REAL(cuMemGetAllocationGranularity) || !HAVE_REAL(cuMemAddressReserve) ||
        !HAVE_REAL(cuMemAddressFree) || !HAVE_REAL(cuMemMap) || !HAVE_REAL(cuMemUnmap))
        return -1;
    if (REAL(cuMemGetAllocationGranularity)(&gran, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ||
        !gran)
        return -1;
    uint64_t top = limit / gran + 1, span; /* granules */
    if (hook_mul(top, gran, &span) != 0) return -1;
    CUdeviceptr va;
    if (REAL(cuMemAddressReserve)(&va, span, 0, 0, 0) != CUDA_SUCCESS) return -1;
    uint64_t fits = 0, too_big = top + 1; /* largest known to map, smallest known not to */
    int failed = 0;
    while (fits + 1 < too_big && !failed) {
        uint64_t mid = fits + (too_big - fits) / 2;
        CUresult r = REAL(cuMemMap)(va, mid * gran, 0, h, 0);
        if (r == CUDA_SUCCESS) {
            failed = REAL(cuMemUnmap)(va, mid * gran) != CUDA_SUCCESS;
            fits = mid;
        } else if (r == CUDA_ERROR_INVALID_VALUE) {
            too_big = mid;
        } else {
            failed = 1;
        }
    }
    REAL(cuMemAddressFree)(va, span);
    if (failed || !fits) return -1;
    *size = fits * gran; /* fits == top: more than the limit, which is all that matters */
    return 0;
}

QGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                    void *os_handle, int type) {
    HOOK_ENTER(cuMemImportFromShareableHandle, handle, os_handle, type);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemImportFromShareableHandle)(handle, os_handle, type);
    if (r != CUDA_SUCCESS || !handle) return r;
    CUmemAllocationProp prop;
    uint64_t size = 0;
    if (!HAVE_REAL(cuMemGetAllocationPropertiesFromHandle) || !HAVE_REAL(cuMemRelease) ||
        REAL(cuMemGetAllocationPropertiesFromHandle)(&prop, *handle) != CUDA_SUCCESS) {
        r = CUDA_ERROR_NOT_SUPPORTED;
    } else if (hook_foreign_location(&prop.location)) {
        r = CUDA_ERROR_INVALID_DEVICE; /* memory on another tenant's GPU */
    } else if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        return CUDA_SUCCESS; /* host memory is not capped */
    } else if (imported_size(*handle, &prop, g_lim.mem_limit, &size) != 0) {
        r = CUDA_ERROR_NOT_SUPPORTED;
    } else if (ledger_reserve(size) != 0) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r != CUDA_SUCCESS) {
        if (HAVE_REAL(cuMemRelease)) REAL(cuMemRelease)(*handle); /* nothing is kept */
        return r;
    }
    track_handle(*handle, size);
    return CUDA_SUCCESS;
}
