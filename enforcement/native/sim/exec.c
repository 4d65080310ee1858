/* Simulated execution: one FIFO engine per GPU shared by all processes. Every op queued on
 * a stream (kernel, graph, event record) is placed on the GPU's timeline at
 * max(now, tail); kernels occupy simulated time (see kernel_duration), events take none.
 * Sync calls sleep until the op they wait for ends. */
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define QUEUE_AHEAD_LIMIT_NS 2000000000LL /* push-buffer back-pressure: 2 s of queued work */
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)

struct CUctx_st *sim_stream_ctx(CUstream s) {
    if (s && (uintptr_t)s > 2) return s->magic == STREAM_MAGIC ? s->ctx : NULL;
    return sim_current_ctx(); /* NULL, CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2) */
}

static struct CUstream_st *real_stream(CUstream s) {
    return (s && (uintptr_t)s > 2 && s->magic == STREAM_MAGIC) ? s : NULL;
}

int64_t sim_enqueue(struct CUctx_st *ctx, struct CUstream_st *s, int64_t dur, int kernels) {
    sim_gpu_state_t *st = g_sim_state[ctx->gidx];
    int64_t now = qgpu_now_ns();
    int64_t ahead = __atomic_load_n(&st->tail_ns, __ATOMIC_RELAXED) - now;
    if (dur > 0 && ahead > QUEUE_AHEAD_LIMIT_NS) {
        qgpu_sleep_ns(ahead - QUEUE_AHEAD_LIMIT_NS);
        now = qgpu_now_ns();
    }
    sim_state_lock(st);
    int64_t start = st->tail_ns > now ? st->tail_ns : now;
    int64_t end = start + dur;
    st->tail_ns = end;
    if (dur > 0 || kernels > 0) {
        sim_proc_t *p = sim_state_proc_slot(st, 1);
        st->busy_total_ns += (uint64_t)dur;
        st->launches += (uint64_t)kernels;
        if (p) {
            p->busy_ns += (uint64_t)dur;
            p->last_end_ns = end;
            p->launches += (uint64_t)kernels;
            uint32_t h = p->ring_head % SIM_PROC_RING;
            p->ring_start[h] = start;
            p->ring_end[h] = end;
            p->ring_head = (h + 1) % SIM_PROC_RING;
        }
        sim_state_snapshot(st, now);
    }
    sim_state_unlock(st);
    if (s) s->last_end_ns = end;
    if (end > ctx->last_end_ns) ctx->last_end_ns = end;
    return start;
}

/* The kernel-duration rule: a function named "qgpu_sim_busy" runs for as many nanoseconds as
 * its first parameter (a uint64); any other kernel runs 1 us per block of its grid. */
static int64_t kernel_duration(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                               void **params, void **extra) {
    if (f->busy_kernel) {
        if (params && params[0]) return (int64_t)*(const uint64_t *)params[0];
        for (int i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END; i += 2)
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER && extra[i + 1])
                return (int64_t)*(const uint64_t *)extra[i + 1];
        return 0;
    }
    return (int64_t)gx * gy * gz * 1000;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream hs, void **params, void **extra) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    sim_enqueue(c, real_stream(hs), kernel_duration(f, gx, gy, gz, params, extra), 1);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                   unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                   CUstream hs, void **params, void **extra) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, hs, params, extra);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy,
                                              unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                              unsigned shmem, CUstream hs, void **params) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, hs, params, NULL);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                     void **extra) {
    if (!cfg) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY,
                  cfg->blockDimZ, cfg->hStream, params, extra);
}

/* ---- streams ---- */

SIM_EXPORT CUresult cuStreamCreate(CUstream *ps, unsigned int flags) {
    (void)flags;
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!ps) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->ctx = c;
    *ps = s;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    if (!real_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}

static int64_t stream_end(CUstream hs) {
    struct CUstream_st *s = real_stream(hs);
    if (s) return s->last_end_ns;
    struct CUctx_st *c = sim_current_ctx();
    return c ? c->last_end_ns : 0;
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!sim_stream_ctx(hs)) return CUDA_ERROR_INVALID_CONTEXT;
    qgpu_sleep_until_ns(stream_end(hs));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamQuery(CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!sim_stream_ctx(hs)) return CUDA_ERROR_INVALID_CONTEXT;
    return qgpu_now_ns() >= stream_end(hs) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuStreamIsCapturing(CUstream hs, int *status) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_stream_ctx(hs)) return CUDA_ERROR_INVALID_CONTEXT;
    *status = 0; /* the simulator has no stream capture */
    return CUDA_SUCCESS;
}

/* ---- events ---- */

SIM_EXPORT CUresult cuEventCreate(CUevent *pe, unsigned int flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!sim_current_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!pe) return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    *pe = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy_v2(CUevent e) {
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventRecord(CUevent e, CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    e->ts_ns = sim_enqueue(c, real_stream(hs), 0, 0);
    e->recorded = 1;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventQuery(CUevent e) {
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    return qgpu_now_ns() >= e->ts_ns ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent e) {
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (e->recorded) qgpu_sleep_until_ns(e->ts_ns);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!a || !b || a->magic != EVENT_MAGIC || b->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING || !a->recorded || !b->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = qgpu_now_ns();
    if (now < a->ts_ns || now < b->ts_ns) return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)(b->ts_ns - a->ts_ns) / 1e6);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) {
    return cuEventElapsedTime(ms, a, b);
}

/* ---- graphs (kernel nodes only) ---- */

SIM_EXPORT CUresult cuGraphCreate(CUgraph *pg, unsigned int flags) {
    (void)flags;
    if (!pg) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = GRAPH_MAGIC;
    *pg = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph g) {
    if (!g || g->magic != GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    g->magic = 0;
    free(g);
    return CUDA_SUCCESS;
}

static CUresult add_node(CUgraphNode *node, CUgraph g, CUfunction f, unsigned gx, unsigned gy,
                         unsigned gz, void **params, void **extra) {
    if (!node || !g || g->magic != GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    /* node parameters are captured when added: the duration is fixed now */
    g->total_ns += kernel_duration(f, gx, gy, gz, params, extra);
    g->nodes++;
    *node = (CUgraphNode)(uintptr_t)(g->nodes);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                            size_t ndeps, const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    (void)deps;
    (void)ndeps;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->kernelParams,
                    p->extra);
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                         size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *p) {
    (void)deps;
    (void)ndeps;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->kernelParams,
                    p->extra);
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                                unsigned long long flags) {
    (void)flags;
    if (!pe || !g || g->magic != GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EXEC_MAGIC;
    e->nodes = g->nodes;
    e->total_ns = g->total_ns;
    *pe = e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, CUgraphNode *err_node,
                                          char *log, size_t log_size) {
    (void)err_node;
    if (log && log_size) log[0] = 0;
    return cuGraphInstantiateWithFlags(pe, g, 0);
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    if (!e || e->magic != EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!e || e->magic != EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    sim_enqueue(c, real_stream(hs), e->total_ns, e->nodes);
    return CUDA_SUCCESS;
}

/* Older entry points with the same ABI as their _v2 successors. */
SIM_EXPORT CUresult cuStreamDestroy(CUstream s) { return cuStreamDestroy_v2(s); }
SIM_EXPORT CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }
