/* Compute gating. A gated slice may launch only while its token bucket has credit: the bucket
 * is refilled at the slice's share of wall time and debited with the device time its own
 * work really took, measured by a pair of events recorded around every gated launch. Work
 * still in flight is counted at the recent mean so a deep queue cannot overshoot the share.
 * The time a launch waits for credit is added to the slice ledger's throttled_ns.
 *
 * Who is gated (gate_mode): fixed-share slices always; burst-share slices while another
 * slice is active on the GPU, else they burst with a bounded queue; best-effort slices only
 * while a guaranteed (fixed- or burst-share) slice is active, at what the guaranteed slices
 * leave (100 - their shares, split between the active best-effort slices): best-effort work
 * gets only what no guaranteed slice is promised, so every fixed-share slice gets its cap and
 * every burst-share slice at least its share. Ungated launches only publish that the process
 * is active (one coarse clock read).
 *
 * Time-sliced devices. Real GPUs run the work of different processes in turns (time
 * slices), so a pair of events around a kernel that another process's slices interrupt
 * spans those slices too. The debit is what the process itself had of the interval
 * (own_time: the slices of the n others with work queued taken out, n averaged over the
 * pair's life: each other process of its slice, and each other slice of the GPU once, which
 * a sampler thread reads from the slices' activity files every millisecond while the
 * process has timed work queued; every gated process publishes in its slice's activity
 * file until when it expects work queued, region.c). QGPU_TIMESLICE_US is the slice length (2000 by default);
 * QGPU_DEVICE_SHARING=serial (one queue for all processes, the simulator's fifo model) turns
 * the correction off. The estimate assumes every other process with work queued uses its
 * whole slice; one that ends its turn early (its queue drained) makes the pair span less of
 * the others' time than assumed, so the debit is too small (on a fully subscribed GPU a
 * gated slice then took up to +2.3 points and a burst-share neighbour lost 5). That error is
 * calibrated with the driver's own per-process accounting: while the process has timed work
 * queued on a time-sliced device, the sampler reads NVML's per-process utilisation samples
 * (nvmlDeviceGetProcessUtilization) for its own pid every CAL_PERIOD_NS, and later debits
 * are scaled by (device time NVML's samples give) / (device time the estimate gave) over the
 * same span, older windows weighted down by CAL_DECAY and the scale clamped to
 * CAL_MIN..CAL_MAX (calibrate()). Where NVML or its per-process samples are missing, or the
 * process's pid is not the one NVML reports (another pid namespace), the scale stays 1. */
#include <stdlib.h>
#include <unistd.h>

#include "hook.h"

#define MAX_PENDING 1024
#define MAX_FREE 256
#define MIN_WAIT_NS 20000LL
#define MAX_WAIT_NS 2000000LL
/* A burst-share slice bursting alone keeps at most this much work queued, so a slice that
 * arrives is not stuck behind a long queue (and is seen as active within the window). */
#define BURST_QUEUE_NS 20000000LL
#define MIN_BEST_EFFORT_SHARE 1

typedef struct {
    CUevent start, end;
    CUcontext ctx;
    double csum; /* contention samples when it was queued (time-sliced correction) */
    uint64_t ccount;
} ev_pair_t;

typedef struct {
    CUevent ev;
    CUcontext ctx;
} spare_event_t;

static ev_pair_t pending[MAX_PENDING];
static int npending;
static spare_event_t spare[2 * MAX_FREE]; /* events to reuse, with their context */
static int nspare;
static int64_t mean_ns; /* moving average of measured intervals */

/* Calibration against NVML's per-process accounting (time-sliced devices) */
#define CAL_PERIOD_NS 100000000LL    /* how often the sampler reads NVML's samples */
#define CAL_MIN_EST_NS 20000000LL    /* estimated device time needed before scaling */
#define CAL_DECAY 0.85              /* weight of the history at each new sample */
#define CAL_NEW_US 1000ULL           /* a sample this close to the last one is the same one */
#define CAL_MIN 0.5
#define CAL_MAX 2.0
static double cal_scale = 1.0;         /* what own_time estimates are multiplied by */
static int64_t cal_est_ns;             /* estimated own device time in the span (unscaled) */
static double cal_nvml_ns;             /* device time NVML's samples gave in the span */
static int64_t cal_est_since_read;     /* estimate accumulated since the last new sample */
static int64_t cal_at;                 /* when NVML was last read (0: never) */
static unsigned long long cal_seen;    /* NVML timestamp of the newest own sample */
static int cal_state;                  /* 0 not tried, 1 ready, -1 no NVML */
static nvmlDevice_t cal_dev;

static double csum;     /* sum of 1/(1+n) over every contention sample */
static uint64_t ccount;
static int was_gated;
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_queued = PTHREAD_COND_INITIALIZER;
static int sampler_running;
#define SAMPLE_NS 1000000LL /* the sampler's period while work is queued */

gate_mode_t gate_mode(void) {
    gate_mode_t m = {0, 100, 0};
    if (g_capped) { /* fixed- or burst-share below 100 */
        m.gated = 1;
        m.share = g_lim.core;
        m.alone = g_lim.policy == POLICY_BURST_SHARE && region_summary().other_slices == 0;
        return m;
    }
    region_summary_t s = region_summary();
    if (!s.guaranteed_slices) return m;
    int rest = 100 - s.guaranteed_share;
    int share = rest / (s.best_effort_slices > 0 ? s.best_effort_slices : 1);
    m.gated = 1;
    m.share = share < MIN_BEST_EFFORT_SHARE ? MIN_BEST_EFFORT_SHARE : share > 100 ? 100 : share;
    return m;
}

/* locked */
static void put_event(CUevent e, CUcontext ctx) {
    if (!e) return;
    if (nspare < 2 * MAX_FREE)
        spare[nspare++] = (spare_event_t){e, ctx};
    else
        REAL(cuEventDestroy_v2)(e);
}

/* locked: a spare event of `ctx`, or NULL */
static CUevent take_event(CUcontext ctx) {
    for (int i = nspare - 1; i >= 0; i--) {
        if (spare[i].ctx != ctx) continue;
        CUevent e = spare[i].ev;
        spare[i] = spare[--nspare];
        return e;
    }
    return NULL;
}

static void recycle_locked(ev_pair_t p) {
    put_event(p.start, p.ctx);
    put_event(p.end, p.ctx);
}

/* contention samples are the number of other processes with work queued */
static double contention_sample(int64_t now) {
    if (!g_lim.timesliced) return 0;
    return region_contenders(now);
}

/* The device time of a pair measured as `w` while `n` other processes (on average over the
 * pair's life) had work queued, on a device that gives each process slices of `t`: the pair
 * starts and ends with slices of our own, and between them it waited m times for the others'
 * slices, m being the one count that fits (each of our pieces but the last is a whole slice).
 * Others may yield before their slice ends, so it is never less than the fair share w/(1+n). */
static int64_t own_time(int64_t w, double n, int64_t t) {
    if (n <= 0 || w <= 0) return w;
    double fair = (double)w / (1.0 + n);
    if (t <= 0) return (int64_t)fair;
    double m = ((double)w - (double)t) / ((1.0 + n) * (double)t);
    m = m <= 0 ? 0 : (double)(int64_t)(m + 0.999999); /* ceil */
    double d = (double)w - m * n * (double)t;
    return (int64_t)(d > fair ? d : fair);
}

/* locked: until when this process expects work queued, for the others' correction */
static void publish_pending_locked(int64_t now) {
    int64_t until = 0;
    if (npending) until = now + (mean_ns ? (int64_t)npending * mean_ns : MAX_WAIT_NS);
    region_publish_pending(1, until);
}

static void poll_locked(int64_t now) {
    int j = 0;
    double sample = -1;
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
            int64_t w = (int64_t)((double)ms * 1e6);
            double n;
            if (ccount > p.ccount) {
                n = (csum - p.csum) / (double)(ccount - p.ccount);
            } else {
                if (sample < 0) sample = contention_sample(now);
                n = sample;
            }
            int64_t own = own_time(w, n, g_lim.timeslice_ns);
            cal_est_since_read += own;
            ledger_debit((int64_t)((double)own * cal_scale));
            mean_ns = mean_ns ? (mean_ns * 7 + w) / 8 : w;
        }
        recycle_locked(p);
    }
    npending = j;
    publish_pending_locked(now);
}

/* NVML for the slice's GPU, once (not locked: NVML calls take the driver's own locks). */
static int cal_open(void) {
    if (cal_state) return cal_state;
    cal_state = -1;
    hook_load_nvml();
    if (!HAVE_REAL(nvmlInit_v2) || !HAVE_REAL(nvmlDeviceGetProcessUtilization) ||
        REAL(nvmlInit_v2)() != 0)
        return cal_state;
    nvmlReturn_t r = -1;
    if (g_lim.device_uuid[0] && HAVE_REAL(nvmlDeviceGetHandleByUUID))
        r = REAL(nvmlDeviceGetHandleByUUID)(g_lim.device_uuid, &cal_dev);
    else if (HAVE_REAL(nvmlDeviceGetHandleByIndex_v2))
        r = REAL(nvmlDeviceGetHandleByIndex_v2)(0, &cal_dev);
    if (r == 0) cal_state = 1;
    return cal_state;
}

/* The device time NVML's samples newer than cal_seen give this process: each sample is its
 * share of the period since the sample before it (the first only sets the start). Returns
 * -1 when NVML has no new sample of this process. */
static double nvml_own_ns(void) {
    nvmlProcessUtilizationSample_t buf[64];
    unsigned n = 64;
    if (REAL(nvmlDeviceGetProcessUtilization)(cal_dev, buf, &n, cal_seen) != 0) return -1;
    unsigned pid = (unsigned)getpid();
    double got = -1;
    for (unsigned i = 0; i < n && i < 64; i++) {
        if (buf[i].pid != pid || buf[i].timeStamp <= cal_seen + CAL_NEW_US) continue;
        if (cal_seen) {
            double period_ns = (double)(buf[i].timeStamp - cal_seen) * 1e3;
            if (period_ns < 1e9) got = (got < 0 ? 0 : got) + period_ns * buf[i].smUtil / 100.0;
        }
        cal_seen = buf[i].timeStamp;
    }
    return got;
}

/* Sampler thread, not locked: every CAL_PERIOD_NS compare NVML's account of this process's
 * device time with the estimate's over the same span, and scale later debits by it. */
static void calibrate(int64_t now) {
    if (!g_lim.timesliced || (cal_at && now - cal_at < CAL_PERIOD_NS)) return;
    cal_at = now;
    if (cal_open() != 1) return;
    int started = cal_seen != 0;
    double seen = nvml_own_ns();
    pthread_mutex_lock(&gate_lock);
    int64_t est = cal_est_since_read;
    /* no new sample: the next one covers this time too, so the estimate waits for it (until
     * the first sample has set the start, what came before it is not compared) */
    if (seen >= 0 || !started) cal_est_since_read = 0;
    if (seen >= 0) {
        cal_est_ns = (int64_t)((double)cal_est_ns * CAL_DECAY) + est;
        cal_nvml_ns = cal_nvml_ns * CAL_DECAY + seen;
        if (cal_est_ns >= CAL_MIN_EST_NS) {
            double k = cal_nvml_ns / (double)cal_est_ns;
            cal_scale = k < CAL_MIN ? CAL_MIN : k > CAL_MAX ? CAL_MAX : k;
        }
    }
    pthread_mutex_unlock(&gate_lock);
}

/* While this process has timed work queued, a thread samples the contention every
 * millisecond (and polls the pairs, so the others see when its queue drains): samples at
 * launches alone would miss the time the application spends waiting on its own queue. */
static void *sampler_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&gate_lock);
    for (;;) {
        while (!npending) pthread_cond_wait(&work_queued, &gate_lock);
        pthread_mutex_unlock(&gate_lock);
        qgpu_sleep_ns(SAMPLE_NS);
        int64_t now = qgpu_now_ns();
        double sample = contention_sample(now);
        pthread_mutex_lock(&gate_lock);
        csum += sample;
        ccount++;
        poll_locked(now);
        pthread_mutex_unlock(&gate_lock);
        calibrate(now);
        pthread_mutex_lock(&gate_lock);
    }
    return NULL;
}

static void sampler_forget(void) { sampler_running = 0; /* threads do not survive fork */ }

/* locked */
static void start_sampler_locked(void) {
    if (sampler_running) return;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    if (pthread_create(&t, &attr, sampler_main, NULL) == 0) {
        sampler_running = 1;
        static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
        pthread_once(&atfork_once, hook_register_sampler_atfork);
    }
    pthread_attr_destroy(&attr);
}

void hook_register_sampler_atfork(void) { pthread_atfork(NULL, NULL, sampler_forget); }

static int have_event_api(void) {
    return HAVE_REAL(cuEventCreate) && HAVE_REAL(cuEventRecord) && HAVE_REAL(cuEventQuery) &&
           HAVE_REAL(cuEventElapsedTime) && HAVE_REAL(cuEventDestroy_v2) &&
           HAVE_REAL(cuCtxGetCurrent);
}

/* Work recorded into a CUDA graph under stream capture does not run now: it is gated
 * when the graph is launched, and events recorded during capture would never complete. */
static int capturing(CUstream stream) {
    int status = 0;
    return HAVE_REAL(cuStreamIsCapturing) &&
           REAL(cuStreamIsCapturing)(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* Blocks until the slice may launch; returns an event pair (already recorded on the
 * stream before the launch) or NULL when the launch is not measured. */
int gate_before(CUstream stream, void **pair_out, gate_mode_t mode) {
    *pair_out = NULL;
    if (!have_event_api() || capturing(stream)) return 0;
    /* Time this launch is held back for want of credit (not the queue bound of a burst-share
     * slice bursting alone): from each check that says wait to the next check. */
    int64_t held = 0, held_since = 0;
    for (;;) {
        int64_t now = qgpu_now_ns();
        double sample = contention_sample(now);
        pthread_mutex_lock(&gate_lock);
        csum += sample;
        ccount++;
        poll_locked(now);
        /* until a first kernel has been timed, one launch in flight at a time */
        int64_t inflight = mean_ns ? (int64_t)npending * mean_ns : (npending ? INT64_MAX / 4 : 0);
        pthread_mutex_unlock(&gate_lock);
        if (held_since) {
            held += now - held_since;
            held_since = 0;
        }
        int64_t avail = ledger_compute_avail(now, inflight, mode.share, mode.alone);
        if (mode.alone ? inflight < BURST_QUEUE_NS : avail > 0) break;
        int64_t wait = mode.alone || inflight >= INT64_MAX / 4
                           ? (mean_ns > MIN_WAIT_NS ? mean_ns / 2 : MIN_WAIT_NS)
                           : (-avail) * 100 / mode.share;
        if (wait < MIN_WAIT_NS) wait = MIN_WAIT_NS;
        if (wait > MAX_WAIT_NS) wait = MAX_WAIT_NS;
        if (!mode.alone) held_since = now;
        qgpu_sleep_ns(wait);
        region_publish_launch();
    }
    if (held) ledger_add_throttled(held);
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx) return 0;
    ev_pair_t *p = malloc(sizeof *p);
    if (!p) return 0;
    p->ctx = ctx;
    pthread_mutex_lock(&gate_lock);
    p->start = take_event(ctx);
    p->end = take_event(ctx);
    pthread_mutex_unlock(&gate_lock);
    if ((!p->start && REAL(cuEventCreate)(&p->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        (!p->end && REAL(cuEventCreate)(&p->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS)) {
        pthread_mutex_lock(&gate_lock);
        recycle_locked(*p);
        pthread_mutex_unlock(&gate_lock);
        free(p);
        return 0;
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
        p->csum = csum;
        p->ccount = ccount;
        pending[npending++] = *p;
        publish_pending_locked(qgpu_now_ns());
        if (g_lim.timesliced) {
            start_sampler_locked();
            pthread_cond_signal(&work_queued);
        }
    } else {
        recycle_locked(*p);
    }
    pthread_mutex_unlock(&gate_lock);
    free(p);
}

/* A process that stops being gated (a best-effort slice whose guaranteed neighbours left)
 * tells the others it is no longer measured: they judge it by its launches again. */
static void note_mode(int gated) {
    if (__atomic_load_n(&was_gated, __ATOMIC_RELAXED) == gated) return;
    __atomic_store_n(&was_gated, gated, __ATOMIC_RELAXED);
    if (!gated) region_publish_pending(0, 0);
}

/* CU_STREAM_PER_THREAD: what a NULL stream means to the _ptsz entry points */
#define PTSZ_STREAM(s) ((s) ? (s) : (CUstream)(uintptr_t)0x2)

#define GATED(stream_expr, call)                                                             \
    do {                                                                                     \
        region_publish_launch();                                                             \
        gate_mode_t m_ = gate_mode();                                                        \
        note_mode(m_.gated);                                                                 \
        if (!m_.gated) return call;                                                          \
        void *pair_;                                                                         \
        gate_before(stream_expr, &pair_, m_);                                                \
        CUresult r_ = call;                                                                  \
        gate_after(stream_expr, pair_);                                                      \
        return r_;                                                                           \
    } while (0)

/* A CUkernel launched as a CUfunction: its library is loaded into the stream's context
 * first, measured (module.c). */
#define KERNEL_LOADED(f, s)                                                                  \
    do {                                                                                     \
        CUresult k_ = module_kernel_use((void *)(f), (s));                                   \
        if (k_ != CUDA_SUCCESS) return k_;                                                   \
    } while (0)

#define LAUNCH_KERNEL(name, SMAP)                                                            \
    QGPU_EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
                              unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params, \
                              void **extra) {                                                \
        HOOK_ENTER(name, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);                \
        KERNEL_LOADED(f, s);                                                                 \
        GATED(SMAP(s), REAL(name)(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));      \
    }

#define LAUNCH_COOP(name, SMAP)                                                              \
    QGPU_EXPORT CUresult name(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
                              unsigned by, unsigned bz, unsigned shmem, CUstream s,           \
                              void **params) {                                               \
        HOOK_ENTER(name, f, gx, gy, gz, bx, by, bz, shmem, s, params);                       \
        KERNEL_LOADED(f, s);                                                                 \
        GATED(SMAP(s), REAL(name)(f, gx, gy, gz, bx, by, bz, shmem, s, params));             \
    }

#define LAUNCH_EX(name, SMAP)                                                                \
    QGPU_EXPORT CUresult name(const CUlaunchConfig *cfg, CUfunction f, void **params,        \
                              void **extra) {                                                \
        HOOK_ENTER(name, cfg, f, params, extra);                                             \
        KERNEL_LOADED(f, cfg ? cfg->hStream : NULL);                                         \
        GATED(SMAP(cfg ? cfg->hStream : NULL), REAL(name)(cfg, f, params, extra));           \
    }

/* A graph launch also allocates the graph's memory nodes (pool.c charges them first); the
 * first launch of one never uploaded uploads its work first, measured (graph_work.c). */
#define GRAPH_LAUNCH(name, SMAP)                                                             \
    QGPU_EXPORT CUresult name(CUgraphExec g, CUstream s) {                                   \
        HOOK_ENTER(name, g, s);                                                              \
        measure_t wm_;                                                                       \
        int first_ = graph_work_first_use_begin(g, SMAP(s), &wm_);                           \
        if (first_ < 0) return CUDA_ERROR_OUT_OF_MEMORY;                                     \
        HOOK_MEM_OP();                                                                       \
        uint64_t need_;                                                                      \
        if (graph_mem_before(g, SMAP(s), 1, &need_) != 0) {                                  \
            if (first_) graph_work_first_use_abort();                                        \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                 \
        }                                                                                    \
        CUresult w_ = first_ ? graph_work_upload_first(g, SMAP(s), &wm_) : CUDA_SUCCESS;     \
        if (w_ != CUDA_SUCCESS) {                                                            \
            graph_mem_after(w_, need_);                                                      \
            return w_;                                                                       \
        }                                                                                    \
        CUresult r_;                                                                         \
        region_publish_launch();                                                             \
        gate_mode_t m_ = gate_mode();                                                        \
        note_mode(m_.gated);                                                                 \
        if (!m_.gated) {                                                                     \
            r_ = REAL(name)(g, s);                                                           \
        } else {                                                                             \
            void *pair_;                                                                     \
            gate_before(SMAP(s), &pair_, m_);                                                \
            r_ = REAL(name)(g, s);                                                           \
            gate_after(SMAP(s), pair_);                                                      \
        }                                                                                    \
        graph_mem_after(r_, need_);                                                          \
        return r_;                                                                           \
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

/* Legacy (CUDA 2.x) launches run on the legacy default stream, or the given one. */
QGPU_EXPORT CUresult cuLaunch(CUfunction f) {
    HOOK_ENTER(cuLaunch, f);
    KERNEL_LOADED(f, NULL);
    GATED(NULL, REAL(cuLaunch)(f));
}

QGPU_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) {
    HOOK_ENTER(cuLaunchGrid, f, w, h);
    KERNEL_LOADED(f, NULL);
    GATED(NULL, REAL(cuLaunchGrid)(f, w, h));
}

QGPU_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    HOOK_ENTER(cuLaunchGridAsync, f, w, h, s);
    KERNEL_LOADED(f, s);
    GATED(s, REAL(cuLaunchGridAsync)(f, w, h, s));
}

/* One launch per device entry, each on its own stream: gated as one piece of work timed on
 * the first entry's stream (a slice is one GPU). */
QGPU_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n,
                                                          unsigned int flags) {
    HOOK_ENTER(cuLaunchCooperativeKernelMultiDevice, list, n, flags);
    for (unsigned i = 0; list && i < n; i++) KERNEL_LOADED(list[i].function, list[i].hStream);
    GATED(list && n ? list[0].hStream : NULL, REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags));
}
