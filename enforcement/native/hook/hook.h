/* libqgpu_hook.so: internal declarations.
 *
 * Load-time work is nil: nothing runs until the first CUDA/NVML entry point is called
 * through the hook. Then the limits are read (config.c), the slice ledger is mapped
 * (ledger.c), the GPU's shared state is opened (roster.c, busy.c, region.c), and the wrappers
 * apply them: plain allocations (mem.c), VMM handles and their export/import (vmm.c),
 * legacy IPC mappings (ipc.c), where managed memory may be moved (managed.c), pools,
 * stream-ordered and graph memory (pool.c), what executable graphs allocate (graph.c) and
 * keep for their own work (graph_work.c), contexts (ctx.c), what loading device code takes,
 * modules, libraries and functions' code loaded lazily (module.c), the local memory a
 * kernel's launch grows (lmem.c), launches (launch.c), which
 * processes a slice may checkpoint (checkpoint.c), NVML views (nvml.c: memory and processes;
 * nvml_activity.c: utilisation), the GPU's settings a slice may not change (nvml_settings.c). dlsym.c makes the wrappers reachable through dlsym, dlvsym and
 * cuGetProcAddress; real.c finds the real driver's functions. */
#ifndef QGPU_HOOK_H
#define QGPU_HOOK_H

#include <stdint.h>

#include "../common/qgpu_common.h"
#include "../include/qgpu_cuda_api.h"

/* Every exported wrapper (also what dlsym/dlvsym/cuGetProcAddress hand out). Every ABI form
 * (v1, _v2.., _ptsz) of a wrapped entry point is wrapped: tests/enforcement check that against
 * the generated cuGetProcAddress table. */
/* NVML calls that change a GPU, or the node, for every process on it (its compute mode,
 * clocks, power, ECC, MIG, accounting, ...): refused in a slice (nvml_settings.c). Each takes
 * at most six parameters, every one an integer, an enum or a pointer (nvml.h), so one
 * forwarding signature serves them all. */
#define HOOK_NVML_SETTINGS(X) \
    X(nvmlComputeInstanceDestroy) X(nvmlDeviceClearAccountingPids)                        \
    X(nvmlDeviceClearEccErrorCounts) X(nvmlDeviceClearFieldValues)                        \
    X(nvmlDeviceCreateGpuInstance) X(nvmlDeviceCreateGpuInstanceWithPlacement)            \
    X(nvmlDeviceDiscoverGpus) X(nvmlDeviceFreezeNvLinkUtilizationCounter)                 \
    X(nvmlDeviceModifyDrainState) X(nvmlDevicePowerSmoothingActivatePresetProfile)        \
    X(nvmlDevicePowerSmoothingSetState)                                                   \
    X(nvmlDevicePowerSmoothingUpdatePresetProfileParam) X(nvmlDeviceRemoveGpu)            \
    X(nvmlDeviceRemoveGpu_v2) X(nvmlDeviceResetApplicationsClocks)                        \
    X(nvmlDeviceResetGpuLockedClocks) X(nvmlDeviceResetMemoryLockedClocks)                \
    X(nvmlDeviceResetNvLinkErrorCounters) X(nvmlDeviceResetNvLinkUtilizationCounter)      \
    X(nvmlDeviceSetAPIRestriction) X(nvmlDeviceSetAccountingMode)                         \
    X(nvmlDeviceSetAdaptiveTgpMode_v1) X(nvmlDeviceSetApplicationsClocks)                 \
    X(nvmlDeviceSetAutoBoostedClocksEnabled) X(nvmlDeviceSetClockOffsets)                 \
    X(nvmlDeviceSetComputeMode) X(nvmlDeviceSetConfComputeUnprotectedMemSize)             \
    X(nvmlDeviceSetDefaultAutoBoostedClocksEnabled) X(nvmlDeviceSetDefaultFanSpeed_v2)    \
    X(nvmlDeviceSetDramEncryptionMode) X(nvmlDeviceSetDriverModel)                        \
    X(nvmlDeviceSetEccMode) X(nvmlDeviceSetFanControlPolicy) X(nvmlDeviceSetFanSpeed_v2)  \
    X(nvmlDeviceSetGpcClkVfOffset) X(nvmlDeviceSetGpuLockedClocks)                        \
    X(nvmlDeviceSetGpuOperationMode) X(nvmlDeviceSetHostname_v1)                          \
    X(nvmlDeviceSetMemClkVfOffset) X(nvmlDeviceSetMemoryLimits_v1)                        \
    X(nvmlDeviceSetMemoryLockedClocks) X(nvmlDeviceSetMigMode)                            \
    X(nvmlDeviceSetNvLinkDeviceLowPowerThreshold)                                         \
    X(nvmlDeviceSetNvLinkUtilizationControl) X(nvmlDeviceSetNvlinkBwMode)                 \
    X(nvmlDeviceSetNvlinkBwModeAsync_v1) X(nvmlDeviceSetPersistenceMode)                  \
    X(nvmlDeviceSetPowerManagementLimit) X(nvmlDeviceSetPowerManagementLimit_v2)          \
    X(nvmlDeviceSetPowerMizerMode_v1) X(nvmlDeviceSetRusdSettings_v1)                     \
    X(nvmlDeviceSetTemperatureThreshold) X(nvmlDeviceSetVgpuCapabilities)                 \
    X(nvmlDeviceSetVgpuHeterogeneousMode) X(nvmlDeviceSetVgpuSchedulerState)              \
    X(nvmlDeviceSetVgpuSchedulerState_v2) X(nvmlDeviceSetVirtualizationMode)              \
    X(nvmlDeviceWorkloadPowerProfileClearRequestedProfiles)                               \
    X(nvmlDeviceWorkloadPowerProfileSetRequestedProfiles)                                 \
    X(nvmlDeviceWorkloadPowerProfileUpdateProfiles_v1) X(nvmlGpmSetStreamingEnabled)      \
    X(nvmlGpuInstanceCreateComputeInstance)                                               \
    X(nvmlGpuInstanceCreateComputeInstanceWithPlacement) X(nvmlGpuInstanceDestroy)        \
    X(nvmlGpuInstanceSetVgpuHeterogeneousMode) X(nvmlGpuInstanceSetVgpuSchedulerState)    \
    X(nvmlGpuInstanceSetVgpuSchedulerState_v2) X(nvmlSetVgpuVersion)                      \
    X(nvmlSystemSetConfComputeGpusReadyState)                                             \
    X(nvmlSystemSetConfComputeKeyRotationThresholdInfo) X(nvmlSystemSetNvlinkBwMode)      \
    X(nvmlUnitSetLedState) X(nvmlVgpuInstanceClearAccountingPids)                         \
    X(nvmlVgpuInstanceSetEncoderCapacity)

#define HOOK_WRAPPED(X)                                                                      \
    X(cuInit) X(cuGetProcAddress) X(cuGetProcAddress_v2)                                     \
    X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAllocPitch) X(cuMemAllocPitch_v2)                  \
    X(cuMemAllocManaged) X(cuMemFree) X(cuMemFree_v2)                                        \
    X(cuArrayCreate) X(cuArrayCreate_v2) X(cuArray3DCreate) X(cuArray3DCreate_v2)            \
    X(cuArrayDestroy) X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy)                   \
    X(cuMemGetInfo) X(cuMemGetInfo_v2) X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2)            \
    X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemRetainAllocationHandle)  \
    X(cuMemMapArrayAsync) X(cuMemMapArrayAsync_ptsz)                                         \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)                        \
    X(cuMemPrefetchAsync) X(cuMemPrefetchAsync_ptsz) X(cuMemPrefetchAsync_v2)                \
    X(cuMemPrefetchAsync_v2_ptsz) X(cuMemPrefetchBatchAsync) X(cuMemPrefetchBatchAsync_ptsz) \
    X(cuMemDiscardAndPrefetchBatchAsync) X(cuMemDiscardAndPrefetchBatchAsync_ptsz)           \
    X(cuMemAdvise) X(cuMemAdvise_v2)                                                         \
    X(cuIpcOpenMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle)                    \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync)                    \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz)                 \
    X(cuMemPoolTrimTo) X(cuMemPoolDestroy) X(cuMemPoolCreate) X(cuDeviceGetMemPool)          \
    X(cuMemPoolExportToShareableHandle) X(cuMemPoolImportFromShareableHandle)                \
    X(cuMemPoolImportPointer)                                                                \
    X(cuDeviceGetDefaultMemPool) X(cuMemGetMemPool) X(cuMemGetDefaultMemPool)                \
    X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuCtxSynchronize)                   \
    X(cuCtxSynchronize_v2)                                                                   \
    X(cuEventSynchronize)                                                                    \
    X(cuGraphAddMemAllocNode) X(cuGraphAddNode) X(cuGraphAddNode_v2)                          \
    X(cuGraphInstantiate) X(cuGraphInstantiate_v2)                                           \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams)                           \
    X(cuGraphInstantiateWithParams_ptsz) X(cuGraphExecDestroy) X(cuGraphUpload)              \
    X(cuGraphUpload_ptsz) X(cuDeviceGraphMemTrim) X(cuGraphExecUpdate)                       \
    X(cuGraphExecUpdate_v2) X(cuGraphExecChildGraphNodeSetParams) X(cuGraphExecNodeSetParams) \
    X(cuGraphNodeSetParams) X(cuGraphKernelNodeSetParams) X(cuGraphKernelNodeSetParams_v2)     \
    X(cuGraphExecKernelNodeSetParams) X(cuGraphExecKernelNodeSetParams_v2)                   \
    X(cuCtxCreate) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuCtxDestroy)     \
    X(cuCtxDestroy_v2) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)              \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset) X(cuDevicePrimaryCtxReset_v2) \
    X(cuGreenCtxCreate) X(cuGreenCtxDestroy) X(cuCtxSetLimit)                                \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)    \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz)                           \
    X(cuLaunchCooperativeKernelMultiDevice) X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) \
    X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuGraphAddKernelNode) X(cuGraphAddKernelNode_v2)  \
    X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary)       \
    X(cuModuleUnload) X(cuFuncLoad) X(cuFuncSetAttribute) X(cuFuncSetCacheConfig)             \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor)                                           \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags) X(cuOccupancyMaxPotentialBlockSize) \
    X(cuOccupancyMaxPotentialBlockSizeWithFlags) X(cuOccupancyAvailableDynamicSMemPerBlock)  \
    X(cuOccupancyMaxPotentialClusterSize) X(cuOccupancyMaxActiveClusters)                    \
    X(cuLibraryLoadData) X(cuLibraryLoadFromFile) X(cuLibraryUnload)       \
    X(cuLibraryGetModule) X(cuLibraryGetGlobal) X(cuLibraryGetManaged) X(cuLibraryGetKernel) \
    X(cuLibraryEnumerateKernels) X(cuKernelGetFunction)                                      \
    X(cuCheckpointProcessGetRestoreThreadId) X(cuCheckpointProcessGetState)                  \
    X(cuCheckpointProcessLock) X(cuCheckpointProcessCheckpoint)                              \
    X(cuCheckpointProcessRestore) X(cuCheckpointProcessUnlock)                               \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)                                 \
    X(nvmlDeviceGetComputeRunningProcesses) X(nvmlDeviceGetComputeRunningProcesses_v2)       \
    X(nvmlDeviceGetComputeRunningProcesses_v3) X(nvmlDeviceGetGraphicsRunningProcesses)      \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2) X(nvmlDeviceGetGraphicsRunningProcesses_v3)  \
    X(nvmlDeviceGetMPSComputeRunningProcesses) X(nvmlDeviceGetMPSComputeRunningProcesses_v2) \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3) X(nvmlDeviceGetProcessUtilization)        \
    X(nvmlDeviceGetRunningProcessDetailList) X(nvmlDeviceGetProcessesUtilizationInfo)        \
    X(nvmlDeviceGetAccountingPids) X(nvmlDeviceGetAccountingStats)                           \
    X(nvmlDeviceGetUtilizationRates) X(nvmlDeviceGetSamples) X(nvmlDeviceGetBAR1MemoryInfo)   \
    X(nvmlDeviceGetEncoderSessions) X(nvmlDeviceGetEncoderStats) X(nvmlDeviceGetFBCSessions)  \
    X(nvmlDeviceGetFBCStats)                                                                 \
    HOOK_NVML_SETTINGS(X)

/* Real functions the hook calls itself without wrapping them. */
#define HOOK_INTERNAL(X)                                                                     \
    X(cuDriverGetVersion) X(cuEventCreate) X(cuEventRecord) X(cuEventQuery)                  \
    X(cuEventElapsedTime) X(cuEventDestroy_v2) X(cuCtxGetCurrent) X(cuCtxGetDevice)          \
    X(cuCtxGetLimit) X(cuStreamIsCapturing) X(cuDeviceGetCount)                              \
    X(cuGraphGetNodes) X(cuGraphNodeGetType) X(cuGraphMemAllocNodeGetParams)                 \
    X(cuGraphChildGraphNodeGetGraph)                                                         \
    X(cuDeviceGet) X(cuDeviceGetUuid) X(cuDeviceGetAttribute)                                \
    X(cuMemPoolGetAttribute) X(cuDeviceGetGraphMemAttribute) X(cuCtxFromGreenCtx)             \
    X(cuMemGetAllocationPropertiesFromHandle) X(cuMemGetAllocationGranularity)               \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemGetAddressRange_v2)                    \
    X(nvmlDeviceGetUUID) X(nvmlInit_v2) X(nvmlDeviceGetHandleByUUID)                         \
    X(nvmlDeviceGetHandleByIndex_v2) X(cuKernelGetLibrary) X(cuStreamGetCtx)                 \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuFuncGetAttribute) X(cuKernelGetAttribute) \
    X(cuFuncIsLoaded) X(cuFuncGetModule)

enum {
#define HOOK_IDX(name) HIDX_##name,
    HOOK_WRAPPED(HOOK_IDX) HOOK_INTERNAL(HOOK_IDX)
#undef HOOK_IDX
        HIDX_COUNT
};

extern QGPU_HIDDEN void *hook_real_fn[HIDX_COUNT];

/* nvml_settings.c: the wrappers of HOOK_NVML_SETTINGS, one signature for all */
typedef nvmlReturn_t (*hook_nvml_setting_fn)(uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                             uintptr_t, uintptr_t);
#define HOOK_SETTING_DECL(name) \
    QGPU_EXPORT nvmlReturn_t name(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t);
HOOK_NVML_SETTINGS(HOOK_SETTING_DECL)
#undef HOOK_SETTING_DECL
extern QGPU_HIDDEN const char *const hook_fn_names[HIDX_COUNT];

/* libc_sym.c: libc's dlsym/dlvsym/dlopen/dlmopen, read from its symbol table */
QGPU_HIDDEN void *hook_libc_dlsym(void *handle, const char *name);
QGPU_HIDDEN void *hook_libc_dlvsym(void *handle, const char *name, const char *version);
QGPU_HIDDEN void *hook_libc_dlopen(const char *file, int flags);
QGPU_HIDDEN void *hook_libc_dlmopen(long lmid, const char *file, int flags);

/* real.c */
QGPU_HIDDEN void *hook_real_dlsym(void *handle, const char *name);
QGPU_HIDDEN void *hook_real_dlvsym(void *handle, const char *name, const char *version);
QGPU_HIDDEN void hook_load_cuda(void); /* resolves every cu* real pointer once */
QGPU_HIDDEN void hook_load_nvml(void);
QGPU_HIDDEN void *hook_wrapper_for(const char *name); /* exact exported name -> wrapper */
QGPU_HIDDEN int hook_index_of(const char *name);
QGPU_HIDDEN int hook_is_own(void *p);
QGPU_HIDDEN int hook_driver_version(void); /* the real driver's CUDA version */

/* config.c */
enum { POLICY_BEST_EFFORT = 0, POLICY_FIXED_SHARE = 1, POLICY_BURST_SHARE = 2 };
typedef struct {
    int active; /* a slice is configured */
    char slice_id[72];
    char device_uuid[64];
    uint64_t mem_limit;
    uint64_t context_memory; /* charged per context */
    int timesliced; /* the device time-slices between processes (real GPUs); 0: one queue */
    int64_t timeslice_ns; /* the length of one time slice (QGPU_TIMESLICE_US) */
    int core;
    int policy;
    char state_dir[1024];
    char real_libcuda[1024];
    /* the agent's MPS backend: the slice's GPU's MPS daemon; its caps are then MPS's, from
     * these limits (init.c), and the hook does not gate compute */
    char mps_pipe_directory[1024];
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
/* A slice is one GPU: 1 when `dev` (or a device location) is not the slice's GPU. */
QGPU_HIDDEN int hook_foreign_device(CUdevice dev);
QGPU_HIDDEN int hook_foreign_location(const CUmemLocation *loc);

/* ledger.c */
QGPU_HIDDEN int ledger_open(const hook_limits_t *lim, char *err, size_t errlen);
/* 0 ok, -1 refused (over the cap: counted in the ledger's oom_refusals). Overflow-safe. */
QGPU_HIDDEN int ledger_reserve(uint64_t bytes);
/* Memory the driver has already committed (found after the fact): charged even past the cap,
 * so the slice's next allocations are refused and the agent's watchdog sees it. */
QGPU_HIDDEN void ledger_force(uint64_t bytes);
QGPU_HIDDEN void ledger_release(uint64_t bytes);
QGPU_HIDDEN uint64_t ledger_used(void);
/* Compute bucket, refilled at `share` percent: available device-ns after refill, minus the
 * in-flight estimate. `alone` (a burst-share slice bursting) forgives a negative balance. */
QGPU_HIDDEN int64_t ledger_compute_avail(int64_t now, int64_t inflight_ns, int share, int alone);
QGPU_HIDDEN void ledger_debit(int64_t busy_ns);
/* Adds the time a launch was held back waiting for compute credit (throttled_ns). */
QGPU_HIDDEN void ledger_add_throttled(int64_t held_ns);
/* 1 if `pid` holds a live slot of this slice (NVML views show only the slice's processes) */
QGPU_HIDDEN int ledger_has_pid(int pid);

/* roster.c: the slices placed on one GPU (written by the agent / device plugin / own hooks) */
#define ROSTER_MAX 128
enum { ROSTER_WRITER_AGENT = 1, ROSTER_WRITER_PLUGIN = 2, ROSTER_WRITER_HOOK = 3 };
typedef struct {
    char slice_id[72];
    int32_t policy; /* POLICY_* */
    int32_t core;
    uint32_t writer; /* ROSTER_WRITER_* */
    uint32_t reserved[3];
} roster_entry_t;
typedef struct roster roster_t;
struct stat;
/* A state file or directory the hook may believe: root's or this user's, and nobody else
 * may write it. */
QGPU_HIDDEN int state_trusted(const struct stat *st);
/* Maps <dir>/roster read-only (NULL when missing or not trusted); in a roster this user
 * owns (no agent), this slice is listed first. */
QGPU_HIDDEN roster_t *roster_open(const char *dir, const hook_limits_t *lim);
QGPU_HIDDEN uint64_t roster_seq(const roster_t *r);
/* A consistent copy of the listed slices (out: ROSTER_MAX entries); -1 while a writer is
 * at work. */
QGPU_HIDDEN int roster_read(const roster_t *r, roster_entry_t *out, uint64_t *seq_out);

/* region.c: the slices of one GPU, what each is doing */
typedef struct {
    int other_slices;       /* other slices of any policy active on the GPU */
    int guaranteed_slices;  /* other fixed-/burst-share slices active on the GPU */
    int best_effort_slices; /* best-effort slices active on the GPU, this one included */
    int guaranteed_share;   /* sum of the shares of the active guaranteed slices */
} region_summary_t;
QGPU_HIDDEN int region_open(const char *state_dir, const char *uuid, const hook_limits_t *lim);
QGPU_HIDDEN void region_forget_entry(void);
QGPU_HIDDEN void region_publish_launch(void); /* every launch: one coarse clock read */
QGPU_HIDDEN void region_publish_pending(int gated, int64_t until_ns);
QGPU_HIDDEN int region_contenders(int64_t now); /* other processes with work on the device */
QGPU_HIDDEN region_summary_t region_summary(void); /* cached for 1 ms */
/* 0 and *alive (a process named in the slice's activity file lives), -1 when unreadable */
QGPU_HIDDEN int activity_any_alive(const char *path, int *alive);

/* busy.c: the slices the node agent's watchdog saw run on this GPU (NVML), <dir>/busy */
#define BUSY_MAX 64
typedef struct busy busy_t;
typedef struct {
    uint64_t seq;           /* the file's seq when copied */
    int64_t valid_until_ns; /* CLOCK_MONOTONIC; the list says nothing after it */
    int count;
    char slice_id[BUSY_MAX][72];
} busy_list_t;
/* Maps <dir>/busy read-only (NULL when missing or not trusted, as the roster). */
QGPU_HIDDEN busy_t *busy_open(const char *dir);
QGPU_HIDDEN uint64_t busy_seq(const busy_t *b);
/* A consistent copy of the list into `out` (0), or -1 while the agent is writing it (`out`
 * is then scratch). */
QGPU_HIDDEN int busy_read(const busy_t *b, busy_list_t *out);
/* 1 if the list names `slice_id` (whether it is still valid: valid_until_ns). */
QGPU_HIDDEN int busy_lists(const busy_list_t *l, const char *slice_id);

/* mem.c */
QGPU_HIDDEN void mem_track(uint64_t key, uint64_t size);
QGPU_HIDDEN CUcontext mem_current_ctx(void);
QGPU_HIDDEN void mem_forget_ctx(CUcontext ctx); /* the driver freed what the context held */
QGPU_HIDDEN void mem_untrack_if_tracked(uint64_t key);

/* ipc.c: legacy IPC mappings the driver closed with their context */
QGPU_HIDDEN void ipc_forget_ctx(CUcontext ctx);

/* pool.c */
QGPU_HIDDEN void pool_settle_all(void); /* credit what pools and graph memory gave back */
/* `ptr` was freed (cuMemFree, or cuMemFreeAsync on `s`): a pointer imported into a shared pool
 * lets go of the pool (async: once the stream reaches the free) */
QGPU_HIDDEN void pool_forget_import(CUdeviceptr ptr, int async, CUstream s);
QGPU_HIDDEN void pool_forget_ctx(CUcontext ctx); /* its imported pointers went with it */
/* after a graph upload or launch that was charged `need` first: the device's graph memory
 * is then charged what the driver reserves (need is given back on failure) */
QGPU_HIDDEN void graph_mem_after(CUresult r, uint64_t need);
/* the driver gives back the graph memory nothing uses (after stream s's earlier work with
 * `wait`) and the charge follows; 1 when the charge fell */
QGPU_HIDDEN int graph_mem_make_room(CUstream s, int wait);
QGPU_HIDDEN uint64_t pool_reserved_total(void); /* what the process's pools reserve now */

/* module.c: device memory taken by loading device code, measured around the driver's call.
 * Every wrapper that makes the driver allocate or free device memory holds the process's
 * memory lock shared for the call (HOOK_MEM_OP); a measured call holds it exclusively. */
QGPU_HIDDEN int memop_begin(void);
QGPU_HIDDEN void memop_end(int *held);
#define HOOK_MEM_OP() \
    int hook_memop_ __attribute__((cleanup(memop_end), unused)) = memop_begin()
typedef struct {
    int own_ok, dev_ok;
    uint64_t own, dev, pools; /* before the call: this pid's, the device's, the pools' */
} measure_t;
/* Around a driver call that takes device memory no allocation call shows (a context's
 * creation, ctx.c): begin takes the process's memory lock exclusively and reads what the
 * process holds; took reads it again and returns what the call took (0 when it failed or
 * nothing could be measured); done, after the charge or the undo, releases the lock. */
QGPU_HIDDEN void measure_call_begin(measure_t *m);
QGPU_HIDDEN uint64_t measure_call_took(measure_t *m, CUresult r);
QGPU_HIDDEN void measure_call_done(void);
QGPU_HIDDEN void module_forget_ctx(CUcontext ctx); /* what was loaded into it is gone */
/* Before a CUkernel is launched or put in a graph node on stream `s`: its library is loaded
 * into that context first, measured. CUDA_ERROR_OUT_OF_MEMORY over the cap. */
QGPU_HIDDEN CUresult module_kernel_use(void *f, CUstream s);
/* The same for a kernel node's kernel: func, or (func NULL) kern in ctx (NULL: current). */
QGPU_HIDDEN CUresult module_node_kernel_use(void *func, void *kern, CUcontext ctx);

/* lmem.c: the local memory a kernel's launch grows its context's reservation to, charged
 * before the kernel is launched or put into a graph (ctx NULL: the current context;
 * CUDA_ERROR_OUT_OF_MEMORY over the cap); the stack limit's share of the same reservation
 * (per thread, before and after a cuCtxSetLimit to `value`; then recorded once set); a
 * context gone forgotten */
QGPU_HIDDEN CUresult lmem_before(void *f, CUcontext ctx, int kernel); /* kernel: a CUkernel */
QGPU_HIDDEN void lmem_stack_reservation(CUcontext ctx, uint64_t value, uint64_t *before,
                                        uint64_t *after);
QGPU_HIDDEN void lmem_stack_set(CUcontext ctx, uint64_t value);
QGPU_HIDDEN void lmem_forget(CUcontext ctx);
/* module.c: moves on whenever a context, a module or a library goes */
QGPU_HIDDEN uint64_t module_generation(void);
/* ctx.c: what `per_thread` bytes of local memory cost on ctx's device beyond the default
 * stack; a charge added to what ctx's destruction gives back */
QGPU_HIDDEN uint64_t ctx_stack_cost(CUcontext ctx, uint64_t per_thread);
QGPU_HIDDEN void ctx_charge_add(CUcontext ctx, uint64_t bytes);

/* graph_work.c: what an executable graph keeps for its own work, measured around its
 * instantiation (begin takes the memory lock exclusively; done charges, or destroys the
 * graph and returns CUDA_ERROR_OUT_OF_MEMORY, and releases the lock) and given back when it
 * is destroyed */
QGPU_HIDDEN void graph_work_begin(measure_t *m);
QGPU_HIDDEN CUresult graph_work_done(CUresult r, CUgraphExec *e, measure_t *m);
QGPU_HIDDEN void graph_work_release(CUgraphExec e);
/* its first upload or launch: begin is 0 (already past it), 1 (measuring: the memory lock
 * held exclusively until end or abort) or -1 (the slice is at its cap: refuse); end charges
 * what the call took (past the cap: charged anyway, CUDA_ERROR_OUT_OF_MEMORY);
 * upload_first uploads it for a first launch, measured, and ends */
QGPU_HIDDEN int graph_work_first_use_begin(CUgraphExec e, CUstream s, measure_t *m);
QGPU_HIDDEN CUresult graph_work_first_use_end(CUresult r, CUgraphExec e, measure_t *m);
QGPU_HIDDEN void graph_work_first_use_abort(void);
QGPU_HIDDEN CUresult graph_work_upload_first(CUgraphExec e, CUstream s, measure_t *m);

/* graph.c: before a graph upload or launch on stream s, its allocations charged in full,
 * room made by trimming when they do not fit (-1: they still do not, refuse) */
QGPU_HIDDEN int graph_mem_before(CUgraphExec e, CUstream s, int can_wait, uint64_t *need);

/* nvml.c: the slice's NVML views. 1: `dev` is the slice's GPU, 0: another GPU, -1: no
 * slice (NVML answers untouched). */
QGPU_HIDDEN int nvml_slice_device(nvmlDevice_t dev);
/* One call of a real NVML list: *count entries of room in buf (NULL: only count). */
typedef nvmlReturn_t (*nvml_fetch_fn)(void *ctx, unsigned *count, void *buf);
/* Everything the real list holds, then only the slice's processes (the pid at `pid_off` of
 * each `size`-byte entry): *out (malloc'd, the caller frees) and their number. */
QGPU_HIDDEN nvmlReturn_t nvml_fetch_own(nvml_fetch_fn fetch, void *ctx, size_t size,
                                        size_t pid_off, void **out, unsigned *mine);
/* Answers the caller with NVML's two-call protocol from `n` entries (frees `mine`): an
 * empty answer is `empty` (NVML_SUCCESS for lists, NVML_ERROR_NOT_FOUND for samples). */
QGPU_HIDDEN nvmlReturn_t nvml_answer(void *mine, unsigned n, size_t size, void *out,
                                     unsigned *count, nvmlReturn_t empty);

/* launch.c */
typedef struct {
    int gated; /* launches wait for credit and are timed */
    int share; /* percent the bucket refills at */
    int alone; /* burst-share with no other slice active: bursting */
} gate_mode_t;
QGPU_HIDDEN gate_mode_t gate_mode(void);
QGPU_HIDDEN void hook_register_sampler_atfork(void);
QGPU_HIDDEN int gate_before(CUstream stream, void **pair_out, gate_mode_t mode);
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

/* size arithmetic that refuses instead of wrapping */
static inline int hook_mul(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}

#endif
