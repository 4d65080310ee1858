/* Simulated libnvidia-ml.so.1: NVML over the simulator's shared per-GPU state. Struct
 * layouts follow nvml.h (and nvidia-ml-py's ctypes mirrors of it). NVML ignores
 * CUDA_VISIBLE_DEVICES, like the real library. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim.h"

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_MEMORY_V2 0x02000028u

typedef struct {
    int index;
    sim_gpu_state_t *st;
} sim_nvml_device_t;
typedef sim_nvml_device_t *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* v2 and v3 */

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time, microseconds since the epoch */
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

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
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
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
    if (m->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
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
 * memory). `size` is the caller's struct size: v1 is {pid, usedGpuMemory}, v2/v3 add the
 * MIG instance ids. */
static nvmlReturn_t running(nvmlDevice_t d, unsigned int *count, void *infos, size_t size) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t found[SIM_MAX_PROCS];
    unsigned n = 0;
    sim_state_lock(d->st);
    sim_state_reclaim_dead(d->st);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &d->st->procs[i];
        if (!p->pid || (!p->mem_used && !p->contexts)) continue;
        found[n].pid = (unsigned)p->pid;
        found[n].usedGpuMemory = p->mem_used;
        found[n].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        found[n].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        n++;
    }
    sim_state_unlock(d->st);
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
 * `lastSeen` (CPU microseconds since the epoch), the percentage of the last sampling
 * period (~100 ms) the device spent on the process's work. NOT_FOUND when none is newer. */
QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                         nvmlProcessUtilizationSample_t *out,
                                                         unsigned int *count,
                                                         unsigned long long lastSeen) {
    nvmlReturn_t r = check(d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    int64_t mono = qgpu_now_ns();
    nvmlProcessUtilizationSample_t found[SIM_MAX_PROCS];
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
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (!out || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, found, n * sizeof *out);
    *count = n;
    return NVML_SUCCESS;
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
