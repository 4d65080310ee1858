/* The checkpoint API (cuCheckpointProcess*, CUDA 12.8) against other slices (our addition).
 * The driver lets a process lock, checkpoint and restore any CUDA process of its user by
 * pid, and Ray or Dask workers of different slices run as one user. Two ways out:
 *
 *  "victim <pid>": freeze or evict another slice's process. Asks the victim's state, locks
 *    it (its CUDA calls would block), checkpoints it (its device memory released) and, to
 *    leave no doubt, also locks it through cuGetProcAddress as CUDA 13 runtimes find the
 *    entry point. Reports each CUresult ("state", "lock", "checkpoint", "lock_getproc").
 *
 *  "child <uuid>": move its own memory onto a GPU that is not its slice's, past the device
 *    fence. Starts a child of its own (same slice) that takes 2 GiB on the slice's GPU, then
 *    locks and checkpoints it, and restores it with gpuPairs {its GPU -> the GPU with <uuid>}
 *    ("restore_other"). Then restores it onto its own GPU ("restore_own", the way that must
 *    still work), unlocks it ("unlock") and reports the child's pid ("child"). Each call is
 *    also given to the child's pid only; the parent takes no context of its own. */
#include "hostile.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

typedef CUresult (*lock_t)(int, CUcheckpointLockArgs *);

static void uuid_of(CUdevice d, CUuuid *u) {
    if (cuDeviceGetUuid(u, d) != CUDA_SUCCESS) {
        say("uuid", 1);
        exit(3);
    }
}

static int parse_uuid(const char *text, CUuuid *u) {
    unsigned b[16];
    if (sscanf(text, "GPU-%2x%2x%2x%2x-%2x%2x-%2x%2x-%2x%2x-%2x%2x%2x%2x%2x%2x", &b[0], &b[1],
               &b[2], &b[3], &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &b[10], &b[11], &b[12],
               &b[13], &b[14], &b[15]) != 16)
        return -1;
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)b[i];
    return 0;
}

static int attack_victim(int pid) {
    CUprocessState st = CU_PROCESS_STATE_FAILED;
    say("state", cuCheckpointProcessGetState(pid, &st));
    CUcheckpointLockArgs lock = {0};
    CUresult r = cuCheckpointProcessLock(pid, &lock);
    say("lock", r);
    if (r == CUDA_SUCCESS) {
        CUcheckpointCheckpointArgs ck = {{0}};
        say("checkpoint", cuCheckpointProcessCheckpoint(pid, &ck));
    }
    void *fn = NULL;
    CUdriverProcAddressQueryResult found;
    if (cuGetProcAddress("cuCheckpointProcessLock", &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT,
                         &found) ||
        !fn) {
        say("missing", 1);
        return 6;
    }
    say("lock_getproc", ((lock_t)fn)(pid, &lock));
    return 0;
}

/* the child: 2 GiB on the slice's GPU, then "1" on `ready_fd`, then wait to be killed */
static int child_main(int ready_fd) {
    setup();
    CUdeviceptr p;
    CUresult r = cuMemAlloc(&p, 2 * GIB);
    char c = r == CUDA_SUCCESS ? '1' : '0';
    if (write(ready_fd, &c, 1) != 1) return 4;
    for (;;) pause();
}

static int move_child(const char *self, const char *other) {
    CUuuid mine, theirs;
    CUdevice own;
    if (parse_uuid(other, &theirs)) {
        say("bad_uuid", 1);
        return 3;
    }
    cuDeviceGet(&own, 0);
    uuid_of(own, &mine);
    int fds[2];
    if (pipe(fds)) return 4;
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* gone with its parent, whatever the test does */
        char fd[16];
        snprintf(fd, sizeof fd, "%d", fds[1]);
        close(fds[0]);
        execl(self, self, "serve-child", fd, (char *)NULL);
        _exit(5);
    }
    close(fds[1]);
    char c = 0;
    if (read(fds[0], &c, 1) != 1 || c != '1') {
        say("child_alloc", 1);
        kill(pid, SIGKILL);
        return 4;
    }
    say("child", pid);
    CUcheckpointLockArgs lock = {0};
    CUcheckpointCheckpointArgs ck = {{0}};
    say("lock", cuCheckpointProcessLock(pid, &lock));
    say("checkpoint", cuCheckpointProcessCheckpoint(pid, &ck));
    CUcheckpointGpuPair pair = {mine, theirs};
    CUcheckpointRestoreArgs restore = {0};
    restore.gpuPairs = &pair;
    restore.gpuPairsCount = 1;
    say("restore_other", cuCheckpointProcessRestore(pid, &restore));
    CUprocessState st = CU_PROCESS_STATE_FAILED;
    cuCheckpointProcessGetState(pid, &st);
    say("state_after_other", st);
    if (st == CU_PROCESS_STATE_CHECKPOINTED) {
        pair.newUuid = mine;
        say("restore_own", cuCheckpointProcessRestore(pid, &restore));
    }
    say("unlock", cuCheckpointProcessUnlock(pid, NULL));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "serve-child")) return child_main(atoi(argv[2]));
    if (argc != 3) {
        fprintf(stderr, "usage: %s victim <pid> | child <uuid>\n", argv[0]);
        return 2;
    }
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) {
        say("init", r);
        return 2;
    }
    int rc = !strcmp(argv[1], "victim") ? attack_victim(atoi(argv[2]))
                                        : move_child(argv[0], argv[2]);
    if (rc) return rc;
    hold();
    return 0;
}
