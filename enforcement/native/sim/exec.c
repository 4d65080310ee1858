/* Simulated execution: work queued on streams occupies the GPU's device model (state.c):
 * one FIFO engine shared by all processes, or a time-sliced device that runs one process at
 * a time. Kernels occupy simulated time (see kernel_duration), events and frees are markers
 * in the process's queue. Sync calls sleep until what they wait for has run; queries report
 * CUDA_ERROR_NOT_READY before that. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define QUEUE_AHEAD_LIMIT_NS 2000000000LL /* push-buffer back-pressure: 2 s of queued work */
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define WAIT_MIN_NS 20000LL
#define WAIT_MAX_NS 1000000LL

struct CUctx_st *sim_stream_ctx(CUstream s) {
    if (s && (uintptr_t)s > 2) return s->magic == STREAM_MAGIC ? s->ctx : NULL;
    return sim_current_ctx(); /* NULL, CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2) */
}

struct CUstream_st *sim_real_stream(CUstream s) {
    return (s && (uintptr_t)s > 2 && s->magic == STREAM_MAGIC) ? s : NULL;
}

static int ts_mode(int gidx) { return g_sim_state[gidx]->scheduler == SIM_SCHED_TIMESLICED; }

static int proc_index(sim_gpu_state_t *st, sim_proc_t *p) { return p ? (int)(p - st->procs) : -1; }

/* ---- submitting work ---- */

static int64_t fifo_enqueue(struct CUctx_st *ctx, struct CUstream_st *s, int64_t dur, int kernels) {
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
        sim_state_advance(st, now);
    }
    sim_state_unlock(st);
    if (s) s->last_end_ns = end;
    if (end > ctx->last_end_ns) ctx->last_end_ns = end;
    return start;
}

void sim_submit(struct CUctx_st *ctx, struct CUstream_st *s, int64_t dur, int kernels) {
    if (kernels) sim_managed_touch(ctx->gidx); /* kernels may touch any managed memory */
    if (!ts_mode(ctx->gidx)) {
        fifo_enqueue(ctx, s, dur, kernels);
        return;
    }
    sim_gpu_state_t *st = g_sim_state[ctx->gidx];
    for (;;) {
        sim_state_lock(st);
        int64_t now = qgpu_now_ns();
        sim_state_advance(st, now);
        sim_proc_t *p = sim_state_proc_slot(st, 1);
        uint64_t queued = p ? p->busy_ns - p->done_ns : 0;
        if (p && dur > 0 && queued > (uint64_t)QUEUE_AHEAD_LIMIT_NS) {
            sim_state_unlock(st);
            qgpu_sleep_ns((int64_t)(queued - QUEUE_AHEAD_LIMIT_NS));
            continue;
        }
        st->busy_total_ns += (uint64_t)dur;
        st->launches += (uint64_t)kernels;
        if (p) {
            p->busy_ns += (uint64_t)dur;
            p->launches += (uint64_t)kernels;
            if (dur > 0) p->ctx_end[(unsigned)ctx->queue % SIM_CTX_QUEUES] = p->busy_ns;
        }
        sim_state_unlock(st);
        return;
    }
}

/* ---- markers ---- */

void sim_marker_record(struct CUctx_st *ctx, struct CUstream_st *s, sim_marker_t *m) {
    memset(m, 0, sizeof *m);
    m->gidx = ctx->gidx;
    m->ts_mode = ts_mode(ctx->gidx);
    if (!m->ts_mode) {
        m->ts = fifo_enqueue(ctx, s, 0, 0);
        return;
    }
    sim_gpu_state_t *st = g_sim_state[ctx->gidx];
    for (;;) {
        sim_state_lock(st);
        int64_t now = qgpu_now_ns();
        sim_state_advance(st, now);
        sim_proc_t *p = sim_state_proc_slot(st, 1);
        if (!p) { /* no slot: behave as if it completed now */
            sim_state_unlock(st);
            m->ts = now;
            m->done = 1;
            return;
        }
        if (p->mk_next - p->mk_done >= SIM_MARKERS) { /* full: wait for the device */
            sim_state_unlock(st);
            qgpu_sleep_ns(WAIT_MIN_NS * 10);
            continue;
        }
        m->slot = proc_index(st, p);
        m->seq = p->mk_next++;
        uint32_t i = (uint32_t)(m->seq % SIM_MARKERS);
        p->mk_pos[i] = p->busy_ns;
        p->mk_ts[i] = 0;
        /* nothing queued before it and the device free or ours: it completes now */
        int cur = st->ts_cur;
        int idle = cur < 0 || cur == m->slot ||
                   !(st->procs[cur].busy_ns > st->procs[cur].done_ns ||
                     st->procs[cur].mk_done < st->procs[cur].mk_next);
        if (idle && p->mk_done == m->seq && p->busy_ns == p->done_ns) {
            p->mk_ts[i] = now;
            p->mk_done++;
        }
        sim_state_unlock(st);
        return;
    }
}

int sim_marker_poll(sim_marker_t *m) {
    if (m->done) return 1;
    if (!m->ts_mode) {
        if (qgpu_now_ns() < m->ts) return 0;
        m->done = 1;
        return 1;
    }
    sim_gpu_state_t *st = g_sim_state[m->gidx];
    sim_state_lock(st);
    sim_state_advance(st, qgpu_now_ns());
    sim_proc_t *p = &st->procs[m->slot];
    int done = !p->pid || p->mk_done > m->seq;
    if (done) {
        uint32_t i = (uint32_t)(m->seq % SIM_MARKERS);
        /* overwritten by a newer marker (it was never polled): its time is gone; the oldest
         * time still known is an upper bound */
        m->ts = p->mk_next - m->seq <= SIM_MARKERS ? p->mk_ts[i] : st->ts_time;
        m->done = 1;
    }
    sim_state_unlock(st);
    return done;
}

/* How long until a marker might complete: its remaining work, plus one slice of every other
 * process with work when it is not ours to run. */
static int64_t marker_eta(sim_marker_t *m) {
    sim_gpu_state_t *st = g_sim_state[m->gidx];
    sim_state_lock(st);
    sim_proc_t *p = &st->procs[m->slot];
    uint32_t i = (uint32_t)(m->seq % SIM_MARKERS);
    int64_t left = p->pid && p->mk_pos[i] > p->done_ns ? (int64_t)(p->mk_pos[i] - p->done_ns) : 0;
    if (st->ts_cur != m->slot) left += st->slice_ns;
    sim_state_unlock(st);
    return left;
}

void sim_marker_wait(sim_marker_t *m) {
    if (!m->ts_mode) {
        qgpu_sleep_until_ns(m->ts);
        m->done = 1;
        return;
    }
    while (!sim_marker_poll(m)) {
        int64_t w = marker_eta(m);
        qgpu_sleep_ns(w < WAIT_MIN_NS ? WAIT_MIN_NS : w > WAIT_MAX_NS ? WAIT_MAX_NS : w);
    }
}

/* Everything the context (or stream) queued so far has run. */
void sim_wait_idle(struct CUctx_st *ctx, struct CUstream_st *s) {
    if (!ts_mode(ctx->gidx)) {
        qgpu_sleep_until_ns(s ? s->last_end_ns : ctx->last_end_ns);
        return;
    }
    sim_marker_t m;
    sim_marker_record(ctx, s, &m);
    sim_marker_wait(&m);
}

/* ---- kernels ---- */

/* The kernel-duration rule: a function named "qgpu_sim_busy" runs for as many nanoseconds as
 * its first parameter (a uint64); any other kernel runs 1 us per block of its grid. */
int64_t sim_kernel_duration(CUfunction f, unsigned gx, unsigned gy, unsigned gz, void **params,
                            void **extra) {
    if (f->busy_kernel) {
        uint64_t ns = 0;
        if (params && params[0]) {
            memcpy(&ns, params[0], sizeof ns);
        } else {
            for (int i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END && i < 64; i += 2)
                if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER && extra[i + 1])
                    memcpy(&ns, extra[i + 1], sizeof ns);
        }
        return ns > (uint64_t)INT64_MAX / 4 ? INT64_MAX / 4 : (int64_t)ns;
    }
    return (int64_t)gx * gy * gz * 1000;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream hs, void **params, void **extra) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!f || (f->magic != FUNC_MAGIC && f->magic != KERNEL_MAGIC)) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (f->magic == KERNEL_MAGIC) { /* a CUkernel: its library is loaded into c if it is not */
        r = sim_kernel_function((struct CUkern_st *)(void *)f, c, &f);
        if (r) return r;
    }
    if ((r = sim_function_load(f)) != CUDA_SUCCESS) return r; /* its code, lazily */
    struct CUstream_st *s = sim_real_stream(hs);
    int64_t dur = sim_kernel_duration(f, gx, gy, gz, params, extra);
    if (s && s->capture) /* a kernel node: its local memory is grown when the graph runs */
        return sim_graph_capture_kernel(s->capture, dur, f->local_bytes);
    r = sim_ctx_local_memory(c, f->local_bytes);
    if (r) return r;
    sim_submit(c, s, dur, 1);
    return CUDA_SUCCESS;
}

#define PTSZ(s) ((s) ? (s) : (CUstream)(uintptr_t)2)

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                   unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                   CUstream hs, void **params, void **extra) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, hs, params, extra);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                        unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                        CUstream hs, void **params, void **extra) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, PTSZ(hs), params, extra);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy,
                                              unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                              unsigned shmem, CUstream hs, void **params) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, hs, params, NULL);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                                   unsigned gz, unsigned bx, unsigned by,
                                                   unsigned bz, unsigned shmem, CUstream hs,
                                                   void **params) {
    (void)shmem;
    return launch(f, gx, gy, gz, bx, by, bz, PTSZ(hs), params, NULL);
}

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                     void **extra) {
    if (!cfg) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY,
                  cfg->blockDimZ, cfg->hStream, params, extra);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                          void **extra) {
    if (!cfg) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY,
                  cfg->blockDimZ, PTSZ(cfg->hStream), params, extra);
}

/* Deprecated multi-device cooperative launch: one launch per entry. */
SIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n,
                                                         unsigned int flags) {
    (void)flags;
    if (!list || n == 0) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++) {
        CUDA_LAUNCH_PARAMS *l = &list[i];
        CUresult r = launch(l->function, l->gridDimX, l->gridDimY, l->gridDimZ, l->blockDimX,
                            l->blockDimY, l->blockDimZ, l->hStream, l->kernelParams, NULL);
        if (r) return r;
    }
    return CUDA_SUCCESS;
}

/* ---- legacy (CUDA 2.x) launches: block shape and parameters set on the function ---- */

SIM_EXPORT CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z) {
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (x <= 0 || y <= 0 || z <= 0) return CUDA_ERROR_INVALID_VALUE;
    f->bx = x;
    f->by = y;
    f->bz = z;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuParamSetSize(CUfunction f, unsigned int bytes) {
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (bytes > sizeof f->params) return CUDA_ERROR_INVALID_VALUE;
    f->param_size = bytes;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuParamSetv(CUfunction f, int offset, void *ptr, unsigned int bytes) {
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (offset < 0 || !ptr || (uint64_t)offset + bytes > sizeof f->params) return CUDA_ERROR_INVALID_VALUE;
    memcpy(f->params + offset, ptr, bytes);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuParamSeti(CUfunction f, int offset, unsigned int value) {
    return cuParamSetv(f, offset, &value, sizeof value);
}

static CUresult legacy(CUfunction f, int gw, int gh, CUstream hs) {
    if (!f || f->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (gw <= 0 || gh <= 0) return CUDA_ERROR_INVALID_VALUE;
    void *buf[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, f->params, CU_LAUNCH_PARAM_END};
    return launch(f, (unsigned)gw, (unsigned)gh, 1, f->bx ? (unsigned)f->bx : 1,
                  f->by ? (unsigned)f->by : 1, f->bz ? (unsigned)f->bz : 1, hs, NULL, buf);
}

SIM_EXPORT CUresult cuLaunch(CUfunction f) { return legacy(f, 1, 1, NULL); }
SIM_EXPORT CUresult cuLaunchGrid(CUfunction f, int gw, int gh) { return legacy(f, gw, gh, NULL); }
SIM_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int gw, int gh, CUstream hs) {
    return legacy(f, gw, gh, hs);
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

SIM_EXPORT CUresult cuStreamCreateWithPriority(CUstream *ps, unsigned int flags, int priority) {
    (void)priority;
    return cuStreamCreate(ps, flags);
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    if (!sim_real_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy(CUstream s) { return cuStreamDestroy_v2(s); }

static CUresult stream_ctx(CUstream hs, CUcontext *pctx, CUgreenCtx *pgreen) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (hs && (uintptr_t)hs > 2 && hs->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *pctx = c;
    if (pgreen) *pgreen = NULL; /* streams of green contexts are not simulated */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamGetCtx(CUstream hs, CUcontext *pctx) { return stream_ctx(hs, pctx, NULL); }
SIM_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream hs, CUcontext *pctx) {
    return stream_ctx(hs ? hs : (CUstream)(uintptr_t)2, pctx, NULL);
}
SIM_EXPORT CUresult cuStreamGetCtx_v2(CUstream hs, CUcontext *pctx, CUgreenCtx *pgreen) {
    return stream_ctx(hs, pctx, pgreen);
}
SIM_EXPORT CUresult cuStreamGetCtx_v2_ptsz(CUstream hs, CUcontext *pctx, CUgreenCtx *pgreen) {
    return stream_ctx(hs ? hs : (CUstream)(uintptr_t)2, pctx, pgreen);
}

static CUresult stream_sync(CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(hs);
    if (s && s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_wait_idle(c, s);
    sim_pools_on_sync(c);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream hs) { return stream_sync(hs); }
SIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hs) { return stream_sync(PTSZ(hs)); }

static CUresult stream_query(CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(hs);
    if (!ts_mode(c->gidx))
        return qgpu_now_ns() >= (s ? s->last_end_ns : c->last_end_ns) ? CUDA_SUCCESS
                                                                      : CUDA_ERROR_NOT_READY;
    sim_marker_t m;
    sim_marker_record(c, s, &m);
    return sim_marker_poll(&m) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuStreamQuery(CUstream hs) { return stream_query(hs); }
SIM_EXPORT CUresult cuStreamQuery_ptsz(CUstream hs) { return stream_query(PTSZ(hs)); }

static CUresult is_capturing(CUstream hs, int *status) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_stream_ctx(hs)) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(hs);
    *status = s && s->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamIsCapturing(CUstream hs, int *status) { return is_capturing(hs, status); }
SIM_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream hs, int *status) {
    return is_capturing(PTSZ(hs), status);
}

/* Stream capture (only on a created stream; the legacy stream cannot capture): into a new
 * graph, or (cuStreamBeginCaptureToGraph, CUDA 12.3) into an existing one, which cannot be
 * instantiated until the capture ends. */
static CUresult begin_capture(CUstream hs, struct CUgraph_st *into) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUstream_st *s = sim_real_stream(hs);
    if (!s) return hs ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (s->capture) return CUDA_ERROR_ILLEGAL_STATE;
    struct CUgraph_st *g = into;
    if (g) {
        r = sim_graph_capture_begin(g);
        if (r) return r;
    } else {
        g = sim_graph_new(s->ctx->gidx);
        if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
        g->capturing = 1;
    }
    s->capture = g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hs, int mode) {
    (void)mode;
    return begin_capture(hs, NULL);
}
SIM_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hs, int mode) {
    (void)mode;
    return begin_capture(hs, NULL);
}
SIM_EXPORT CUresult cuStreamBeginCapture(CUstream hs) { return begin_capture(hs, NULL); }
SIM_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hs) { return begin_capture(hs, NULL); }

static CUresult capture_to_graph(CUstream hs, CUgraph g, const CUgraphNode *deps, size_t ndeps) {
    if (!g || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    return begin_capture(hs, g);
}

SIM_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream hs, CUgraph g, const CUgraphNode *deps,
                                                const CUgraphEdgeData *edges, size_t ndeps,
                                                int mode) {
    (void)edges;
    (void)mode;
    return capture_to_graph(hs, g, deps, ndeps);
}
SIM_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hs, CUgraph g,
                                                     const CUgraphNode *deps,
                                                     const CUgraphEdgeData *edges, size_t ndeps,
                                                     int mode) {
    (void)edges;
    (void)mode;
    return capture_to_graph(PTSZ(hs), g, deps, ndeps);
}

static CUresult end_capture(CUstream hs, CUgraph *pg) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUstream_st *s = sim_real_stream(hs);
    if (!pg) return CUDA_ERROR_INVALID_VALUE;
    if (!s || !s->capture) return CUDA_ERROR_ILLEGAL_STATE;
    *pg = s->capture;
    sim_graph_capture_end(s->capture);
    s->capture = NULL;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamEndCapture(CUstream hs, CUgraph *pg) { return end_capture(hs, pg); }
SIM_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hs, CUgraph *pg) { return end_capture(hs, pg); }

/* What a stream is capturing, as cuStreamGetCaptureInfo (v1: status and id; v2: also the
 * graph and its dependency list; v3: also edge data). The capture id is the graph's
 * address; simulated graphs are linear, so no dependencies are reported. */
static CUresult capture_info(CUstream hs, int *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, const void **edges, size_t *ndeps) {
    CUresult r = is_capturing(hs, status);
    if (r) return r;
    struct CUstream_st *s = sim_real_stream(hs);
    struct CUgraph_st *g = s ? s->capture : NULL;
    if (id && g) *id = (cuuint64_t)(uintptr_t)g;
    if (graph) *graph = g;
    if (deps) *deps = NULL;
    if (edges) *edges = NULL;
    if (ndeps) *ndeps = 0;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamGetCaptureInfo(CUstream hs, int *status, cuuint64_t *id) {
    return capture_info(hs, status, id, NULL, NULL, NULL, NULL);
}
SIM_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream hs, int *status, cuuint64_t *id) {
    return capture_info(PTSZ(hs), status, id, NULL, NULL, NULL, NULL);
}
SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream hs, int *status, cuuint64_t *id,
                                              CUgraph *graph, const CUgraphNode **deps,
                                              size_t *ndeps) {
    return capture_info(hs, status, id, graph, deps, NULL, ndeps);
}
SIM_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hs, int *status, cuuint64_t *id,
                                                   CUgraph *graph, const CUgraphNode **deps,
                                                   size_t *ndeps) {
    return capture_info(PTSZ(hs), status, id, graph, deps, NULL, ndeps);
}
SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream hs, int *status, cuuint64_t *id,
                                              CUgraph *graph, const CUgraphNode **deps,
                                              const void **edges, size_t *ndeps) {
    return capture_info(hs, status, id, graph, deps, edges, ndeps);
}
SIM_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hs, int *status, cuuint64_t *id,
                                                   CUgraph *graph, const CUgraphNode **deps,
                                                   const void **edges, size_t *ndeps) {
    return capture_info(PTSZ(hs), status, id, graph, deps, edges, ndeps);
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

SIM_EXPORT CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

static CUresult event_record(CUevent e, CUstream hs) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    struct CUctx_st *c = sim_stream_ctx(hs);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = sim_real_stream(hs);
    if (s && s->capture) return CUDA_SUCCESS; /* an event node of the graph */
    sim_marker_record(c, s, &e->m);
    e->recorded = 1;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventRecord(CUevent e, CUstream hs) { return event_record(e, hs); }
SIM_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream hs) { return event_record(e, PTSZ(hs)); }
SIM_EXPORT CUresult cuEventRecordWithFlags(CUevent e, CUstream hs, unsigned int flags) {
    (void)flags;
    return event_record(e, hs);
}

SIM_EXPORT CUresult cuEventQuery(CUevent e) {
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    return sim_marker_poll(&e->m) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent e) {
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (e->recorded) {
        sim_marker_wait(&e->m);
        struct CUctx_st *c = sim_current_ctx();
        if (c) sim_pools_on_sync(c);
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!a || !b || a->magic != EVENT_MAGIC || b->magic != EVENT_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING || !a->recorded || !b->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!sim_marker_poll(&a->m) || !sim_marker_poll(&b->m)) return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)(b->m.ts - a->m.ts) / 1e6);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) {
    return cuEventElapsedTime(ms, a, b);
}
