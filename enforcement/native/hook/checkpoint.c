/* The checkpoint API in a slice (cuCheckpointProcess*, CUDA 12.8).
 *
 * Each call names another process by its pid, and the driver lets any process of the same
 * user lock it (its CUDA calls block), checkpoint it (its device memory is released) and
 * restore it, with gpuPairs onto other GPUs. Between slices on one host (Ray and Dask
 * workers run as one user) that let a tenant freeze or evict another slice's process, and
 * move its own memory onto a GPU that is not its slice's, past the device fence.
 *
 * In a slice the six calls are refused (CUDA_ERROR_NOT_PERMITTED, one line on stderr) unless
 * the pid is the caller itself or one of its descendants (walked up /proc/<pid>/stat's
 * parent links), and a restore's gpuPairs may only name the slice's own GPU as the new one
 * (CUDA_ERROR_INVALID_DEVICE otherwise). A pid <= 0 is refused (CUDA_ERROR_INVALID_VALUE)
 * without asking the driver. Outside a slice (the node's operator running cuda-checkpoint)
 * nothing changes. Left open: the pid is checked, then the driver is called with it; a
 * descendant that exits in between frees its pid for reuse by another process. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

/* the parent of `pid` (/proc/<pid>/stat field 4), -1 when it cannot be read */
static int parent_of(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *close_paren = strrchr(buf, ')'); /* the command name may hold anything */
    int ppid = -1;
    if (!close_paren || sscanf(close_paren + 1, " %*c %d", &ppid) != 1) return -1;
    return ppid;
}

/* 1 when `pid` is this process or one of its descendants */
static int own_process(int pid) {
    int me = getpid();
    for (int depth = 0; depth < 256 && pid > 1; depth++) {
        if (pid == me) return 1;
        pid = parent_of(pid);
    }
    return 0;
}

static CUresult refused(const char *call, int pid) {
    fprintf(stderr, "qgpu: %s(pid %d) refused in slice %s (CUDA_ERROR_NOT_PERMITTED): a "
            "slice may lock, checkpoint and restore only its own process and its "
            "descendants\n", call, pid, g_lim.slice_id);
    return CUDA_ERROR_NOT_PERMITTED;
}

#define FENCE_PID(name, pid)                                       \
    do {                                                           \
        if ((pid) <= 0) return CUDA_ERROR_INVALID_VALUE;           \
        if (!own_process(pid)) return refused(#name, pid);         \
    } while (0)

QGPU_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    HOOK_ENTER(cuCheckpointProcessGetRestoreThreadId, pid, tid);
    FENCE_PID(cuCheckpointProcessGetRestoreThreadId, pid);
    return REAL(cuCheckpointProcessGetRestoreThreadId)(pid, tid);
}

QGPU_EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    HOOK_ENTER(cuCheckpointProcessGetState, pid, state);
    FENCE_PID(cuCheckpointProcessGetState, pid);
    return REAL(cuCheckpointProcessGetState)(pid, state);
}

QGPU_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    HOOK_ENTER(cuCheckpointProcessLock, pid, args);
    FENCE_PID(cuCheckpointProcessLock, pid);
    return REAL(cuCheckpointProcessLock)(pid, args);
}

QGPU_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    HOOK_ENTER(cuCheckpointProcessCheckpoint, pid, args);
    FENCE_PID(cuCheckpointProcessCheckpoint, pid);
    return REAL(cuCheckpointProcessCheckpoint)(pid, args);
}

QGPU_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    HOOK_ENTER(cuCheckpointProcessRestore, pid, args);
    FENCE_PID(cuCheckpointProcessRestore, pid);
    if (args && args->gpuPairsCount) {
        if (!args->gpuPairs) return CUDA_ERROR_INVALID_VALUE;
        /* one copy, read once: the tenant's other threads may rewrite the array */
        unsigned n = args->gpuPairsCount;
        if (n > 64) return CUDA_ERROR_INVALID_VALUE;
        CUcheckpointGpuPair pairs[64];
        memcpy(pairs, args->gpuPairs, n * sizeof pairs[0]);
        for (unsigned i = 0; i < n; i++) {
            char uuid[41];
            qgpu_uuid_format((const unsigned char *)pairs[i].newUuid.bytes, uuid);
            if (!g_lim.device_uuid[0] || strcmp(uuid, g_lim.device_uuid) != 0) {
                fprintf(stderr, "qgpu: cuCheckpointProcessRestore onto %s refused in slice %s "
                        "(CUDA_ERROR_INVALID_DEVICE): a slice is its GPU %s\n", uuid,
                        g_lim.slice_id, g_lim.device_uuid);
                return CUDA_ERROR_INVALID_DEVICE;
            }
        }
        CUcheckpointRestoreArgs copy = *args;
        copy.gpuPairs = pairs;
        return REAL(cuCheckpointProcessRestore)(pid, &copy);
    }
    return REAL(cuCheckpointProcessRestore)(pid, args);
}

QGPU_EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    HOOK_ENTER(cuCheckpointProcessUnlock, pid, args);
    FENCE_PID(cuCheckpointProcessUnlock, pid);
    return REAL(cuCheckpointProcessUnlock)(pid, args);
}
