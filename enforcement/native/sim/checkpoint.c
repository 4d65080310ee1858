/* The simulated CUDA checkpoint API (cuCheckpointProcess*, CUDA 12.8): one process locks,
 * checkpoints, restores and unlocks another CUDA process by its pid, as `cuda-checkpoint`
 * does. As in NVIDIA's driver, the work happens in the target process: every process that
 * initialised CUDA runs a restore thread (cuCheckpointProcessGetRestoreThreadId names it),
 * here serving an abstract unix socket named after its pid. A caller of another user is
 * refused (the socket's peer credentials; root may), as the driver refuses a process it
 * could not ptrace.
 *
 * What each step does to the target, as cuda.h says:
 *  - Lock: its further CUDA calls block (at the driver's entry, sim_check_init) until Unlock;
 *    the simulator does not wait for calls already inside the driver.
 *  - Checkpoint (locked): its device memory is released on every GPU it used (the GPU's and
 *    the process's accounting drop to nothing; the contents go to host memory).
 *  - Restore (checkpointed): the memory is taken again, on the same GPUs or, with gpuPairs,
 *    on the GPUs they name (each checkpointed GPU must be paired, with a GPU of the same
 *    model); from then on the process's work and memory on that device are on the new GPU
 *    (its device ordinals keep their numbers). Not enough memory there: the restore fails
 *    and the process stays checkpointed.
 *  - Unlock (locked): its calls go on.
 * Wrong state: CUDA_ERROR_ILLEGAL_STATE; a pid with no CUDA process: CUDA_ERROR_INVALID_VALUE.
 * A statically linked program that dlopens the simulator runs no restore thread (see
 * dynamic_program), so it is not a CUDA process to the API. Not simulated: the contents
 * themselves, memory shared with other processes moving with its owner (it is released and
 * restored as the owner's), Lock's timeout (the lock is immediate). */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "driver.h"

enum { CK_TID = 1, CK_STATE, CK_LOCK, CK_CHECKPOINT, CK_RESTORE, CK_UNLOCK };

typedef struct {
    uint32_t op;
    uint32_t npairs;
    unsigned char old_uuid[SIM_MAX_GPUS][16];
    unsigned char new_uuid[SIM_MAX_GPUS][16];
} ck_request_t;

typedef struct {
    int32_t result;
    int32_t value;
} ck_reply_t;

static pthread_mutex_t ck_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ck_cv = PTHREAD_COND_INITIALIZER;
static int ck_state = CU_PROCESS_STATE_RUNNING;
static int ck_gate; /* 1 while locked or checkpointed: calls wait */
static int ck_tid;
static uint64_t ck_saved[SIM_MAX_GPUS]; /* what the checkpoint released, per GPU index */
static uint64_t ck_managed[SIM_MAX_GPUS]; /* the managed part of it */
static int ck_had[SIM_MAX_GPUS];        /* the GPUs it had a slot on */
static sim_gpu_state_t *ck_phys[SIM_MAX_GPUS]; /* each GPU's own state (g_sim_state is the
                                                  process's view, remapped by a restore) */

static void socket_name(int pid, struct sockaddr_un *a, socklen_t *len) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "qgpu-sim-restore-%d", pid);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

void sim_checkpoint_gate(void) {
    if (!__atomic_load_n(&ck_gate, __ATOMIC_ACQUIRE)) return;
    /* the restore thread is never held (no TLS: a static program dlopening us has none) */
    if ((int)syscall(SYS_gettid) == __atomic_load_n(&ck_tid, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&ck_mu);
    while (ck_gate) pthread_cond_wait(&ck_cv, &ck_mu);
    pthread_mutex_unlock(&ck_mu);
}

static int gidx_of_uuid(const unsigned char u[16]) {
    for (int g = 0; g < g_sim_cfg.ngpus; g++) {
        unsigned char b[16];
        if (qgpu_uuid_parse(g_sim_cfg.gpus[g].uuid, b) == 0 && memcmp(b, u, 16) == 0) return g;
    }
    return -1;
}

static CUresult do_checkpoint(void) {
    int pid = getpid();
    for (int g = 0; g < SIM_MAX_GPUS; g++) {
        ck_saved[g] = 0;
        ck_managed[g] = 0;
        ck_had[g] = 0;
        sim_gpu_state_t *st = g_sim_state[g];
        if (!st) continue;
        sim_state_lock(st);
        sim_proc_t *p = sim_state_proc_slot(st, 0);
        if (p && p->pid == pid) {
            ck_had[g] = 1;
            ck_saved[g] = p->mem_used;
            ck_managed[g] = p->managed_bytes;
            p->managed_bytes = 0;
            st->mem_used = st->mem_used >= p->mem_used ? st->mem_used - p->mem_used : 0;
            p->mem_used = 0;
            sim_acct_memory(st, p);
        }
        sim_state_unlock(st);
    }
    return CUDA_SUCCESS;
}

static CUresult do_restore(const ck_request_t *rq) {
    int dest[SIM_MAX_GPUS];
    for (int g = 0; g < SIM_MAX_GPUS; g++) dest[g] = g;
    if (rq->npairs > SIM_MAX_GPUS) return CUDA_ERROR_INVALID_VALUE;
    if (rq->npairs) {
        int paired[SIM_MAX_GPUS] = {0};
        for (unsigned i = 0; i < rq->npairs; i++) {
            int o = gidx_of_uuid(rq->old_uuid[i]), n = gidx_of_uuid(rq->new_uuid[i]);
            if (o < 0 || n < 0 || paired[o]) return CUDA_ERROR_INVALID_VALUE;
            const sim_gpu_config_t *a = &g_sim_cfg.gpus[o], *b = &g_sim_cfg.gpus[n];
            if (strcmp(a->name, b->name) || a->cc_major != b->cc_major || a->cc_minor != b->cc_minor)
                return CUDA_ERROR_INVALID_VALUE; /* not the same chip */
            paired[o] = 1;
            dest[o] = n;
        }
        for (int g = 0; g < SIM_MAX_GPUS; g++)
            if (ck_had[g] && !paired[g]) return CUDA_ERROR_INVALID_VALUE; /* every GPU paired */
    }
    sim_gpu_state_t *to[SIM_MAX_GPUS] = {0};
    int charged[SIM_MAX_GPUS] = {0};
    CUresult r = CUDA_SUCCESS;
    for (int g = 0; g < SIM_MAX_GPUS && r == CUDA_SUCCESS; g++) {
        if (!g_sim_state[g]) continue;
        int d = dest[g];
        if (!ck_phys[d]) ck_phys[d] = sim_state_open(&g_sim_cfg.gpus[d], &g_sim_cfg);
        to[g] = dest[g] == g ? g_sim_state[g] : ck_phys[d];
        if (!to[g]) {
            r = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        if (!ck_saved[g]) continue;
        sim_state_lock(to[g]);
        r = sim_state_charge(to[g], ck_saved[g] - ck_managed[g]);
        if (r == CUDA_SUCCESS && ck_managed[g]) {
            r = sim_state_charge_managed(to[g], ck_managed[g]);
            if (r) sim_state_uncharge(to[g], ck_saved[g] - ck_managed[g]);
        }
        sim_state_unlock(to[g]);
        charged[g] = r == CUDA_SUCCESS;
    }
    if (r != CUDA_SUCCESS) { /* undo: the process stays checkpointed */
        for (int g = 0; g < SIM_MAX_GPUS; g++) {
            if (!charged[g]) continue;
            sim_state_lock(to[g]);
            sim_state_uncharge(to[g], ck_saved[g] - ck_managed[g]);
            sim_state_uncharge_managed(to[g], ck_managed[g]);
            sim_state_unlock(to[g]);
        }
        return r;
    }
    int pid = getpid();
    for (int g = 0; g < SIM_MAX_GPUS; g++) {
        if (!g_sim_state[g] || to[g] == g_sim_state[g]) continue;
        sim_gpu_state_t *st = g_sim_state[g]; /* moved away: its slot there goes */
        sim_state_lock(st);
        sim_proc_t *p = sim_state_proc_slot(st, 0);
        if (p && p->pid == pid) sim_state_drop_slot(st, (int)(p - st->procs));
        sim_state_unlock(st);
    }
    for (int g = 0; g < SIM_MAX_GPUS; g++)
        if (to[g]) g_sim_state[g] = to[g];
    return CUDA_SUCCESS;
}

static ck_reply_t serve_one(const ck_request_t *rq) {
    ck_reply_t rp = {CUDA_SUCCESS, 0};
    pthread_mutex_lock(&ck_mu);
    switch (rq->op) {
    case CK_TID:
        rp.value = ck_tid;
        break;
    case CK_STATE:
        rp.value = ck_state;
        break;
    case CK_LOCK:
        if (ck_state != CU_PROCESS_STATE_RUNNING) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        ck_state = CU_PROCESS_STATE_LOCKED;
        __atomic_store_n(&ck_gate, 1, __ATOMIC_RELEASE);
        break;
    case CK_CHECKPOINT:
        if (ck_state != CU_PROCESS_STATE_LOCKED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        rp.result = do_checkpoint();
        if (rp.result == CUDA_SUCCESS) ck_state = CU_PROCESS_STATE_CHECKPOINTED;
        break;
    case CK_RESTORE:
        if (ck_state != CU_PROCESS_STATE_CHECKPOINTED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        rp.result = do_restore(rq);
        if (rp.result == CUDA_SUCCESS) ck_state = CU_PROCESS_STATE_LOCKED;
        break;
    case CK_UNLOCK:
        if (ck_state != CU_PROCESS_STATE_LOCKED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        ck_state = CU_PROCESS_STATE_RUNNING;
        __atomic_store_n(&ck_gate, 0, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&ck_cv);
        break;
    default:
        rp.result = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&ck_mu);
    return rp;
}

static void *restore_thread(void *arg) {
    int lfd = (int)(intptr_t)arg;
    __atomic_store_n(&ck_tid, (int)syscall(SYS_gettid), __ATOMIC_RELEASE);
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return NULL;
        }
        struct ucred cred;
        socklen_t cl = sizeof cred;
        ck_request_t rq;
        ck_reply_t rp = {CUDA_ERROR_INVALID_VALUE, 0};
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
            rp.result = CUDA_ERROR_INVALID_VALUE;
        else if (cred.uid != 0 && cred.uid != geteuid())
            rp.result = CUDA_ERROR_NOT_PERMITTED;
        else if (recv(fd, &rq, sizeof rq, 0) == (ssize_t)sizeof rq)
            rp = serve_one(&rq);
        (void)!send(fd, &rp, sizeof rp, MSG_NOSIGNAL);
        close(fd);
    }
}

/* 1 when the program has a dynamic loader (PT_INTERP among its program headers, found from
 * /proc/self/auxv: a static program that dlopens us has a libc of its own in which
 * pthread_create from this library crashes, so no restore thread is started there) */
static int dynamic_program(void) {
    FILE *f = fopen("/proc/self/auxv", "re");
    if (!f) return 0;
    unsigned long av[2], phdr = 0, phnum = 0;
    while (fread(av, sizeof av, 1, f) == 1 && av[0] != AT_NULL) {
        if (av[0] == AT_PHDR) phdr = av[1];
        if (av[0] == AT_PHNUM) phnum = av[1];
    }
    fclose(f);
    const ElfW(Phdr) *ph = (const ElfW(Phdr) *)phdr;
    for (unsigned long i = 0; ph && i < phnum; i++)
        if (ph[i].p_type == PT_INTERP) return 1;
    return 0;
}

void sim_checkpoint_start(void) {
    for (int g = 0; g < SIM_MAX_GPUS; g++) ck_phys[g] = g_sim_state[g];
    if (!dynamic_program()) return; /* the checkpoint API cannot reach it (INVALID_VALUE) */
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct sockaddr_un a;
    socklen_t len;
    socket_name(getpid(), &a, &len);
    if (bind(fd, (struct sockaddr *)&a, len) != 0 || listen(fd, 16) != 0) {
        close(fd);
        return; /* no restore thread: the checkpoint API cannot reach this process */
    }
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the application's signals are not its */
    if (pthread_create(&t, &at, restore_thread, (void *)(intptr_t)fd) != 0) close(fd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&at);
}

/* ---- the caller's side ---- */

static CUresult ask(int pid, ck_request_t *rq, int *value) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (pid <= 0) return CUDA_ERROR_INVALID_VALUE;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    struct sockaddr_un a;
    socklen_t len;
    socket_name(pid, &a, &len);
    ck_reply_t rp;
    if (connect(fd, (struct sockaddr *)&a, len) != 0) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE; /* no CUDA process of that pid */
    }
    if (send(fd, rq, sizeof *rq, MSG_NOSIGNAL) != (ssize_t)sizeof *rq ||
        recv(fd, &rp, sizeof rp, 0) != (ssize_t)sizeof rp) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE; /* it ended meanwhile */
    }
    close(fd);
    if (value) *value = rp.value;
    return (CUresult)rp.result;
}

static int zeroed(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

SIM_EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    ck_request_t rq = {.op = CK_TID};
    return ask(pid, &rq, tid);
}

SIM_EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    ck_request_t rq = {.op = CK_STATE};
    int v = 0;
    CUresult r = ask(pid, &rq, &v);
    if (r == CUDA_SUCCESS) *state = (CUprocessState)v;
    return r;
}

SIM_EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    if (args && (args->reserved0 || !zeroed(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    ck_request_t rq = {.op = CK_LOCK};
    return ask(pid, &rq, NULL);
}

SIM_EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    if (args && !zeroed(args, sizeof *args)) return CUDA_ERROR_INVALID_VALUE;
    ck_request_t rq = {.op = CK_CHECKPOINT};
    return ask(pid, &rq, NULL);
}

SIM_EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    ck_request_t rq = {.op = CK_RESTORE};
    if (args) {
        if (!zeroed(args->reserved, sizeof args->reserved) || args->reserved1)
            return CUDA_ERROR_INVALID_VALUE;
        if (args->gpuPairsCount && !args->gpuPairs) return CUDA_ERROR_INVALID_VALUE;
        if (args->gpuPairsCount > SIM_MAX_GPUS) return CUDA_ERROR_INVALID_VALUE;
        rq.npairs = args->gpuPairsCount;
        for (unsigned i = 0; i < rq.npairs; i++) {
            memcpy(rq.old_uuid[i], args->gpuPairs[i].oldUuid.bytes, 16);
            memcpy(rq.new_uuid[i], args->gpuPairs[i].newUuid.bytes, 16);
        }
    }
    return ask(pid, &rq, NULL);
}

SIM_EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    if (args && !zeroed(args, sizeof *args)) return CUDA_ERROR_INVALID_VALUE;
    ck_request_t rq = {.op = CK_UNLOCK};
    return ask(pid, &rq, NULL);
}
