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
 *    for graphs (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT); cuDeviceGraphMemTrim gives back
 *    what the driver gives back.
 * The charges are settled again at every synchronisation, cuMemGetInfo, trim and destroy. */
#include <stdlib.h>

#include "hook.h"

#define MAX_DEVICES 64

typedef struct {
    CUmemoryPool pool;
    uint64_t charged;
    int exact; /* the driver reports the pool's reserved memory */
} hpool_t;

static hpool_t *pools;
static size_t npools, cap_pools;
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
    pools[npools] = (hpool_t){p, 0, 1};
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
    if (hp->exact && pool_reserved(hp->pool, &r) == 0) settle_to(&hp->charged, r);
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
    for (size_t i = 0; i < npools; i++) settle_pool_locked(&pools[i]);
    for (int d = 0; d < MAX_DEVICES; d++) {
        uint64_t r;
        if (graph_charged[d] && graph_reserved(d, &r) == 0) settle_to(&graph_charged[d], r);
    }
    pthread_mutex_unlock(&pool_lock);
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
    return alloc_stream_ordered((void *)REAL(cuMemAllocAsync), call_async, dptr, size, NULL, s, s);
}

QGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    HOOK_ENTER(cuMemAllocAsync_ptsz, dptr, size, s);
    return alloc_stream_ordered((void *)REAL(cuMemAllocAsync_ptsz), call_async, dptr, size, NULL, s,
                                PTSZ_STREAM(s));
}

QGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                             CUstream s) {
    HOOK_ENTER(cuMemAllocFromPoolAsync, dptr, size, pool, s);
    if (!pool) return REAL(cuMemAllocFromPoolAsync)(dptr, size, pool, s); /* the driver refuses */
    return alloc_stream_ordered((void *)REAL(cuMemAllocFromPoolAsync), call_from_pool, dptr, size,
                                pool, s, s);
}

QGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                                  CUstream s) {
    HOOK_ENTER(cuMemAllocFromPoolAsync_ptsz, dptr, size, pool, s);
    if (!pool) return REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, size, pool, s);
    return alloc_stream_ordered((void *)REAL(cuMemAllocFromPoolAsync_ptsz), call_from_pool, dptr,
                                size, pool, s, PTSZ_STREAM(s));
}

/* A stream-ordered free returns memory to its pool, not to the device: nothing is given
 * back until the pool is seen to hold less. cuMemFreeAsync of a cuMemAlloc'ed pointer frees
 * it (like cuMemFree): that charge is given back. */
QGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    HOOK_ENTER(cuMemFreeAsync, dptr, s);
    CUresult r = REAL(cuMemFreeAsync)(dptr, s);
    if (r == CUDA_SUCCESS) mem_untrack_if_tracked(dptr);
    return r;
}

QGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    HOOK_ENTER(cuMemFreeAsync_ptsz, dptr, s);
    CUresult r = REAL(cuMemFreeAsync_ptsz)(dptr, s);
    if (r == CUDA_SUCCESS) mem_untrack_if_tracked(dptr);
    return r;
}

QGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    HOOK_ENTER(cuMemPoolTrimTo, pool, keep);
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
    cuuint64_t used = UINT64_MAX;
    if (HAVE_REAL(cuMemPoolGetAttribute))
        REAL(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    CUresult r = REAL(cuMemPoolDestroy)(pool);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&pool_lock);
    hpool_t *hp = find_pool(pool, 0);
    if (hp) {
        uint64_t keep = used < hp->charged ? used : hp->charged;
        ledger_release(hp->charged - keep); /* `keep` is never given back */
        *hp = pools[--npools];
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
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

QGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    HOOK_ENTER(cuDeviceGraphMemTrim, dev);
    CUresult r = REAL(cuDeviceGraphMemTrim)(dev);
    if (r == CUDA_SUCCESS && dev >= 0 && dev < MAX_DEVICES) {
        pthread_mutex_lock(&pool_lock);
        uint64_t truth;
        if (graph_reserved(dev, &truth) == 0) settle_to(&graph_charged[dev], truth);
        pthread_mutex_unlock(&pool_lock);
    }
    return r;
}
