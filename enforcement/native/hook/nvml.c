/* NVML view of a slice: what NVML tells a tenant about memory and processes.
 *  - nvmlDeviceGetMemoryInfo(_v2) on the slice's GPU reports the slice (total = cap, used =
 *    what the slice holds, never above the cap, free = the rest), so nvidia-smi-like tools
 *    and frameworks that size themselves from NVML see the slice, not the card. Another GPU
 *    of the node is not the slice's: NVML_ERROR_NO_PERMISSION, as NVML answers an
 *    unprivileged caller asking for a whole MIG-mode GPU (nvml.h documents the code).
 *  - BAR1 (nvmlDeviceGetBAR1MemoryInfo) maps every context of the GPU and NVML cannot tell
 *    whose: NVML_ERROR_NOT_SUPPORTED in a slice.
 *  - Every list that names processes shows only the slice's own (those holding a live slot
 *    in its ledger), on every GPU of the node (NVML ignores CUDA_VISIBLE_DEVICES; a slice has
 *    one GPU, so the lists of the others are empty): the compute, graphics and MPS lists
 *    (v1, v2, v3), the detail list, per-process utilisation (both forms, nvml_activity.c),
 *    and accounting mode's pids and per-process stats, and the video engines' encoder and
 *    frame-buffer capture sessions (their statistics are the slice's sessions'). Counts and
 *    NVML_ERROR_INSUFFICIENT_SIZE keep NVML's two-call protocol. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

#define MAX_LIST 1024

int nvml_slice_device(nvmlDevice_t dev) {
    if (hook_state() != HOOK_ACTIVE) return -1;
    if (!g_lim.device_uuid[0]) return 1;
    char uuid[96];
    if (!HAVE_REAL(nvmlDeviceGetUUID) || REAL(nvmlDeviceGetUUID)(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return 0; /* cannot say it is the slice's: it is not */
    return strcmp(uuid, g_lim.device_uuid) == 0;
}

/* Everything the real call lists, into a buffer of our own, then only the slice's entries
 * (the pid at `pid_off` of each `size`-byte entry), compacted to the front. */
nvmlReturn_t nvml_fetch_own(nvml_fetch_fn fetch, void *ctx, size_t size, size_t pid_off,
                            void **out, unsigned *mine) {
    *out = NULL;
    *mine = 0;
    unsigned n = 0;
    nvmlReturn_t r = fetch(ctx, &n, NULL);
    if (r != NVML_SUCCESS && r != NVML_ERROR_INSUFFICIENT_SIZE) return r;
    unsigned char *all = NULL;
    for (int attempt = 0; n && attempt < 4; attempt++) {
        unsigned room = n * 2 + 8 > MAX_LIST ? MAX_LIST : n * 2 + 8;
        unsigned char *buf = realloc(all, (size_t)room * size);
        if (!buf) {
            free(all);
            return NVML_ERROR_UNKNOWN;
        }
        all = buf;
        n = room;
        r = fetch(ctx, &n, all);
        if (r != NVML_ERROR_INSUFFICIENT_SIZE) break;
    }
    if (r != NVML_SUCCESS) {
        free(all);
        return r == NVML_ERROR_INSUFFICIENT_SIZE ? NVML_ERROR_UNKNOWN : r;
    }
    unsigned kept = 0;
    for (unsigned i = 0; i < n; i++) {
        unsigned pid;
        memcpy(&pid, all + (size_t)i * size + pid_off, sizeof pid);
        if (!ledger_has_pid((int)pid)) continue;
        if (kept != i) memmove(all + (size_t)kept * size, all + (size_t)i * size, size);
        kept++;
    }
    *out = all;
    *mine = kept;
    return NVML_SUCCESS;
}

nvmlReturn_t nvml_answer(void *mine, unsigned n, size_t size, void *out, unsigned *count,
                         nvmlReturn_t empty) {
    nvmlReturn_t r;
    if (!n && empty != NVML_SUCCESS)
        r = empty;
    else if (!out || *count < n)
        r = n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    else {
        if (n) memcpy(out, mine, (size_t)n * size);
        r = NVML_SUCCESS;
    }
    *count = n;
    free(mine);
    return r;
}

/* ---- memory ---- */

static void slice_numbers(unsigned long long *total, unsigned long long *used,
                          unsigned long long *free_bytes) {
    uint64_t u = ledger_used();
    if (u > g_lim.mem_limit) u = g_lim.mem_limit; /* never more used than there is */
    *total = g_lim.mem_limit;
    *used = u;
    *free_bytes = g_lim.mem_limit - u;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetMemoryInfo)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(dev, m);
    if (r != NVML_SUCCESS || !m) return r;
    switch (nvml_slice_device(dev)) {
    case 1: slice_numbers(&m->total, &m->used, &m->free); return r;
    case 0: memset(m, 0, sizeof *m); return NVML_ERROR_NO_PERMISSION;
    default: return r;
    }
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(dev, m);
    if (r != NVML_SUCCESS || !m) return r;
    switch (nvml_slice_device(dev)) {
    case 1:
        slice_numbers(&m->total, &m->used, &m->free);
        m->reserved = 0;
        return r;
    case 0: m->total = m->reserved = m->free = m->used = 0; return NVML_ERROR_NO_PERMISSION;
    default: return r;
    }
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t dev, nvmlBAR1Memory_t *bar1) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetBAR1MemoryInfo)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetBAR1MemoryInfo)(dev, bar1);
    nvmlBAR1Memory_t real;
    nvmlReturn_t r = REAL(nvmlDeviceGetBAR1MemoryInfo)(dev, bar1 ? &real : NULL);
    return r == NVML_SUCCESS ? NVML_ERROR_NOT_SUPPORTED : r; /* its errors are its own */
}

/* ---- process lists ---- */

typedef nvmlReturn_t (*list_fn)(nvmlDevice_t, unsigned int *, void *);

typedef struct {
    list_fn real;
    nvmlDevice_t dev;
} list_ctx_t;

static nvmlReturn_t fetch_list(void *c, unsigned *count, void *buf) {
    list_ctx_t *ctx = c;
    return ctx->real(ctx->dev, count, buf);
}

/* `size` is the entry size of that version of the call; the pid is first in every one. */
static nvmlReturn_t filtered(list_fn real, nvmlDevice_t dev, unsigned int *count, void *infos,
                             size_t size) {
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return real(dev, count, infos);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    list_ctx_t ctx = {real, dev};
    void *mine;
    unsigned n;
    nvmlReturn_t r = nvml_fetch_own(fetch_list, &ctx, size, 0, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    return nvml_answer(mine, n, size, infos, count, NVML_SUCCESS);
}

#define PROC_LIST(name, entry_t)                                                             \
    QGPU_EXPORT nvmlReturn_t name(nvmlDevice_t dev, unsigned int *count, entry_t *infos) {   \
        hook_load_nvml();                                                                    \
        return filtered((list_fn)hook_real_fn[HIDX_##name], dev, count, infos, sizeof(entry_t)); \
    }
PROC_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t)
PROC_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* ---- video engines: encoder (NVENC) and frame-buffer capture (NvFBC) sessions ---- */

/* A session names its process (the pid at offset 4 of both entries): only the slice's own
 * are listed, and the statistics are those of its own sessions (the real ones average every
 * process's). NVML's protocol: *count 0 asks for the count (NVML_SUCCESS). */
typedef nvmlReturn_t (*session_fn)(nvmlDevice_t, unsigned int *, void *);

static nvmlReturn_t own_sessions(session_fn real, nvmlDevice_t dev, size_t size, void **mine,
                                 unsigned *n) {
    list_ctx_t ctx = {(list_fn)real, dev};
    return nvml_fetch_own(fetch_list, &ctx, size, 4, mine, n);
}

static nvmlReturn_t session_answer(session_fn real, nvmlDevice_t dev, unsigned int *count,
                                   void *infos, size_t size) {
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return real(dev, count, infos);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    void *mine;
    unsigned n;
    nvmlReturn_t r = own_sessions(real, dev, size, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    if (*count == 0) {
        free(mine);
        *count = n;
        return NVML_SUCCESS;
    }
    if (!infos) {
        free(mine);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return nvml_answer(mine, n, size, infos, count, NVML_SUCCESS);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderSessions(nvmlDevice_t dev, unsigned int *count,
                                                      nvmlEncoderSessionInfo_t *infos) {
    hook_load_nvml();
    return session_answer((session_fn)hook_real_fn[HIDX_nvmlDeviceGetEncoderSessions], dev,
                          count, infos, sizeof *infos);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCSessions(nvmlDevice_t dev, unsigned int *count,
                                                  nvmlFBCSessionInfo_t *infos) {
    hook_load_nvml();
    return session_answer((session_fn)hook_real_fn[HIDX_nvmlDeviceGetFBCSessions], dev, count,
                          infos, sizeof *infos);
}

/* The slice's sessions: how many, and the mean of their frame rates and latencies (what
 * NVML's statistics are over all sessions). Without the session list nothing can be told
 * apart: NVML_ERROR_NOT_SUPPORTED. */
static nvmlReturn_t own_session_stats(session_fn real, nvmlDevice_t dev, size_t size,
                                      size_t fps_off, size_t lat_off, unsigned *count,
                                      unsigned *fps, unsigned *lat) {
    if (!real) return NVML_ERROR_NOT_SUPPORTED;
    void *mine;
    unsigned n;
    nvmlReturn_t r = own_sessions(real, dev, size, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    unsigned long long f = 0, l = 0;
    for (unsigned i = 0; i < n; i++) {
        unsigned v;
        memcpy(&v, (char *)mine + (size_t)i * size + fps_off, sizeof v);
        f += v;
        memcpy(&v, (char *)mine + (size_t)i * size + lat_off, sizeof v);
        l += v;
    }
    free(mine);
    *count = n;
    *fps = n ? (unsigned)(f / n) : 0;
    *lat = n ? (unsigned)(l / n) : 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderStats(nvmlDevice_t dev, unsigned int *count,
                                                   unsigned int *fps, unsigned int *latency) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetEncoderStats)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetEncoderStats)(dev, count, fps, latency);
    if (!count || !fps || !latency) return NVML_ERROR_INVALID_ARGUMENT;
    return own_session_stats((session_fn)hook_real_fn[HIDX_nvmlDeviceGetEncoderSessions], dev,
                             sizeof(nvmlEncoderSessionInfo_t),
                             offsetof(nvmlEncoderSessionInfo_t, averageFps),
                             offsetof(nvmlEncoderSessionInfo_t, averageLatency), count, fps,
                             latency);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCStats(nvmlDevice_t dev, nvmlFBCStats_t *stats) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetFBCStats)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetFBCStats)(dev, stats);
    if (!stats) return NVML_ERROR_INVALID_ARGUMENT;
    return own_session_stats((session_fn)hook_real_fn[HIDX_nvmlDeviceGetFBCSessions], dev,
                             sizeof(nvmlFBCSessionInfo_t),
                             offsetof(nvmlFBCSessionInfo_t, averageFPS),
                             offsetof(nvmlFBCSessionInfo_t, averageLatency),
                             &stats->sessionsCount, &stats->averageFPS, &stats->averageLatency);
}

/* The detail list is versioned: only the version whose layout the hook knows is answered
 * (a newer one is refused, never passed through unfiltered). */
typedef struct {
    nvmlDevice_t dev;
    unsigned mode;
} detail_ctx_t;

static nvmlReturn_t fetch_detail(void *c, unsigned *count, void *buf) {
    detail_ctx_t *ctx = c;
    nvmlProcessDetailList_t l = {nvmlProcessDetailList_v1, ctx->mode, *count, buf};
    nvmlReturn_t r = REAL(nvmlDeviceGetRunningProcessDetailList)(ctx->dev, &l);
    *count = l.numProcArrayEntries;
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t dev,
                                                               nvmlProcessDetailList_t *plist) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetRunningProcessDetailList)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetRunningProcessDetailList)(dev, plist);
    if (!plist) return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    detail_ctx_t ctx = {dev, plist->mode};
    void *mine;
    unsigned n;
    nvmlReturn_t r = nvml_fetch_own(fetch_detail, &ctx, sizeof(nvmlProcessDetail_v1_t), 0, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    return nvml_answer(mine, n, sizeof(nvmlProcessDetail_v1_t), plist->procArray,
                       &plist->numProcArrayEntries, NVML_SUCCESS);
}

/* ---- accounting mode: a record per process, kept after it ends ---- */

static nvmlReturn_t fetch_pids(void *c, unsigned *count, void *buf) {
    return REAL(nvmlDeviceGetAccountingPids)(*(nvmlDevice_t *)c, count, buf);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t dev, unsigned int *count,
                                                     unsigned int *pids) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetAccountingPids)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetAccountingPids)(dev, count, pids);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    void *mine;
    unsigned n;
    nvmlReturn_t r = nvml_fetch_own(fetch_pids, &dev, sizeof(unsigned), 0, &mine, &n);
    if (r != NVML_SUCCESS) return r;
    return nvml_answer(mine, n, sizeof(unsigned), pids, count, NVML_SUCCESS);
}

/* Stats of the slice's live processes only: a pid of another tenant, or one whose record
 * is of a process that ended (a reused pid), is NOT_FOUND, as a pid NVML never saw. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t dev, unsigned int pid,
                                                      nvmlAccountingStats_t *stats) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetAccountingStats)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return REAL(nvmlDeviceGetAccountingStats)(dev, pid, stats);
    nvmlAccountingStats_t s;
    nvmlReturn_t r = REAL(nvmlDeviceGetAccountingStats)(dev, pid, stats ? &s : NULL);
    if (r != NVML_SUCCESS) return r; /* accounting off, a bad device, NOT_FOUND: nobody's */
    if (!s.isRunning || !ledger_has_pid((int)pid)) return NVML_ERROR_NOT_FOUND;
    *stats = s;
    return NVML_SUCCESS;
}
