/* Compute gating. A capped slice (fixed-share, or burst-share while another slice is busy)
 * may launch only while its token bucket has credit: the bucket is refilled at the slice's
 * share of wall time and debited with the device time its own work really took, measured
 * by a pair of events recorded around every gated launch. Work still in flight is counted
 * at the recent mean kernel time so a deep queue cannot overshoot the share. The time a
 * launch waits for credit is added to the slice ledger's throttled_ns (one atomic add per
 * launch that waited).
 * Uncapped slices only publish that they are active (one coarse clock read). */
#include <stdlib.h>

#include "hook.h"

#define MAX_PENDING 1024
#define MAX_FREE 256
#define MIN_WAIT_NS 20000LL
#define MAX_WAIT_NS 2000000LL
/* A burst-share slice bursting alone keeps at most this much work queued, so a slice that
 * arrives is not stuck behind a long queue (and is seen as active within the window). */
#define BURST_QUEUE_NS 20000000LL

typedef struct {
    CUevent start, end;
    CUcontext ctx;
} ev_pair_t;

static ev_pair_t pending[MAX_PENDING];
static int npending;
static ev_pair_t freelist[MAX_FREE];
static int nfree;
static int64_t mean_ns; /* moving average of measured kernel time */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;

static void recycle_locked(ev_pair_t p) {
    if (nfree < MAX_FREE) {
        freelist[nfree++] = p;
    } else {
        REAL(cuEventDestroy_v2)(p.start);
        REAL(cuEventDestroy_v2)(p.end);
    }
}

static void poll_locked(void) {
    int j = 0;
    for (int i = 0; i < npending; i++) {
        ev_pair_t p = pending[i];
        CUresult q = REAL(cuEventQuery)(p.end);
        if (q == CUDA_ERROR_NOT_READY) {
            pending[j++] = p;
            continue;
        }
        if (q != CUDA_SUCCESS) { /* e.g. its context was destroyed: forget it */
            recycle_locked(p);
            continue;
        }
        float ms = 0;
        if (REAL(cuEventElapsedTime)(&ms, p.start, p.end) == CUDA_SUCCESS && ms > 0) {
            int64_t ns = (int64_t)((double)ms * 1e6);
            ledger_debit(ns);
            mean_ns = mean_ns ? (mean_ns * 7 + ns) / 8 : ns;
        }
        recycle_locked(p);
    }
    npending = j;
}

static int have_event_api(void) {
    return HAVE_REAL(cuEventCreate) && HAVE_REAL(cuEventRecord) && HAVE_REAL(cuEventQuery) &&
           HAVE_REAL(cuEventElapsedTime) && HAVE_REAL(cuEventDestroy_v2) &&
           HAVE_REAL(cuCtxGetCurrent);
}

/* Blocks until the slice may launch; returns an event pair (already recorded on the
 * stream before the launch) or NULL when the launch is not measured. */
/* Work recorded into a CUDA graph under stream capture does not run now: it is gated
 * when the graph is launched, and events recorded during capture would never complete. */
static int capturing(CUstream stream) {
    int status = 0;
    return HAVE_REAL(cuStreamIsCapturing) &&
           REAL(cuStreamIsCapturing)(stream, &status) == CUDA_SUCCESS && status != 0;
}

int gate_before(CUstream stream, void **pair_out) {
    *pair_out = NULL;
    if (!have_event_api() || capturing(stream)) return 0;
    /* Time this launch is held back for want of credit (not the queue bound of a burst-share
     * slice bursting alone): from each check that says wait to the next check. */
    int64_t held = 0, held_since = 0;
    for (;;) {
        pthread_mutex_lock(&gate_lock);
        poll_locked();
        /* until a first kernel has been timed, one launch in flight at a time */
        int64_t inflight = mean_ns ? (int64_t)npending * mean_ns : (npending ? INT64_MAX / 4 : 0);
        pthread_mutex_unlock(&gate_lock);
        int alone = 0;
        int64_t now = qgpu_now_ns();
        if (held_since) {
            held += now - held_since;
            held_since = 0;
        }
        int64_t avail = ledger_compute_avail(now, inflight, &alone);
        if (alone ? inflight < BURST_QUEUE_NS : avail > 0) break;
        int64_t wait = alone || inflight >= INT64_MAX / 4
                           ? (mean_ns > MIN_WAIT_NS ? mean_ns / 2 : MIN_WAIT_NS)
                           : (-avail) * 100 / g_lim.core;
        if (wait < MIN_WAIT_NS) wait = MIN_WAIT_NS;
        if (wait > MAX_WAIT_NS) wait = MAX_WAIT_NS;
        if (!alone) held_since = now;
        qgpu_sleep_ns(wait);
        ledger_publish_activity();
    }
    if (held) ledger_add_throttled(held);
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx) return 0;
    ev_pair_t *p = malloc(sizeof *p);
    if (!p) return 0;
    int got = 0;
    pthread_mutex_lock(&gate_lock);
    for (int i = nfree - 1; i >= 0; i--) {
        if (freelist[i].ctx != ctx) continue;
        *p = freelist[i];
        freelist[i] = freelist[--nfree];
        got = 1;
        break;
    }
    pthread_mutex_unlock(&gate_lock);
    if (!got) {
        p->ctx = ctx;
        if (REAL(cuEventCreate)(&p->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
            free(p);
            return 0;
        }
        if (REAL(cuEventCreate)(&p->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
            REAL(cuEventDestroy_v2)(p->start);
            free(p);
            return 0;
        }
    }
    if (REAL(cuEventRecord)(p->start, stream) != CUDA_SUCCESS) {
        pthread_mutex_lock(&gate_lock);
        recycle_locked(*p);
        pthread_mutex_unlock(&gate_lock);
        free(p);
        return 0;
    }
    *pair_out = p;
    return 1;
}

void gate_after(CUstream stream, void *pair) {
    ev_pair_t *p = pair;
    if (!p) return;
    int ok = REAL(cuEventRecord)(p->end, stream) == CUDA_SUCCESS;
    pthread_mutex_lock(&gate_lock);
    if (ok && npending < MAX_PENDING) {
        pending[npending++] = *p;
    } else {
        recycle_locked(*p);
    }
    pthread_mutex_unlock(&gate_lock);
    free(p);
}

/* CU_STREAM_PER_THREAD: what a NULL stream means to the _ptsz entry points */
#define PTSZ_STREAM(s) ((s) ? (s) : (CUstream)(uintptr_t)0x2)

#define GATED(stream_expr, call)                                                             \
    do {                                                                                     \
        ledger_publish_activity();                                                           \
        if (!g_capped) return call;                                                          \
        void *pair_;                                                                         \
        gate_before(stream_expr, &pair_);                                                    \
        CUresult r_ = call;                                                                  \
        gate_after(stream_expr, pair_);                                                      \
        return r_;                                                                           \
    } while (0)

#define LAUNCH_KERNEL(name, SMAP)                                                            \
    QGPU_EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
                              unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params, \
                              void **extra) {                                                \
        HOOK_ENTER(name, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);                \
        GATED(SMAP(s), REAL(name)(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));      \
    }

#define LAUNCH_COOP(name, SMAP)                                                              \
    QGPU_EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
                              unsigned by, unsigned bz, unsigned shmem, CUstream s,           \
                              void **params) {                                               \
        HOOK_ENTER(name, f, gx, gy, gz, bx, by, bz, shmem, s, params);                       \
        GATED(SMAP(s), REAL(name)(f, gx, gy, gz, bx, by, bz, shmem, s, params));             \
    }

#define LAUNCH_EX(name, SMAP)                                                                \
    QGPU_EXPORT CUresult name(const CUlaunchConfig *cfg, CUfunction f, void **params,        \
                              void **extra) {                                                \
        HOOK_ENTER(name, cfg, f, params, extra);                                             \
        GATED(SMAP(cfg ? cfg->hStream : NULL), REAL(name)(cfg, f, params, extra));           \
    }

#define GRAPH_LAUNCH(name, SMAP)                                                             \
    QGPU_EXPORT CUresult name(CUgraphExec g, CUstream s) {                                   \
        HOOK_ENTER(name, g, s);                                                              \
        GATED(SMAP(s), REAL(name)(g, s));                                                    \
    }

#define SAME(s) (s)
LAUNCH_KERNEL(cuLaunchKernel, SAME)
LAUNCH_KERNEL(cuLaunchKernel_ptsz, PTSZ_STREAM)
LAUNCH_COOP(cuLaunchCooperativeKernel, SAME)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz, PTSZ_STREAM)
LAUNCH_EX(cuLaunchKernelEx, SAME)
LAUNCH_EX(cuLaunchKernelEx_ptsz, PTSZ_STREAM)
GRAPH_LAUNCH(cuGraphLaunch, SAME)
GRAPH_LAUNCH(cuGraphLaunch_ptsz, PTSZ_STREAM)
