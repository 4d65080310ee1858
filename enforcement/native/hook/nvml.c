/* NVML view of a slice. On the slice's GPU:
 *  - nvmlDeviceGetMemoryInfo(_v2) reports the slice (total = cap, used = what the slice
 *    holds, never above the cap, free = the rest), so nvidia-smi-like tools and frameworks
 *    that size themselves from NVML see the slice, not the card;
 *  - the process lists (compute, graphics, MPS; v1, v2, v3) and per-process utilisation show
 *    only the slice's own processes (those holding a slot in its ledger), on every GPU of the
 *    node (NVML ignores CUDA_VISIBLE_DEVICES; a slice has one GPU, so the lists of the others
 *    are empty): other tenants' processes and their memory are not visible. Counts and NVML_ERROR_INSUFFICIENT_SIZE keep
 *    NVML's two-call protocol. */
#include <stdlib.h>
#include <string.h>

#include "hook.h"

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_UNKNOWN 999

static int slice_device(nvmlDevice_t dev) {
    if (hook_state() != HOOK_ACTIVE) return 0;
    if (!g_lim.device_uuid[0]) return 1;
    if (!HAVE_REAL(nvmlDeviceGetUUID)) return 0;
    char uuid[96];
    if (REAL(nvmlDeviceGetUUID)(dev, uuid, sizeof uuid) != NVML_SUCCESS) return 0;
    return strcmp(uuid, g_lim.device_uuid) == 0;
}

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
    if (r == NVML_SUCCESS && m && slice_device(dev)) slice_numbers(&m->total, &m->used, &m->free);
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(dev, m);
    if (r == NVML_SUCCESS && m && slice_device(dev)) {
        slice_numbers(&m->total, &m->used, &m->free);
        m->reserved = 0;
    }
    return r;
}

/* ---- process lists ---- */

typedef nvmlReturn_t (*list_fn)(nvmlDevice_t, unsigned int *, void *);

#define MAX_LIST 1024

/* Ask the real list with room for everyone, keep the slice's own processes, then answer the
 * caller with NVML's protocol. `size` is the entry size of that version of the call. */
static nvmlReturn_t filtered(list_fn real, nvmlDevice_t dev, unsigned int *count, void *infos,
                             size_t size) {
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE) return real(dev, count, infos);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    nvmlReturn_t r = real(dev, &n, NULL);
    if (r != NVML_SUCCESS && r != NVML_ERROR_INSUFFICIENT_SIZE) return r;
    unsigned char *all = NULL;
    for (int attempt = 0; n && attempt < 4; attempt++) {
        unsigned int room = n * 2 + 8 > MAX_LIST ? MAX_LIST : n * 2 + 8;
        unsigned char *buf = realloc(all, (size_t)room * size);
        if (!buf) {
            free(all);
            return NVML_ERROR_UNKNOWN;
        }
        all = buf;
        n = room;
        r = real(dev, &n, all);
        if (r != NVML_ERROR_INSUFFICIENT_SIZE) break;
    }
    if (r != NVML_SUCCESS) {
        free(all);
        return r == NVML_ERROR_INSUFFICIENT_SIZE ? NVML_ERROR_UNKNOWN : r;
    }
    unsigned int mine = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid;
        memcpy(&pid, all + (size_t)i * size, sizeof pid); /* pid is first in every version */
        if (!ledger_has_pid((int)pid)) continue;
        if (mine != i) memmove(all + (size_t)mine * size, all + (size_t)i * size, size);
        mine++;
    }
    if (!infos || *count < mine) {
        *count = mine;
        free(all);
        return mine ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    if (mine) memcpy(infos, all, (size_t)mine * size);
    *count = mine;
    free(all);
    return NVML_SUCCESS;
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

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t dev,
                                                         nvmlProcessUtilizationSample_t *out,
                                                         unsigned int *count,
                                                         unsigned long long last_seen) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetProcessUtilization)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (hook_state() != HOOK_ACTIVE)
        return REAL(nvmlDeviceGetProcessUtilization)(dev, out, count, last_seen);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    nvmlReturn_t r = REAL(nvmlDeviceGetProcessUtilization)(dev, NULL, &n, last_seen);
    if (r != NVML_ERROR_INSUFFICIENT_SIZE) return r;
    unsigned int room = n * 2 + 8 > MAX_LIST ? MAX_LIST : n * 2 + 8;
    nvmlProcessUtilizationSample_t *all = calloc(room, sizeof *all);
    if (!all) return NVML_ERROR_UNKNOWN;
    n = room;
    r = REAL(nvmlDeviceGetProcessUtilization)(dev, all, &n, last_seen);
    if (r != NVML_SUCCESS) {
        free(all);
        return r == NVML_ERROR_INSUFFICIENT_SIZE ? NVML_ERROR_UNKNOWN : r;
    }
    unsigned int mine = 0;
    for (unsigned int i = 0; i < n; i++)
        if (ledger_has_pid((int)all[i].pid)) all[mine++] = all[i];
    nvmlReturn_t out_r = NVML_SUCCESS;
    if (!mine) {
        out_r = NVML_ERROR_NOT_FOUND;
    } else if (!out || *count < mine) {
        out_r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        memcpy(out, all, mine * sizeof *all);
    }
    *count = mine;
    free(all);
    return out_r;
}
