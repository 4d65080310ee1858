/* Simulated device memory: every allocation API charges the GPU's shared accounting. No
 * host memory backs the fake device addresses. */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define TAG_HOST (-1) /* host-located cuMemCreate: tracked, not charged */

static uint64_t next_addr = 0x7f0000000000ULL;

uint64_t sim_next_address(uint64_t size) {
    uint64_t step = (size + 0x1FFFFFULL) & ~0x1FFFFFULL; /* 2 MiB granules */
    if (!step) step = 0x200000ULL;
    return __atomic_fetch_add(&next_addr, step, __ATOMIC_RELAXED);
}

static CUresult charge(int gidx, uint64_t size) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    if (st->mem_used + size > st->mem_total) {
        sim_state_reclaim_dead(st);
        if (st->mem_used + size > st->mem_total) {
            sim_state_unlock(st);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    sim_proc_t *p = sim_state_proc_slot(st, 1);
    if (!p) {
        sim_state_unlock(st);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    st->mem_used += size;
    p->mem_used += size;
    sim_state_unlock(st);
    return CUDA_SUCCESS;
}

static void uncharge(int gidx, uint64_t size) {
    if (gidx < 0) return;
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    sim_proc_t *p = sim_state_proc_slot(st, 0);
    st->mem_used = st->mem_used >= size ? st->mem_used - size : 0;
    if (p) p->mem_used = p->mem_used >= size ? p->mem_used - size : 0;
    sim_state_unlock(st);
}

static CUresult alloc_on(int gidx, uint64_t size, unsigned long long *out) {
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = charge(gidx, size);
    if (r) return r;
    uint64_t a = sim_next_address(size);
    if (qgpu_table_put(&g_sim_allocs, a, size, gidx) != 0) {
        uncharge(gidx, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult free_key(uint64_t key) {
    uint64_t size;
    int64_t gidx;
    if (qgpu_table_take(&g_sim_allocs, key, &size, &gidx) != 0) return CUDA_ERROR_INVALID_VALUE;
    uncharge((int)gidx, size);
    return CUDA_SUCCESS;
}

static CUresult ctx_gidx(int *gidx) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *gidx = c->gidx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    int g;
    CUresult r = ctx_gidx(&g);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return alloc_on(g, size, dptr);
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                       size_t height, unsigned int elem) {
    int g;
    CUresult r = ctx_gidx(&g);
    if (r) return r;
    if (!dptr || !pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + 511) & ~(size_t)511;
    r = alloc_on(g, (uint64_t)p * height, dptr);
    if (!r) *pitch = p;
    return r;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    (void)flags;
    int g;
    CUresult r = ctx_gidx(&g);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return alloc_on(g, size, dptr);
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!dptr) return CUDA_SUCCESS;
    return free_key(dptr);
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    int g;
    CUresult r = ctx_gidx(&g);
    if (r) return r;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    sim_gpu_state_t *st = g_sim_state[g];
    sim_state_lock(st);
    sim_state_reclaim_dead(st);
    *total = st->mem_total;
    *free_bytes = st->mem_used < st->mem_total ? st->mem_total - st->mem_used : 0;
    sim_state_unlock(st);
    return CUDA_SUCCESS;
}

/* ---- virtual memory management ---- */

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!handle || !prop || !size || flags) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        int g;
        r = sim_device_gidx(prop->location.id, &g);
        if (r) return r;
        unsigned long long h;
        r = alloc_on(g, size, &h);
        if (!r) *handle = h;
        return r;
    }
    uint64_t h = sim_next_address(size);
    qgpu_table_put(&g_sim_allocs, h, size, TAG_HOST);
    *handle = h;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult r = sim_check_init();
    if (r) return r;
    return free_key(handle);
}

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop,
                                                  int option) {
    (void)prop;
    (void)option;
    if (!gran) return CUDA_ERROR_INVALID_VALUE;
    *gran = 2 << 20;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags) {
    (void)alignment;
    (void)addr;
    (void)flags;
    if (!ptr || !size) return CUDA_ERROR_INVALID_VALUE;
    *ptr = sim_next_address(size);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    (void)ptr;
    (void)size;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags) {
    (void)ptr;
    (void)offset;
    (void)flags;
    uint64_t have;
    if (qgpu_table_get(&g_sim_allocs, handle, &have, NULL) != 0) return CUDA_ERROR_INVALID_HANDLE;
    return size <= have ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    (void)ptr;
    (void)size;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)ptr;
    (void)size;
    (void)desc;
    (void)count;
    return CUDA_SUCCESS;
}

/* ---- stream-ordered allocator ---- */

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int g;
    r = sim_device_gidx(props->location.id, &g);
    if (r) return r;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = POOL_MAGIC;
    p->gidx = g;
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    if (!pool || pool->magic != POOL_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    pool->magic = 0;
    free(pool);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_stream_ctx(stream);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return alloc_on(c->gidx, size, dptr);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                            CUstream stream) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!dptr || !pool || pool->magic != POOL_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_stream_ctx(stream)) return CUDA_ERROR_INVALID_CONTEXT;
    return alloc_on(pool->gidx, size, dptr);
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    CUresult r = sim_check_init();
    if (r) return r;
    return free_key(dptr);
}

/* ---- arrays ---- */

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

static CUresult array_create(CUarray *arr, uint64_t bytes) {
    int g;
    CUresult r = ctx_gidx(&g);
    if (r) return r;
    unsigned long long a;
    r = alloc_on(g, bytes, &a);
    if (!r) *arr = (CUarray)(uintptr_t)a;
    return r;
}

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!arr || !d || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t h = d->Height ? d->Height : 1;
    return array_create(arr, d->Width * h * format_bytes(d->Format) * d->NumChannels);
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!arr || !d || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t h = d->Height ? d->Height : 1, dep = d->Depth ? d->Depth : 1;
    return array_create(arr, d->Width * h * dep * format_bytes(d->Format) * d->NumChannels);
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray arr) {
    CUresult r = sim_check_init();
    if (r) return r;
    return free_key((uint64_t)(uintptr_t)arr);
}
