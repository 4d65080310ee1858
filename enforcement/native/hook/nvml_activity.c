/* NVML view of a slice: what NVML tells a tenant about activity on the GPU.
 *  - Per-process utilisation (nvmlDeviceGetProcessUtilization and its versioned form
 *    nvmlDeviceGetProcessesUtilizationInfo) lists only the slice's own processes.
 *  - Device utilisation (nvmlDeviceGetUtilizationRates) and its history
 *    (nvmlDeviceGetSamples of GPU, memory, encoder, decoder, JPEG and OFA utilisation) are
 *    the slice's own share of the GPU: the sum over the slice's processes of NVML's latest
 *    per-process samples (percent of the whole GPU's time, capped at 100). A slice running
 *    flat out beside a busy neighbour on a time-sliced GPU reads about half, its share, not
 *    the 100 % the GPU is busy; an idle slice reads 0 however busy its neighbours are. The
 *    sample history becomes one sample, stamped with NVML's newest, so a caller polling with
 *    lastSeenTimeStamp still advances. Where NVML has no per-process samples the slice's view
 *    cannot be made, and its error is returned rather than the GPU's number. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hook.h"

#define STALE_US 1500000ULL /* a sample older than this is not the current period's */

/* ---- per-process utilisation: the slice's processes only ---- */

typedef struct {
    nvmlDevice_t dev;
    unsigned long long last_seen;
} util_ctx_t;

static nvmlReturn_t fetch_samples(void *c, unsigned *count, void *buf) {
    util_ctx_t *ctx = c;
    return REAL(nvmlDeviceGetProcessUtilization)(ctx->dev, buf, count, ctx->last_seen);
}

static nvmlReturn_t fetch_infos(void *c, unsigned *count, void *buf) {
    util_ctx_t *ctx = c;
    nvmlProcessesUtilizationInfo_t info = {nvmlProcessesUtilizationInfo_v1, *count,
                                           ctx->last_seen, buf};
    nvmlReturn_t r = REAL(nvmlDeviceGetProcessesUtilizationInfo)(ctx->dev, &info);
    *count = info.processSamplesCount;
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev,
                                                         nvmlProcessUtilizationSample_t *out,
                                                         unsigned int *count,
                                                         unsigned long long last_seen) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetProcessUtilization)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE)
        return REAL(nvmlDeviceGetProcessUtilization)(dev, out, count, last_seen);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    util_ctx_t ctx = {dev, last_seen};
    void *mine;
    unsigned n;
    nvmlReturn_t r = nvml_fetch_own(fetch_samples, &ctx, sizeof *out, 0, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    return nvml_answer(mine, n, sizeof *out, out, count, NVML_ERROR_NOT_FOUND);
}

/* The versioned form: the pid is not first in its entries. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t dev,
                                                               nvmlProcessesUtilizationInfo_t *info) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetProcessesUtilizationInfo)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetProcessesUtilizationInfo)(dev, info);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    util_ctx_t ctx = {dev, info->lastSeenTimeStamp};
    size_t size = sizeof(nvmlProcessUtilizationInfo_v1_t);
    void *mine;
    unsigned n;
    nvmlReturn_t r = nvml_fetch_own(fetch_infos, &ctx, size,
                                    offsetof(nvmlProcessUtilizationInfo_v1_t, pid), &mine, &n);
    if (r != NVML_SUCCESS) return r;
    return nvml_answer(mine, n, size, info->procUtilArray, &info->processSamplesCount,
                       NVML_ERROR_NOT_FOUND);
}

/* ---- the slice's own load ---- */

typedef struct {
    unsigned sm, mem, enc, dec, jpg, ofa; /* percent of the GPU, summed over the slice */
} slice_load_t;

static unsigned long long now_us(void) {
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    return (unsigned long long)rt.tv_sec * 1000000u + (unsigned long long)rt.tv_nsec / 1000u;
}

static unsigned add_pct(unsigned a, unsigned b) { return a + b > 100 ? 100 : a + b; }

/* 1 if entry i is the newest of its pid among n (a driver may keep several per process) */
static int newest_of_pid(const nvmlProcessUtilizationInfo_v1_t *e, unsigned n, unsigned i) {
    for (unsigned j = 0; j < n; j++)
        if (j != i && e[j].pid == e[i].pid &&
            (e[j].timeStamp > e[i].timeStamp || (e[j].timeStamp == e[i].timeStamp && j > i)))
            return 0;
    return 1;
}

/* The slice's processes' latest samples, in the versioned layout (the older call's
 * samples are converted: no JPEG or OFA figures there). */
static nvmlReturn_t own_samples(nvmlDevice_t dev, nvmlProcessUtilizationInfo_v1_t **out,
                                unsigned *n) {
    util_ctx_t ctx = {dev, 0};
    void *mine = NULL;
    nvmlReturn_t r = NVML_ERROR_FUNCTION_NOT_FOUND;
    if (HAVE_REAL(nvmlDeviceGetProcessesUtilizationInfo))
        r = nvml_fetch_own(fetch_infos, &ctx, sizeof **out,
                           offsetof(nvmlProcessUtilizationInfo_v1_t, pid), &mine, n);
    if (r == NVML_SUCCESS || r == NVML_ERROR_NOT_FOUND) {
        *out = mine;
        return r;
    }
    if (!HAVE_REAL(nvmlDeviceGetProcessUtilization)) return r;
    r = nvml_fetch_own(fetch_samples, &ctx, sizeof(nvmlProcessUtilizationSample_t), 0, &mine, n);
    if (r != NVML_SUCCESS) return r;
    nvmlProcessUtilizationInfo_v1_t *conv = calloc(*n ? *n : 1, sizeof *conv);
    if (!conv) {
        free(mine);
        return NVML_ERROR_UNKNOWN;
    }
    const nvmlProcessUtilizationSample_t *s = mine;
    for (unsigned i = 0; i < *n; i++)
        conv[i] = (nvmlProcessUtilizationInfo_v1_t){s[i].timeStamp, s[i].pid, s[i].smUtil,
                                                    s[i].memUtil, s[i].encUtil, s[i].decUtil, 0, 0};
    free(mine);
    *out = conv;
    return NVML_SUCCESS;
}

static nvmlReturn_t slice_load(nvmlDevice_t dev, slice_load_t *load) {
    memset(load, 0, sizeof *load);
    nvmlProcessUtilizationInfo_v1_t *e = NULL;
    unsigned n = 0;
    nvmlReturn_t r = own_samples(dev, &e, &n);
    if (r == NVML_ERROR_NOT_FOUND) return NVML_SUCCESS; /* no process sampled: nothing ran */
    if (r != NVML_SUCCESS) return r;
    unsigned long long now = now_us();
    for (unsigned i = 0; i < n; i++) {
        if (!newest_of_pid(e, n, i) || e[i].timeStamp + STALE_US < now) continue;
        load->sm = add_pct(load->sm, e[i].smUtil);
        load->mem = add_pct(load->mem, e[i].memUtil);
        load->enc = add_pct(load->enc, e[i].encUtil);
        load->dec = add_pct(load->dec, e[i].decUtil);
        load->jpg = add_pct(load->jpg, e[i].jpgUtil);
        load->ofa = add_pct(load->ofa, e[i].ofaUtil);
    }
    free(e);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *u) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetUtilizationRates)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetUtilizationRates)(dev, u);
    if (r != NVML_SUCCESS || !u || hook_state() != HOOK_ACTIVE) return r;
    u->gpu = u->memory = 0; /* never the GPU's numbers, whatever happens below */
    slice_load_t load;
    r = slice_load(dev, &load);
    if (r != NVML_SUCCESS) return r;
    u->gpu = load.sm;
    u->memory = load.mem;
    return NVML_SUCCESS;
}

/* ---- sample history ---- */

static int slice_value(const slice_load_t *l, int type, unsigned *v) {
    switch (type) {
    case NVML_GPU_UTILIZATION_SAMPLES: *v = l->sm; return 1;
    case NVML_MEMORY_UTILIZATION_SAMPLES: *v = l->mem; return 1;
    case NVML_ENC_UTILIZATION_SAMPLES: *v = l->enc; return 1;
    case NVML_DEC_UTILIZATION_SAMPLES: *v = l->dec; return 1;
    case NVML_JPG_UTILIZATION_SAMPLES: *v = l->jpg; return 1;
    case NVML_OFA_UTILIZATION_SAMPLES: *v = l->ofa; return 1;
    default: return 0; /* power and clocks: the GPU's (docs/enforcement.md, side channels) */
    }
}

/* NVML's newest sample time of `type` after last_seen (its errors: none newer is NOT_FOUND). */
static nvmlReturn_t newest_sample(nvmlDevice_t dev, int type, unsigned long long last_seen,
                                  unsigned long long *ts) {
    int vt;
    unsigned n = 0;
    nvmlReturn_t r = REAL(nvmlDeviceGetSamples)(dev, type, last_seen, &vt, &n, NULL);
    if (r != NVML_SUCCESS) return r;
    if (!n) return NVML_ERROR_NOT_FOUND;
    nvmlSample_t *all = calloc(n, sizeof *all);
    if (!all) return NVML_ERROR_UNKNOWN;
    r = REAL(nvmlDeviceGetSamples)(dev, type, last_seen, &vt, &n, all);
    *ts = 0;
    for (unsigned i = 0; r == NVML_SUCCESS && i < n; i++)
        if (all[i].timeStamp > *ts) *ts = all[i].timeStamp;
    free(all);
    if (r == NVML_SUCCESS && !*ts) r = NVML_ERROR_NOT_FOUND;
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t dev, int type,
                                              unsigned long long last_seen, int *value_type,
                                              unsigned int *count, nvmlSample_t *samples) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetSamples)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    slice_load_t load = {0};
    unsigned value;
    if (hook_state() != HOOK_ACTIVE || !slice_value(&load, type, &value))
        return REAL(nvmlDeviceGetSamples)(dev, type, last_seen, value_type, count, samples);
    if (!count || !value_type || (samples && *count == 0)) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long ts;
    nvmlReturn_t r = newest_sample(dev, type, last_seen, &ts);
    if (r != NVML_SUCCESS) return r;
    r = slice_load(dev, &load);
    if (r != NVML_SUCCESS) return r;
    slice_value(&load, type, &value);
    *value_type = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (samples) {
        memset(&samples[0], 0, sizeof samples[0]);
        samples[0].timeStamp = ts;
        samples[0].sampleValue.uiVal = value;
    }
    *count = 1;
    return NVML_SUCCESS;
}
