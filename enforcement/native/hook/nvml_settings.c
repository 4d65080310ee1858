/* The GPU's settings in a slice: NVML calls that change a GPU, or the node, for every process
 * on it (HOOK_NVML_SETTINGS in hook.h: compute mode, persistence, clocks and their offsets,
 * power limits and profiles, fans and thresholds, ECC, MIG instances, accounting, NVLink,
 * vGPU, drain and removal).
 *
 * NVIDIA's driver lets root (often what a Ray or Dask worker in a container runs as) make
 * them: one tenant could set EXCLUSIVE_PROCESS or PROHIBITED and so deny every other slice of
 * its GPU a context, lock clocks or a power limit low and slow them all, or turn accounting
 * off and forget their records. In a slice each call is refused with
 * NVML_ERROR_NO_PERMISSION (what NVML answers a caller without the privilege) and one line
 * on stderr, whatever the GPU, before the driver sees it; a slice whose limits could not be
 * read is refused too. Outside a slice (the node's operator, nvidia-smi on the host) the
 * call goes to the driver unchanged, its parameters forwarded as six integer registers,
 * which serves every signature in the list (none passes a float or a struct by value). */
#include <stdint.h>
#include <stdio.h>

#include "hook.h"

static nvmlReturn_t refused(const char *call) {
    fprintf(stderr, "qgpu: %s refused in slice %s (NVML_ERROR_NO_PERMISSION): a slice may not "
            "change its GPU's settings for the other processes on it\n", call, g_lim.slice_id);
    return NVML_ERROR_NO_PERMISSION;
}

#define HOOK_SETTING(name)                                                                 \
    QGPU_EXPORT nvmlReturn_t name(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d,      \
                                  uintptr_t e, uintptr_t f) {                              \
        hook_load_nvml();                                                                  \
        int hs = hook_state();                                                             \
        if (hs == HOOK_ACTIVE) return refused(#name);                                      \
        if (hs == HOOK_ERROR) return NVML_ERROR_NO_PERMISSION;                             \
        if (!HAVE_REAL(name)) return NVML_ERROR_FUNCTION_NOT_FOUND;                        \
        return ((hook_nvml_setting_fn)hook_real_fn[HIDX_##name])(a, b, c, d, e, f);        \
    }
HOOK_NVML_SETTINGS(HOOK_SETTING)
#undef HOOK_SETTING
