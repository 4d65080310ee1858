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
 * nothing changes. The process is pinned with a pidfd from before /proc is read until the
 * driver has answered, so its pid cannot pass to another process unseen while it is checked.
 * Left open: the driver takes a pid, not the pidfd; a descendant that is reaped during the
 * driver's call may leave its pid to another process before the driver looks it up (said on
 * stderr afterwards). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
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

/* A pidfd pins the process a pid names while the call is checked and made: as long as it
 * has not been reaped, its pid cannot be handed to another process. -1 where the kernel has
 * no pidfd_open (before Linux 5.3): then only the /proc check stands. */
static int pin(int pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    errno = ENOSYS;
    return -1;
#endif
}

/* 1 while the pinned process is unreaped (a zombie still holds its pid) */
static int still_there(int pidfd) {
#ifdef SYS_pidfd_send_signal
    return syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) == 0;
#else
    (void)pidfd;
    return 1;
#endif
}

/* CUDA_SUCCESS when a slice may name `pid` (itself or a descendant), the process pinned in
 * *pidfd (or -1); otherwise the refusal. The pin is taken before /proc is read and checked
 * after it, so what was read is that process's, not a successor's. */
static CUresult fence(const char *call, int pid, int *pidfd) {
    *pidfd = -1;
    if (pid <= 0) return CUDA_ERROR_INVALID_VALUE;
    int fd = pin(pid);
    if (fd < 0 && errno == ESRCH) return CUDA_ERROR_INVALID_VALUE; /* no such process */
    if (!own_process(pid) || (fd >= 0 && !still_there(fd))) {
        if (fd >= 0) close(fd);
        return refused(call, pid);
    }
    *pidfd = fd;
    return CUDA_SUCCESS;
}

/* After the driver's call: a pinned process reaped during it may have left its pid to
 * another process before the driver looked it up (the one window left, said on stderr). */
static CUresult unpin(const char *call, int pid, int pidfd, CUresult r) {
    if (pidfd < 0) return r;
    if (!still_there(pidfd))
        fprintf(stderr, "qgpu: %s(pid %d) in slice %s: the process ended during the call; "
                "its pid may have named another process to the driver\n", call, pid,
                g_lim.slice_id);
    close(pidfd);
    return r;
}

#define FENCED(name, pid, ...)                                     \
    do {                                                           \
        int pfd_;                                                  \
        CUresult f_ = fence(#name, pid, &pfd_);                    \
        if (f_) return f_;                                         \
        return unpin(#name, pid, pfd_, REAL(name)(pid, __VA_ARGS__)); \
    } while (0)

QGPU_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    HOOK_ENTER(cuCheckpointProcessGetRestoreThreadId, pid, tid);
    FENCED(cuCheckpointProcessGetRestoreThreadId, pid, tid);
}

QGPU_EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    HOOK_ENTER(cuCheckpointProcessGetState, pid, state);
    FENCED(cuCheckpointProcessGetState, pid, state);
}

QGPU_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    HOOK_ENTER(cuCheckpointProcessLock, pid, args);
    FENCED(cuCheckpointProcessLock, pid, args);
}

QGPU_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    HOOK_ENTER(cuCheckpointProcessCheckpoint, pid, args);
    FENCED(cuCheckpointProcessCheckpoint, pid, args);
}

static CUresult restore(int pid, CUcheckpointRestoreArgs *args);

QGPU_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    HOOK_ENTER(cuCheckpointProcessRestore, pid, args);
    int pfd;
    CUresult f = fence("cuCheckpointProcessRestore", pid, &pfd);
    if (f) return f;
    return unpin("cuCheckpointProcessRestore", pid, pfd, restore(pid, args));
}

/* the restore itself, once the pid is allowed: gpuPairs only onto the slice's GPU */
static CUresult restore(int pid, CUcheckpointRestoreArgs *args) {
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
    FENCED(cuCheckpointProcessUnlock, pid, args);
}
