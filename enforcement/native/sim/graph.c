/* Simulated CUDA graphs: nodes (kernel, empty, memory allocation and free, child graph,
 * conditional), stream capture into graphs, the queries that walk a graph, cloning,
 * instantiation, executable-graph updates, upload and launch.
 *
 * Strict where cuda.h says NVIDIA's driver is:
 *  - a graph with allocation or free nodes can only become a child graph by moving it into
 *    its parent (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE, CUDA 12.9+); cuGraphAddChildGraphNode
 *    and CLONE ownership refuse it, and refuse conditional nodes in a child graph;
 *  - no allocation or free node can be added to a graph a node owns (a moved or cloned child
 *    graph, the graph cuGraphChildGraphNodeGetGraph returns, a conditional body), by the
 *    node APIs or by stream capture; a moved graph cannot be instantiated, destroyed, moved
 *    again or passed to cuGraphExecUpdate;
 *  - cuGraphClone refuses graphs with allocation, free or conditional nodes;
 *    cuGraphNodeSetParams / cuGraphExecNodeSetParams refuse allocation and free nodes;
 *    cuGraphDestroyNode refuses nodes of a graph that has allocation or free nodes;
 *  - a graph with allocation or free nodes has at most one executable graph at a time; a
 *    graph being captured into cannot be instantiated; device-launch graphs hold only
 *    kernels and child graphs.
 * Where cuda.h names no restriction, the simulator lets the most through: cuGraphExecUpdate
 * and cuGraphExecChildGraphNodeSetParams may change an allocation node's size (topology
 * and node types must match), so the interposer must not rely on a real driver refusing it.
 *
 * An executable graph runs its own copy of the graph it was instantiated from; updates
 * change the copy. Its allocation nodes take memory from the device's graph pool at upload
 * or launch, and live by the rules graphmem.c keeps (a free node must name an allocation
 * node's address, once per graph, and not in both its own and another graph: refused here).
 * Graph objects are not thread-safe, as in CUDA. A kernel node's kernel is a CUfunction, a
 * CUkernel cast to one, or (func NULL) the parameters' `kern` in their `ctx`, when added and
 * when changed (the kernel node setters, the generic ones); resolving a CUkernel loads its
 * library into that context (module.c). */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define PTSZ(s) ((s) ? (s) : (CUstream)(uintptr_t)2)
#define MAX_BODIES 1024

enum { HAS_ALLOC = 1, HAS_FREE = 2, HAS_COND = 4 };
#define MEM_NODES (HAS_ALLOC | HAS_FREE)

/* ---- graphs and nodes ---- */

static int graph_ok(const struct CUgraph_st *g) {
    return g && g->magic == GRAPH_MAGIC && !g->destroyed;
}

static int node_ok(const struct CUgraphNode_st *n) { return n && n->magic == NODE_MAGIC; }

struct CUgraph_st *sim_graph_new(int gidx) {
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->magic = GRAPH_MAGIC;
    g->gidx = gidx;
    return g;
}

static void graph_free(struct CUgraph_st *g);

static void node_free(struct CUgraphNode_st *n) {
    if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) sim_gmem_node_gone(n);
    if (n->child) graph_free(n->child);
    for (unsigned i = 0; i < n->nbodies; i++) graph_free(n->bodies[i]);
    free(n->bodies);
    n->magic = 0;
    free(n);
}

static void graph_clear(struct CUgraph_st *g) {
    for (int i = 0; i < g->nnodes; i++) node_free(g->node[i]);
    free(g->node);
    g->node = NULL;
    g->nnodes = g->cap = 0;
}

static void graph_free(struct CUgraph_st *g) {
    graph_clear(g);
    g->magic = 0;
    free(g);
}

static struct CUgraphNode_st *append(struct CUgraph_st *g, int type) {
    if (g->nnodes == g->cap) {
        int nc = g->cap ? g->cap * 2 : 8;
        struct CUgraphNode_st **n = realloc(g->node, (size_t)nc * sizeof *n);
        if (!n) return NULL;
        g->node = n;
        g->cap = nc;
    }
    struct CUgraphNode_st *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->magic = NODE_MAGIC;
    n->type = type;
    n->owner = g;
    n->gidx = -1;
    g->node[g->nnodes++] = n;
    return n;
}

/* What a graph holds, its child graphs and bodies included (HAS_*). */
static int contents(const struct CUgraph_st *g) {
    int c = 0;
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) c |= HAS_ALLOC;
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_FREE) c |= HAS_FREE;
        if (n->type == CU_GRAPH_NODE_TYPE_CONDITIONAL) c |= HAS_COND;
        if (n->child) c |= contents(n->child);
        for (unsigned b = 0; b < n->nbodies; b++) c |= contents(n->bodies[b]);
    }
    return c;
}

/* The device the graph's allocation nodes are on: -1 none, -2 more than one (allocation
 * nodes on two devices in one graph are not simulated). */
static int mem_device(const struct CUgraph_st *g) {
    int dev = -1;
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        int d = n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? n->gidx : n->child ? mem_device(n->child) : -1;
        if (d == -2 || (d >= 0 && dev >= 0 && d != dev)) return -2;
        if (d >= 0) dev = d;
    }
    return dev;
}

static struct CUgraph_st *up(const struct CUgraph_st *g) {
    return g->parent ? g->parent->owner : NULL;
}

static struct CUgraph_st *root_of(struct CUgraph_st *g) {
    while (up(g)) g = up(g);
    return g;
}

/* `a` is `g` or one of the graphs `g` is nested in */
static int encloses(const struct CUgraph_st *a, const struct CUgraph_st *g) {
    for (const struct CUgraph_st *p = g; p; p = up(p))
        if (p == a) return 1;
    return 0;
}

/* `g` lies inside a child graph node's graph, at any depth */
static int inside_child_graph(const struct CUgraph_st *g) {
    for (const struct CUgraph_st *p = g; p->parent; p = up(p))
        if (p->parent->type == CU_GRAPH_NODE_TYPE_GRAPH) return 1;
    return 0;
}

/* Allocation nodes on `gidx` may join `g` (one device per graph, see mem_device). */
static CUresult same_device(struct CUgraph_st *g, int gidx) {
    int have = mem_device(root_of(g));
    return have == -2 || (have >= 0 && have != gidx) ? CUDA_ERROR_NOT_SUPPORTED : CUDA_SUCCESS;
}

static struct CUgraph_st *clone_graph(const struct CUgraph_st *src, int keep_origin);

static struct CUgraphNode_st *clone_node(struct CUgraph_st *into, const struct CUgraphNode_st *n,
                                         int keep_origin) {
    struct CUgraphNode_st *c = append(into, n->type);
    if (!c) return NULL;
    c->ns = n->ns;
    c->lmem = n->lmem;
    c->alloc = n->alloc;
    c->gidx = n->gidx;
    c->dptr = n->dptr;
    c->cond_type = n->cond_type;
    c->origin = keep_origin ? n->origin : (struct CUgraphNode_st *)n;
    if (n->child) {
        if (!(c->child = clone_graph(n->child, 0))) return NULL;
        c->child->parent = c;
        c->child->moved = n->child->moved;
    }
    if (n->nbodies) {
        if (!(c->bodies = calloc(n->nbodies, sizeof *c->bodies))) return NULL;
        for (unsigned b = 0; b < n->nbodies; b++, c->nbodies++) {
            if (!(c->bodies[b] = clone_graph(n->bodies[b], 0))) return NULL;
            c->bodies[b]->parent = c;
        }
    }
    return c;
}

/* A deep copy; each copied node names the node it was copied from (`origin`), or keeps that
 * node's own origin with keep_origin. */
static struct CUgraph_st *clone_graph(const struct CUgraph_st *src, int keep_origin) {
    struct CUgraph_st *g = sim_graph_new(src->gidx);
    if (!g) return NULL;
    for (int i = 0; i < src->nnodes; i++)
        if (!clone_node(g, src->node[i], keep_origin)) {
            graph_free(g);
            return NULL;
        }
    return g;
}

/* Moves the nodes of `from` (freed) into `into`, which keeps its handle. */
static void adopt(struct CUgraph_st *into, struct CUgraph_st *from) {
    graph_clear(into);
    into->node = from->node;
    into->nnodes = from->nnodes;
    into->cap = from->cap;
    for (int i = 0; i < into->nnodes; i++) into->node[i]->owner = into;
    from->node = NULL;
    from->nnodes = from->cap = 0;
    graph_free(from);
}

/* ---- adding nodes ---- */

static CUresult add_kernel(CUgraphNode *out, struct CUgraph_st *g, int64_t ns, uint64_t lmem) {
    struct CUgraphNode_st *n = append(g, CU_GRAPH_NODE_TYPE_KERNEL);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->ns = ns;
    n->lmem = lmem;
    if (out) *out = n;
    return CUDA_SUCCESS;
}

/* What a kernel node runs, as cuda.h describes CUDA_KERNEL_NODE_PARAMS(_v2/_v3): `f`, a
 * CUfunction or a CUkernel cast to one (resolved in the current context); when `f` is NULL,
 * `kern` ("will only be referenced if func is NULL") in `ctx` (the current context when
 * NULL; only the v2 and v3 parameters have these two fields). Resolving a CUkernel loads its
 * library into that context (lazy loading, module.c). */
typedef struct {
    CUfunction f;
    void *kern;
    CUcontext ctx;
    unsigned gx, gy, gz;
    void **params, **extra;
} kernel_args_t;

#define KERNEL_ARGS_V1(p)                                                                        ((kernel_args_t){(p)->func, NULL, NULL, (p)->gridDimX, (p)->gridDimY, (p)->gridDimZ,                           (p)->kernelParams, (p)->extra})
#define KERNEL_ARGS_V2(p)                                                                        ((kernel_args_t){(p)->func, (p)->kern, (p)->ctx, (p)->gridDimX, (p)->gridDimY,                                 (p)->gridDimZ, (p)->kernelParams, (p)->extra})

/* The node's duration and its function's local memory, its kernel resolved first. */
static CUresult kernel_ns(const kernel_args_t *a, int64_t *ns, uint64_t *lmem) {
    CUfunction f = a->f;
    struct CUkern_st *k = NULL;
    struct CUctx_st *c = sim_current_ctx();
    if (f && f->magic == KERNEL_MAGIC) {
        k = (struct CUkern_st *)(void *)f;
    } else if (!f && a->kern) {
        k = a->kern;
        if (a->ctx) {
            if (a->ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
            c = a->ctx;
        }
    }
    if (k) {
        if (!c) return CUDA_ERROR_INVALID_CONTEXT;
        CUresult r = sim_kernel_function(k, c, &f);
        if (r) return r;
    }
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = sim_function_load(f); /* a kernel node's code is loaded with the node */
    if (r) return r;
    *ns = sim_kernel_duration(f, a->gx, a->gy, a->gz, a->params, a->extra);
    *lmem = f->local_bytes;
    return CUDA_SUCCESS;
}

static CUresult kernel_node(CUgraphNode *out, CUgraph g, kernel_args_t a) {
    if (!out || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    int64_t ns;
    uint64_t lmem;
    CUresult r = kernel_ns(&a, &ns, &lmem); /* node parameters are captured when added */
    return r ? r : add_kernel(out, g, ns, lmem);
}

/* Allocation and free nodes go only into a graph no node owns. */
static CUresult takes_memory_nodes(const struct CUgraph_st *g) {
    return g->parent ? CUDA_ERROR_NOT_SUPPORTED : CUDA_SUCCESS;
}

static CUresult add_alloc(CUgraphNode *out, struct CUgraph_st *g, int gidx,
                          CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    if (!p->bytesize) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = takes_memory_nodes(g);
    if (!r) r = same_device(g, gidx);
    if (r) return r;
    struct CUgraphNode_st *n = append(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->alloc = *p;
    n->alloc.accessDescs = NULL; /* owned by the caller: not kept */
    n->alloc.accessDescCount = 0;
    n->alloc.dptr = sim_next_address(p->bytesize);
    n->gidx = gidx;
    if (sim_gmem_node_added(n, n->alloc.dptr, p->bytesize, gidx) != CUDA_SUCCESS) {
        g->nnodes--;
        node_free(n);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->dptr = n->alloc.dptr;
    if (g->gidx < 0) g->gidx = gidx;
    if (out) *out = n;
    return CUDA_SUCCESS;
}

static CUresult alloc_node(CUgraphNode *out, CUgraph g, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    if (!out || !graph_ok(g) || !p) return CUDA_ERROR_INVALID_VALUE;
    if (p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    int gidx;
    CUresult r = sim_device_gidx(p->poolProps.location.id, &gidx);
    if (r) return r;
    return add_alloc(out, g, gidx, p);
}

/* A free node for dptr somewhere in g (child graphs included). */
static int frees_in(const struct CUgraph_st *g, CUdeviceptr dptr) {
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_FREE && n->dptr == dptr) return 1;
        if (n->child && frees_in(n->child, dptr)) return 1;
    }
    return 0;
}

/* cuda.h: a free node must name an allocation node's address, at most once per graph; an
 * allocation freed in its own graph cannot be freed in another, nor one freed in another
 * graph in its own. */
static CUresult add_free(CUgraphNode *out, struct CUgraph_st *g, CUdeviceptr dptr) {
    CUresult r = takes_memory_nodes(g);
    if (r) return r;
    struct CUgraphNode_st *an;
    int elsewhere;
    if (sim_gmem_lookup(dptr, &an, &elsewhere) != 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *root = root_of(g), *home = an ? root_of(an->owner) : NULL;
    int own = home == root;
    if (frees_in(root, dptr) || (own && elsewhere) || (!own && home && frees_in(home, dptr)))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphNode_st *n = append(g, CU_GRAPH_NODE_TYPE_MEM_FREE);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->dptr = dptr;
    if (!own) sim_gmem_freed_elsewhere(dptr);
    if (out) *out = n;
    return CUDA_SUCCESS;
}

static CUresult add_empty(CUgraphNode *out, CUgraph g) {
    if (!out || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    return append(g, CU_GRAPH_NODE_TYPE_EMPTY) ? (*out = g->node[g->nnodes - 1], CUDA_SUCCESS)
                                               : CUDA_ERROR_OUT_OF_MEMORY;
}

/* A child graph node: CLONE copies a graph without memory or conditional nodes; MOVE hands
 * a graph no node owns to the parent, memory nodes and all. */
static CUresult add_child(CUgraphNode *out, CUgraph g, CUgraph child, int ownership) {
    if (!out || !graph_ok(g) || !graph_ok(child)) return CUDA_ERROR_INVALID_VALUE;
    int c = contents(child);
    if (c & HAS_COND) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *owned;
    if (ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE) {
        if (c & MEM_NODES) return CUDA_ERROR_INVALID_VALUE;
        if (!(owned = clone_graph(child, 0))) return CUDA_ERROR_OUT_OF_MEMORY;
    } else if (ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) {
        if (child->parent || child->capturing || child->execs || encloses(child, g))
            return CUDA_ERROR_INVALID_VALUE;
        if (c & MEM_NODES) {
            CUresult r = takes_memory_nodes(g);
            int dev = mem_device(child);
            if (!r && dev != -1) r = dev == -2 ? CUDA_ERROR_NOT_SUPPORTED : same_device(g, dev);
            if (r) return r;
        }
        owned = child;
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct CUgraphNode_st *n = append(g, CU_GRAPH_NODE_TYPE_GRAPH);
    if (!n) {
        if (owned != child) graph_free(owned);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    n->child = owned;
    owned->parent = n;
    owned->moved = owned == child;
    *out = n;
    return CUDA_SUCCESS;
}

/* ---- conditional nodes (CUDA 12.3+) ---- */

typedef struct {
    struct CUgraph_st *graph;
    CUcontext ctx;
} cond_handle_t;

static cond_handle_t *handles;
static size_t nhandles, cap_handles;
static pthread_mutex_t handle_lock = PTHREAD_MUTEX_INITIALIZER;

SIM_EXPORT CUresult cuGraphConditionalHandleCreate(CUgraphConditionalHandle *out, CUgraph g,
                                                   CUcontext ctx, unsigned int value,
                                                   unsigned int flags) {
    (void)value;
    if (!out || !graph_ok(g) || !ctx || ctx->magic != CTX_MAGIC || flags > CU_GRAPH_COND_ASSIGN_DEFAULT)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&handle_lock);
    if (nhandles == cap_handles) {
        size_t nc = cap_handles ? cap_handles * 2 : 16;
        cond_handle_t *n = realloc(handles, nc * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&handle_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        handles = n;
        cap_handles = nc;
    }
    handles[nhandles++] = (cond_handle_t){g, ctx};
    *out = nhandles; /* index + 1 */
    pthread_mutex_unlock(&handle_lock);
    return CUDA_SUCCESS;
}

/* Its body graphs hold kernels, empty nodes, child graphs, memsets, memcopies and
 * conditionals: never memory nodes (takes_memory_nodes refuses them in any owned graph). */
static CUresult add_conditional(CUgraphNode *out, CUgraph g, CUDA_CONDITIONAL_NODE_PARAMS *p) {
    if (!out || !graph_ok(g) || !p || !p->ctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&handle_lock);
    cond_handle_t h = p->handle && p->handle <= nhandles ? handles[p->handle - 1]
                                                         : (cond_handle_t){NULL, NULL};
    pthread_mutex_unlock(&handle_lock);
    if (!h.graph || !encloses(h.graph, g) || h.ctx != p->ctx) return CUDA_ERROR_INVALID_VALUE;
    if (inside_child_graph(g)) return CUDA_ERROR_INVALID_VALUE; /* child graphs have none */
    unsigned size = p->size;
    int ok = (p->type == CU_GRAPH_COND_TYPE_IF && (size == 1 || size == 2)) ||
             (p->type == CU_GRAPH_COND_TYPE_WHILE && size == 1) ||
             (p->type == CU_GRAPH_COND_TYPE_SWITCH && size >= 1 && size <= MAX_BODIES);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphNode_st *n = append(g, CU_GRAPH_NODE_TYPE_CONDITIONAL);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->cond_type = p->type;
    if (!(n->bodies = calloc(size, sizeof *n->bodies))) return CUDA_ERROR_OUT_OF_MEMORY;
    for (; n->nbodies < size; n->nbodies++) {
        struct CUgraph_st *b = sim_graph_new(g->gidx);
        if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
        b->parent = n;
        n->bodies[n->nbodies] = b;
    }
    p->phGraph_out = n->bodies;
    *out = n;
    return CUDA_SUCCESS;
}

/* ---- the node APIs ---- */

SIM_EXPORT CUresult cuGraphCreate(CUgraph *pg, unsigned int flags) {
    if (!pg || flags) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_current_ctx();
    struct CUgraph_st *g = sim_graph_new(c ? c->gidx : -1);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    *pg = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                            size_t ndeps, const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    (void)deps;
    (void)ndeps;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    return kernel_node(node, g, KERNEL_ARGS_V2(p));
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                         size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *p) {
    (void)deps;
    (void)ndeps;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    return kernel_node(node, g, KERNEL_ARGS_V1(p));
}

SIM_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                        size_t ndeps) {
    (void)deps;
    (void)ndeps;
    return add_empty(node, g);
}

SIM_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                           size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    (void)deps;
    (void)ndeps;
    return alloc_node(node, g, p);
}

SIM_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, CUdeviceptr dptr) {
    (void)deps;
    (void)ndeps;
    if (!node || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    return add_free(node, g, dptr);
}

/* The node is cloned from childGraph, which must have no allocation, free or conditional
 * nodes (cuda.h). */
SIM_EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                             size_t ndeps, CUgraph child) {
    (void)deps;
    (void)ndeps;
    return add_child(node, g, child, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE);
}

/* CUDA 12.2+'s generic node; other node types are not simulated. */
static CUresult add_generic_node(CUgraphNode *node, CUgraph g, CUgraphNodeParams *p) {
    if (!p || p->reserved0[0] || p->reserved0[1] || p->reserved0[2] || p->reserved2)
        return CUDA_ERROR_INVALID_VALUE;
    switch (p->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL:
        return kernel_node(node, g, KERNEL_ARGS_V2(&p->kernel));
    case CU_GRAPH_NODE_TYPE_EMPTY: return add_empty(node, g);
    case CU_GRAPH_NODE_TYPE_GRAPH: return add_child(node, g, p->graph.graph, p->graph.ownership);
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: return alloc_node(node, g, &p->alloc);
    case CU_GRAPH_NODE_TYPE_MEM_FREE: return cuGraphAddMemFreeNode(node, g, NULL, 0, p->free_dptr);
    case CU_GRAPH_NODE_TYPE_CONDITIONAL: return add_conditional(node, g, &p->conditional);
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
}

SIM_EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                   size_t ndeps, CUgraphNodeParams *p) {
    (void)deps;
    (void)ndeps;
    return add_generic_node(node, g, p);
}

SIM_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                      const CUgraphEdgeData *edges, size_t ndeps,
                                      CUgraphNodeParams *p) {
    (void)deps;
    (void)edges;
    (void)ndeps;
    return add_generic_node(node, g, p);
}

/* ---- queries ---- */

SIM_EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *num) {
    if (!graph_ok(g) || !num) return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *num = (size_t)g->nnodes;
        return CUDA_SUCCESS;
    }
    size_t k = *num < (size_t)g->nnodes ? *num : (size_t)g->nnodes;
    for (size_t i = 0; i < *num; i++) nodes[i] = i < k ? g->node[i] : NULL;
    *num = k;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphNodeGetType(CUgraphNode n, int *type) {
    if (!node_ok(n) || !type) return CUDA_ERROR_INVALID_VALUE;
    *type = n->type;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, CUDA_MEM_ALLOC_NODE_PARAMS *out) {
    if (!node_ok(n) || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || !out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = n->alloc;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode n, CUdeviceptr *out) {
    if (!node_ok(n) || n->type != CU_GRAPH_NODE_TYPE_MEM_FREE || !out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = n->dptr;
    return CUDA_SUCCESS;
}

/* The node keeps ownership; no allocation or free node can be added to the graph. */
SIM_EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode n, CUgraph *out) {
    if (!node_ok(n) || n->type != CU_GRAPH_NODE_TYPE_GRAPH || !out)
        return CUDA_ERROR_INVALID_VALUE;
    *out = n->child;
    return CUDA_SUCCESS;
}

/* ---- changing graphs ---- */

SIM_EXPORT CUresult cuGraphClone(CUgraph *out, CUgraph g) {
    if (!out || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    if (contents(g) & (MEM_NODES | HAS_COND)) return CUDA_ERROR_NOT_SUPPORTED;
    struct CUgraph_st *c = clone_graph(g, 0);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *out = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphDestroyNode(CUgraphNode n) {
    if (!node_ok(n)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = n->owner;
    if (contents(g) & MEM_NODES) return CUDA_ERROR_INVALID_VALUE;
    int i = 0;
    while (i < g->nnodes && g->node[i] != n) i++;
    if (i == g->nnodes) return CUDA_ERROR_INVALID_VALUE;
    memmove(&g->node[i], &g->node[i + 1], (size_t)(g->nnodes - i - 1) * sizeof g->node[0]);
    g->nnodes--;
    node_free(n);
    return CUDA_SUCCESS;
}

/* A graph a node owns is destroyed with that node. */
SIM_EXPORT CUresult cuGraphDestroy(CUgraph g) {
    if (!graph_ok(g) || g->parent) return CUDA_ERROR_INVALID_VALUE;
    if (g->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    if (!g->execs) {
        graph_free(g);
        return CUDA_SUCCESS;
    }
    graph_clear(g); /* its executable graphs run their own copies */
    g->destroyed = 1;
    return CUDA_SUCCESS;
}

/* A kernel node's parameters changed (its kernel may be a CUkernel now). */
static CUresult kernel_set(CUgraphNode n, kernel_args_t a) {
    if (!node_ok(n) || n->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
    return kernel_ns(&a, &n->ns, &n->lmem);
}

SIM_EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    return p ? kernel_set(n, KERNEL_ARGS_V2(p)) : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGraphKernelNodeSetParams(CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS *p) {
    return p ? kernel_set(n, KERNEL_ARGS_V1(p)) : CUDA_ERROR_INVALID_VALUE;
}

/* Allocation and free nodes cannot be changed. A child graph node takes a copy of a graph
 * without memory or conditional nodes, and cannot drop the memory nodes it has. */
SIM_EXPORT CUresult cuGraphNodeSetParams(CUgraphNode n, CUgraphNodeParams *p) {
    if (!node_ok(n) || !p || p->type != n->type) return CUDA_ERROR_INVALID_VALUE;
    switch (n->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL: return kernel_set(n, KERNEL_ARGS_V2(&p->kernel));
    case CU_GRAPH_NODE_TYPE_EMPTY: return CUDA_SUCCESS;
    case CU_GRAPH_NODE_TYPE_GRAPH: {
        if (p->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) return CUDA_ERROR_NOT_SUPPORTED;
        if (p->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE || !graph_ok(p->graph.graph) ||
            (contents(p->graph.graph) & (MEM_NODES | HAS_COND)))
            return CUDA_ERROR_INVALID_VALUE;
        if (contents(n->child) & MEM_NODES) return CUDA_ERROR_NOT_SUPPORTED;
        struct CUgraph_st *c = clone_graph(p->graph.graph, 0);
        if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
        adopt(n->child, c);
        return CUDA_SUCCESS;
    }
    default: return CUDA_ERROR_NOT_SUPPORTED; /* memory nodes: "not supported" (cuda.h) */
    }
}

/* ---- instantiation ---- */

#define KNOWN_FLAGS                                                                          \
    (CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD |   \
     CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)

/* Device-launch graphs: kernels and child graphs only (no memory nodes), one kernel at least. */
static int device_launchable(const struct CUgraph_st *g, int *kernels) {
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        if (n->type == CU_GRAPH_NODE_TYPE_KERNEL) (*kernels)++;
        else if (n->type != CU_GRAPH_NODE_TYPE_GRAPH || !device_launchable(n->child, kernels))
            return 0;
    }
    return 1;
}

typedef struct {
    int64_t ns;
    int kernels;
    uint64_t nodes;
    uint64_t lmem; /* the most local memory per thread of a kernel */
} needs_t;

/* What running a graph takes: conditional bodies are counted once each. */
static void needs(const struct CUgraph_st *g, needs_t *out) {
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        out->nodes++;
        if (n->type == CU_GRAPH_NODE_TYPE_KERNEL) {
            out->ns += n->ns;
            out->kernels++;
            if (n->lmem > out->lmem) out->lmem = n->lmem;
        }
        if (n->child) needs(n->child, out);
        for (unsigned b = 0; b < n->nbodies; b++) needs(n->bodies[b], out);
    }
}

/* The memory nodes of a graph (child graphs included): allocations (address, size) and
 * the addresses its free nodes free. */
typedef struct {
    uint64_t *alloc, *size, *freed;
    int nalloc, nsize, nfreed, cap_alloc, cap_size, cap_freed;
} mem_nodes_t;

static int push_u64(uint64_t **arr, int *n, int *cap, uint64_t v) {
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 16;
        uint64_t *p = realloc(*arr, (size_t)nc * sizeof *p);
        if (!p) return -1;
        *arr = p;
        *cap = nc;
    }
    (*arr)[(*n)++] = v;
    return 0;
}

static int collect(const struct CUgraph_st *g, mem_nodes_t *m) {
    for (int i = 0; i < g->nnodes; i++) {
        const struct CUgraphNode_st *n = g->node[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC &&
            (push_u64(&m->alloc, &m->nalloc, &m->cap_alloc, n->alloc.dptr) ||
             push_u64(&m->size, &m->nsize, &m->cap_size, n->alloc.bytesize)))
            return -1;
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_FREE &&
            push_u64(&m->freed, &m->nfreed, &m->cap_freed, n->dptr))
            return -1;
        if (n->child && collect(n->child, m)) return -1;
    }
    return 0;
}

static int in_list(const uint64_t *l, int n, uint64_t v) {
    for (int i = 0; i < n; i++)
        if (l[i] == v) return 1;
    return 0;
}

/* What the executable graph's copy takes from the graph memory pool at a launch: the
 * allocations it leaves allocated (keep), the size of those it frees itself, and the
 * other graphs' allocations it frees. 0, or -1 out of host memory. */
static int refresh_memory(struct CUgraphExec_st *e) {
    mem_nodes_t m;
    memset(&m, 0, sizeof m);
    uint64_t *keep = NULL, *frees = NULL;
    int nkeep = 0, cap_keep = 0, nfrees = 0, cap_frees = 0, rc = collect(e->snap, &m);
    uint64_t keep_backed = 0, temp_backed = 0;
    for (int i = 0; !rc && i < m.nalloc; i++) {
        uint64_t b = sim_gmem_backed(m.size[i]);
        if (in_list(m.freed, m.nfreed, m.alloc[i])) {
            temp_backed = temp_backed > UINT64_MAX - b ? UINT64_MAX : temp_backed + b;
        } else {
            keep_backed = keep_backed > UINT64_MAX - b ? UINT64_MAX : keep_backed + b;
            rc = push_u64(&keep, &nkeep, &cap_keep, m.alloc[i]);
        }
    }
    for (int i = 0; !rc && i < m.nfreed; i++)
        if (!in_list(m.alloc, m.nalloc, m.freed[i])) rc = push_u64(&frees, &nfrees, &cap_frees, m.freed[i]);
    free(m.alloc);
    free(m.size);
    free(m.freed);
    if (rc) {
        free(keep);
        free(frees);
        return -1;
    }
    free(e->keep);
    free(e->frees);
    e->keep = keep;
    e->nkeep = nkeep;
    e->frees = frees;
    e->nfrees = nfrees;
    e->keep_backed = keep_backed;
    e->temp_backed = temp_backed;
    return 0;
}

static int refresh(struct CUgraphExec_st *e) {
    needs_t nd = {0, 0, 0, 0};
    needs(e->snap, &nd);
    e->total_ns = nd.ns;
    e->kernels = nd.kernels;
    e->lmem = nd.lmem;
    e->mem_gidx = mem_device(e->snap);
    return refresh_memory(e);
}

static void exec_free(struct CUgraphExec_st *e) {
    if (e->work_bytes) sim_uncharge(e->work_gidx, e->work_bytes);
    struct CUgraph_st *src = e->src;
    if (--src->execs == 0 && src->destroyed) graph_free(src);
    graph_free(e->snap);
    free(e->keep);
    free(e->frees);
    e->magic = 0;
    free(e);
}

/* An executable graph keeps its work on its graph's GPU (its context's when the graph has
 * none yet): NVIDIA does not document where, when or how much, so a fixed size per node,
 * from its instantiation or from its first upload or launch (graph_work_at: cuda.h says an
 * upload "uploads the work"), once. */
static CUresult take_work(struct CUgraphExec_st *e) {
    if (e->work_taken) return CUDA_SUCCESS;
    needs_t nd = {0, 0, 0, 0};
    needs(e->snap, &nd);
    struct CUctx_st *c = sim_current_ctx();
    int gidx = e->snap->gidx >= 0 ? e->snap->gidx : c ? c->gidx : 0;
    uint64_t per = g_sim_cfg.graph_node_bytes;
    if (!per || !nd.nodes) return CUDA_SUCCESS;
    if (nd.nodes > UINT64_MAX / per) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = sim_charge(gidx, nd.nodes * per);
    if (r == CUDA_SUCCESS) {
        e->work_bytes = nd.nodes * per;
        e->work_gidx = gidx;
        e->work_taken = 1;
    }
    return r;
}

static CUresult instantiate(CUgraphExec *pe, CUgraph g, unsigned long long flags) {
    if (!pe || !graph_ok(g) || g->moved || g->capturing) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long dev_auto =
        CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
    if ((flags & ~KNOWN_FLAGS) || (flags & dev_auto) == dev_auto) return CUDA_ERROR_INVALID_VALUE;
    int kernels = 0;
    if ((flags & CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH) &&
        (!device_launchable(g, &kernels) || !kernels))
        return CUDA_ERROR_INVALID_VALUE;
    if ((contents(g) & MEM_NODES) && g->execs) return CUDA_ERROR_INVALID_VALUE; /* one at a time */
    if (mem_device(g) == -2) return CUDA_ERROR_NOT_SUPPORTED;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!(e->snap = clone_graph(g, 0))) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    e->magic = EXEC_MAGIC;
    e->src = g;
    e->flags = flags;
    e->id = sim_gmem_new_exec_id();
    g->execs++;
    if (refresh(e) != 0 || (!g_sim_cfg.graph_work_at_use && take_work(e) != CUDA_SUCCESS)) {
        exec_free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pe = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                                unsigned long long flags) {
    if (flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) /* only cuGraphInstantiateWithParams */
        return CUDA_ERROR_INVALID_VALUE;
    return instantiate(pe, g, flags);
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, CUgraphNode *err_node,
                                          char *log, size_t log_size) {
    if (err_node) *err_node = NULL;
    if (log && log_size) log[0] = 0;
    return instantiate(pe, g, 0);
}

SIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g, CUgraphNode *err_node,
                                       char *log, size_t log_size) {
    return cuGraphInstantiate_v2(pe, g, err_node, log, log_size);
}

typedef struct {
    unsigned long long flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out;
} graph_instantiate_params_t; /* CUDA_GRAPH_INSTANTIATE_PARAMS */

static CUresult upload(struct CUgraphExec_st *e, CUstream hs);

static CUresult instantiate_with_params(CUgraphExec *pe, CUgraph g, graph_instantiate_params_t *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    p->hErrNode_out = NULL;
    CUresult r = instantiate(pe, g, p->flags);
    if (!r && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) {
        r = upload(*pe, p->hUploadStream);
        if (r) {
            exec_free(*pe);
            *pe = NULL;
        }
    }
    p->result_out = r ? 1 : 0; /* CUDA_GRAPH_INSTANTIATE_SUCCESS / _ERROR */
    return r;
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
                                                 graph_instantiate_params_t *p) {
    return instantiate_with_params(pe, g, p);
}

SIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *pe, CUgraph g,
                                                      graph_instantiate_params_t *p) {
    return instantiate_with_params(pe, g, p);
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    if (!e || e->magic != EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    exec_free(e);
    return CUDA_SUCCESS;
}

/* ---- updating executable graphs ---- */

static int exec_ok(const struct CUgraphExec_st *e) { return e && e->magic == EXEC_MAGIC; }

/* 0 when `b` has the topology and node types of `a` (child graphs and bodies too), else the
 * CU_GRAPH_EXEC_UPDATE_ERROR_* that says why. Allocation node sizes may differ. */
static int shape_diff(const struct CUgraph_st *a, const struct CUgraph_st *b) {
    if (a->nnodes != b->nnodes) return CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
    for (int i = 0; i < a->nnodes; i++) {
        const struct CUgraphNode_st *x = a->node[i], *y = b->node[i];
        if (x->type != y->type) return CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED;
        if (x->type == CU_GRAPH_NODE_TYPE_CONDITIONAL &&
            (x->cond_type != y->cond_type || x->nbodies != y->nbodies))
            return CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED;
        int d = x->child ? shape_diff(x->child, y->child) : 0;
        for (unsigned k = 0; !d && k < x->nbodies; k++) d = shape_diff(x->bodies[k], y->bodies[k]);
        if (d) return d == CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED ? d
                                                                      : CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
    }
    return 0;
}

/* The node of `b` a shape difference is reported on (NULL when the node counts differ). */
static struct CUgraphNode_st *diff_node(const struct CUgraph_st *a, const struct CUgraph_st *b) {
    if (a->nnodes != b->nnodes) return NULL;
    for (int i = 0; i < a->nnodes; i++) {
        struct CUgraph_st one_a = {.node = &a->node[i], .nnodes = 1};
        struct CUgraph_st one_b = {.node = &b->node[i], .nnodes = 1};
        if (shape_diff(&one_a, &one_b)) return b->node[i];
    }
    return NULL;
}

static CUresult exec_update(CUgraphExec e, CUgraph h, CUgraphExecUpdateResultInfo *info) {
    CUgraphExecUpdateResultInfo res = {CU_GRAPH_EXEC_UPDATE_ERROR, NULL, NULL};
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (exec_ok(e) && graph_ok(h) && !h->moved) { /* a moved graph cannot be an argument */
        int d = shape_diff(e->snap, h);
        if (!d && mem_device(h) == -2) d = CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED;
        struct CUgraph_st *snap = d ? NULL : clone_graph(h, 0);
        if (d) {
            res.result = d;
            res.errorNode = diff_node(e->snap, h);
            r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
        } else if (!snap) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            /* the copy still stands for the nodes of the graph it was instantiated from */
            for (int i = 0; i < snap->nnodes; i++) snap->node[i]->origin = e->snap->node[i]->origin;
            graph_free(e->snap);
            e->snap = snap;
            (void)refresh(e); /* out of host memory: the memory lists stay the old ones */
            res.result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
            r = CUDA_SUCCESS;
        }
    }
    if (info) *info = res;
    return r;
}

SIM_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph h, CUgraphExecUpdateResultInfo *info) {
    return exec_update(e, h, info);
}

SIM_EXPORT CUresult cuGraphExecUpdate(CUgraphExec e, CUgraph h, CUgraphNode *err_node, int *result) {
    CUgraphExecUpdateResultInfo info;
    CUresult r = exec_update(e, h, &info);
    if (err_node) *err_node = info.errorNode;
    if (result) *result = info.result;
    return r;
}

/* The executable graph's copy of `n`, a node of the graph it was instantiated from. */
static struct CUgraphNode_st *exec_twin(struct CUgraphExec_st *e, CUgraphNode n) {
    if (!exec_ok(e) || !node_ok(n) || n->owner != e->src) return NULL;
    for (int i = 0; i < e->snap->nnodes; i++)
        if (e->snap->node[i]->origin == n) return e->snap->node[i];
    return NULL;
}

/* childGraph must have the topology of the node's graph; its parameters (allocation sizes
 * included) replace those of the executable graph's copy. */
static CUresult exec_child_set(CUgraphExec e, CUgraphNode n, CUgraph child) {
    struct CUgraphNode_st *t = exec_twin(e, n);
    if (!t || t->type != CU_GRAPH_NODE_TYPE_GRAPH || !graph_ok(child) || child->moved ||
        shape_diff(t->child, child))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *c = clone_graph(child, 0);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUgraph_st *old = t->child;
    t->child = c;
    c->parent = t;
    c->moved = old->moved;
    if (mem_device(e->snap) == -2) {
        t->child = old;
        graph_free(c);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    graph_free(old);
    (void)refresh(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec e, CUgraphNode n, CUgraph child) {
    return exec_child_set(e, n, child);
}

/* A kernel node's parameters changed in the executable graph's copy. cuda.h's rule that
 * the function's owning context cannot change is not checked (nodes do not record it). */
static CUresult exec_kernel_set(CUgraphExec e, CUgraphNode n, kernel_args_t a) {
    struct CUgraphNode_st *t = exec_twin(e, n);
    if (!t || t->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = kernel_ns(&a, &t->ns, &t->lmem);
    if (!r) (void)refresh(e);
    return r;
}

SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode n,
                                                      const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    return p ? exec_kernel_set(e, n, KERNEL_ARGS_V2(p)) : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec e, CUgraphNode n,
                                                   const CUDA_KERNEL_NODE_PARAMS *p) {
    return p ? exec_kernel_set(e, n, KERNEL_ARGS_V1(p)) : CUDA_ERROR_INVALID_VALUE;
}

/* Allocation and free nodes: "API unsupported" (cuda.h). */
SIM_EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec e, CUgraphNode n, CUgraphNodeParams *p) {
    struct CUgraphNode_st *t = exec_twin(e, n);
    if (!t || !p || p->type != t->type) return CUDA_ERROR_INVALID_VALUE;
    switch (t->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL: return exec_kernel_set(e, n, KERNEL_ARGS_V2(&p->kernel));
    case CU_GRAPH_NODE_TYPE_EMPTY: return CUDA_SUCCESS;
    case CU_GRAPH_NODE_TYPE_GRAPH: return exec_child_set(e, n, p->graph.graph);
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
}

/* ---- upload and launch ---- */

/* The device an executable graph's allocations are on (its context's without any). */
static int mem_dev(const struct CUgraphExec_st *e, const struct CUctx_st *c) {
    return e->mem_gidx >= 0 ? e->mem_gidx : e->snap->gidx >= 0 ? e->snap->gidx : c->gidx;
}

/* A graph's allocation nodes take their memory from the device's graph pool (graphmem.c)
 * when the graph is uploaded or launched. */
static CUresult upload(struct CUgraphExec_st *e, CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!exec_ok(e)) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    r = take_work(e);
    return r ? r : sim_gmem_upload(e, mem_dev(e, c));
}

SIM_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream hs) { return upload(e, hs); }
SIM_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream hs) { return upload(e, PTSZ(hs)); }

/* Refused while its allocations from a launch before are unfreed (without
 * AUTO_FREE_ON_LAUNCH), or when the graph pool cannot grow to what it needs. */
static CUresult graph_launch(CUgraphExec e, CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!exec_ok(e)) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(hs);
    if (s && s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    r = sim_ctx_local_memory(c, e->lmem);
    if (!r) r = take_work(e);
    if (r) return r;
    int dev = mem_dev(e, c);
    r = sim_gmem_launch(e, dev);
    if (r) return r;
    sim_submit(c, s, e->total_ns, e->kernels);
    sim_gmem_launched(e, dev, c, s);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream hs) { return graph_launch(e, hs); }
SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream hs) { return graph_launch(e, PTSZ(hs)); }

/* ---- what stream capture records ---- */

CUresult sim_graph_capture_begin(struct CUgraph_st *g) {
    if (!graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    g->capturing++;
    return CUDA_SUCCESS;
}

void sim_graph_capture_end(struct CUgraph_st *g) {
    if (g->capturing > 0) g->capturing--;
}

CUresult sim_graph_capture_kernel(struct CUgraph_st *g, int64_t ns, uint64_t lmem) {
    return add_kernel(NULL, g, ns, lmem);
}

/* cuMemAllocAsync / cuMemAllocFromPoolAsync while capturing: an allocation node on the
 * pool's device (its visible ordinal is the node's location). */
CUresult sim_graph_capture_alloc(struct CUgraph_st *g, int gidx, uint64_t size, CUdeviceptr *dptr) {
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = -1;
    for (int v = 0; v < g_sim_nvis; v++)
        if (g_sim_vis[v] == gidx) p.poolProps.location.id = v;
    p.bytesize = size;
    CUresult r = add_alloc(NULL, g, gidx, &p);
    if (!r) *dptr = p.dptr;
    return r;
}

CUresult sim_graph_capture_free(struct CUgraph_st *g, CUdeviceptr dptr) {
    return add_free(NULL, g, dptr);
}
