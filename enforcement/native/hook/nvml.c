/* NVML view of a slice: nvmlDeviceGetMemoryInfo(_v2) on the slice's GPU reports the slice
 * (total = cap, used = what the slice holds), so nvidia-smi-like tools and frameworks that
 * size themselves from NVML see the slice, not the card. */
#include <string.h>

#include "hook.h"

#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13

static int is_slice_device(nvmlDevice_t dev) {
    if (!g_lim.device_uuid[0]) return 1;
    if (!HAVE_REAL(nvmlDeviceGetUUID)) return 0;
    char uuid[96];
    if (REAL(nvmlDeviceGetUUID)(dev, uuid, sizeof uuid) != NVML_SUCCESS) return 0;
    return strcmp(uuid, g_lim.device_uuid) == 0;
}

static void slice_numbers(unsigned long long *total, unsigned long long *used,
                          unsigned long long *free_bytes) {
    uint64_t u = ledger_used();
    *total = g_lim.mem_limit;
    *used = u;
    *free_bytes = u < g_lim.mem_limit ? g_lim.mem_limit - u : 0;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetMemoryInfo)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(dev, m);
    if (r == NVML_SUCCESS && m && hook_state() == HOOK_ACTIVE && is_slice_device(dev))
        slice_numbers(&m->total, &m->used, &m->free);
    return r;
}

QGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(dev, m);
    if (r == NVML_SUCCESS && m && hook_state() == HOOK_ACTIVE && is_slice_device(dev)) {
        slice_numbers(&m->total, &m->used, &m->free);
        m->reserved = 0;
    }
    return r;
}
