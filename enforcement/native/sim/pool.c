/* Memory pools of the simulated driver and the stream-ordered allocator, with the lifetimes
 * NVIDIA's driver gives them (cuda.h), and pools shared between processes.
 *  - A pool keeps the physical memory it grew by (its "reserved" memory) after cuMemFreeAsync,
 *    which takes effect when the stream reaches it; at a synchronisation the pool gives back
 *    what it holds above its release threshold (default 0), and cuMemPoolTrimTo gives back on
 *    demand. cuMemPoolDestroy gives back what is unused; memory still allocated from it stays.
 *  - A pool created with CUmemPoolProps.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
 *    can be exported to a descriptor (cuMemPoolExportToShareableHandle). Its memory then
 *    becomes an entry of the GPU's shared table (shared.c) that follows the pool's reserved
 *    memory while the exporter has the pool, and stays while the exporter's pool, a
 *    descriptor (passed, kept or inherited, in any process), a pool imported from one
 *    (cuMemPoolImportFromShareableHandle) or a pointer imported into one
 *    (cuMemPoolImportPointer, of an allocation cuMemPoolExportPointer named) exists, whoever
 *    made it and whether that process lives. cuda.h does not say what a pool's descriptor
 *    keeps: the simulator keeps what a memory cap must expect (the pool's memory), and while
 *    another process holds the pool or a pointer into it, the exporter's trims give nothing
 *    back ("no more memory that the allocator can safely release").
 *  - Refused like the driver: export of a pool made without that handle type, other handle
 *    types (no Win32, no fabric on these devices), allocating from an imported pool or making
 *    it a device's current pool ("Imported memory pools do not support creating new
 *    allocations"), importing a pointer into a pool it did not come from. An imported pointer
 *    is freed with cuMemFree or cuMemFreeAsync (in stream order), and closes with its context.
 */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define GRANULE (2ULL << 20)
#define PTR_MAGIC 0x3150544d50475151ULL /* "QQGPMTP1": a CUmemPoolPtrExportData of ours */

static uint64_t round_up(uint64_t size) {
    if (size > UINT64_MAX - (GRANULE - 1)) return 0;
    return (size + GRANULE - 1) & ~(GRANULE - 1);
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

/* ---- pools ---- */

#define MAX_POOLS 256
static struct CUmemPoolHandle_st *pools[MAX_POOLS];
static int npools;
static struct CUmemPoolHandle_st *default_pool[SIM_MAX_GPUS], *current_pool[SIM_MAX_GPUS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static qgpu_table_t pool_allocs = QGPU_TABLE_INIT; /* ptr -> (size, pool) */

typedef struct {
    sim_marker_t m;
    struct CUmemPoolHandle_st *pool;
    uint64_t size;
    int import_gidx, import_idx; /* a pointer imported from another process's pool: let go */
    uint64_t import_id;          /* (0: a pool allocation of this process) */
} pending_free_t;

/* pointers imported into this process (cuMemPoolImportPointer) */
typedef struct {
    uint64_t ptr, size, id;
    int gidx, idx;
    struct CUctx_st *ctx;
    struct CUmemPoolHandle_st *pool;
} pool_import_t;
static pool_import_t *imports;
static size_t nimports, cap_imports;
static pending_free_t *pending;
static size_t npending, cap_pending;

static struct CUmemPoolHandle_st *new_pool(int gidx, int is_default) {
    if (npools >= MAX_POOLS) return NULL;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->magic = POOL_MAGIC;
    p->gidx = gidx;
    p->is_default = is_default;
    p->share = -1;
    pools[npools++] = p;
    return p;
}

static int valid_pool(CUmemoryPool p) {
    for (int i = 0; i < npools; i++)
        if (pools[i] == p) return p->magic == POOL_MAGIC;
    return 0;
}

/* a reference to a shared entry goes (the entry frees itself when it was the last) */
static void let_go(int gidx, int idx, uint64_t id) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    if (sim_shared_alive(st, idx, id)) sim_shared_ref(st, idx, -1);
    sim_state_unlock(st);
}

/* locked: the free of `size` bytes of pool p took effect */
static void freed_locked(const pending_free_t *f) {
    struct CUmemPoolHandle_st *p = f->pool;
    p->used = p->used >= f->size ? p->used - f->size : 0;
    if (f->import_id) let_go(f->import_gidx, f->import_idx, f->import_id);
}

/* locked: frees whose stream position has been reached go back to their pool */
static void reap_locked(void) {
    for (size_t i = 0; i < npending;) {
        if (sim_marker_poll(&pending[i].m)) {
            freed_locked(&pending[i]);
            pending[i] = pending[--npending];
            continue;
        }
        i++;
    }
}

/* locked: pool p (of this process) holds `delta` bytes more or less of its GPU's memory: its
 * own charge, or its shared entry's once exported */
static CUresult resize_locked(struct CUmemPoolHandle_st *p, int64_t delta) {
    if (p->share < 0) {
        if (delta > 0) return sim_charge(p->gidx, (uint64_t)delta);
        sim_uncharge(p->gidx, (uint64_t)-delta);
        return CUDA_SUCCESS;
    }
    sim_gpu_state_t *st = g_sim_state[p->gidx];
    sim_state_lock(st);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    /* while another process holds the pool or a pointer into it, nothing is safe to release */
    if (sim_shared_alive(st, p->share, p->share_id) &&
        (delta > 0 || !sim_shared_held_elsewhere(st, p->share)))
        r = sim_shared_resize(st, p->share, delta);
    sim_state_unlock(st);
    return r;
}

/* locked: give back what the pool holds above max(used, keep) */
static void trim_locked(struct CUmemPoolHandle_st *p, uint64_t keep) {
    if (p->imported) return; /* the exporter's memory: not the importer's to release */
    uint64_t floor = p->used > keep ? p->used : keep;
    if (p->reserved <= floor) return;
    uint64_t give = (p->reserved - floor) & ~(GRANULE - 1);
    if (give && resize_locked(p, -(int64_t)give) == CUDA_SUCCESS) p->reserved -= give;
}

void sim_pools_on_sync(struct CUctx_st *ctx) {
    pthread_mutex_lock(&pool_lock);
    reap_locked();
    for (int i = 0; i < npools; i++)
        if (pools[i]->magic == POOL_MAGIC && (!ctx || pools[i]->gidx == ctx->gidx))
            trim_locked(pools[i], pools[i]->threshold);
    pthread_mutex_unlock(&pool_lock);
}

static struct CUmemPoolHandle_st *device_pool_locked(int gidx, int current) {
    if (!default_pool[gidx]) default_pool[gidx] = new_pool(gidx, 1);
    if (current && current_pool[gidx]) return current_pool[gidx];
    return default_pool[gidx];
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    *pool = device_pool_locked(g, 0);
    pthread_mutex_unlock(&pool_lock);
    return *pool ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    *pool = device_pool_locked(g, 1);
    pthread_mutex_unlock(&pool_lock);
    return *pool ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* CUDA 13: the pools of a memory location (pinned device memory; the host's pools are not
 * simulated). */
#define SIM_ALLOC_TYPE_PINNED 1
static CUresult location_pool(CUmemoryPool *pool, const CUmemLocation *loc, int type, int current) {
    if (!pool || !loc || type != SIM_ALLOC_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    return current ? cuDeviceGetMemPool(pool, loc->id) : cuDeviceGetDefaultMemPool(pool, loc->id);
}

SIM_EXPORT CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *loc, int type) {
    return location_pool(pool, loc, type, 1);
}

SIM_EXPORT CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *loc, int type) {
    return location_pool(pool, loc, type, 0);
}

SIM_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool) || pool->gidx != g || pool->imported) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    current_pool[g] = pool;
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    uint32_t types = (uint32_t)props->handleTypes;
    if (types & ~(uint32_t)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_WIN32 |
                            CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC))
        return CUDA_ERROR_INVALID_VALUE;
    if (types & ~(uint32_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED; /* Linux, no fabric: POSIX descriptors only */
    int g;
    r = sim_device_gidx(props->location.id, &g);
    if (r) return r;
    pthread_mutex_lock(&pool_lock);
    struct CUmemPoolHandle_st *p = new_pool(g, 0);
    if (p) {
        p->max_size = props->maxSize;
        p->handle_types = types;
    }
    pthread_mutex_unlock(&pool_lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool) || pool->is_default) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    reap_locked();
    /* memory still allocated from it is given back when freed; the rest now */
    trim_locked(pool, pool->used);
    for (int g = 0; g < SIM_MAX_GPUS; g++)
        if (current_pool[g] == pool) current_pool[g] = NULL;
    /* shared: this process's hold on the pool's memory goes; descriptors, importers and
     * imported pointers keep it */
    if (pool->share >= 0) let_go(pool->gidx, pool->share, pool->share_id);
    pool->magic = 0; /* kept allocated: outstanding frees may still name it */
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool)) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    reap_locked();
    trim_locked(pool, keep);
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult r = CUDA_SUCCESS;
    if (!valid_pool(pool)) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        pool->threshold = *(cuuint64_t *)value;
    } else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) {
        if (*(cuuint64_t *)value != 0) r = CUDA_ERROR_INVALID_VALUE; /* can only be reset */
        else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) pool->reserved_high = pool->reserved;
        else pool->used_high = pool->used;
    } else if (attr < 1 || attr > 3) {
        r = CUDA_ERROR_INVALID_VALUE; /* the reuse flags (1..3) are accepted and ignored */
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

/* locked: what a pool reserves; an imported pool's is the shared pool's memory */
static uint64_t reserved_locked(struct CUmemPoolHandle_st *p) {
    if (!p->imported) return p->reserved;
    sim_gpu_state_t *st = g_sim_state[p->gidx];
    sim_state_lock(st);
    uint64_t n = sim_shared_alive(st, p->share, p->share_id) ? st->shared[p->share].size : 0;
    sim_state_unlock(st);
    if (n > p->reserved_high) p->reserved_high = n;
    return n;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool)) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    reap_locked();
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = pool->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = reserved_locked(pool); break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = pool->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = pool->used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = pool->used_high; break;
    case 1: case 2: case 3: *(int *)value = 1; break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

static CUresult pool_alloc(struct CUmemPoolHandle_st *p, uint64_t size, CUdeviceptr *out) {
    if (!size) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    reap_locked();
    uint64_t spare = p->reserved - p->used;
    if (spare < size) {
        uint64_t grow_by = round_up(size - spare);
        if (!grow_by || (p->max_size && grow_by > p->max_size - p->reserved)) {
            pthread_mutex_unlock(&pool_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        CUresult r = resize_locked(p, (int64_t)grow_by);
        if (r) {
            pthread_mutex_unlock(&pool_lock);
            return r;
        }
        p->reserved += grow_by;
        if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    }
    p->used += size;
    if (p->used > p->used_high) p->used_high = p->used;
    uint64_t a = sim_next_address(size);
    qgpu_table_put(&pool_allocs, a, size, (int64_t)(uintptr_t)p);
    pthread_mutex_unlock(&pool_lock);
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, struct CUmemPoolHandle_st *pool,
                            CUstream stream) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_stream_ctx(stream);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || !size) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = sim_real_stream(stream);
    if (s && s->capture) /* an allocation node of the graph, on the pool's device */
        return sim_graph_capture_alloc(s->capture, pool ? pool->gidx : c->gidx, size, dptr);
    if (!pool) {
        pthread_mutex_lock(&pool_lock);
        pool = device_pool_locked(c->gidx, 1);
        pthread_mutex_unlock(&pool_lock);
        if (!pool) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return pool_alloc(pool, size, dptr);
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
    return alloc_async(dptr, size, NULL, stream);
}

SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream stream) {
    return alloc_async(dptr, size, NULL, stream ? stream : (CUstream)(uintptr_t)2);
}

static CUresult from_pool(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
    pthread_mutex_lock(&pool_lock);
    int ok = valid_pool(pool) && !pool->imported; /* imported pools make no allocations */
    pthread_mutex_unlock(&pool_lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, size, pool, stream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                            CUstream stream) {
    return from_pool(dptr, size, pool, stream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                                 CUstream stream) {
    return from_pool(dptr, size, pool, stream ? stream : (CUstream)(uintptr_t)2);
}

/* locked: takes the imported pointer `ptr` out of the table into a pending free; 0 if none */
static int take_import_locked(uint64_t ptr, pending_free_t *f) {
    for (size_t i = 0; i < nimports; i++) {
        if (imports[i].ptr != ptr) continue;
        f->pool = imports[i].pool;
        f->size = imports[i].size;
        f->import_gidx = imports[i].gidx;
        f->import_idx = imports[i].idx;
        f->import_id = imports[i].id;
        imports[i] = imports[--nimports];
        return 1;
    }
    return 0;
}

static CUresult free_async(CUdeviceptr dptr, CUstream stream) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_stream_ctx(stream);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(stream);
    if (s && s->capture) return sim_graph_capture_free(s->capture, dptr); /* a free node */
    uint64_t size;
    int64_t tag;
    pending_free_t f = {0};
    pthread_mutex_lock(&pool_lock);
    int found = qgpu_table_take(&pool_allocs, dptr, &size, &tag) == 0;
    if (found) {
        f.pool = (struct CUmemPoolHandle_st *)(uintptr_t)tag;
        f.size = size;
    } else {
        found = take_import_locked(dptr, &f);
    }
    pthread_mutex_unlock(&pool_lock);
    if (!found) { /* a graph allocation (in stream order), or cuMemAlloc'ed memory (at once) */
        int gr = sim_gmem_free(dptr, c, s, 1);
        if (gr >= 0) return (CUresult)gr;
        return sim_free_plain(dptr) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    }
    sim_marker_record(c, s, &f.m); /* takes effect when the stream reaches this point */
    pthread_mutex_lock(&pool_lock);
    if (grow((void **)&pending, &cap_pending, npending, sizeof *pending) != 0) {
        sim_marker_wait(&f.m); /* no room to remember it: wait for it */
        freed_locked(&f);
    } else {
        pending[npending++] = f;
    }
    pthread_mutex_unlock(&pool_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) { return free_async(dptr, stream); }

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    return free_async(dptr, stream ? stream : (CUstream)(uintptr_t)2);
}


/* ---- pools shared between processes ---- */

typedef struct {
    uint64_t magic;
    uint32_t gidx, idx;
    uint64_t id, token, ptr, size;
} ptr_blob_t;
_Static_assert(sizeof(ptr_blob_t) <= sizeof(CUmemPoolPtrExportData), "fits the export data");

int sim_pool_range(uint64_t addr, uint64_t *base, uint64_t *size) {
    if (qgpu_table_find_range(&pool_allocs, addr, base, size) == 0) return 0;
    int r = -1;
    pthread_mutex_lock(&pool_lock);
    for (size_t i = 0; i < nimports && r; i++) {
        if (addr < imports[i].ptr || addr - imports[i].ptr >= imports[i].size) continue;
        *base = imports[i].ptr;
        *size = imports[i].size;
        r = 0;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

int sim_pool_import_free(uint64_t ptr) {
    pending_free_t f = {0};
    pthread_mutex_lock(&pool_lock);
    int found = take_import_locked(ptr, &f);
    if (found) freed_locked(&f);
    pthread_mutex_unlock(&pool_lock);
    return found;
}

void sim_pool_forget_ctx(struct CUctx_st *ctx) {
    pthread_mutex_lock(&pool_lock);
    for (size_t i = 0; i < nimports;) {
        pending_free_t f = {0};
        if (imports[i].ctx == ctx && take_import_locked(imports[i].ptr, &f)) {
            freed_locked(&f);
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&pool_lock);
}

/* Exports a pool made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR to a new descriptor; on
 * the first export its memory becomes a shared entry (charged to this process, which holds
 * it). */
SIM_EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool pool, int type,
                                                     unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out || flags || type == CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool) || pool->imported || !(pool->handle_types & (uint32_t)type)) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE; /* not an IPC-capable pool of this process */
    }
    sim_gpu_state_t *st = g_sim_state[pool->gidx];
    if (pool->share < 0) {
        sim_state_lock(st);
        int idx = sim_shared_publish(st, pool->reserved, SIM_SHARE_POOL, pool->handle_types, 1,
                                     &pool->share_id);
        sim_state_unlock(st);
        if (idx < 0) {
            pthread_mutex_unlock(&pool_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        pool->share = idx;
    }
    int fd = sim_shared_open_fd(st, pool->gidx, pool->share, pool->share_id);
    pthread_mutex_unlock(&pool_lock);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}

/* A pool another (or this) process exported: it holds the pool's memory until destroyed. */
SIM_EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle, int type,
                                                       unsigned long long flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out || flags || type == CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)handle, g, idx;
    uint64_t id, token;
    if (sim_shared_read_fd(fd, g_sim_cfg.ngpus, &g, &idx, &id, &token) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_visible_ordinal(g) < 0) return CUDA_ERROR_NOT_SUPPORTED; /* its GPU is not ours */
    pthread_mutex_lock(&pool_lock);
    struct CUmemPoolHandle_st *p = new_pool(g, 0);
    sim_gpu_state_t *st = g_sim_state[g];
    sim_state_lock(st);
    if (p && sim_shared_fd_is(st, idx, id, token, fd, SIM_SHARE_POOL)) {
        sim_shared_ref(st, idx, 1);
        p->imported = 1;
        p->handle_types = st->shared[idx].handle_types;
        p->share = idx;
        p->share_id = id;
    } else if (!p) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else { /* not a pool's descriptor: the pool made for it goes */
        r = CUDA_ERROR_INVALID_VALUE;
        pools[--npools] = NULL;
        free(p);
    }
    sim_state_unlock(st);
    pthread_mutex_unlock(&pool_lock);
    if (!r) *out = p;
    return r;
}

/* Names an allocation of an exported pool for cuMemPoolImportPointer in another process. */
SIM_EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    uint64_t size;
    int64_t tag;
    pthread_mutex_lock(&pool_lock);
    struct CUmemPoolHandle_st *p = qgpu_table_get(&pool_allocs, ptr, &size, &tag) == 0
                                       ? (struct CUmemPoolHandle_st *)(uintptr_t)tag
                                       : NULL;
    if (!p || p->share < 0) { /* not the base of an allocation from a shared pool */
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    ptr_blob_t b = {PTR_MAGIC, (uint32_t)p->gidx, (uint32_t)p->share, p->share_id, 0, ptr, size};
    sim_gpu_state_t *st = g_sim_state[p->gidx];
    sim_state_lock(st);
    if (sim_shared_alive(st, p->share, p->share_id)) b.token = st->shared[p->share].token;
    else r = CUDA_ERROR_INVALID_VALUE;
    sim_state_unlock(st);
    pthread_mutex_unlock(&pool_lock);
    if (r) return r;
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, &b, sizeof b);
    return CUDA_SUCCESS;
}

/* Maps an allocation of the exporter's pool into this process, through the pool imported
 * from it; the mapping holds the pool's memory until freed. */
SIM_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool pool,
                                           CUmemPoolPtrExportData *data) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *ctx = sim_current_ctx();
    if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!out || !data) return CUDA_ERROR_INVALID_VALUE;
    ptr_blob_t b;
    memcpy(&b, data->reserved, sizeof b);
    pthread_mutex_lock(&pool_lock);
    if (!valid_pool(pool) || !pool->imported || b.magic != PTR_MAGIC || b.gidx != (uint32_t)pool->gidx ||
        b.idx != (uint32_t)pool->share || b.id != pool->share_id || !b.size ||
        grow((void **)&imports, &cap_imports, nimports, sizeof *imports) != 0) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE; /* not from the pool this one was imported from */
    }
    sim_gpu_state_t *st = g_sim_state[pool->gidx];
    sim_state_lock(st);
    int ok = sim_shared_alive(st, pool->share, pool->share_id) &&
             st->shared[pool->share].token == b.token;
    if (ok) sim_shared_ref(st, pool->share, 1);
    sim_state_unlock(st);
    if (!ok) {
        pthread_mutex_unlock(&pool_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t a = sim_next_address(b.size);
    imports[nimports++] = (pool_import_t){a, b.size, pool->share_id, pool->gidx, pool->share, ctx, pool};
    pool->used += b.size;
    if (pool->used > pool->used_high) pool->used_high = pool->used;
    pthread_mutex_unlock(&pool_lock);
    *out = a;
    return CUDA_SUCCESS;
}
