/* Managed memory of the simulated driver (cuMemAllocManaged): where its pages live, and how
 * the calls NVIDIA documents for Unified Memory (cuda.h) move them. Owns the residency of
 * every managed allocation of this process, cuMemPrefetchAsync (all four ABI forms),
 * cuMemPrefetchBatchAsync, cuMemDiscardBatchAsync, cuMemDiscardAndPrefetchBatchAsync (and
 * their _ptsz forms), cuMemAdvise (v1 and v2) and cuMemRangeGetAttribute(s).
 *
 * The model, per 2 MiB block (the Unified Memory driver's large-page granularity; a range is
 * widened to whole blocks, as cuda.h widens it to whole pages):
 *  - a block lives on one GPU or on the host; on a GPU it counts in that GPU's used memory,
 *    charged to this process there (what the tests' ground truth reads; NVML's per-process
 *    lists leave it out, sim_proc_t.managed_bytes, as NVIDIA's do). The driver's other
 *    allocations evict blocks to the host when the GPU is full (sim_state_make_room); this
 *    process moves their record there when it next takes its lock (notice_evictions). A new
 *    allocation is populated on its context's GPU at once (cuda.h allows population on
 *    access; populating at once is what a memory cap must expect);
 *  - a prefetch moves a block to its destination GPU or to the host; a block whose
 *    destination GPU has no room stays where it is (the real driver may evict other managed
 *    memory to make room, which the simulator does not model); with SET_READ_MOSTLY a
 *    prefetch to a GPU adds a read-only copy there instead, which also takes that GPU's
 *    memory until UNSET_READ_MOSTLY collapses the copies or the allocation is freed;
 *  - advice records policy and moves nothing ("does not cause data to migrate"): the
 *    preferred location and the GPUs that access the range by mapping (SET_ACCESSED_BY);
 *  - a kernel launched on a GPU may touch any managed memory of its process (the simulator
 *    cannot see which), so at each launch a block elsewhere is handled as cuda.h says a fault
 *    is: it stays where it is if that is its preferred location or the launching GPU has
 *    SET_ACCESSED_BY on it (the GPU maps it there), a read-mostly block gets a copy on the
 *    launching GPU, and any other block migrates to the launching GPU.
 * The device attribute CONCURRENT_MANAGED_ACCESS is 1 on every simulated GPU (compute
 * capability 6.0 and later on Linux), which prefetches and advice to a GPU require. */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define BLOCK (2ULL << 20)
#define LOC_HOST (-1)
#define NO_TYPE 0 /* no preferred location / never prefetched */
#define CU_STREAM_LEGACY_HANDLE ((CUstream)(uintptr_t)0x1)
#define CU_STREAM_PER_THREAD_HANDLE ((CUstream)(uintptr_t)0x2)

typedef struct {
    int16_t loc;          /* where the block's writable copy is: a GPU index or LOC_HOST */
    int16_t pref_gidx;    /* the preferred GPU, when pref_type is DEVICE */
    int16_t fetched_gidx; /* the last explicit prefetch's GPU, when fetched_type is DEVICE */
    uint8_t pref_type;    /* CU_MEM_LOCATION_TYPE_* of the preferred location, NO_TYPE: none */
    uint8_t fetched_type; /* CU_MEM_LOCATION_TYPE_* of the last prefetch, NO_TYPE: never */
    uint8_t read_mostly;
    uint8_t host_by;      /* SET_ACCESSED_BY the host */
    uint64_t copies;      /* GPUs with a read-only copy besides loc (bit = GPU index) */
    uint64_t by;          /* GPUs with SET_ACCESSED_BY (bit = GPU index) */
} block_t;

typedef struct {
    uint64_t base, size;
    size_t nblocks;
    block_t *blocks;
} managed_t;

static managed_t *ranges;
static size_t nranges, cap_ranges;
static int live; /* nranges, read without the lock by launches */
static pthread_mutex_t managed_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t bit(int gidx) { return 1ULL << (unsigned)gidx; }

static uint64_t block_bytes(const managed_t *m, size_t i) {
    uint64_t start = (uint64_t)i * BLOCK;
    return m->size - start < BLOCK ? m->size - start : BLOCK;
}

/* ---- where a block lives ---- */

static int take(int gidx, uint64_t bytes) {
    return gidx < 0 || sim_charge_managed(gidx, bytes) == CUDA_SUCCESS;
}

static void give(int gidx, uint64_t bytes) {
    if (gidx >= 0) sim_uncharge_managed(gidx, bytes);
}

/* locked: `n` bytes of a block left GPU `g` by eviction; of those, `*gone` had already left
 * its accounting there (what the evicting allocation took), the rest is given back now */
static void settle(int g, uint64_t n, uint64_t *gone) {
    if (n <= *gone) {
        *gone -= n;
        return;
    }
    give(g, n - *gone);
    *gone = 0;
}

/* locked: the blocks another allocation evicted to the host (sim_state_make_room) are moved
 * there in this process's record too, read-only copies first (their data stays in its
 * writable copy), then writable blocks from the lowest address; before any call reads or
 * moves a block, so that none is ever found where the GPU no longer holds it */
static void notice_evictions(void) {
    for (int g = 0; g < SIM_MAX_GPUS; g++) {
        uint64_t gone = sim_take_evicted(g);
        for (int copies = 1; copies >= 0 && gone; copies--)
            for (size_t k = 0; k < nranges && gone; k++)
                for (size_t i = 0; i < ranges[k].nblocks && gone; i++) {
                    block_t *b = &ranges[k].blocks[i];
                    if (copies && (b->copies & bit(g))) {
                        b->copies &= ~bit(g);
                    } else if (!copies && b->loc == g) {
                        b->loc = LOC_HOST;
                    } else {
                        continue;
                    }
                    settle(g, block_bytes(&ranges[k], i), &gone);
                }
    }
}

static void lock_managed(void) {
    pthread_mutex_lock(&managed_lock);
    notice_evictions();
}

/* moves the block's writable copy to `to` (a GPU or LOC_HOST); stays when `to` has no room */
static void move_block(managed_t *m, size_t i, int to) {
    block_t *b = &m->blocks[i];
    uint64_t n = block_bytes(m, i);
    if (b->loc == to) return;
    if (to >= 0 && (b->copies & bit(to))) { /* a copy is already there: it becomes the one */
        b->copies &= ~bit(to);
    } else if (!take(to, n)) {
        return;
    }
    give(b->loc, n);
    b->loc = (int16_t)to;
}

/* a read-only copy on `to` (read-mostly); the host's copies cost no device memory */
static void copy_block(managed_t *m, size_t i, int to) {
    block_t *b = &m->blocks[i];
    if (to < 0 || b->loc == to || (b->copies & bit(to))) return;
    if (take(to, block_bytes(m, i))) b->copies |= bit(to);
}

static void drop_copies(managed_t *m, size_t i) {
    block_t *b = &m->blocks[i];
    for (int g = 0; g < SIM_MAX_GPUS && b->copies; g++) {
        if (!(b->copies & bit(g))) continue;
        give(g, block_bytes(m, i));
        b->copies &= ~bit(g);
    }
}

/* ---- the allocations ---- */

CUresult sim_managed_new(uint64_t base, uint64_t size, int gidx) {
    size_t n = (size_t)(size / BLOCK + (size % BLOCK != 0));
    block_t *blocks = calloc(n ? n : 1, sizeof *blocks);
    if (!blocks) return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < n; i++) blocks[i].loc = (int16_t)gidx;
    lock_managed();
    if (nranges == cap_ranges) {
        size_t nc = cap_ranges ? cap_ranges * 2 : 16;
        managed_t *p = realloc(ranges, nc * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&managed_lock);
            free(blocks);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        ranges = p;
        cap_ranges = nc;
    }
    ranges[nranges++] = (managed_t){base, size, n, blocks};
    __atomic_store_n(&live, (int)nranges, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&managed_lock);
    return CUDA_SUCCESS;
}

int sim_managed_free(uint64_t base) {
    lock_managed();
    for (size_t k = 0; k < nranges; k++) {
        managed_t *m = &ranges[k];
        if (m->base != base) continue;
        for (size_t i = 0; i < m->nblocks; i++) {
            drop_copies(m, i);
            give(m->blocks[i].loc, block_bytes(m, i));
        }
        free(m->blocks);
        ranges[k] = ranges[--nranges];
        __atomic_store_n(&live, (int)nranges, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&managed_lock);
        return 1;
    }
    pthread_mutex_unlock(&managed_lock);
    return 0;
}

/* locked: the allocation holding [ptr, ptr + count) and its first and last block */
static managed_t *find(uint64_t ptr, uint64_t count, size_t *first, size_t *last) {
    if (!count) return NULL;
    for (size_t k = 0; k < nranges; k++) {
        managed_t *m = &ranges[k];
        if (ptr < m->base || ptr - m->base >= m->size || count > m->size - (ptr - m->base))
            continue;
        *first = (size_t)((ptr - m->base) / BLOCK);
        *last = (size_t)((ptr - m->base + count - 1) / BLOCK);
        return m;
    }
    return NULL;
}

/* ---- locations ---- */

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE, _HOST or _HOST_NUMA (node 0, the only one) */
    int gidx; /* the GPU, or LOC_HOST */
} where_t;

static CUresult device_where(CUdevice dev, where_t *w) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (g_sim_cfg.gpus[g].cc_major < 6) return CUDA_ERROR_INVALID_DEVICE; /* no concurrent access */
    *w = (where_t){CU_MEM_LOCATION_TYPE_DEVICE, g};
    return CUDA_SUCCESS;
}

/* a CUmemLocation a prefetch or a preferred location may name */
static CUresult location_where(const CUmemLocation *loc, where_t *w) {
    switch (loc->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return device_where(loc->id, w);
    case CU_MEM_LOCATION_TYPE_HOST: *w = (where_t){CU_MEM_LOCATION_TYPE_HOST, LOC_HOST}; break;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (loc->id != 0) return CUDA_ERROR_INVALID_VALUE; /* one host NUMA node: 0 */
        *w = (where_t){CU_MEM_LOCATION_TYPE_HOST_NUMA, LOC_HOST};
        break;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *w = (where_t){CU_MEM_LOCATION_TYPE_HOST_NUMA, LOC_HOST};
        break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* the v1 forms name a device ordinal, or CU_DEVICE_CPU for the host */
static CUresult device_or_cpu(CUdevice dev, where_t *w) {
    if (dev == CU_DEVICE_CPU) {
        *w = (where_t){CU_MEM_LOCATION_TYPE_HOST, LOC_HOST};
        return CUDA_SUCCESS;
    }
    return device_where(dev, w);
}

/* ---- prefetch ---- */

/* locked: one prefetch of blocks first..last to w */
static void prefetch_blocks(managed_t *m, size_t first, size_t last, where_t w) {
    for (size_t i = first; i <= last; i++) {
        block_t *b = &m->blocks[i];
        if (b->read_mostly)
            copy_block(m, i, w.gidx);
        else
            move_block(m, i, w.gidx);
        b->fetched_type = (uint8_t)w.type;
        b->fetched_gidx = (int16_t)w.gidx;
    }
}

static CUresult stream_ok(CUstream s) {
    CUresult r = sim_check_init();
    if (r) return r;
    return sim_stream_ctx(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult prefetch(CUdeviceptr ptr, size_t count, where_t w, CUstream s) {
    CUresult r = stream_ok(s);
    if (r) return r;
    size_t first, last;
    lock_managed();
    managed_t *m = find(ptr, count, &first, &last);
    if (m) prefetch_blocks(m, first, last, w);
    pthread_mutex_unlock(&managed_lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; /* not managed memory */
}

static CUresult prefetch_v1(CUdeviceptr ptr, size_t count, CUdevice dst, CUstream s) {
    CUresult r = sim_check_init();
    if (r) return r;
    where_t w;
    r = device_or_cpu(dst, &w);
    return r ? r : prefetch(ptr, count, w, s);
}

static CUresult prefetch_v2(CUdeviceptr ptr, size_t count, CUmemLocation loc, unsigned flags,
                            CUstream s) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (flags) return CUDA_ERROR_INVALID_VALUE; /* "must be zero now" */
    where_t w;
    r = location_where(&loc, &w);
    return r ? r : prefetch(ptr, count, w, s);
}

SIM_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr ptr, size_t count, CUdevice dst, CUstream s) {
    return prefetch_v1(ptr, count, dst, s);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr ptr, size_t count, CUdevice dst,
                                            CUstream s) {
    return prefetch_v1(ptr, count, dst, s ? s : CU_STREAM_PER_THREAD_HANDLE);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr ptr, size_t count, CUmemLocation loc,
                                          unsigned int flags, CUstream s) {
    return prefetch_v2(ptr, count, loc, flags, s);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr ptr, size_t count, CUmemLocation loc,
                                               unsigned int flags, CUstream s) {
    return prefetch_v2(ptr, count, loc, flags, s ? s : CU_STREAM_PER_THREAD_HANDLE);
}

/* ---- batches (CUDA 13): checked whole, then applied ---- */

/* prefetchLocIdxs: starts at 0, strictly increasing, below count; at most count entries */
static CUresult batch_check(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locs,
                            size_t *idxs, size_t nlocs, unsigned long long flags, CUstream s,
                            where_t *where) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!dptrs || !sizes || !count || flags || s == NULL || s == CU_STREAM_LEGACY_HANDLE)
        return CUDA_ERROR_INVALID_VALUE; /* "must not be legacy NULL stream" */
    if (locs) {
        if (!idxs || !nlocs || nlocs > count || idxs[0] != 0) return CUDA_ERROR_INVALID_VALUE;
        for (size_t k = 0; k < nlocs; k++) {
            if (k && idxs[k] <= idxs[k - 1]) return CUDA_ERROR_INVALID_VALUE;
            if (idxs[k] >= count) return CUDA_ERROR_INVALID_VALUE;
            r = location_where(&locs[k], &where[k]);
            if (r) return r;
        }
    }
    r = stream_ok(s);
    if (r) return r;
    lock_managed();
    for (size_t i = 0; i < count && !r; i++) {
        size_t first, last;
        if (!find(dptrs[i], sizes[i], &first, &last)) r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&managed_lock);
    return r;
}

static CUresult prefetch_batch(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locs,
                               size_t *idxs, size_t nlocs, unsigned long long flags, CUstream s) {
    if (!locs) return CUDA_ERROR_INVALID_VALUE; /* every prefetch needs a location */
    where_t *where = calloc(nlocs ? nlocs : 1, sizeof *where);
    if (!where) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = batch_check(dptrs, sizes, count, locs, idxs, nlocs, flags, s, where);
    if (!r) {
        lock_managed();
        size_t k = 0;
        for (size_t i = 0; i < count; i++) {
            while (k + 1 < nlocs && idxs[k + 1] <= i) k++;
            size_t first, last;
            managed_t *m = find(dptrs[i], sizes[i], &first, &last);
            if (m) prefetch_blocks(m, first, last, where[k]);
        }
        pthread_mutex_unlock(&managed_lock);
    }
    free(where);
    return r;
}

SIM_EXPORT CUresult cuMemPrefetchBatchAsync(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                            CUmemLocation *locs, size_t *idxs, size_t nlocs,
                                            unsigned long long flags, CUstream s) {
    return prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s);
}

SIM_EXPORT CUresult cuMemPrefetchBatchAsync_ptsz(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                                 CUmemLocation *locs, size_t *idxs, size_t nlocs,
                                                 unsigned long long flags, CUstream s) {
    return prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags,
                          s ? s : CU_STREAM_PER_THREAD_HANDLE);
}

/* A discard tells the driver the contents are no longer needed; it may free the pages or keep
 * them. The simulator keeps them where they are (what a memory cap must expect). */
static CUresult discard_batch(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                              unsigned long long flags, CUstream s) {
    return batch_check(dptrs, sizes, count, NULL, NULL, 0, flags, s, NULL);
}

SIM_EXPORT CUresult cuMemDiscardBatchAsync(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                           unsigned long long flags, CUstream s) {
    return discard_batch(dptrs, sizes, count, flags, s);
}

SIM_EXPORT CUresult cuMemDiscardBatchAsync_ptsz(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                                unsigned long long flags, CUstream s) {
    return discard_batch(dptrs, sizes, count, flags, s ? s : CU_STREAM_PER_THREAD_HANDLE);
}

SIM_EXPORT CUresult cuMemDiscardAndPrefetchBatchAsync(CUdeviceptr *dptrs, size_t *sizes,
                                                      size_t count, CUmemLocation *locs,
                                                      size_t *idxs, size_t nlocs,
                                                      unsigned long long flags, CUstream s) {
    return prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s);
}

SIM_EXPORT CUresult cuMemDiscardAndPrefetchBatchAsync_ptsz(CUdeviceptr *dptrs, size_t *sizes,
                                                           size_t count, CUmemLocation *locs,
                                                           size_t *idxs, size_t nlocs,
                                                           unsigned long long flags, CUstream s) {
    return prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags,
                          s ? s : CU_STREAM_PER_THREAD_HANDLE);
}

/* ---- advice: policy, no migration ---- */

/* locked: UNSET_READ_MOSTLY collapses the copies into one, at the preferred GPU when a copy
 * is there, otherwise where the writable copy already is */
static void collapse(managed_t *m, size_t i) {
    block_t *b = &m->blocks[i];
    if (b->pref_type == CU_MEM_LOCATION_TYPE_DEVICE && (b->copies & bit(b->pref_gidx)))
        move_block(m, i, b->pref_gidx);
    drop_copies(m, i);
}

static void advise_block(managed_t *m, size_t i, int advice, where_t w) {
    block_t *b = &m->blocks[i];
    switch (advice) {
    case CU_MEM_ADVISE_SET_READ_MOSTLY: b->read_mostly = 1; break;
    case CU_MEM_ADVISE_UNSET_READ_MOSTLY:
        b->read_mostly = 0;
        collapse(m, i);
        break;
    case CU_MEM_ADVISE_SET_PREFERRED_LOCATION:
        b->pref_type = (uint8_t)w.type;
        b->pref_gidx = (int16_t)w.gidx;
        break;
    case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: b->pref_type = NO_TYPE; break;
    case CU_MEM_ADVISE_SET_ACCESSED_BY:
    case CU_MEM_ADVISE_UNSET_ACCESSED_BY: {
        int set = advice == CU_MEM_ADVISE_SET_ACCESSED_BY;
        if (w.gidx < 0) b->host_by = (uint8_t)set;
        else if (set) b->by |= bit(w.gidx);
        else b->by &= ~bit(w.gidx);
        break;
    }
    }
}

static int uses_location(int advice) {
    return advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION ||
           advice == CU_MEM_ADVISE_SET_ACCESSED_BY || advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY;
}

static CUresult advise(CUdeviceptr ptr, size_t count, int advice, where_t w) {
    size_t first, last;
    lock_managed();
    managed_t *m = find(ptr, count, &first, &last);
    for (size_t i = first; m && i <= last; i++) advise_block(m, i, advice, w);
    pthread_mutex_unlock(&managed_lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult advise_check(int advice) {
    CUresult r = sim_check_init();
    if (r) return r;
    return advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY
               ? CUDA_ERROR_INVALID_VALUE
               : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr ptr, size_t count, int advice, CUmemLocation loc) {
    CUresult r = advise_check(advice);
    if (r) return r;
    where_t w = {NO_TYPE, LOC_HOST};
    if (uses_location(advice)) {
        /* accessed-by names a GPU or the host, nothing else */
        if (advice != CU_MEM_ADVISE_SET_PREFERRED_LOCATION &&
            loc.type != CU_MEM_LOCATION_TYPE_DEVICE && loc.type != CU_MEM_LOCATION_TYPE_HOST)
            return CUDA_ERROR_INVALID_VALUE;
        r = location_where(&loc, &w);
        if (r) return r;
    }
    return advise(ptr, count, advice, w);
}

SIM_EXPORT CUresult cuMemAdvise(CUdeviceptr ptr, size_t count, int advice, CUdevice dev) {
    CUresult r = advise_check(advice);
    if (r) return r;
    where_t w = {NO_TYPE, LOC_HOST};
    if (uses_location(advice)) {
        r = device_or_cpu(dev, &w);
        if (r) return r;
    }
    return advise(ptr, count, advice, w);
}

/* ---- a kernel's accesses ---- */

/* locked: the launching GPU `g` touches the block (the fault rules of cuda.h) */
static void touch_block(managed_t *m, size_t i, int g) {
    block_t *b = &m->blocks[i];
    if (b->loc == g || (b->copies & bit(g))) return;
    if (b->read_mostly) {
        copy_block(m, i, g);
        return;
    }
    int at_preferred = (b->pref_type == CU_MEM_LOCATION_TYPE_DEVICE && b->pref_gidx == b->loc) ||
                       (b->pref_type != NO_TYPE && b->pref_type != CU_MEM_LOCATION_TYPE_DEVICE &&
                        b->loc == LOC_HOST);
    if (at_preferred || (b->by & bit(g))) return; /* mapped where it is */
    move_block(m, i, g);
}

void sim_managed_touch(int gidx) {
    if (!__atomic_load_n(&live, __ATOMIC_ACQUIRE)) return;
    lock_managed();
    for (size_t k = 0; k < nranges; k++)
        for (size_t i = 0; i < ranges[k].nblocks; i++) touch_block(&ranges[k], i, gidx);
    pthread_mutex_unlock(&managed_lock);
}

/* ---- range attributes ---- */

/* the CUdevice a GPU index or the host reads as in the legacy attributes */
static int legacy_id(int type, int gidx) {
    if (type == CU_MEM_LOCATION_TYPE_DEVICE) return sim_visible_ordinal(gidx);
    return type == NO_TYPE ? CU_DEVICE_INVALID : CU_DEVICE_CPU;
}

/* the blocks' common (type, gidx) of the preferred (pref = 1) or last prefetch location;
 * NO_TYPE when they differ */
static where_t common(const managed_t *m, size_t first, size_t last, int pref) {
    const block_t *b = &m->blocks[first];
    where_t w = pref ? (where_t){b->pref_type, b->pref_gidx} : (where_t){b->fetched_type, b->fetched_gidx};
    for (size_t i = first + 1; i <= last && w.type != NO_TYPE; i++) {
        b = &m->blocks[i];
        where_t o = pref ? (where_t){b->pref_type, b->pref_gidx} : (where_t){b->fetched_type, b->fetched_gidx};
        if (o.type != w.type || (w.type == CU_MEM_LOCATION_TYPE_DEVICE && o.gidx != w.gidx))
            w.type = NO_TYPE;
    }
    return w;
}

static CUresult put_int(void *data, size_t size, int v) {
    if (size != sizeof(int)) return CUDA_ERROR_INVALID_VALUE;
    memcpy(data, &v, sizeof v);
    return CUDA_SUCCESS;
}

/* ACCESSED_BY: the devices set on every block, then CU_DEVICE_INVALID in the rest */
static CUresult accessed_by(const managed_t *m, size_t first, size_t last, void *data, size_t size) {
    if (!size || size % sizeof(int)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t all = ~0ULL;
    int host = 1;
    for (size_t i = first; i <= last; i++) {
        all &= m->blocks[i].by;
        host &= m->blocks[i].host_by;
    }
    size_t n = size / sizeof(int), k = 0;
    int *out = data;
    if (host && k < n) out[k++] = CU_DEVICE_CPU;
    for (int g = 0; g < SIM_MAX_GPUS && k < n; g++)
        if (all & bit(g)) out[k++] = sim_visible_ordinal(g);
    while (k < n) out[k++] = CU_DEVICE_INVALID;
    return CUDA_SUCCESS;
}

static CUresult attribute(const managed_t *m, size_t first, size_t last, int attr, void *data,
                          size_t size) {
    where_t w;
    switch (attr) {
    case CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY: {
        int all = 1;
        for (size_t i = first; i <= last; i++) all &= m->blocks[i].read_mostly;
        return put_int(data, size, all);
    }
    case CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY: return accessed_by(m, first, last, data, size);
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION:
        w = common(m, first, last, attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION);
        return put_int(data, size, legacy_id(w.type, w.gidx));
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE:
        w = common(m, first, last, attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE);
        return put_int(data, size, w.type); /* NO_TYPE is CU_MEM_LOCATION_TYPE_INVALID */
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID:
        w = common(m, first, last, attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID);
        return put_int(data, size,
                       w.type == CU_MEM_LOCATION_TYPE_DEVICE ? sim_visible_ordinal(w.gidx)
                       : w.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? 0
                                                                  : CU_DEVICE_INVALID);
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuMemRangeGetAttributes(void **data, size_t *sizes, int *attrs, size_t n,
                                            CUdeviceptr ptr, size_t count) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!data || !sizes || !attrs || !n) return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < n; k++)
        if (!data[k]) return CUDA_ERROR_INVALID_VALUE;
    size_t first, last;
    lock_managed();
    managed_t *m = find(ptr, count, &first, &last);
    if (!m) r = CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < n && !r; k++) r = attribute(m, first, last, attrs[k], data[k], sizes[k]);
    pthread_mutex_unlock(&managed_lock);
    return r;
}

SIM_EXPORT CUresult cuMemRangeGetAttribute(void *data, size_t size, int attr, CUdeviceptr ptr,
                                           size_t count) {
    return cuMemRangeGetAttributes(&data, &size, &attr, 1, ptr, count);
}
