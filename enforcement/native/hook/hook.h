/* libqgpu_hook.so: internal declarations.
 *
 * Load-time work is nil: nothing runs until the first CUDA/NVML entry point is called
 * through the hook. Then the limits are read (config.c), the slice ledger and per-GPU
 * region are mapped (ledger.c), and wrappers (mem.c, launch.c, nvml.c, init.c) apply them.
 * dlsym.c makes the wrappers reachable via dlsym and cuGetProcAddress; real.c finds the
 * real driver's functions. */
#ifndef QGPU_HOOK_H
#define QGPU_HOOK_H

#include <stdint.h>

#include "../common/qgpu_common.h"
#include "../include/qgpu_cuda_api.h"

/* Every exported wrapper (also what dlsym/cuGetProcAddress hand out). */
#define HOOK_WRAPPED(X)                                                                      \
    X(cuInit) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuMemAlloc_v2)                    \
    X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemFree_v2) X(cuMemCreate) X(cuMemRelease) \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync)                    \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz)                 \
    X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMemGetInfo_v2)           \
    X(cuDeviceTotalMem_v2) X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx)      \
    X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz)  \
    X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(nvmlDeviceGetMemoryInfo)                        \
    X(nvmlDeviceGetMemoryInfo_v2)

/* Real functions the hook calls itself without wrapping them. */
#define HOOK_INTERNAL(X)                                                                     \
    X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventElapsedTime)                  \
    X(cuEventDestroy_v2) X(cuCtxGetCurrent) X(cuStreamIsCapturing) X(cuDeviceGetCount)       \
    X(cuDeviceGet)                                                                           \
    X(cuDeviceGetUuid) X(nvmlDeviceGetUUID)

enum {
#define HOOK_IDX(name) HIDX_##name,
    HOOK_WRAPPED(HOOK_IDX) HOOK_INTERNAL(HOOK_IDX)
#undef HOOK_IDX
        HIDX_COUNT
};

extern QGPU_HIDDEN void *hook_real_fn[HIDX_COUNT];
extern QGPU_HIDDEN const char *const hook_fn_names[HIDX_COUNT];

/* real.c */
QGPU_HIDDEN void *hook_real_dlsym(void *handle, const char *name);
QGPU_HIDDEN void hook_load_cuda(void); /* resolves every cu* real pointer once */
QGPU_HIDDEN void hook_load_nvml(void);
QGPU_HIDDEN void *hook_wrapper_for(const char *name); /* exact exported name -> wrapper */
QGPU_HIDDEN int hook_index_of(const char *name);

/* config.c */
enum { POLICY_BEST_EFFORT = 0, POLICY_FIXED_SHARE = 1, POLICY_BURST_SHARE = 2 };
typedef struct {
    int active; /* a slice is configured */
    char slice_id[72];
    char device_uuid[64];
    uint64_t mem_limit;
    int core;
    int policy;
    char state_dir[1024];
    char real_libcuda[1024];
    char mem_source[1024]; /* "environment" or the limits file: for error messages */
} hook_limits_t;
QGPU_HIDDEN int hook_config_load(hook_limits_t *out, char *err, size_t errlen);

/* init.c */
enum { HOOK_PASSTHROUGH = 1, HOOK_ACTIVE = 2, HOOK_ERROR = 3 };
extern QGPU_HIDDEN hook_limits_t g_lim;
extern QGPU_HIDDEN int g_hook_state;
extern QGPU_HIDDEN int g_capped; /* compute gating on (fixed-/burst-share below 100) */
QGPU_HIDDEN int hook_state(void); /* reads the limits on first use */
QGPU_HIDDEN void hook_fail(const char *fmt, ...);

/* ledger.c */
QGPU_HIDDEN int ledger_open(const hook_limits_t *lim, char *err, size_t errlen);
QGPU_HIDDEN int ledger_region_open(const char *state_dir, const char *uuid, const hook_limits_t *lim);
/* 0 ok, -1 refused (over the cap: counted in the ledger's oom_refusals) */
QGPU_HIDDEN int ledger_reserve(uint64_t bytes);
QGPU_HIDDEN void ledger_release(uint64_t bytes);
QGPU_HIDDEN uint64_t ledger_used(void);
QGPU_HIDDEN void ledger_publish_activity(void);
/* Compute bucket: returns available device-ns after refill (minus in-flight estimate);
 * *alone is set for burst-share when no other slice on the GPU is active. */
QGPU_HIDDEN int64_t ledger_compute_avail(int64_t now, int64_t inflight_ns, int *alone);
QGPU_HIDDEN void ledger_debit(int64_t busy_ns);
/* Adds the time a launch was held back waiting for compute credit (throttled_ns). */
QGPU_HIDDEN void ledger_add_throttled(int64_t held_ns);

/* mem.c */
QGPU_HIDDEN void mem_track(uint64_t key, uint64_t size);

/* launch.c */
QGPU_HIDDEN int gate_before(CUstream stream, void **pair_out);
QGPU_HIDDEN void gate_after(CUstream stream, void *pair);

#define REAL(name) ((__typeof__(&name))hook_real_fn[HIDX_##name])
#define HAVE_REAL(name) (hook_real_fn[HIDX_##name] != NULL)

/* Wrapper prologue: resolve the driver, read the limits once, refuse after a bad config,
 * and forward untouched when no slice is configured. */
#define HOOK_ENTER(name, ...)                                                                \
    do {                                                                                     \
        hook_load_cuda();                                                                    \
        if (!HAVE_REAL(name)) return CUDA_ERROR_NOT_FOUND;                                   \
        int hs_ = hook_state();                                                              \
        if (hs_ == HOOK_ERROR) return CUDA_ERROR_NOT_INITIALIZED;                            \
        if (hs_ != HOOK_ACTIVE) return REAL(name)(__VA_ARGS__);                              \
    } while (0)

#endif
