/* What an executable graph allocates, asked of the driver rather than counted as nodes are
 * added. A graph's allocation nodes take device memory when the executable graph is
 * uploaded or launched; there are many ways to put one into a graph (cuGraphAddMemAllocNode,
 * the generic cuGraphAddNode(_v2), stream capture into a new or an existing graph, a child
 * graph moved into its parent, ...) and CUDA adds more. So at every instantiation the hook
 * walks the graph the driver instantiated (cuGraphGetNodes, cuGraphNodeGetType,
 * cuGraphMemAllocNodeGetParams, into child graphs through cuGraphChildGraphNodeGetGraph) and
 * records the executable graph's need: the sum of its allocation nodes' sizes, each rounded
 * up to the device's allocation granularity (the larger of cuMemGetAllocationGranularity's
 * minimum and recommended, 2 MiB when it cannot say): every graph allocation has an address
 * of its own, so the driver may back each with whole pages of physical memory, and a graph
 * of many small nodes takes that much more than it asks. The walk refuses an allocation
 * node on another GPU than the slice's (CUDA_ERROR_INVALID_DEVICE).
 *
 * The graph is walked before the driver instantiates it and again after, and the larger sum
 * is kept: graphs are not thread-safe, and another thread could add nodes in between; a
 * graph with allocation or free nodes cannot lose nodes (cuGraphDestroyNode refuses,
 * allocation nodes cannot be changed), so what the executable graph holds is still there
 * after. CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD allocates inside the call: charged first.
 *
 * What changes an executable graph afterwards replaces its need: cuGraphExecUpdate(_v2) with
 * the new graph's; cuGraphExecChildGraphNodeSetParams / cuGraphExecNodeSetParams of a child
 * graph node with the old need less that node's share plus the new child graph's (each top-
 * level child graph node's share is kept; where it is not known, nothing is taken off). The
 * larger need is recorded before the driver is called, so a failed record refuses the
 * change. cuGraphExecNodeSetParams of an allocation or free node is refused, as cuda.h says
 * the driver does.
 *
 * Not walked: conditional nodes' body graphs (CUDA 13.0 has no query for them); cuda.h says
 * the driver refuses allocation and free nodes there, and in any graph a node owns.
 * Upload and launch (graph_mem_before here, pool.c's graph_mem_after) charge the need. */
#include <stdlib.h>
#include <string.h>

#include "hook.h"

#define WALK_MAX_DEPTH 64
#define GET_NODES_TRIES 8

static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;
static qgpu_table_t exec_need = QGPU_TABLE_INIT; /* CUgraphExec -> bytes its allocations take */
/* top-level child graph node -> its share of its executable graph's need (tag: the exec) */
static qgpu_table_t child_share = QGPU_TABLE_INIT;

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* ---- walking a graph ---- */

#define GRAN_DEVICES 64
#define GRAN_FALLBACK (2ULL << 20)

/* What the driver may map for one allocation of `size` on `loc`: whole granules. */
static uint64_t backed_size(uint64_t size, const CUmemLocation *loc) {
    static uint64_t gran[GRAN_DEVICES]; /* found once per device (0: not yet) */
    int dev = loc->id >= 0 && loc->id < GRAN_DEVICES ? loc->id : 0;
    uint64_t g = __atomic_load_n(&gran[dev], __ATOMIC_RELAXED);
    if (!g) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = *loc;
        size_t min = 0, rec = 0;
        if (HAVE_REAL(cuMemGetAllocationGranularity)) {
            REAL(cuMemGetAllocationGranularity)(&min, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
            REAL(cuMemGetAllocationGranularity)(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        }
        g = min > rec ? min : rec;
        if (!g || (g & (g - 1))) g = GRAN_FALLBACK; /* unknown or not a power of two */
        __atomic_store_n(&gran[dev], g, __ATOMIC_RELAXED);
    }
    if (size > UINT64_MAX - (g - 1)) return UINT64_MAX;
    return (size + g - 1) & ~(g - 1);
}

typedef struct {
    CUgraphNode node;
    uint64_t bytes;
} share_t;

typedef struct {
    uint64_t bytes;
    share_t *shares; /* top-level child graph nodes holding allocations */
    size_t nshares, cap;
} walk_t;

static void walk_free(walk_t *w) {
    free(w->shares);
    w->shares = NULL;
    w->nshares = w->cap = 0;
}

static void keep_share(walk_t *w, CUgraphNode node, uint64_t bytes) {
    if (w->nshares == w->cap) {
        size_t nc = w->cap ? w->cap * 2 : 8;
        share_t *n = realloc(w->shares, nc * sizeof *n);
        if (!n) return; /* unknown shares are never taken off: only over-charges */
        w->shares = n;
        w->cap = nc;
    }
    w->shares[w->nshares++] = (share_t){node, bytes};
}

/* The graph's nodes, as many as it has when asked (retried if it grows meanwhile). */
static CUresult graph_nodes(CUgraph g, CUgraphNode **out, size_t *n) {
    *out = NULL;
    *n = 0;
    for (int t = 0; t < GET_NODES_TRIES; t++) {
        size_t count = 0, again = 0;
        CUresult r = REAL(cuGraphGetNodes)(g, NULL, &count);
        if (r != CUDA_SUCCESS || !count) return r;
        CUgraphNode *nodes = malloc(count * sizeof *nodes);
        if (!nodes) return CUDA_ERROR_OUT_OF_MEMORY;
        size_t got = count;
        r = REAL(cuGraphGetNodes)(g, nodes, &got);
        if (r == CUDA_SUCCESS) r = REAL(cuGraphGetNodes)(g, NULL, &again);
        if (r != CUDA_SUCCESS) {
            free(nodes);
            return r;
        }
        if (again == count && got == count) {
            *out = nodes;
            *n = count;
            return CUDA_SUCCESS;
        }
        free(nodes);
    }
    return CUDA_ERROR_NOT_SUPPORTED;
}

static int can_walk(void) {
    return HAVE_REAL(cuGraphGetNodes) && HAVE_REAL(cuGraphNodeGetType) &&
           HAVE_REAL(cuGraphChildGraphNodeGetGraph);
}

/* Adds the sizes of g's allocation nodes (child graphs included) to *bytes; with `w`, keeps
 * the share of each of g's child graph nodes. An error refuses what asked for the walk. */
static CUresult walk(CUgraph g, int depth, uint64_t *bytes, walk_t *w) {
    if (depth > WALK_MAX_DEPTH || !can_walk()) return CUDA_ERROR_NOT_SUPPORTED;
    CUgraphNode *nodes;
    size_t n;
    CUresult r = graph_nodes(g, &nodes, &n);
    for (size_t i = 0; r == CUDA_SUCCESS && i < n; i++) {
        int type = -1;
        r = REAL(cuGraphNodeGetType)(nodes[i], &type);
        if (r != CUDA_SUCCESS) break;
        if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            r = HAVE_REAL(cuGraphMemAllocNodeGetParams)
                    ? REAL(cuGraphMemAllocNodeGetParams)(nodes[i], &p)
                    : CUDA_ERROR_NOT_SUPPORTED;
            if (r == CUDA_SUCCESS && hook_foreign_location(&p.poolProps.location))
                r = CUDA_ERROR_INVALID_DEVICE;
            if (r == CUDA_SUCCESS)
                *bytes = add_sat(*bytes, backed_size(p.bytesize, &p.poolProps.location));
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child = NULL;
            uint64_t share = 0;
            r = REAL(cuGraphChildGraphNodeGetGraph)(nodes[i], &child);
            if (r == CUDA_SUCCESS) r = walk(child, depth + 1, &share, NULL);
            if (r == CUDA_SUCCESS) {
                *bytes = add_sat(*bytes, share);
                if (w && share) keep_share(w, nodes[i], share);
            }
        }
    }
    free(nodes);
    return r;
}

static CUresult walk_graph(CUgraph g, walk_t *w) {
    *w = (walk_t){0, NULL, 0, 0};
    CUresult r = walk(g, 0, &w->bytes, w);
    if (r != CUDA_SUCCESS) walk_free(w);
    return r;
}

/* ---- executable graphs' needs ---- */

static uint64_t need_of(CUgraphExec e) {
    uint64_t need = 0;
    qgpu_table_get(&exec_need, (uintptr_t)e, &need, NULL);
    return need;
}

static int set_need(CUgraphExec e, uint64_t bytes) {
    if (!bytes) {
        qgpu_table_take(&exec_need, (uintptr_t)e, NULL, NULL);
        return 0;
    }
    return qgpu_table_put(&exec_need, (uintptr_t)e, bytes, 0);
}

static CUgraphExec dying; /* under graph_lock: whose shares forget_shares takes */

static int share_of_dying(uint64_t key, uint64_t size, int64_t tag) {
    (void)key;
    (void)size;
    return tag == (int64_t)(uintptr_t)dying;
}

static void forget_shares(CUgraphExec e) {
    qgpu_entry_t gone[64];
    dying = e;
    while (qgpu_table_take_if(&child_share, share_of_dying, gone, 64) == 64) {
    }
    dying = NULL;
}

static void keep_shares(CUgraphExec e, const walk_t *w) {
    for (size_t i = 0; i < w->nshares; i++) /* a share not kept is never taken off */
        qgpu_table_put(&child_share, (uintptr_t)w->shares[i].node, w->shares[i].bytes,
                       (int64_t)(uintptr_t)e);
}

/* After an instantiation: the executable graph's need is what its graph holds (at least
 * `at_least`, what was charged for an upload inside the call). Without a walk or a record
 * the executable graph is destroyed and the instantiation refused. */
static CUresult instantiated(CUresult r, CUgraphExec *e, CUgraph g, uint64_t at_least) {
    if (r != CUDA_SUCCESS || !e) return r;
    walk_t w;
    CUresult wr = walk_graph(g, &w);
    pthread_mutex_lock(&graph_lock);
    forget_shares(*e); /* a destroyed executable graph's handle may come back */
    if (wr == CUDA_SUCCESS && set_need(*e, w.bytes > at_least ? w.bytes : at_least) != 0)
        wr = CUDA_ERROR_OUT_OF_MEMORY;
    if (wr == CUDA_SUCCESS) keep_shares(*e, &w);
    pthread_mutex_unlock(&graph_lock);
    walk_free(&w);
    if (wr != CUDA_SUCCESS) {
        set_need(*e, 0);
        graph_work_release(*e);
        REAL(cuGraphExecDestroy)(*e);
        *e = NULL;
    }
    return wr;
}

/* Before an upload or launch: the executable graph's allocations, charged in full. When
 * they do not fit, the driver is asked to give back the graph memory nothing uses
 * (pool.c), first at once, then after the stream's earlier work has run (a relaunch of the
 * same graph on the same stream): the charge is never smaller than the driver's pool plus
 * the whole need, so a launch can take no more than it was charged for. `s` NULL: no
 * waiting. */
int graph_mem_before(CUgraphExec e, CUstream s, int can_wait, uint64_t *need) {
    *need = need_of(e);
    if (!*need || ledger_reserve(*need) == 0) return 0;
    for (int wait = 0; wait <= can_wait; wait++)
        if (graph_mem_make_room(s, wait) && ledger_reserve(*need) == 0) return 0;
    return -1;
}

/* ---- graph allocation nodes: the slice's GPU only (refused early; the walk checks too) ---- */

QGPU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                            size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    HOOK_ENTER(cuGraphAddMemAllocNode, node, g, deps, ndeps, p);
    if (p && hook_foreign_location(&p->poolProps.location)) return CUDA_ERROR_INVALID_DEVICE;
    return REAL(cuGraphAddMemAllocNode)(node, g, deps, ndeps, p);
}

static int generic_alloc_refused(const CUgraphNodeParams *p) {
    return p && p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC &&
           hook_foreign_location(&p->alloc.poolProps.location);
}

/* A kernel node of a CUkernel (as func, or as kern in its ctx): its library is loaded into
 * that context first, measured (module.c), as for cuGraphAddKernelNode. */
static CUresult generic_kernel_loaded(const CUgraphNodeParams *p) {
    if (!p || p->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_SUCCESS;
    return module_node_kernel_use((void *)p->kernel.func, p->kernel.kern, p->kernel.ctx);
}

/* A node's parameters changed: a kernel node may name a CUkernel now. */
QGPU_EXPORT CUresult cuGraphNodeSetParams(CUgraphNode node, CUgraphNodeParams *p) {
    HOOK_ENTER(cuGraphNodeSetParams, node, p);
    CUresult k = generic_kernel_loaded(p);
    return k != CUDA_SUCCESS ? k : REAL(cuGraphNodeSetParams)(node, p);
}

QGPU_EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                    size_t ndeps, CUgraphNodeParams *p) {
    HOOK_ENTER(cuGraphAddNode, node, g, deps, ndeps, p);
    if (generic_alloc_refused(p)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult k = generic_kernel_loaded(p);
    if (k != CUDA_SUCCESS) return k;
    return REAL(cuGraphAddNode)(node, g, deps, ndeps, p);
}

QGPU_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                       const CUgraphEdgeData *edges, size_t ndeps,
                                       CUgraphNodeParams *p) {
    HOOK_ENTER(cuGraphAddNode_v2, node, g, deps, edges, ndeps, p);
    if (generic_alloc_refused(p)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult k = generic_kernel_loaded(p);
    if (k != CUDA_SUCCESS) return k;
    return REAL(cuGraphAddNode_v2)(node, g, deps, edges, ndeps, p);
}

/* ---- instantiation ---- */

/* Before the driver instantiates: what the graph holds now (an allocation node on another
 * GPU refuses the instantiation). */
static CUresult before_instantiate(CUgraph g, uint64_t *bytes) {
    walk_t w;
    CUresult r = walk_graph(g, &w);
    *bytes = w.bytes;
    walk_free(&w);
    return r;
}

/* The instantiation itself, measured: what the executable graph keeps for its work
 * (graph_work.c), then its allocations' need (instantiated). */
#define INSTANTIATE(name, params, ...)                                                       \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, __VA_ARGS__);                                                       \
        uint64_t before;                                                                     \
        CUresult r = before_instantiate(g, &before);                                         \
        if (r != CUDA_SUCCESS) return r;                                                     \
        measure_t m;                                                                         \
        graph_work_begin(&m);                                                                \
        r = graph_work_done(REAL(name)(__VA_ARGS__), e, &m);                                 \
        return instantiated(r, e, g, before);                                                \
    }
INSTANTIATE(cuGraphInstantiate, (CUgraphExec * e, CUgraph g, CUgraphNode *err, char *log, size_t n),
            e, g, err, log, n)
INSTANTIATE(cuGraphInstantiate_v2,
            (CUgraphExec * e, CUgraph g, CUgraphNode *err, char *log, size_t n), e, g, err, log, n)
INSTANTIATE(cuGraphInstantiateWithFlags, (CUgraphExec * e, CUgraph g, unsigned long long f), e, g,
            f)

/* CUDA_GRAPH_INSTANTIATE_PARAMS: flags (u64) first; CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
 * uploads the graph, and so allocates its memory, inside the call: charged first. */
static CUresult with_params(CUresult (*real)(CUgraphExec *, CUgraph, void *), CUgraphExec *e,
                            CUgraph g, void *params) {
    unsigned long long flags = params ? *(unsigned long long *)params : 0;
    int upload = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) != 0;
    uint64_t need;
    CUresult r = before_instantiate(g, &need);
    if (r != CUDA_SUCCESS) return r;
    if (upload && need) { /* the trim frees memory: under the memory lock, shared */
        int held = memop_begin();
        int fits = ledger_reserve(need) == 0 ||
                   (graph_mem_make_room(NULL, 0) && ledger_reserve(need) == 0);
        memop_end(&held);
        if (!fits) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    measure_t m; /* the memory lock, exclusively: the upload's allocations are under it */
    graph_work_begin(&m);
    r = real(e, g, params);
    if (upload) graph_mem_after(r, need);
    return instantiated(graph_work_done(r, e, &m), e, g, need);
}

QGPU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, void *params) {
    HOOK_ENTER(cuGraphInstantiateWithParams, e, g, params);
    return with_params(REAL(cuGraphInstantiateWithParams), e, g, params);
}

QGPU_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, void *params) {
    HOOK_ENTER(cuGraphInstantiateWithParams_ptsz, e, g, params);
    return with_params(REAL(cuGraphInstantiateWithParams_ptsz), e, g, params);
}

QGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    HOOK_ENTER(cuGraphExecDestroy, e);
    HOOK_MEM_OP();
    CUresult r = REAL(cuGraphExecDestroy)(e);
    if (r == CUDA_SUCCESS) {
        graph_work_release(e);
        pthread_mutex_lock(&graph_lock);
        set_need(e, 0);
        forget_shares(e);
        pthread_mutex_unlock(&graph_lock);
    }
    return r;
}

/* ---- updates of an executable graph ---- */

/* The whole graph's parameters replace the executable graph's: its need becomes the new
 * graph's (the larger of both while the driver decides). */
static CUresult updated(CUgraphExec e, CUgraph h, CUresult (*call)(void *), void *args) {
    walk_t w;
    CUresult r = walk_graph(h, &w);
    if (r != CUDA_SUCCESS) return r;
    walk_free(&w); /* shares of h's nodes: the executable graph names its own graph's nodes */
    pthread_mutex_lock(&graph_lock);
    uint64_t old = need_of(e);
    if (w.bytes > old && set_need(e, w.bytes) != 0) {
        pthread_mutex_unlock(&graph_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = call(args);
    if (r == CUDA_SUCCESS) {
        forget_shares(e); /* unknown now: nothing is taken off at a child update */
        if (w.bytes < old) set_need(e, w.bytes); /* on failure the larger need stays */
    } else if (w.bytes > old) {
        set_need(e, old);
    }
    pthread_mutex_unlock(&graph_lock);
    return r;
}

typedef struct {
    CUgraphExec e;
    CUgraph h;
    CUgraphNode *err;
    int *result;
    CUgraphExecUpdateResultInfo *info;
} update_args_t;

static CUresult call_update_v1(void *a) {
    update_args_t *u = a;
    return REAL(cuGraphExecUpdate)(u->e, u->h, u->err, u->result);
}

static CUresult call_update_v2(void *a) {
    update_args_t *u = a;
    return REAL(cuGraphExecUpdate_v2)(u->e, u->h, u->info);
}

QGPU_EXPORT CUresult cuGraphExecUpdate(CUgraphExec e, CUgraph h, CUgraphNode *err, int *result) {
    HOOK_ENTER(cuGraphExecUpdate, e, h, err, result);
    update_args_t a = {e, h, err, result, NULL};
    return updated(e, h, call_update_v1, &a);
}

QGPU_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph h,
                                          CUgraphExecUpdateResultInfo *info) {
    HOOK_ENTER(cuGraphExecUpdate_v2, e, h, info);
    update_args_t a = {e, h, NULL, NULL, info};
    return updated(e, h, call_update_v2, &a);
}

/* A child graph node's graph replaced in the executable graph: its share becomes the new
 * child graph's. */
static CUresult child_updated(CUgraphExec e, CUgraphNode node, CUgraph child,
                              CUresult (*call)(void *), void *args) {
    walk_t w;
    CUresult r = walk_graph(child, &w);
    if (r != CUDA_SUCCESS) return r;
    walk_free(&w);
    pthread_mutex_lock(&graph_lock);
    uint64_t old = need_of(e), share = 0;
    int64_t owner = 0;
    if (qgpu_table_get(&child_share, (uintptr_t)node, &share, &owner) != 0 ||
        owner != (int64_t)(uintptr_t)e || share > old)
        share = 0;
    uint64_t bound = add_sat(old, w.bytes);
    if (bound > old && set_need(e, bound) != 0) {
        pthread_mutex_unlock(&graph_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = call(args);
    if (r == CUDA_SUCCESS) {
        set_need(e, add_sat(old - share, w.bytes)); /* never above `bound`: on failure it stays */
        if (w.bytes)
            qgpu_table_put(&child_share, (uintptr_t)node, w.bytes, (int64_t)(uintptr_t)e);
        else
            qgpu_table_take(&child_share, (uintptr_t)node, NULL, NULL);
    } else if (bound > old) {
        set_need(e, old);
    }
    pthread_mutex_unlock(&graph_lock);
    return r;
}

typedef struct {
    CUgraphExec e;
    CUgraphNode node;
    CUgraph child;
    CUgraphNodeParams *p;
} child_args_t;

static CUresult call_child_set(void *a) {
    child_args_t *c = a;
    return REAL(cuGraphExecChildGraphNodeSetParams)(c->e, c->node, c->child);
}

static CUresult call_node_set(void *a) {
    child_args_t *c = a;
    return REAL(cuGraphExecNodeSetParams)(c->e, c->node, c->p);
}

QGPU_EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec e, CUgraphNode node,
                                                        CUgraph child) {
    HOOK_ENTER(cuGraphExecChildGraphNodeSetParams, e, node, child);
    child_args_t a = {e, node, child, NULL};
    return child_updated(e, node, child, call_child_set, &a);
}

QGPU_EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec e, CUgraphNode node,
                                              CUgraphNodeParams *p) {
    HOOK_ENTER(cuGraphExecNodeSetParams, e, node, p);
    if (p && (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || p->type == CU_GRAPH_NODE_TYPE_MEM_FREE))
        return CUDA_ERROR_NOT_SUPPORTED; /* "API unsupported" (cuda.h) */
    CUresult k = generic_kernel_loaded(p);
    if (k != CUDA_SUCCESS) return k;
    if (!p || p->type != CU_GRAPH_NODE_TYPE_GRAPH) return REAL(cuGraphExecNodeSetParams)(e, node, p);
    child_args_t a = {e, node, p->graph.graph, p};
    return child_updated(e, node, p->graph.graph, call_node_set, &a);
}

/* ---- upload ---- */

#define UPLOAD(name, SMAP)                                                                   \
    QGPU_EXPORT CUresult name(CUgraphExec e, CUstream s) {                                   \
        HOOK_ENTER(name, e, s);                                                              \
        measure_t wm;                                                                        \
        int first = graph_work_first_use_begin(e, SMAP(s), &wm); /* its work (graph_work.c) */ \
        if (first < 0) return CUDA_ERROR_OUT_OF_MEMORY;                                      \
        HOOK_MEM_OP();                                                                       \
        uint64_t need;                                                                       \
        if (graph_mem_before(e, SMAP(s), 1, &need) != 0) {                                   \
            if (first) graph_work_first_use_abort();                                         \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                 \
        }                                                                                    \
        CUresult r = REAL(name)(e, s);                                                       \
        graph_mem_after(r, need);                                                            \
        return first ? graph_work_first_use_end(r, e, &wm) : r;                              \
    }
#define SAME_STREAM(s) (s)
#define PTSZ_STREAM(s) ((s) ? (s) : (CUstream)(uintptr_t)0x2)
UPLOAD(cuGraphUpload, SAME_STREAM)
UPLOAD(cuGraphUpload_ptsz, PTSZ_STREAM)
