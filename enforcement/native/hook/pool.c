/* Memory the driver holds on the process's behalf, charged by what the driver reports it
 * really holds:
 *  - memory pools (cuMemAllocAsync, cuMemAllocFromPoolAsync): a pool keeps the memory it grew
 *    by after cuMemFreeAsync (until its release threshold lets it go at a synchronisation, or
 *    cuMemPoolTrimTo), and a free takes effect only when the stream reaches it. So the charge
 *    for a pool is its reserved memory (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT): an allocation
 *    is charged in full before the call (refused over the cap), then the pool's charge is set
 *    to what the driver says it holds; frees give nothing back until the pool does.
 *  - graph memory (allocation nodes; cuMemAllocAsync while a stream is captured is one): an
 *    upload or launch charges what the executable graph allocates (graph.c) first, refused
 *    over the cap, then the device's graph memory charge is set to what the driver reserves
 *    for graphs (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), which holds every allocation a
 *    launched graph did not free; cuDeviceGraphMemTrim gives back what the driver gives
 *    back. A need that does not fit first has the driver trim (graph_mem_make_room).
 *  - pools shared between processes: a pool exported to a descriptor
 *    (cuMemPoolExportToShareableHandle) keeps its memory in any process the descriptor
 *    reaches, after the exporter destroyed the pool or exited, and through every pool and
 *    pointer imported from it: no charge can follow it, so a slice may not export a pool
 *    (CUDA_ERROR_NOT_PERMITTED), as it may not export VMM memory (vmm.c). A pool imported
 *    from a descriptor made outside the slice (cuMemPoolImportFromShareableHandle) is charged
 *    to the importer what the driver says it reserves, settled like a pool of its own (the
 *    exporter may grow it), over the cap the import is undone; the charge goes when the
 *    imported pool is destroyed and every pointer imported into it (cuMemPoolImportPointer)
 *    is freed (in stream order for cuMemFreeAsync: once an event recorded after the free has
 *    completed).
 * The charges are settled again at every synchronisation, cuMemGetInfo, trim and destroy. */
#include <stdio.h>
#include <stdlib.h>

#include "hook.h"

#define MAX_DEVICES 64

typedef struct {
    CUmemoryPool pool; /* NULL once destroyed (imported, pointers still outstanding) */
    uint64_t charged;
    int exact;         /* the driver reports the pool's reserved memory */
    int imported;      /* from another process's descriptor */
    int ptrs;          /* pointers imported into it and not yet freed */
    uint64_t id;       /* names the record for its imported pointers */
    CUevent last_free; /* destroyed, its last pointer freed in stream order: charged until done */
} hpool_t;

static hpool_t *pools;
static size_t npools, cap_pools;
static uint64_t next_pool_id;
static qgpu_table_t import_ptrs = QGPU_TABLE_INIT; /* imported pointer -> (context, record id) */
static uint64_t graph_charged[MAX_DEVICES];
static int outstanding; /* some pool or graph memory is charged: settle at syncs */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

/* CU_STREAM_PER_THREAD: what a NULL stream means to the _ptsz entry points */
#define PTSZ_STREAM(s) ((s) ? (s) : (CUstream)(uintptr_t)0x2)

static hpool_t *find_pool(CUmemoryPool p, int add) {
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == p) return &pools[i];
    if (!add) return NULL;
    if (npools == cap_pools) {
        size_t nc = cap_pools ? cap_pools * 2 : 16;
        hpool_t *n = realloc(pools, nc * sizeof *n);
        if (!n) return NULL;
        pools = n;
        cap_pools = nc;
    }
    pools[npools] = (hpool_t){.pool = p, .exact = 1, .id = ++next_pool_id};
    return &pools[npools++];
}

static int pool_reserved(CUmemoryPool p, uint64_t *out) {
    cuuint64_t v = 0;
    if (!HAVE_REAL(cuMemPoolGetAttribute) ||
        REAL(cuMemPoolGetAttribute)(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *out = v;
    return 0;
}

/* Set a charge to what the driver reports: more is charged even past the cap (it is already
 * allocated), less is given back. */
static void settle_to(uint64_t *charged, uint64_t truth) {
    if (truth > *charged)
        ledger_force(truth - *charged);
    else if (truth < *charged)
        ledger_release(*charged - truth);
    *charged = truth;
}

static void settle_pool_locked(hpool_t *hp) {
    uint64_t r;
    if (hp->pool && hp->exact && pool_reserved(hp->pool, &r) == 0) settle_to(&hp->charged, r);
}

/* locked: the record goes, and what it charged */
static void drop_pool_locked(hpool_t *hp) {
    ledger_release(hp->charged);
    if (hp->last_free && HAVE_REAL(cuEventDestroy_v2)) REAL(cuEventDestroy_v2)(hp->last_free);
    *hp = pools[--npools];
}

/* locked: a destroyed imported pool whose last pointer's stream-ordered free has completed */
static int free_done_locked(const hpool_t *hp) {
    return !hp->pool && hp->last_free && HAVE_REAL(cuEventQuery) &&
           REAL(cuEventQuery)(hp->last_free) == CUDA_SUCCESS;
}

static int current_device(void) {
    CUdevice d = -1;
    if (!HAVE_REAL(cuCtxGetDevice) || REAL(cuCtxGetDevice)(&d) != CUDA_SUCCESS) return -1;
    return d >= 0 && d < MAX_DEVICES ? d : -1;
}

static int graph_reserved(int dev, uint64_t *out) {
    cuuint64_t v = 0;
    if (dev < 0 || !HAVE_REAL(cuDeviceGetGraphMemAttribute) ||
        REAL(cuDeviceGetGraphMemAttribute)(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &v) !=
            CUDA_SUCCESS)
        return -1;
    *out = v;
    return 0;
}

void pool_settle_all(void) {
    if (!__atomic_load_n(&outstanding, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&pool_lock);
    for (size_t i = 0; i < npools;) {
        if (free_done_locked(&pools[i])) {
            drop_pool_locked(&pools[i]);
            continue;
        }
        settle_pool_locked(&pools[i++]);
    }
    for (int d = 0; d < MAX_DEVICES; d++) {
        uint64_t r;
        if (graph_charged[d] && graph_reserved(d, &r) == 0) settle_to(&graph_charged[d], r);
    }
    pthread_mutex_unlock(&pool_lock);
}

/* What the process's pools reserve now, by the driver's account: module.c takes pools
 * giving memory back during a measured call out of what the call took. */
uint64_t pool_reserved_total(void) {
    uint64_t sum = 0, graph = 0;
    pthread_mutex_lock(&pool_lock);
    for (size_t i = 0; i < npools; i++) {
        uint64_t r;
        if (pools[i].pool && pool_reserved(pools[i].pool, &r) == 0) sum += r;
    }
    pthread_mutex_unlock(&pool_lock);
    /* the device's graph memory is the graphs' own charge (graph.c) too */
    if (graph_reserved(current_device(), &graph) == 0) sum += graph;
    return sum;
}

/* ---- stream-ordered allocations ---- */

static int capturing(CUstream s) {
    int status = 0;
    return HAVE_REAL(cuStreamIsCapturing) && REAL(cuStreamIsCapturing)(s, &status) == CUDA_SUCCESS &&
           status != 0;
}

typedef CUresult (*alloc_call_t)(void *real, CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                 CUstream s);

static CUresult call_async(void *real, CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                           CUstream s) {
    (void)pool;
    return ((CUresult(*)(CUdeviceptr *, size_t, CUstream))real)(dptr, size, s);
}

static CUresult call_from_pool(void *real, CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                               CUstream s) {
    return ((CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))real)(dptr, size, pool, s);
}

static CUresult alloc_stream_ordered(void *real, alloc_call_t call, CUdeviceptr *dptr,
                                     size_t size, CUmemoryPool pool, CUstream s, CUstream eff) {
    /* While a stream is captured, an allocation is an allocation node of the graph being
     * built: it takes memory when that graph runs, and is charged then (graph.c). */
    if (capturing(eff)) return call(real, dptr, size, pool, s);
    if (!pool) {
        int dev = current_device();
        if (dev < 0 || !HAVE_REAL(cuDeviceGetMemPool) ||
            REAL(cuDeviceGetMemPool)(&pool, dev) != CUDA_SUCCESS)
            pool = NULL;
    }
    if (size && ledger_reserve(size) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&pool_lock);
    CUresult r = call(real, dptr, size, pool, s);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_unlock(&pool_lock);
        ledger_release(size);
        return r;
    }
    hpool_t *hp = pool ? find_pool(pool, 1) : NULL;
    uint64_t reserved;
    if (hp && pool_reserved(pool, &reserved) == 0) {
        uint64_t charged = hp->charged + size; /* what is charged for it now */
        settle_to(&charged, reserved);
        hp->charged = charged;
    } else if (hp) {
        hp->exact = 0; /* no way to see what the pool gives back: keep every charge */
        hp->charged += size;
    }
    __atomic_store_n(&outstanding, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&pool_lock);
    return r;
}

QGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) {
    HOOK_ENTER(cuMemAllocAsync, dptr, size, s);
    HOOK_MEM_OP();
    return alloc_stream_ordered((void *)REAL(cuMemAllocAsync), call_async, dptr, size, NULL, s, s);
}

QGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    HOOK_ENTER(cuMemAllocAsync_ptsz, dptr, size, s);
    HOOK_MEM_OP();
    return alloc_stream_ordered((void *)REAL(cuMemAllocAsync_ptsz), call_async, dptr, size, NULL, s,
                                PTSZ_STREAM(s));
}

QGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                             CUstream s) {
    HOOK_ENTER(cuMemAllocFromPoolAsync, dptr, size, pool, s);
    HOOK_MEM_OP();
    if (!pool) return REAL(cuMemAllocFromPoolAsync)(dptr, size, pool, s); /* the driver refuses */
    return alloc_stream_ordered((void *)REAL(cuMemAllocFromPoolAsync), call_from_pool, dptr, size,
                                pool, s, s);
}

QGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                                  CUstream s) {
    HOOK_ENTER(cuMemAllocFromPoolAsync_ptsz, dptr, size, pool, s);
    HOOK_MEM_OP();
    if (!pool) return REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, size, pool, s);
    return alloc_stream_ordered((void *)REAL(cuMemAllocFromPoolAsync_ptsz), call_from_pool, dptr,
                                size, pool, s, PTSZ_STREAM(s));
}

/* A stream-ordered free returns memory to its pool, not to the device: nothing is given
 * back until the pool is seen to hold less. cuMemFreeAsync of a cuMemAlloc'ed pointer frees
 * it (like cuMemFree): that charge is given back. */
QGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    HOOK_ENTER(cuMemFreeAsync, dptr, s);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemFreeAsync)(dptr, s);
    if (r == CUDA_SUCCESS) {
        mem_untrack_if_tracked(dptr);
        pool_forget_import(dptr, 1, s);
    }
    return r;
}

QGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    HOOK_ENTER(cuMemFreeAsync_ptsz, dptr, s);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemFreeAsync_ptsz)(dptr, s);
    if (r == CUDA_SUCCESS) {
        mem_untrack_if_tracked(dptr);
        pool_forget_import(dptr, 1, PTSZ_STREAM(s));
    }
    return r;
}

QGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    HOOK_ENTER(cuMemPoolTrimTo, pool, keep);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemPoolTrimTo)(pool, keep);
    if (r == CUDA_SUCCESS) pool_settle_all();
    return r;
}

/* Pools placed on, or belonging to, a device other than the slice's GPU are refused
 * (CUDA_ERROR_INVALID_DEVICE): allocating from one would take that GPU's memory. */
QGPU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    HOOK_ENTER(cuMemPoolCreate, pool, props);
    if (props && hook_foreign_location(&props->location)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuMemPoolCreate)(pool, props);
}

#define DEVICE_POOL(name)                                                                    \
    QGPU_EXPORT CUresult name(CUmemoryPool *pool, CUdevice dev) {                            \
        HOOK_ENTER(name, pool, dev);                                                         \
        if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;                      \
        return REAL(name)(pool, dev);                                                        \
    }
DEVICE_POOL(cuDeviceGetMemPool)
DEVICE_POOL(cuDeviceGetDefaultMemPool)

QGPU_EXPORT CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *loc, int type) {
    HOOK_ENTER(cuMemGetMemPool, pool, loc, type);
    if (hook_foreign_location(loc)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuMemGetMemPool)(pool, loc, type);
}

QGPU_EXPORT CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *loc,
                                            int type) {
    HOOK_ENTER(cuMemGetDefaultMemPool, pool, loc, type);
    if (hook_foreign_location(loc)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuMemGetDefaultMemPool)(pool, loc, type);
}

/* A destroyed pool frees what is unused now and the rest when its last allocation is freed,
 * which the hook cannot see: what is still in use stays charged until the process exits. */
QGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    HOOK_ENTER(cuMemPoolDestroy, pool);
    HOOK_MEM_OP();
    cuuint64_t used = UINT64_MAX;
    if (HAVE_REAL(cuMemPoolGetAttribute))
        REAL(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    CUresult r = REAL(cuMemPoolDestroy)(pool);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&pool_lock);
    hpool_t *hp = find_pool(pool, 0);
    if (hp && hp->imported && hp->ptrs > 0) { /* its pointers keep the shared memory */
        hp->pool = NULL;
    } else if (hp && hp->imported) {
        drop_pool_locked(hp);
    } else if (hp) {
        uint64_t keep = used < hp->charged ? used : hp->charged;
        ledger_release(hp->charged - keep); /* `keep` is never given back */
        *hp = pools[--npools];
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

/* ---- pools shared between processes ---- */

QGPU_EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool pool, int type,
                                                      unsigned long long flags) {
    HOOK_ENTER(cuMemPoolExportToShareableHandle, out, pool, type, flags);
    static int told;
    if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "qgpu: cuMemPoolExportToShareableHandle refused in slice %s "
                "(CUDA_ERROR_NOT_PERMITTED): an exported pool's descriptor keeps the pool's "
                "memory alive in any process it reaches, beyond what the slice's cap can "
                "follow\n", g_lim.slice_id);
    return CUDA_ERROR_NOT_PERMITTED;
}

QGPU_EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle, int type,
                                                        unsigned long long flags) {
    HOOK_ENTER(cuMemPoolImportFromShareableHandle, out, handle, type, flags);
    HOOK_MEM_OP(); /* the shared pool's memory may become this process's (NVML) */
    CUresult r = REAL(cuMemPoolImportFromShareableHandle)(out, handle, type, flags);
    if (r != CUDA_SUCCESS || !out) return r;
    uint64_t reserved = 0;
    if (pool_reserved(*out, &reserved) != 0) r = CUDA_ERROR_NOT_SUPPORTED; /* cannot tell: refuse */
    else if (reserved && ledger_reserve(reserved) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        pthread_mutex_lock(&pool_lock);
        size_t before = npools;
        hpool_t *hp = find_pool(*out, 1);
        if (hp && npools > before) { /* a new record: it holds the charge */
            hp->charged = reserved;
            hp->imported = 1;
            __atomic_store_n(&outstanding, 1, __ATOMIC_RELEASE);
        } else {
            ledger_release(reserved); /* charged already, or no room to follow it */
            if (!hp) r = CUDA_ERROR_OUT_OF_MEMORY;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    if (r != CUDA_SUCCESS && HAVE_REAL(cuMemPoolDestroy)) REAL(cuMemPoolDestroy)(*out);
    return r; /* refused: nothing is kept */
}

QGPU_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool pool,
                                            CUmemPoolPtrExportData *data) {
    HOOK_ENTER(cuMemPoolImportPointer, out, pool, data);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemPoolImportPointer)(out, pool, data);
    if (r != CUDA_SUCCESS || !out) return r;
    pthread_mutex_lock(&pool_lock);
    hpool_t *hp = find_pool(pool, 0);
    if (hp && hp->imported &&
        qgpu_table_put(&import_ptrs, *out, (uintptr_t)mem_current_ctx(), (int64_t)hp->id) == 0)
        hp->ptrs++; /* the pool's charge stays while it is outstanding */
    pthread_mutex_unlock(&pool_lock);
    return r;
}

/* locked: the record `id` names */
static hpool_t *find_id(uint64_t id) {
    for (size_t i = 0; i < npools; i++)
        if (pools[i].id == id) return &pools[i];
    return NULL;
}

/* locked: an event recorded on `s` now, or NULL */
static CUevent event_after(CUstream s) {
    CUevent e = NULL;
    if (!HAVE_REAL(cuEventCreate) || !HAVE_REAL(cuEventRecord) || !HAVE_REAL(cuEventDestroy_v2) ||
        REAL(cuEventCreate)(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
        return NULL;
    if (REAL(cuEventRecord)(e, s) == CUDA_SUCCESS) return e;
    REAL(cuEventDestroy_v2)(e);
    return NULL;
}

/* locked: an imported pointer of record `id` is gone (async: its free is on stream s) */
static void import_gone_locked(uint64_t id, int async, CUstream s) {
    hpool_t *hp = find_id(id);
    if (!hp || hp->ptrs <= 0 || --hp->ptrs > 0 || hp->pool) return; /* the pool keeps it */
    if (!async) {
        drop_pool_locked(hp);
        return;
    }
    hp->last_free = event_after(s); /* given back at a settle once it has completed */
    if (!hp->last_free) hp->ptrs = 1; /* no way to see it complete: charged until exit */
}

void pool_forget_import(CUdeviceptr ptr, int async, CUstream s) {
    int64_t id;
    if (qgpu_table_take(&import_ptrs, ptr, NULL, &id) != 0) return;
    pthread_mutex_lock(&pool_lock);
    import_gone_locked((uint64_t)id, async, s);
    pthread_mutex_unlock(&pool_lock);
}

static uintptr_t dying_ctx;
static int of_dying_ctx(uint64_t key, uint64_t size, int64_t tag) {
    (void)key;
    (void)tag;
    return (uintptr_t)size == dying_ctx;
}

void pool_forget_ctx(CUcontext ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&pool_lock);
    dying_ctx = (uintptr_t)ctx;
    qgpu_entry_t taken[64];
    size_t n;
    do {
        n = qgpu_table_take_if(&import_ptrs, of_dying_ctx, taken, 64);
        for (size_t i = 0; i < n; i++) import_gone_locked((uint64_t)taken[i].tag, 0, NULL);
    } while (n == 64);
    pthread_mutex_unlock(&pool_lock);
}

#define SYNC_WRAPPER(name, params, args)                                                     \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, args);                                                              \
        CUresult r = REAL(name)(args);                                                       \
        if (r == CUDA_SUCCESS) pool_settle_all();                                            \
        return r;                                                                            \
    }
#define ARGS(...) __VA_ARGS__
SYNC_WRAPPER(cuStreamSynchronize, (CUstream s), ARGS(s))
SYNC_WRAPPER(cuStreamSynchronize_ptsz, (CUstream s), ARGS(s))
SYNC_WRAPPER(cuEventSynchronize, (CUevent e), ARGS(e))
SYNC_WRAPPER(cuCtxSynchronize_v2, (CUcontext c), ARGS(c))

QGPU_EXPORT CUresult cuCtxSynchronize(void) {
    hook_load_cuda();
    if (!HAVE_REAL(cuCtxSynchronize)) return CUDA_ERROR_NOT_FOUND;
    int hs = hook_state();
    if (hs == HOOK_ERROR) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuCtxSynchronize)();
    if (r == CUDA_SUCCESS && hs == HOOK_ACTIVE) pool_settle_all();
    return r;
}

/* ---- graph memory ---- */

/* After an upload or launch charged `need`: the device's graph memory charge is what the
 * driver reserves for graphs. */
void graph_mem_after(CUresult r, uint64_t need) {
    if (r != CUDA_SUCCESS) {
        ledger_release(need);
        return;
    }
    int dev = current_device();
    pthread_mutex_lock(&pool_lock);
    if (dev >= 0) {
        uint64_t charged = graph_charged[dev] + need, truth;
        if (graph_reserved(dev, &truth) == 0) settle_to(&charged, truth);
        graph_charged[dev] = charged;
        if (charged) __atomic_store_n(&outstanding, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pool_lock);
}

int graph_mem_make_room(CUstream s, int wait) {
    int dev = current_device();
    if (dev < 0 || !HAVE_REAL(cuDeviceGraphMemTrim)) return 0;
    pthread_mutex_lock(&pool_lock);
    uint64_t before = graph_charged[dev];
    pthread_mutex_unlock(&pool_lock);
    if (!before) return 0;
    if (wait && (capturing(s) || !HAVE_REAL(cuStreamSynchronize) ||
                 REAL(cuStreamSynchronize)(s) != CUDA_SUCCESS))
        return 0;
    if (REAL(cuDeviceGraphMemTrim)(dev) != CUDA_SUCCESS) return 0;
    pthread_mutex_lock(&pool_lock);
    uint64_t truth;
    if (graph_reserved(dev, &truth) == 0) settle_to(&graph_charged[dev], truth);
    int fell = graph_charged[dev] < before;
    pthread_mutex_unlock(&pool_lock);
    return fell;
}

QGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    HOOK_ENTER(cuDeviceGraphMemTrim, dev);
    HOOK_MEM_OP();
    CUresult r = REAL(cuDeviceGraphMemTrim)(dev);
    if (r == CUDA_SUCCESS && dev >= 0 && dev < MAX_DEVICES) {
        pthread_mutex_lock(&pool_lock);
        uint64_t truth;
        if (graph_reserved(dev, &truth) == 0) settle_to(&graph_charged[dev], truth);
        pthread_mutex_unlock(&pool_lock);
    }
    return r;
}
