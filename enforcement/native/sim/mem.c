/* Simulated device memory, with the lifetimes a real driver gives it:
 *  - plain allocations (cuMemAlloc v1/v2, pitch, managed, arrays, mipmapped arrays) belong to
 *    the context they were made in and die with it; managed memory lives where managed.c
 *    says (its context's GPU, until prefetched or migrated elsewhere);
 *  - VMM physical allocations (cuMemCreate) live until they are released AND unmapped: a
 *    handle released while still mapped keeps its memory (NVIDIA's vectorAddMMAP sample
 *    releases right after mapping);
 *  - stream-ordered allocations come from memory pools (pool.c);
 *  - graph memory nodes take memory from a per-device graph pool (graphmem.c); cuMemFree and
 *    cuMemFreeAsync free graph allocations too.
 * Every size check is overflow-safe. No host memory backs the device addresses. */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define GRANULE (2ULL << 20)
#define TAG_KIND_SHIFT 8
#define TAG_CTX_SHIFT 16
enum { KIND_DEV = 1, KIND_ARRAY = 2, KIND_V1 = 3, KIND_MANAGED = 4 };

/* ---- addresses ---- */

static uint64_t next_addr = 0x7f0000000000ULL;

static uint64_t round_up(uint64_t size) {
    if (size > UINT64_MAX - (GRANULE - 1)) return 0;
    return (size + GRANULE - 1) & ~(GRANULE - 1);
}

uint64_t sim_next_address(uint64_t size) {
    uint64_t step = round_up(size);
    if (!step) step = GRANULE;
    if (step > (1ULL << 46)) step = 1ULL << 46; /* fake VA: never past the 47-bit space */
    return __atomic_fetch_add(&next_addr, step, __ATOMIC_RELAXED);
}

/* CUDA 2.0 (v1) pointers are 32-bit: a first-fit allocator of 2 MiB granules below 4 GiB. */
#define V1_BASE 0x10000000ULL
#define V1_GRANULES 1792 /* up to 0xF0000000 */
static unsigned char v1_used[V1_GRANULES];
static pthread_mutex_t v1_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t v1_take(uint64_t size) {
    uint64_t n = round_up(size) / GRANULE;
    if (!n) n = 1;
    pthread_mutex_lock(&v1_lock);
    for (uint64_t i = 0; n <= V1_GRANULES && i + n <= V1_GRANULES; i++) {
        uint64_t k = 0;
        while (k < n && !v1_used[i + k]) k++;
        if (k == n) {
            memset(v1_used + i, 1, n);
            pthread_mutex_unlock(&v1_lock);
            return V1_BASE + i * GRANULE;
        }
        i += k;
    }
    pthread_mutex_unlock(&v1_lock);
    return 0;
}

static void v1_give(uint64_t addr, uint64_t size) {
    uint64_t n = round_up(size) / GRANULE, i = (addr - V1_BASE) / GRANULE;
    if (!n) n = 1;
    pthread_mutex_lock(&v1_lock);
    if (i + n <= V1_GRANULES) memset(v1_used + i, 0, n);
    pthread_mutex_unlock(&v1_lock);
}

/* ---- the GPU's accounting ---- */

/* `bytes` onto / off GPU `gidx` for this process, under the GPU's lock: the driver's own
 * memory (it may evict managed memory to fit) or managed memory (it never evicts) */
static CUresult charge_on(int gidx, uint64_t bytes, CUresult (*charge)(sim_gpu_state_t *, uint64_t)) {
    if (!bytes) return CUDA_SUCCESS;
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    CUresult r = charge(st, bytes);
    sim_state_unlock(st);
    return r;
}

static void uncharge_on(int gidx, uint64_t bytes, void (*uncharge)(sim_gpu_state_t *, uint64_t)) {
    if (gidx < 0 || !bytes) return;
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    uncharge(st, bytes);
    sim_state_unlock(st);
}

CUresult sim_charge(int gidx, uint64_t bytes) { return charge_on(gidx, bytes, sim_state_charge); }
void sim_uncharge(int gidx, uint64_t bytes) { uncharge_on(gidx, bytes, sim_state_uncharge); }
CUresult sim_charge_managed(int gidx, uint64_t bytes) {
    return charge_on(gidx, bytes, sim_state_charge_managed);
}
void sim_uncharge_managed(int gidx, uint64_t bytes) {
    uncharge_on(gidx, bytes, sim_state_uncharge_managed);
}

uint64_t sim_take_evicted(int gidx) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    if (!st) return 0;
    sim_state_lock(st);
    uint64_t n = sim_state_take_evicted(st);
    sim_state_unlock(st);
    return n;
}

static int64_t make_tag(int kind, int gidx, const struct CUctx_st *ctx) {
    (void)ctx;
    return ((int64_t)(uintptr_t)ctx << TAG_CTX_SHIFT) | ((int64_t)kind << TAG_KIND_SHIFT) | gidx;
}
static int tag_gidx(int64_t tag) { return (int)(tag & 0xff); }
static int tag_kind(int64_t tag) { return (int)((tag >> TAG_KIND_SHIFT) & 0xff); }
static uintptr_t tag_ctx(int64_t tag) { return (uintptr_t)((uint64_t)tag >> TAG_CTX_SHIFT); }

static CUresult ctx_gidx(struct CUctx_st **ctx, int *gidx) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *ctx = c;
    *gidx = c->gidx;
    return CUDA_SUCCESS;
}

static CUresult alloc_in(struct CUctx_st *ctx, int kind, uint64_t size, CUdeviceptr *out) {
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    int managed = kind == KIND_MANAGED;
    CUresult r = managed ? sim_charge_managed(ctx->gidx, size) : sim_charge(ctx->gidx, size);
    if (r) return r;
    uint64_t a = kind == KIND_V1 ? v1_take(size) : sim_next_address(size);
    if (!a || qgpu_table_put(&g_sim_allocs, a, size, make_tag(kind, ctx->gidx, ctx)) != 0) {
        if (a && kind == KIND_V1) v1_give(a, size);
        if (managed) sim_uncharge_managed(ctx->gidx, size);
        else sim_uncharge(ctx->gidx, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = a;
    return CUDA_SUCCESS;
}

/* the memory of an allocation taken out of the table goes: managed memory from wherever
 * it lives, IPC-exported memory when no importer holds it either */
static void release(uint64_t key, uint64_t size, int64_t tag) {
    if (tag_kind(tag) == KIND_V1) v1_give(key, size);
    if (tag_kind(tag) == KIND_MANAGED) {
        if (!sim_managed_free(key)) sim_uncharge_managed(tag_gidx(tag), size); /* never recorded */
        return;
    }
    if (!sim_ipc_freed(key)) sim_uncharge(tag_gidx(tag), size);
}

static CUresult free_kind(uint64_t key, int want_array) {
    uint64_t size;
    int64_t tag;
    if (qgpu_table_get(&g_sim_allocs, key, &size, &tag) != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((tag_kind(tag) == KIND_ARRAY) != want_array) return CUDA_ERROR_INVALID_VALUE;
    if (qgpu_table_take(&g_sim_allocs, key, &size, &tag) != 0) return CUDA_ERROR_INVALID_VALUE;
    release(key, size, tag);
    return CUDA_SUCCESS;
}

CUresult sim_free_plain(uint64_t ptr) { return free_kind(ptr, 0); }

CUresult sim_ipc_source(uint64_t ptr, uint64_t *size, int *gidx) {
    int64_t tag;
    if (qgpu_table_get(&g_sim_allocs, ptr, size, &tag) != 0 || tag_kind(tag) != KIND_DEV)
        return CUDA_ERROR_INVALID_VALUE; /* not the base of a cuMemAlloc'ed allocation */
    *gidx = tag_gidx(tag);
    return CUDA_SUCCESS;
}

/* A destroyed context takes its allocations with it. */
static uintptr_t dying_ctx;
static int owned_by_dying(uint64_t key, uint64_t size, int64_t tag) {
    (void)key;
    (void)size;
    return tag_ctx(tag) == dying_ctx;
}
static pthread_mutex_t dying_lock = PTHREAD_MUTEX_INITIALIZER;

QGPU_HIDDEN void sim_free_ctx_allocations(struct CUctx_st *ctx) {
    pthread_mutex_lock(&dying_lock);
    dying_ctx = (uintptr_t)ctx;
    qgpu_entry_t taken[256];
    size_t n;
    while ((n = qgpu_table_take_if(&g_sim_allocs, owned_by_dying, taken, 256)) > 0) {
        for (size_t i = 0; i < n; i++) release(taken[i].key, taken[i].size, taken[i].tag);
        if (n < 256) break;
    }
    pthread_mutex_unlock(&dying_lock);
    sim_ipc_forget_ctx(ctx);  /* what it opened through IPC handles is closed with it */
    sim_pool_forget_ctx(ctx); /* and the pointers it imported from other processes' pools */
}

/* ---- plain allocations ---- */

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return alloc_in(c, KIND_DEV, size, dptr);
}

SIM_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr a;
    r = alloc_in(c, KIND_V1, size, &a);
    if (!r) *dptr = (CUdeviceptr_v1)a;
    return r;
}

static CUresult pitch_alloc(struct CUctx_st *c, int kind, uint64_t width, uint64_t height,
                            unsigned elem, CUdeviceptr *dptr, uint64_t *pitch) {
    if (!width || !height || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    if (width > UINT64_MAX - 511) return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = (width + 511) & ~(uint64_t)511, bytes;
    if (__builtin_mul_overflow(p, height, &bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = alloc_in(c, kind, bytes, dptr);
    if (!r) *pitch = p;
    return r;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                       size_t height, unsigned int elem) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!dptr || !pitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr d;
    uint64_t p;
    r = pitch_alloc(c, KIND_DEV, width, height, elem, &d, &p);
    if (!r) {
        *dptr = d;
        *pitch = p;
    }
    return r;
}

SIM_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                    unsigned int height, unsigned int elem) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!dptr || !pitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr d;
    uint64_t p;
    r = pitch_alloc(c, KIND_V1, width, height, elem, &d, &p);
    if (!r) {
        *dptr = (CUdeviceptr_v1)d;
        *pitch = (unsigned int)p;
    }
    return r;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    r = alloc_in(c, KIND_MANAGED, size, dptr);
    if (r) return r;
    r = sim_managed_new(*dptr, size, c->gidx); /* populated on its context's GPU */
    if (r) free_kind(*dptr, 0);
    return r;
}

/* cuMemFree frees a graph allocation at once ("immediately upon the freeing call"). */
SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!dptr || sim_pool_import_free(dptr)) return CUDA_SUCCESS;
    int gr = sim_gmem_free(dptr, NULL, NULL, 0);
    return gr >= 0 ? (CUresult)gr : free_kind(dptr, 0);
}

SIM_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!dptr || sim_pool_import_free(dptr)) return CUDA_SUCCESS;
    return free_kind(dptr, 0); /* 32-bit pointers: never a graph allocation */
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
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

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) {
    size_t f = 0, t = 0;
    CUresult r = cuMemGetInfo_v2(free_bytes ? &f : NULL, total ? &t : NULL);
    if (r) return r;
    *free_bytes = f > 0xFFFFFFFFu ? 0xFFFFFFFFu : (unsigned int)f;
    *total = t > 0xFFFFFFFFu ? 0xFFFFFFFFu : (unsigned int)t;
    return CUDA_SUCCESS;
}

/* ---- arrays ---- */

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_ARRAY_FORMAT_UNSIGNED_INT8:
    case CU_ARRAY_FORMAT_SIGNED_INT8: return 1;
    case CU_ARRAY_FORMAT_UNSIGNED_INT16:
    case CU_ARRAY_FORMAT_SIGNED_INT16:
    case CU_ARRAY_FORMAT_HALF: return 2;
    case CU_ARRAY_FORMAT_UNSIGNED_INT32:
    case CU_ARRAY_FORMAT_SIGNED_INT32:
    case CU_ARRAY_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

/* bytes of a w x h x d array (0 dims count as 1); 0 on a bad descriptor, UINT64_MAX on
 * overflow */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned ch) {
    uint64_t fb = format_bytes(f), out;
    if (!w || !fb || (ch != 1 && ch != 2 && ch != 4)) return 0;
    if (__builtin_mul_overflow(w, h ? h : 1, &out) || __builtin_mul_overflow(out, d ? d : 1, &out) ||
        __builtin_mul_overflow(out, fb * ch, &out))
        return UINT64_MAX;
    return out;
}

static CUresult array_create(CUarray *arr, uint64_t bytes) {
    struct CUctx_st *c;
    int g;
    CUresult r = ctx_gidx(&c, &g);
    if (r) return r;
    if (!arr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    if (bytes == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr a;
    r = alloc_in(c, KIND_ARRAY, bytes, &a);
    if (!r) *arr = (CUarray)(uintptr_t)a;
    return r;
}

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(arr, array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(arr, array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(arr, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(arr, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray arr) {
    CUresult r = sim_check_init();
    if (r) return r;
    return free_kind((uint64_t)(uintptr_t)arr, 1) ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

/* A mipmapped array holds every level: each halves the previous one (at least 1). */
SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *out, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned int levels) {
    if (!out || !d || levels == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t w = d->Width, h = d->Height, dep = d->Depth, total = 0;
    for (unsigned l = 0; l < levels; l++) {
        uint64_t b = array_bytes(w, h, dep, d->Format, d->NumChannels);
        if (!b) return CUDA_ERROR_INVALID_VALUE;
        if (b == UINT64_MAX || total > UINT64_MAX - b) return CUDA_ERROR_OUT_OF_MEMORY;
        total += b;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        dep = dep > 1 ? dep / 2 : dep;
    }
    CUarray a;
    CUresult r = array_create(&a, total);
    if (!r) *out = (CUmipmappedArray)(void *)a;
    return r;
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray m) {
    return cuArrayDestroy((CUarray)(void *)m);
}

SIM_EXPORT CUresult cuMipmappedArrayGetLevel(CUarray *level, CUmipmappedArray m, unsigned int l) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!level || qgpu_table_get(&g_sim_allocs, (uint64_t)(uintptr_t)m, NULL, NULL) != 0)
        return CUDA_ERROR_INVALID_HANDLE;
    *level = (CUarray)((char *)(void *)m + l); /* a view: no memory of its own */
    return CUDA_SUCCESS;
}

/* ---- virtual memory management: physical handles live until released and unmapped ---- */

typedef struct {
    uint64_t handle, size;
    int gidx; /* -1: host memory, not charged */
    int released;
    int refs; /* cuMemCreate + cuMemRetainAllocationHandle - cuMemRelease */
    int maps;
    uint32_t types; /* requestedHandleTypes */
    int share;      /* its entry in the GPU's shared table (shared.c), -1: this process's own */
    uint64_t share_id;
} vmm_handle_t;

typedef struct {
    uint64_t va, size, handle;
} vmm_map_t;

typedef struct {
    uint64_t va, size;
} vmm_range_t; /* a VA reservation (cuMemAddressReserve) */

static vmm_handle_t *handles;
static size_t nhandles, cap_handles;
static vmm_map_t *maps;
static size_t nmaps, cap_maps;
static vmm_range_t *ranges;
static size_t nranges, cap_ranges;
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;

static vmm_handle_t *find_handle(uint64_t h) {
    for (size_t i = 0; i < nhandles; i++)
        if (handles[i].handle == h) return &handles[i];
    return NULL;
}

/* locked: a reference or mapping of a shared allocation came or went in this process */
static void share_delta(const vmm_handle_t *h, int delta) {
    if (h->share < 0) return;
    sim_gpu_state_t *st = g_sim_state[h->gidx];
    sim_state_lock(st);
    if (sim_shared_alive(st, h->share, h->share_id)) sim_shared_ref(st, h->share, delta);
    sim_state_unlock(st);
}

/* A shared allocation's memory is not this process's to free: shared.c frees it when no
 * process holds it and no descriptor is open. */
static void drop_if_dead(vmm_handle_t *h) {
    if (h->refs > 0 || h->maps > 0) return;
    if (h->gidx >= 0 && h->share < 0) sim_uncharge(h->gidx, h->size);
    *h = handles[--nhandles];
}

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!handle || !prop || !size || flags || size % GRANULE) return CUDA_ERROR_INVALID_VALUE;
    uint32_t types = (uint32_t)prop->requestedHandleTypes;
    if (types & ~(uint32_t)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_WIN32 |
                            CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC))
        return CUDA_ERROR_INVALID_VALUE;
    /* host memory is not IPC capable (cuda.h); this Linux device exports to POSIX file
     * descriptors only: no Win32 handles, no fabric (its attribute 128 is 0) */
    if (types && prop->location.type == CU_MEM_LOCATION_TYPE_HOST) return CUDA_ERROR_INVALID_VALUE;
    if (types & ~(uint32_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int g = -1;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        r = sim_device_gidx(prop->location.id, &g);
        if (r) return r;
        r = sim_charge(g, size);
        if (r) return r;
    } else if (prop->location.type != CU_MEM_LOCATION_TYPE_HOST) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&vmm_lock);
    if (grow((void **)&handles, &cap_handles, nhandles, sizeof *handles) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        if (g >= 0) sim_uncharge(g, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t h = sim_next_address(size) | 1; /* an opaque handle, not an address */
    handles[nhandles++] = (vmm_handle_t){h, size, g, 0, 1, 0, types, -1, 0};
    pthread_mutex_unlock(&vmm_lock);
    *handle = h;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult r = sim_check_init();
    if (r) return r;
    pthread_mutex_lock(&vmm_lock);
    vmm_handle_t *h = find_handle(handle);
    if (!h || h->refs <= 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    h->refs--;
    share_delta(h, -1);
    drop_if_dead(h); /* still mapped: the memory stays until the last unmap */
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < nmaps; i++) {
        if (a < maps[i].va || a - maps[i].va >= maps[i].size) continue;
        vmm_handle_t *h = find_handle(maps[i].handle);
        if (!h) break;
        h->refs++;
        share_delta(h, 1);
        *handle = h->handle;
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop,
                                                  int option) {
    (void)option;
    if (!gran || !prop) return CUDA_ERROR_INVALID_VALUE;
    *gran = GRANULE;
    return CUDA_SUCCESS;
}

/* The simulated GPU's virtual address space: one reservation may not exceed 64 TiB (real
 * GPUs have 47 to 49 bits of VA). Reservations are remembered: mappings must lie inside
 * one, and only an exact reservation can be freed. */
#define VA_RESERVE_MAX (1ULL << 46)

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags) {
    (void)addr; /* a hint: the simulator picks its own addresses */
    CUresult r = sim_check_init();
    if (r) return r;
    if (!ptr || !size || size % GRANULE || flags || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (size > VA_RESERVE_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&vmm_lock);
    if (grow((void **)&ranges, &cap_ranges, nranges, sizeof *ranges) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t va = sim_next_address(size);
    ranges[nranges++] = (vmm_range_t){va, size};
    pthread_mutex_unlock(&vmm_lock);
    *ptr = va;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!ptr || !size) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < nranges; i++) {
        if (ranges[i].va == ptr && ranges[i].size == size) {
            ranges[i] = ranges[--nranges];
            pthread_mutex_unlock(&vmm_lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_ERROR_INVALID_VALUE; /* not what cuMemAddressReserve returned */
}

/* locked: [va, va + size) lies inside one reservation (size > 0, overflow-safe) */
static int reserved_locked(uint64_t va, uint64_t size) {
    for (size_t i = 0; i < nranges; i++)
        if (va >= ranges[i].va && va - ranges[i].va <= ranges[i].size &&
            size <= ranges[i].size - (va - ranges[i].va))
            return 1;
    return 0;
}

/* As documented: offset must be zero, the range granularity-aligned and inside a reservation,
 * and not mapped already. */
SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!ptr || !size || flags || offset || size % GRANULE || ptr % GRANULE)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    vmm_handle_t *h = find_handle(handle);
    if (!h || h->refs <= 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (size > h->size || !reserved_locked(ptr, size)) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < nmaps; i++) {
        /* overlap of [ptr, ptr + size) and [va, va + msize), without computing an end */
        uint64_t va = maps[i].va, msize = maps[i].size;
        if (ptr >= va ? ptr - va < msize : va - ptr < size) {
            pthread_mutex_unlock(&vmm_lock);
            return CUDA_ERROR_INVALID_VALUE; /* already mapped */
        }
    }
    if (grow((void **)&maps, &cap_maps, nmaps, sizeof *maps) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    maps[nmaps++] = (vmm_map_t){ptr, size, handle};
    h->maps++;
    share_delta(h, 1);
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!ptr || !size) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    int found = 0;
    for (size_t i = 0; i < nmaps;) {
        vmm_map_t m = maps[i];
        if (m.va >= ptr && m.va - ptr < size) {
            maps[i] = maps[--nmaps];
            vmm_handle_t *h = find_handle(m.handle);
            if (h) {
                h->maps--;
                share_delta(h, -1);
                drop_if_dead(h);
            }
            found = 1;
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    if (!ptr || !size || !desc || !count) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* ---- VMM sharing between processes: POSIX file descriptors (shared.c keeps the lifetime) ---- */

/* Exports to a new descriptor. Refused like NVIDIA's driver: a handle type other than a
 * POSIX descriptor is not supported on this device, and a handle created without requesting
 * that type cannot be exported. */
SIM_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
                                                 int type, unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out || flags || type == CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&vmm_lock);
    vmm_handle_t *h = find_handle(handle);
    if (!h || h->refs <= 0 || h->gidx < 0 || !(h->types & (uint32_t)type)) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_gpu_state_t *st = g_sim_state[h->gidx];
    if (h->share < 0) { /* first export: the allocation becomes shared */
        sim_state_lock(st);
        int idx = sim_shared_publish(st, h->size, SIM_SHARE_VMM, h->types, h->refs + h->maps,
                                     &h->share_id);
        sim_state_unlock(st);
        if (idx < 0) {
            pthread_mutex_unlock(&vmm_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        h->share = idx;
    }
    int fd = sim_shared_open_fd(st, h->gidx, h->share, h->share_id);
    pthread_mutex_unlock(&vmm_lock);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}

/* Imports a descriptor another (or this) process exported: a new handle holding the memory,
 * to be released with cuMemRelease like one cuMemCreate made. */
SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                   void *os_handle, int type) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)os_handle, g, idx;
    uint64_t id, token;
    if (sim_shared_read_fd(fd, g_sim_cfg.ngpus, &g, &idx, &id, &token) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_visible_ordinal(g) < 0) return CUDA_ERROR_NOT_SUPPORTED; /* its GPU is not ours */
    pthread_mutex_lock(&vmm_lock);
    if (grow((void **)&handles, &cap_handles, nhandles, sizeof *handles) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_gpu_state_t *st = g_sim_state[g];
    sim_state_lock(st);
    if (!sim_shared_fd_is(st, idx, id, token, fd, SIM_SHARE_VMM)) {
        sim_state_unlock(st);
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_shared_ref(st, idx, 1);
    uint64_t size = st->shared[idx].size;
    uint32_t types = st->shared[idx].handle_types;
    sim_state_unlock(st);
    uint64_t h = sim_next_address(size) | 1;
    handles[nhandles++] = (vmm_handle_t){h, size, g, 0, 1, 0, types, idx, id};
    pthread_mutex_unlock(&vmm_lock);
    *handle = h;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    vmm_handle_t *h = find_handle(handle);
    if (!h || h->refs <= 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = (int)h->types;
    if (h->gidx < 0) {
        prop->location.type = CU_MEM_LOCATION_TYPE_HOST;
    } else {
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = sim_visible_ordinal(h->gidx);
    }
    pthread_mutex_unlock(&vmm_lock);
    return CUDA_SUCCESS;
}

/* ---- which allocation an address lies in ---- */

SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!sim_current_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t b = 0, n = 0;
    int found = qgpu_table_find_range(&g_sim_allocs, dptr, &b, &n) == 0 ||
                sim_pool_range(dptr, &b, &n) == 0 ||
                sim_ipc_range(dptr, &b, &n) == 0 || sim_gmem_range(dptr, &b, &n) == 0;
    if (!found) {
        pthread_mutex_lock(&vmm_lock);
        for (size_t i = 0; i < nmaps && !found; i++) {
            if (dptr < maps[i].va || dptr - maps[i].va >= maps[i].size) continue;
            b = maps[i].va;
            n = maps[i].size;
            found = 1;
        }
        pthread_mutex_unlock(&vmm_lock);
    }
    if (!found) return CUDA_ERROR_NOT_FOUND;
    if (base) *base = b;
    if (size) *size = n;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAddressRange(CUdeviceptr_v1 *base, unsigned int *size,
                                         CUdeviceptr_v1 dptr) {
    CUdeviceptr b;
    size_t n;
    CUresult r = cuMemGetAddressRange_v2(&b, &n, dptr);
    if (r) return r;
    if (base) *base = (CUdeviceptr_v1)b;
    if (size) *size = n > 0xFFFFFFFFu ? 0xFFFFFFFFu : (unsigned int)n;
    return CUDA_SUCCESS;
}

