/* Virtual memory management: a physical allocation (cuMemCreate on a device) is charged when
 * it is created and given back only when the driver frees it: when every reference is
 * released (cuMemRelease; cuMemRetainAllocationHandle adds one) AND every mapping of it is
 * unmapped (cuMemMap / cuMemUnmap). Releasing a handle that is still mapped (the pattern of
 * NVIDIA's own samples) keeps the charge until the last unmap. A handle mapped into a sparse
 * array (cuMemMapArrayAsync) keeps its charge until the process exits: the unmap there does
 * not name the handle. Host-located allocations are not device memory and are not charged;
 * one placed on a device other than the slice's GPU is refused. */
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
    pthread_mutex_lock(&vmm_lock);
    /* without room to track it the charge is simply never given back */
    if (grow((void **)&handles, &cap_handles, nhandles, sizeof *handles) == 0)
        handles[nhandles++] = (vhandle_t){*handle, size, 1, 0, 0};
    pthread_mutex_unlock(&vmm_lock);
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
