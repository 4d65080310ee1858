/* Simulated libnvidia-ml.so.1: NVML over the simulator's shared per-GPU state. Struct
 * layouts follow nvml.h (include/qgpu_nvml.h, pinned against nvidia-ml-py's ctypes mirrors).
 * NVML ignores CUDA_VISIBLE_DEVICES, like the real library. What the simulated GPUs do not
 * have (power, clocks, the video engines' utilisation, MIG, confidential computing) is
 * NVML_ERROR_NOT_SUPPORTED or not exported; the video engines' sessions are listed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../include/qgpu_nvml.h"
#include "sim.h"

typedef struct {
    int index;
    sim_gpu_state_t *st;
} sim_nvml_device_t;
typedef sim_nvml_device_t *nvmlDevice_t;

static sim_config_t cfg;
static sim_nvml_device_t devices[SIM_MAX_GPUS];
static int refcount;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

QGPU_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (refcount == 0) {
        const char *path = getenv("QGPU_SIM_CONFIG");
        char err[512];
        if (!path || !*path) {
            fprintf(stderr, "qgpu-sim-nvml: QGPU_SIM_CONFIG is not set: no simulated GPUs\n");
            ret = NVML_ERROR_DRIVER_NOT_LOADED;
        } else if (sim_config_load(path, &cfg, err, sizeof err) != 0) {
            fprintf(stderr, "qgpu-sim-nvml: %s\n", err);
            ret = NVML_ERROR_DRIVER_NOT_LOADED;
        } else {
            for (int i = 0; i < cfg.ngpus; i++) {
                devices[i].index = i;
                if (!devices[i].st) devices[i].st = sim_state_open(&cfg.gpus[i], &cfg);
                if (!devices[i].st) ret = NVML_ERROR_UNKNOWN;
            }
        }
    }
    if (ret == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

QGPU_EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
QGPU_EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

QGPU_EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount > 0) refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

QGPU_EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t check(nvmlDevice_t d) {
    if (__atomic_load_n(&refcount, __ATOMIC_ACQUIRE) <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!d || d < devices || d >= devices + cfg.ngpus || !d->st) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(cfg.driver_version) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(buf, len, "%s", cfg.driver_version);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = cfg.cuda_version;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    return nvmlSystemGetCudaDriverVersion_v2(version);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)cfg.ngpus;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev) {
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!dev || index >= (unsigned)cfg.ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &devices[index];
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev) {
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev) {
    if (refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !dev) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < cfg.ngpus; i++)
        if (strcmp(cfg.gpus[i].uuid, uuid) == 0) {
            *dev = &devices[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t copy_str(char *buf, unsigned int len, const char *s) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(buf, len, "%s", s);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len) {
    nvmlReturn_t r = check(d);
    return r ? r : copy_str(buf, len, cfg.gpus[d->index].uuid);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int len) {
    nvmlReturn_t r = check(d);
    return r ? r : copy_str(buf, len, cfg.gpus[d->index].name);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = cfg.gpus[d->index].cc_major;
    *minor = cfg.gpus[d->index].cc_minor;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)d->index;
    return NVML_SUCCESS;
}

static void mem_numbers(nvmlDevice_t d, unsigned long long *total, unsigned long long *used) {
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    *total = d->st->mem_total;
    *used = d->st->mem_used;
    sim_state_unlock(d->st);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    mem_numbers(d, &m->total, &m->used);
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem_numbers(d, &m->total, &m->used);
    m->reserved = 0;
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    sim_state_lock(d->st);
    u->gpu = sim_state_utilization(d->st, qgpu_now_ns());
    sim_state_unlock(d->st);
    u->memory = 0;
    return NVML_SUCCESS;
}

/* The processes holding memory on the device (a process with a context holds its context's
 * memory), into found[SIM_MAX_PROCS]; returns how many. */
static unsigned compute_procs(nvmlDevice_t d, nvmlProcessInfo_t *found) {
    unsigned n = 0;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &d->st->procs[i];
        if (!p->pid || (!p->mem_used && !p->contexts)) continue;
        found[n].pid = (unsigned)p->pid;
        found[n].usedGpuMemory = sim_proc_listed_memory(p); /* managed memory left out */
        found[n].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        found[n].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        n++;
    }
    sim_state_unlock(d->st);
    return n;
}

/* The compute process list. `size` is the caller's struct size: v1 is {pid, usedGpuMemory},
 * v2/v3 add the MIG instance ids. */
static nvmlReturn_t running(nvmlDevice_t d, unsigned int *count, void *infos, size_t size) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t found[SIM_MAX_PROCS];
    unsigned n = compute_procs(d, found);
    if (!infos || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < n; i++) {
        if (size == sizeof(nvmlProcessInfo_v1_t)) {
            nvmlProcessInfo_v1_t v1 = {found[i].pid, found[i].usedGpuMemory};
            memcpy((char *)infos + i * size, &v1, size);
        } else {
            memcpy((char *)infos + i * size, &found[i], size);
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos) {
    return running(d, count, infos, sizeof *infos);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos) {
    return running(d, count, infos, sizeof *infos);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *count,
                                                              nvmlProcessInfo_v1_t *infos) {
    return running(d, count, infos, sizeof *infos);
}

/* ---- video engines: sessions opened with qgpuSimVideoSessionOpen (video.c) ---- */

/* Every live process's encoder (`fbc` 0) or capture sessions, one entry each, into
 * found[SIM_MAX_VIDEO]; returns how many. Session ids are the slot and the session's number
 * in it (stable while the process lives). */
#define SIM_MAX_VIDEO 256
typedef struct {
    unsigned pid, id, fps, latency_us;
} video_session_t;

static unsigned video_sessions(nvmlDevice_t d, int fbc, video_session_t *found) {
    unsigned n = 0;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &d->st->procs[i];
        unsigned have = fbc ? p->fbc_sessions : p->enc_sessions;
        for (unsigned k = 0; p->pid && k < have && n < SIM_MAX_VIDEO; k++) {
            found[n].pid = (unsigned)p->pid;
            found[n].id = (unsigned)i * 1000u + k + 1;
            found[n].fps = fbc ? 30 : p->enc_fps;
            found[n].latency_us = fbc ? 2000 : p->enc_latency_us;
            n++;
        }
    }
    sim_state_unlock(d->st);
    return n;
}

/* NVML's protocol for these lists: *count 0 asks for the count (NVML_SUCCESS), a buffer
 * too small is NVML_ERROR_INSUFFICIENT_SIZE with the count needed. */
static nvmlReturn_t session_list(nvmlDevice_t d, int fbc, unsigned int *count, void *infos) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    video_session_t found[SIM_MAX_VIDEO];
    unsigned n = video_sessions(d, fbc, found);
    if (*count == 0) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (!infos) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        if (fbc) {
            nvmlFBCSessionInfo_t e = {found[i].id, found[i].pid, 0, 0, 1, 0, 3840, 2160,
                                      1920, 1080, found[i].fps, found[i].latency_us};
            ((nvmlFBCSessionInfo_t *)infos)[i] = e;
        } else {
            nvmlEncoderSessionInfo_t e = {found[i].id, found[i].pid, 0, 0, 1920, 1080,
                                          found[i].fps, found[i].latency_us};
            ((nvmlEncoderSessionInfo_t *)infos)[i] = e;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

static void session_stats(const video_session_t *s, unsigned n, unsigned *fps, unsigned *lat) {
    unsigned long long f = 0, l = 0;
    for (unsigned i = 0; i < n; i++) {
        f += s[i].fps;
        l += s[i].latency_us;
    }
    *fps = n ? (unsigned)(f / n) : 0;
    *lat = n ? (unsigned)(l / n) : 0;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderSessions(nvmlDevice_t d, unsigned int *count,
                                                      nvmlEncoderSessionInfo_t *infos) {
    return session_list(d, 0, count, infos);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCSessions(nvmlDevice_t d, unsigned int *count,
                                                  nvmlFBCSessionInfo_t *infos) {
    return session_list(d, 1, count, infos);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderStats(nvmlDevice_t d, unsigned int *count,
                                                   unsigned int *fps, unsigned int *latency) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count || !fps || !latency) return NVML_ERROR_INVALID_ARGUMENT;
    video_session_t found[SIM_MAX_VIDEO];
    *count = video_sessions(d, 0, found);
    session_stats(found, *count, fps, latency);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCStats(nvmlDevice_t d, nvmlFBCStats_t *stats) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!stats) return NVML_ERROR_INVALID_ARGUMENT;
    video_session_t found[SIM_MAX_VIDEO];
    stats->sessionsCount = video_sessions(d, 1, found);
    session_stats(found, stats->sessionsCount, &stats->averageFPS, &stats->averageLatency);
    return NVML_SUCCESS;
}

/* No graphics work and no MPS server on simulated GPUs: empty lists. */
static nvmlReturn_t none(nvmlDevice_t d, unsigned int *count) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                                  nvmlProcessInfo_t *infos) {
    (void)infos;
    return none(d, count);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *count,
                                                                  nvmlProcessInfo_t *infos) {
    (void)infos;
    return none(d, count);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned int *count,
                                                               nvmlProcessInfo_v1_t *infos) {
    (void)infos;
    return none(d, count);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d,
                                                                    unsigned int *count,
                                                                    nvmlProcessInfo_t *infos) {
    (void)infos;
    return none(d, count);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t d,
                                                                    unsigned int *count,
                                                                    nvmlProcessInfo_t *infos) {
    (void)infos;
    return none(d, count);
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t d,
                                                                 unsigned int *count,
                                                                 nvmlProcessInfo_v1_t *infos) {
    (void)infos;
    return none(d, count);
}

/* CPU microseconds since the epoch at monotonic time 0, read once per process: a sample
 * keeps one timestamp however often it is asked for (recomputing it from both clocks at
 * every call would make the same sample look newer than itself). */
static int64_t epoch_offset_us(void) {
    static int64_t offset;
    int64_t v = __atomic_load_n(&offset, __ATOMIC_RELAXED);
    if (v) return v;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    v = (int64_t)rt.tv_sec * 1000000 + rt.tv_nsec / 1000 - qgpu_now_ns() / 1000;
    int64_t expected = 0;
    if (!__atomic_compare_exchange_n(&offset, &expected, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        v = expected;
    return v;
}

/* Per-process SM utilisation, as NVML reports it: one sample per process newer than
 * `lastSeen` (CPU microseconds since the epoch), the percentage of the last sampling period
 * (~100 ms) the device spent on the process's work. Into found[SIM_MAX_PROCS]; returns how
 * many. Framebuffer, video and JPEG/OFA engines are not modelled: 0. */
static unsigned process_samples(nvmlDevice_t d, unsigned long long lastSeen,
                                nvmlProcessUtilizationSample_t *found) {
    int64_t mono = qgpu_now_ns();
    unsigned n = 0;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    sim_state_advance(d->st, mono);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &d->st->procs[i];
        if (!p->pid) continue;
        uint32_t h = p->usnap_head % SIM_USNAPS, prev = (h + SIM_USNAPS - 1) % SIM_USNAPS;
        int64_t t1 = p->usnap_t[prev], t2 = p->usnap_t[h];
        if (!t1 || !t2 || t2 <= t1) continue;
        unsigned long long ts = (unsigned long long)(epoch_offset_us() + t2 / 1000);
        if (ts <= lastSeen) continue;
        uint64_t busy = p->usnap_done[h] - p->usnap_done[prev];
        unsigned pct = (unsigned)((busy * 100 + (uint64_t)(t2 - t1) / 2) / (uint64_t)(t2 - t1));
        found[n] = (nvmlProcessUtilizationSample_t){(unsigned)p->pid, ts, pct > 100 ? 100 : pct, 0, 0, 0};
        n++;
    }
    sim_state_unlock(d->st);
    return n;
}

/* NOT_FOUND when no sample is newer than lastSeen. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                         nvmlProcessUtilizationSample_t *out,
                                                         unsigned int *count,
                                                         unsigned long long lastSeen) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessUtilizationSample_t found[SIM_MAX_PROCS];
    unsigned n = process_samples(d, lastSeen, found);
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (!out || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, found, n * sizeof *out);
    *count = n;
    return NVML_SUCCESS;
}

/* The same samples in the versioned form (R550+): every engine of each process, the
 * timestamp first. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t d,
                                                               nvmlProcessesUtilizationInfo_t *info) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlProcessUtilizationSample_t found[SIM_MAX_PROCS];
    unsigned n = process_samples(d, info->lastSeenTimeStamp, found);
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (!info->procUtilArray || info->processSamplesCount < n) {
        info->processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++)
        info->procUtilArray[i] = (nvmlProcessUtilizationInfo_v1_t){
            found[i].timeStamp, found[i].pid, found[i].smUtil, found[i].memUtil,
            found[i].encUtil, found[i].decUtil, 0, 0};
    info->processSamplesCount = n;
    return NVML_SUCCESS;
}

/* Running processes of one kind with their memory (Hopper and newer, as nvml.h says; older
 * GPUs refuse it). Only compute work runs on simulated GPUs: the graphics and MPS lists are
 * empty. No confidential computing: no protected memory. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t d,
                                                               nvmlProcessDetailList_t *plist) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!plist) return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (cfg.gpus[d->index].cc_major < 9) return NVML_ERROR_NOT_SUPPORTED;
    if (plist->mode > NVML_PROCESS_MODE_MPS) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t found[SIM_MAX_PROCS];
    unsigned n = plist->mode == NVML_PROCESS_MODE_COMPUTE ? compute_procs(d, found) : 0;
    if (!plist->procArray || plist->numProcArrayEntries < n) {
        plist->numProcArrayEntries = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < n; i++)
        plist->procArray[i] = (nvmlProcessDetail_v1_t){found[i].pid, found[i].usedGpuMemory,
                                                       found[i].gpuInstanceId,
                                                       found[i].computeInstanceId, 0};
    plist->numProcArrayEntries = n;
    return NVML_SUCCESS;
}

/* The device's utilisation history: one sample per ~100 ms snapshot of the device model,
 * the share of the period since the one before that the device was busy; oldest first, as
 * many as fit. Only GPU (SM) and memory utilisation are modelled (memory: always 0, no
 * bandwidth model); power, clocks and the video engines are NOT_SUPPORTED. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t d, int type, unsigned long long lastSeen,
                                              int *valueType, unsigned int *count,
                                              nvmlSample_t *samples) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count || !valueType || (samples && *count == 0) || type < 0 ||
        type >= NVML_SAMPLINGTYPE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_GPU_UTILIZATION_SAMPLES && type != NVML_MEMORY_UTILIZATION_SAMPLES)
        return NVML_ERROR_NOT_SUPPORTED;
    nvmlSample_t found[SIM_SNAPSHOTS];
    unsigned n = 0;
    sim_gpu_state_t *st = d->st;
    sim_state_lock(st);
    sim_state_advance(st, qgpu_now_ns());
    uint32_t oldest = (st->snap_head + 1) % SIM_SNAPSHOTS;
    for (uint32_t k = 1; k < SIM_SNAPSHOTS; k++) {
        uint32_t prev = (oldest + k - 1) % SIM_SNAPSHOTS, cur = (oldest + k) % SIM_SNAPSHOTS;
        int64_t t1 = st->snap_t[prev], t2 = st->snap_t[cur];
        if (!t1 || t2 <= t1) continue;
        unsigned long long ts = (unsigned long long)(epoch_offset_us() + t2 / 1000);
        if (ts <= lastSeen) continue;
        uint64_t span = (uint64_t)(t2 - t1), busy = st->snap_busy[cur] - st->snap_busy[prev];
        unsigned pct = (unsigned)((busy * 100 + span / 2) / span);
        found[n].timeStamp = ts;
        found[n].sampleValue.ullVal = 0;
        found[n].sampleValue.uiVal = type == NVML_GPU_UTILIZATION_SAMPLES ? (pct > 100 ? 100 : pct) : 0;
        n++;
    }
    sim_state_unlock(st);
    if (!n) return NVML_ERROR_NOT_FOUND;
    *valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (!samples) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (*count < n) n = *count;
    memcpy(samples, found, n * sizeof *samples);
    *count = n;
    return NVML_SUCCESS;
}

/* BAR1: the aperture (config gpuN.bar1) and what the live contexts map of it
 * (SIM_BAR1_PER_CONTEXT each; NVIDIA does not publish the figure). */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t d, nvmlBAR1Memory_t *bar1) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!bar1) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t contexts = 0;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (d->st->procs[i].pid) contexts += d->st->procs[i].contexts;
    sim_state_unlock(d->st);
    uint64_t total = cfg.gpus[d->index].bar1;
    uint64_t used = contexts > total / SIM_BAR1_PER_CONTEXT ? total : contexts * SIM_BAR1_PER_CONTEXT;
    bar1->bar1Total = total;
    bar1->bar1Used = used;
    bar1->bar1Free = total - used;
    return NVML_SUCCESS;
}

/* ---- accounting mode (acct.c keeps the records) ---- */

static nvmlReturn_t acct_check(nvmlDevice_t d) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    return __atomic_load_n(&d->st->acct_mode, __ATOMIC_ACQUIRE) ? NVML_SUCCESS
                                                                 : NVML_ERROR_NOT_SUPPORTED;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingMode(nvmlDevice_t d, int *mode) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = __atomic_load_n(&d->st->acct_mode, __ATOMIC_ACQUIRE) ? NVML_FEATURE_ENABLED
                                                                  : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

/* Root only, as on NVIDIA's driver; turning it off forgets every record. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceSetAccountingMode(nvmlDevice_t d, int mode) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (mode != NVML_FEATURE_ENABLED && mode != NVML_FEATURE_DISABLED)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    sim_state_lock(d->st);
    if (mode == NVML_FEATURE_DISABLED) sim_acct_clear(d->st, 1);
    __atomic_store_n(&d->st->acct_mode, (uint32_t)mode, __ATOMIC_RELEASE);
    sim_state_unlock(d->st);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t d, int *mode) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (int)__atomic_load_n(&d->st->compute_mode, __ATOMIC_ACQUIRE);
    return NVML_SUCCESS;
}

/* Root only, as on NVIDIA's driver; the mode is the GPU's, for every process on it, and lasts
 * (in the state file) until it is set again. EXCLUSIVE_THREAD (1) is gone from current
 * drivers: NVML_ERROR_NOT_SUPPORTED. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t d, int mode) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (mode < 0 || mode > CU_COMPUTEMODE_EXCLUSIVE_PROCESS) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode == 1) return NVML_ERROR_NOT_SUPPORTED;
    if (geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    __atomic_store_n(&d->st->compute_mode, (uint32_t)mode, __ATOMIC_RELEASE);
    return NVML_SUCCESS;
}

/* Root only: forgets the processes that ended. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceClearAccountingPids(nvmlDevice_t d) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (geteuid() != 0) return NVML_ERROR_NO_PERMISSION;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    sim_acct_clear(d->st, 0);
    sim_state_unlock(d->st);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingBufferSize(nvmlDevice_t d, unsigned int *size) {
    nvmlReturn_t r = acct_check(d);
    if (r) return r;
    if (!size) return NVML_ERROR_INVALID_ARGUMENT;
    *size = SIM_ACCT_RECORDS;
    return NVML_SUCCESS;
}

/* Every process with a record, running or ended, oldest first. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t d, unsigned int *count,
                                                     unsigned int *pids) {
    nvmlReturn_t r = acct_check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned found[SIM_ACCT_RECORDS], n = 0;
    sim_gpu_state_t *st = d->st;
    sim_state_lock(st);
    sim_state_reclaim_dead(st); /* a dead process's record ends */
    for (uint64_t k = 0; k < SIM_ACCT_RECORDS; k++) {
        const sim_acct_t *a = &st->acct[(st->acct_next + k) % SIM_ACCT_RECORDS];
        if (a->pid) found[n++] = (unsigned)a->pid;
    }
    sim_state_unlock(st);
    if (!pids || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    memcpy(pids, found, n * sizeof *pids);
    *count = n;
    return NVML_SUCCESS;
}

/* A record's numbers: over a process's life so far (running) or its whole life (ended). */
static void acct_stats(sim_gpu_state_t *st, const sim_acct_t *a, int64_t now,
                       nvmlAccountingStats_t *out) {
    uint64_t done = a->done_ns, max_mem = a->max_mem;
    int64_t end = a->end_ns;
    if (a->running) {
        end = now;
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            const sim_proc_t *p = &st->procs[i];
            if (p->pid != a->pid || p->start_time != a->proc_start) continue;
            done = p->done_ns;
            if (sim_proc_listed_memory(p) > max_mem) max_mem = sim_proc_listed_memory(p);
        }
    }
    uint64_t life = end > a->start_ns ? (uint64_t)(end - a->start_ns) : 0;
    unsigned pct = life ? (unsigned)((done * 100 + life / 2) / life) : 0;
    memset(out, 0, sizeof *out);
    out->gpuUtilization = pct > 100 ? 100 : pct;
    out->memoryUtilization = 0; /* no bandwidth model */
    out->maxMemoryUsage = max_mem;
    out->time = a->running ? 0 : life / 1000000u;
    out->startTime = a->start_us;
    out->isRunning = a->running ? 1 : 0;
}

/* The newest record of `pid` (for a pid used twice, the process that came last). */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t d, unsigned int pid,
                                                      nvmlAccountingStats_t *stats) {
    nvmlReturn_t r = acct_check(d);
    if (r) return r;
    if (!stats) return NVML_ERROR_INVALID_ARGUMENT;
    sim_gpu_state_t *st = d->st;
    int64_t now = qgpu_now_ns();
    r = NVML_ERROR_NOT_FOUND;
    sim_state_lock(st);
    sim_state_reclaim_dead(st);
    sim_state_advance(st, now);
    for (uint64_t k = 1; k <= SIM_ACCT_RECORDS && r != NVML_SUCCESS; k++) {
        const sim_acct_t *a = &st->acct[(st->acct_next + SIM_ACCT_RECORDS - k) % SIM_ACCT_RECORDS];
        if (!a->pid || (unsigned)a->pid != pid) continue;
        acct_stats(st, a, now, stats);
        r = NVML_SUCCESS;
    }
    sim_state_unlock(st);
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t d, nvmlDeviceAttributes_t *a) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!a) return NVML_ERROR_INVALID_ARGUMENT;
    memset(a, 0, sizeof *a);
    a->multiprocessorCount = (unsigned)cfg.gpus[d->index].sms;
    a->sharedCopyEngineCount = 1;
    a->gpuInstanceSliceCount = 1;
    a->computeInstanceSliceCount = 1;
    a->memorySizeMB = cfg.gpus[d->index].memory >> 20;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    *node = 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter,
                                                     unsigned long long *count) {
    (void)type;
    (void)counter;
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->bus = (unsigned)cfg.gpus[d->index].pci_bus;
    pci->pciDeviceId = 0x233010DEu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(d, pci);
}
