/* Simulated graph memory: the lifetime of every graph allocation and the per-device graph
 * memory pool that backs them, by the rules cuda.h and NVIDIA's programming guide give.
 *
 *  - An allocation node gets a fixed address when it is added. Each launch of an executable
 *    graph allocates its allocation nodes again. An allocation freed in the same graph (a free
 *    node for its address) lives only while that launch runs; one the graph does not free
 *    stays allocated after the launch, and after its graph and executable graph are
 *    destroyed, until cuMemFree (at once), cuMemFreeAsync (when the stream reaches it), the
 *    launch of another graph with a free node for it (when that graph runs), or, with
 *    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, the next launch of its graph frees it.
 *  - Relaunching an executable graph whose allocations from a previous launch are still
 *    allocated fails with CUDA_ERROR_INVALID_VALUE, unless it was instantiated with
 *    AUTO_FREE_ON_LAUNCH.
 *  - Physical memory: each allocation is backed in whole 2 MiB granules (its address is its
 *    own, so no two allocations share a granule). The device's graph pool ("reserved")
 *    grows, at upload or launch, to hold everything in use at once: every allocation still
 *    allocated, every allocation of a graph still running or queued, and the new launch's
 *    allocations; memory no launch or allocation uses any more stays reserved (the driver
 *    may reuse it for any graph) until cuDeviceGraphMemTrim gives it back. Trimming never
 *    takes memory that is allocated or that a running or queued graph uses. Growth the card
 *    cannot hold fails with CUDA_ERROR_OUT_OF_MEMORY.
 *  - cuDeviceGetGraphMemAttribute: USED_MEM_CURRENT is what is in use (above),
 *    RESERVED_MEM_CURRENT the pool; the high watermarks can only be reset (to zero, which
 *    starts them again from the current value) by cuDeviceSetGraphMemAttribute.
 * The pool is per process and device, like the driver's; its memory is charged to the
 * process on the GPU's shared accounting, and goes when the process exits. */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

enum { G_IDLE = 0, G_LIVE = 1 };

typedef struct {
    uint64_t dptr;
    uint64_t backed; /* physical size: whole granules */
    int gidx;
    int state;                   /* G_IDLE: not allocated now; G_LIVE: allocated */
    int freed_elsewhere;         /* a free node for it is in a graph other than its own */
    struct CUgraphNode_st *node; /* the allocation node that made it (NULL once destroyed) */
} galloc_t;

/* Memory in use until a point of a stream is reached: a launch's allocations that the graph
 * frees itself (until the launch ends), an allocation freed in stream order. */
typedef struct {
    sim_marker_t m;
    int gidx;
    uint64_t backed;
    uint64_t exec_id; /* the launch of this executable graph (0: a stream-ordered free) */
} ghold_t;

static pthread_mutex_t gm_lock = PTHREAD_MUTEX_INITIALIZER;
static galloc_t *allocs;
static size_t nallocs, cap_allocs;
static qgpu_table_t by_addr = QGPU_TABLE_INIT; /* dptr -> index in allocs */
static ghold_t *holds;
static size_t nholds, cap_holds;
static uint64_t reserved[SIM_MAX_GPUS], reserved_high[SIM_MAX_GPUS], used_high[SIM_MAX_GPUS];
static uint64_t next_exec_id;

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

uint64_t sim_gmem_backed(uint64_t size) {
    if (size > UINT64_MAX - (SIM_GRANULE - 1)) return UINT64_MAX;
    return (size + SIM_GRANULE - 1) & ~(SIM_GRANULE - 1);
}

uint64_t sim_gmem_new_exec_id(void) { return __atomic_add_fetch(&next_exec_id, 1, __ATOMIC_RELAXED); }

static int grow_array(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

/* locked: the record of a graph allocation's base address, or NULL */
static galloc_t *find_locked(uint64_t dptr) {
    int64_t idx;
    if (!dptr || qgpu_table_get(&by_addr, dptr, NULL, &idx) != 0) return NULL;
    return &allocs[idx];
}

/* ---- allocation nodes ---- */

CUresult sim_gmem_node_added(struct CUgraphNode_st *node, uint64_t dptr, uint64_t size, int gidx) {
    pthread_mutex_lock(&gm_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (grow_array((void **)&allocs, &cap_allocs, nallocs, sizeof *allocs) == 0 &&
        qgpu_table_put(&by_addr, dptr, size, (int64_t)nallocs) == 0) {
        allocs[nallocs++] = (galloc_t){dptr, sim_gmem_backed(size), gidx, G_IDLE, 0, node};
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&gm_lock);
    return r;
}

void sim_gmem_node_gone(struct CUgraphNode_st *node) {
    pthread_mutex_lock(&gm_lock);
    galloc_t *a = find_locked(node->alloc.dptr);
    if (a && a->node == node) a->node = NULL;
    pthread_mutex_unlock(&gm_lock);
}

int sim_gmem_lookup(uint64_t dptr, struct CUgraphNode_st **node, int *freed_elsewhere) {
    pthread_mutex_lock(&gm_lock);
    galloc_t *a = find_locked(dptr);
    if (a) {
        *node = a->node;
        *freed_elsewhere = a->freed_elsewhere;
    }
    pthread_mutex_unlock(&gm_lock);
    return a ? 0 : -1;
}

void sim_gmem_freed_elsewhere(uint64_t dptr) {
    pthread_mutex_lock(&gm_lock);
    galloc_t *a = find_locked(dptr);
    if (a) a->freed_elsewhere = 1;
    pthread_mutex_unlock(&gm_lock);
}

/* ---- what is in use ---- */

/* locked: holds whose stream point has been reached are over */
static void reap_locked(void) {
    for (size_t i = 0; i < nholds;) {
        if (sim_marker_poll(&holds[i].m)) {
            holds[i] = holds[--nholds];
            continue;
        }
        i++;
    }
}

/* locked: memory in use on gidx: allocations still allocated, and holds (but those of the
 * executable graph `skip_exec`, whose next launch is ordered after them) */
static uint64_t in_use_locked(int gidx, uint64_t skip_exec) {
    uint64_t sum = 0;
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].gidx == gidx && allocs[i].state == G_LIVE) sum = add_sat(sum, allocs[i].backed);
    for (size_t i = 0; i < nholds; i++)
        if (holds[i].gidx == gidx && (!skip_exec || holds[i].exec_id != skip_exec))
            sum = add_sat(sum, holds[i].backed);
    return sum;
}

/* locked: the pool holds at least `need` (grown by the difference, charged to the device) */
static CUresult reserve_locked(int gidx, uint64_t need) {
    if (need == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    if (need > reserved[gidx]) {
        CUresult r = sim_charge(gidx, need - reserved[gidx]);
        if (r) return r;
        reserved[gidx] = need;
        if (need > reserved_high[gidx]) reserved_high[gidx] = need;
    }
    return CUDA_SUCCESS;
}

static void note_used_locked(int gidx) {
    uint64_t u = in_use_locked(gidx, 0);
    if (u > used_high[gidx]) used_high[gidx] = u;
}

static int push_hold_locked(const ghold_t *h) {
    if (grow_array((void **)&holds, &cap_holds, nholds, sizeof *holds) != 0) return -1;
    holds[nholds++] = *h;
    return 0;
}

/* ---- upload and launch ---- */

/* locked: the backing of e's allocations that are still allocated */
static uint64_t live_of_locked(const struct CUgraphExec_st *e) {
    uint64_t sum = 0;
    for (int i = 0; i < e->nkeep; i++) {
        galloc_t *a = find_locked(e->keep[i]);
        if (a && a->state == G_LIVE) sum = add_sat(sum, a->backed);
    }
    return sum;
}

/* What an upload or launch of e needs the pool to hold: what else is in use, and all of
 * e's allocations (with AUTO_FREE_ON_LAUNCH its own allocations still allocated are freed
 * first). */
static uint64_t needs_locked(const struct CUgraphExec_st *e, int gidx) {
    uint64_t others = in_use_locked(gidx, e->id);
    if (e->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) {
        uint64_t own = live_of_locked(e);
        others = others >= own ? others - own : 0;
    }
    return add_sat(add_sat(others, e->keep_backed), e->temp_backed);
}

CUresult sim_gmem_upload(struct CUgraphExec_st *e, int gidx) {
    if (!e->keep_backed && !e->temp_backed) return CUDA_SUCCESS;
    pthread_mutex_lock(&gm_lock);
    reap_locked();
    CUresult r = reserve_locked(gidx, needs_locked(e, gidx));
    pthread_mutex_unlock(&gm_lock);
    return r;
}

CUresult sim_gmem_launch(struct CUgraphExec_st *e, int gidx) {
    if (!e->nkeep && !e->temp_backed && !e->nfrees) return CUDA_SUCCESS;
    pthread_mutex_lock(&gm_lock);
    reap_locked();
    int autofree = (e->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    if (!autofree && live_of_locked(e)) { /* its allocations from a launch before are unfreed */
        pthread_mutex_unlock(&gm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* room to remember what it frees itself (sim_gmem_launched), before anything changes */
    CUresult r = e->temp_backed && grow_array((void **)&holds, &cap_holds, nholds, sizeof *holds)
                     ? CUDA_ERROR_OUT_OF_MEMORY
                     : reserve_locked(gidx, needs_locked(e, gidx));
    if (!r) {
        for (size_t i = 0; i < nholds;) { /* its earlier launch ends before this one starts */
            if (holds[i].exec_id == e->id) {
                holds[i] = holds[--nholds];
                continue;
            }
            i++;
        }
        for (int i = 0; i < e->nkeep; i++) { /* freed by AUTO_FREE_ON_LAUNCH, allocated again */
            galloc_t *a = find_locked(e->keep[i]);
            if (a) a->state = G_LIVE;
        }
    }
    pthread_mutex_unlock(&gm_lock);
    return r;
}

/* After the launch's work was queued on (c, s): what it frees lives until it has run. */
void sim_gmem_launched(struct CUgraphExec_st *e, int gidx, struct CUctx_st *c, struct CUstream_st *s) {
    if (!e->temp_backed && !e->nfrees) {
        pthread_mutex_lock(&gm_lock);
        note_used_locked(gidx);
        pthread_mutex_unlock(&gm_lock);
        return;
    }
    ghold_t h;
    memset(&h, 0, sizeof h);
    sim_marker_record(c, s, &h.m);
    pthread_mutex_lock(&gm_lock);
    h.gidx = gidx;
    if (e->temp_backed) {
        h.backed = e->temp_backed;
        h.exec_id = e->id;
        if (push_hold_locked(&h) != 0) { /* cannot remember it: wait for the launch */
            pthread_mutex_unlock(&gm_lock);
            sim_marker_wait(&h.m);
            pthread_mutex_lock(&gm_lock);
        }
    }
    for (int i = 0; i < e->nfrees; i++) { /* free nodes for other graphs' allocations */
        galloc_t *a = find_locked(e->frees[i]);
        if (!a || a->state != G_LIVE) continue; /* not allocated: nothing to free */
        a->state = G_IDLE;
        ghold_t f = h;
        f.gidx = a->gidx;
        f.backed = a->backed;
        f.exec_id = 0;
        push_hold_locked(&f); /* if it cannot be remembered it is free at once */
    }
    note_used_locked(gidx);
    pthread_mutex_unlock(&gm_lock);
}

/* ---- frees outside the graph ---- */

int sim_gmem_free(uint64_t dptr, struct CUctx_st *c, struct CUstream_st *s, int async) {
    pthread_mutex_lock(&gm_lock);
    galloc_t *a = find_locked(dptr);
    if (!a) {
        pthread_mutex_unlock(&gm_lock);
        return -1; /* not a graph allocation */
    }
    if (a->state != G_LIVE) {
        pthread_mutex_unlock(&gm_lock);
        return CUDA_ERROR_INVALID_VALUE; /* not allocated now */
    }
    a->state = G_IDLE;
    ghold_t h;
    memset(&h, 0, sizeof h);
    h.gidx = a->gidx;
    h.backed = a->backed;
    pthread_mutex_unlock(&gm_lock);
    if (!async) return CUDA_SUCCESS;
    sim_marker_record(c, s, &h.m); /* in use until the stream reaches the free */
    pthread_mutex_lock(&gm_lock);
    push_hold_locked(&h);
    pthread_mutex_unlock(&gm_lock);
    return CUDA_SUCCESS;
}

int sim_gmem_range(uint64_t addr, uint64_t *base, uint64_t *size) {
    pthread_mutex_lock(&gm_lock);
    int found = -1;
    for (size_t i = 0; i < nallocs && found; i++) {
        galloc_t *a = &allocs[i];
        uint64_t n = 0;
        if (a->state != G_LIVE || addr < a->dptr) continue;
        qgpu_table_get(&by_addr, a->dptr, &n, NULL);
        if (addr - a->dptr < n) {
            *base = a->dptr;
            *size = n;
            found = 0;
        }
    }
    pthread_mutex_unlock(&gm_lock);
    return found;
}

/* ---- the pool ---- */

SIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&gm_lock);
    reap_locked();
    uint64_t keep = in_use_locked(g, 0);
    if (reserved[g] > keep) {
        sim_uncharge(g, reserved[g] - keep);
        reserved[g] = keep;
    }
    pthread_mutex_unlock(&gm_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gm_lock);
    reap_locked();
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = in_use_locked(g, 0); break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = used_high[g]; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = reserved[g]; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = reserved_high[g]; break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&gm_lock);
    return r;
}

/* Only the high watermarks, and only to zero (they start again from the current value). */
SIM_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!value || *(cuuint64_t *)value != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gm_lock);
    reap_locked();
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH) used_high[g] = in_use_locked(g, 0);
    else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH) reserved_high[g] = reserved[g];
    else r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&gm_lock);
    return r;
}
