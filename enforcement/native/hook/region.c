/* What the slices of one physical GPU tell each other, under <QGPU_STATE_DIR>/.gpu-<uuid>/
 * (a name no slice id can take: ids never start with a dot):
 *  - roster: every slice on the GPU with its policy and share, written only by whoever
 *    places slices (roster.c); workloads read it;
 *  - <slice>.activity: what the slice's processes do, written only by them (the file is
 *    the slice user's; in Kubernetes it is the one file of the directory mounted writable
 *    into the slice's container), read by the GPU's other workloads:
 *      - when it last launched work (through the hook);
 *      - until when it expects work queued on the device (`pending_until`): how many others
 *        contend for the device right now, which is how the compute gate turns a measured
 *        event interval into the device time it really had on a time-sliced GPU (launch.c).
 *    A slice can lie only about itself: claiming to be active is what being active costs
 *    its neighbours, and it counts as one contender at most whatever it writes;
 *  - busy: the slices the node agent's watchdog saw run in NVML's samples (busy.c), written
 *    only by the agent: what a slice hides from its activity file, or runs past the hook.
 * A slice is *active* if one of its processes launched in the last 100 ms OR the agent's
 * busy list names it (region_summary, the one place that decides). Burst-share looks at the
 * active slices besides its own; best-effort slices take only what the active guaranteed
 * slices leave (launch.c).
 * The other slices' files are read with pread (never mapped: a file its owner truncates
 * must not crash its readers), at most every SNAPSHOT_NS, into a process-local snapshot.
 *
 * Activity file layout, little endian (ACT_SIZE bytes):
 *   0 magic u64 "QGPUACT1"   8 version u32   12 max_procs u32
 *  16 last_launch_ns i64 (any process of the slice; coarse monotonic clock)
 *  24 pending_until i64 (the latest any gated process of the slice expects work queued)
 *  32 gated i32 (the slice measures its work with events)     36 used u32 (slots in use)
 *  64 lock (robust mutex, the slice's own processes)        128 procs[64] of 32 bytes:
 *     pid i32, gated i32, start_time u64, last_launch_ns i64, pending_until i64
 * Readers of other slices read the first ACT_PUBLIC bytes only. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

#define ACT_MAGIC 0x3154434155504751ULL /* "QGPUACT1" */
#define ACT_VERSION 1
#define ACT_PROCS 64
#define ACT_PUBLIC 40
#define ACTIVE_WINDOW_NS 100000000LL /* a slice that launched in the last 100 ms is active */
#define UNGATED_BUSY_NS 20000000LL   /* an ungated slice that launched in the last 20 ms has work */
#define SUMMARY_EVERY_NS 1000000LL   /* the neighbour summary is recomputed at most every 1 ms */
#define SNAPSHOT_NS 1000000LL        /* the others' activity is re-read at most every 1 ms */
#define REOPEN_NS 1000000000LL       /* a neighbour whose file could not be read is retried */

typedef struct {
    int32_t pid;
    int32_t gated;
    uint64_t start_time;
    int64_t last_launch_ns;
    int64_t pending_until;
} act_proc_t;

typedef struct {
    uint64_t magic;         /* 0 */
    uint32_t version;       /* 8 */
    uint32_t max_procs;     /* 12 */
    int64_t last_launch_ns; /* 16 */
    int64_t pending_until;  /* 24 */
    int32_t gated;          /* 32 */
    uint32_t used;          /* 36 */
    char pad[24];           /* 40 .. 64 */
    char lock_area[64];     /* 64 */
    act_proc_t procs[ACT_PROCS]; /* 128 */
} activity_t;

_Static_assert(sizeof(act_proc_t) == 32, "activity slot layout");
_Static_assert(__builtin_offsetof(activity_t, procs) == 128, "activity layout");
_Static_assert(__builtin_offsetof(activity_t, used) + 4 == ACT_PUBLIC, "public part");

/* Another slice as last read. */
typedef struct {
    roster_entry_t who; /* id, policy, share: from the roster */
    int fd;             /* its activity file, read-only; -1 when it could not be opened */
    int64_t retry_at;
    int64_t last_launch_ns, pending_until;
    int gated;
    int busy; /* the agent's busy list names it */
} neighbour_t;

static const hook_limits_t *lim;
static char gpu_dir[1200];
static int gpu_known; /* the GPU's directory and roster are usable */
static roster_t *roster;
static busy_t *busy; /* the agent's busy list (NULL: no agent) */
static activity_t *A; /* this slice's activity (its file, or private memory) */
static act_proc_t *mine;
static int mine_pid;

static pthread_mutex_t nb_lock = PTHREAD_MUTEX_INITIALIZER;
static neighbour_t nb[ROSTER_MAX];
static int nnb;
static uint64_t nb_seq = UINT64_MAX; /* no roster's seq: the first refresh loads it */
static int64_t nb_at;
static busy_list_t busy_list = {UINT64_MAX, 0, 0, {{0}}}; /* as last copied (nb_lock) */
static int own_busy;                                     /* the list names this slice */

/* -- this slice's own file ------------------------------------------------------------- */

static void act_init(void *base, void *arg) {
    (void)arg;
    activity_t *a = base;
    a->version = ACT_VERSION;
    a->max_procs = ACT_PROCS;
}

/* Locked (the activity lock): this process's slot (a forked child gets its own). */
static act_proc_t *claim(int pid) {
    uint64_t start = qgpu_proc_start_time(pid);
    act_proc_t *free_p = NULL;
    for (int i = 0; i < ACT_PROCS; i++) {
        act_proc_t *p = &A->procs[i];
        if (p->pid == pid && p->start_time == start) return p;
        if (!free_p && (!p->pid || !qgpu_proc_alive(p->pid, p->start_time))) free_p = p;
    }
    if (!free_p) return NULL;
    memset(free_p, 0, sizeof *free_p);
    free_p->pid = pid;
    free_p->start_time = start;
    uint32_t used = (uint32_t)(free_p - A->procs) + 1;
    if (A->used < used) A->used = used;
    /* registered counts as active: a new slice is seen at once */
    int64_t now = qgpu_now_coarse_ns();
    free_p->last_launch_ns = now;
    __atomic_store_n(&A->last_launch_ns, now, __ATOMIC_RELAXED);
    return free_p;
}

static act_proc_t *entry(void) {
    if (!A) return NULL;
    int pid = getpid(); /* cheap enough here: called at launches of gated processes only */
    act_proc_t *p = __atomic_load_n(&mine, __ATOMIC_ACQUIRE);
    if (p && mine_pid == pid) return p;
    qgpu_lock((pthread_mutex_t *)A->lock_area);
    p = claim(pid);
    qgpu_unlock((pthread_mutex_t *)A->lock_area);
    mine_pid = pid;
    __atomic_store_n(&mine, p, __ATOMIC_RELEASE);
    return p;
}

/* The slice's activity file (pre-created by the agent or the device plugin, owned by the
 * slice's user; created here where this user may write the directory), else private memory:
 * the others then do not see this slice, which only this slice can lose by. */
static activity_t *open_own_activity(void) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s.activity", gpu_dir, lim->slice_id);
    activity_t *a = qgpu_map_state_mode(path, sizeof(activity_t), ACT_MAGIC,
                                        __builtin_offsetof(activity_t, lock_area), act_init, NULL,
                                        0600);
    if (a) return a;
    a = calloc(1, sizeof *a);
    if (!a) return NULL;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutex_init((pthread_mutex_t *)a->lock_area, &attr);
    pthread_mutexattr_destroy(&attr);
    act_init(a, NULL);
    a->magic = ACT_MAGIC;
    return a;
}

/* The GPU's directory: made here (private to this user) when nobody placed it; used only
 * when it belongs to root or to this user and nobody else may write it, so no other user
 * can add a roster, a slice or an activity file to it. */
static int open_gpu_dir(void) {
    if (mkdir(gpu_dir, 0700) == 0) chmod(gpu_dir, 0700);
    int fd = open(gpu_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    int ok = qgpu_fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && state_trusted(&st);
    close(fd);
    if (!ok)
        fprintf(stderr, "qgpu: %s is not root's or this user's, or others may write it: the "
                        "GPU's other slices are not read (this slice is gated as if they were "
                        "busy)\n", gpu_dir);
    return ok ? 0 : -1;
}

int region_open(const char *state_dir, const char *uuid, const hook_limits_t *limits) {
    lim = limits;
    snprintf(gpu_dir, sizeof gpu_dir, "%s/.gpu-%s", state_dir, uuid);
    int dir_ok = open_gpu_dir() == 0;
    A = dir_ok ? open_own_activity() : NULL;
    pthread_atfork(NULL, NULL, region_forget_entry);
    act_proc_t *p = entry(); /* before listing the slice: a listed slice has a live process */
    if (dir_ok) roster = roster_open(gpu_dir, limits);
    if (roster) busy = busy_open(gpu_dir);
    __atomic_store_n(&gpu_known, roster != NULL, __ATOMIC_RELEASE);
    return p ? 0 : -1;
}

/* fork child: its own slot, and no lock held by a thread that did not survive the fork */
void region_forget_entry(void) {
    __atomic_store_n(&mine, NULL, __ATOMIC_RELEASE);
    pthread_mutex_init(&nb_lock, NULL);
}

/* The launch hot path of every process: one coarse clock read, two stores at most. */
void region_publish_launch(void) {
    act_proc_t *p = __atomic_load_n(&mine, __ATOMIC_ACQUIRE);
    if (!p) return;
    int64_t now = qgpu_now_coarse_ns();
    if (__atomic_load_n(&p->last_launch_ns, __ATOMIC_RELAXED) != now) {
        __atomic_store_n(&p->last_launch_ns, now, __ATOMIC_RELAXED);
        __atomic_store_n(&A->last_launch_ns, now, __ATOMIC_RELAXED);
    }
}

void region_publish_pending(int gated, int64_t until_ns) {
    act_proc_t *p = entry();
    if (!p) return;
    if (p->gated != gated) __atomic_store_n(&p->gated, gated, __ATOMIC_RELAXED);
    __atomic_store_n(&p->pending_until, until_ns, __ATOMIC_RELAXED);
    /* the slice's: the latest of its gated processes (dead ones' run out by themselves) */
    int64_t latest = 0;
    uint32_t used = __atomic_load_n(&A->used, __ATOMIC_RELAXED);
    for (uint32_t i = 0; i < used && i < ACT_PROCS; i++) {
        act_proc_t *q = &A->procs[i];
        int64_t u = __atomic_load_n(&q->pending_until, __ATOMIC_RELAXED);
        if (q->pid && __atomic_load_n(&q->gated, __ATOMIC_RELAXED) && u > latest) latest = u;
    }
    if (__atomic_load_n(&A->gated, __ATOMIC_RELAXED) != gated)
        __atomic_store_n(&A->gated, gated, __ATOMIC_RELAXED);
    __atomic_store_n(&A->pending_until, latest, __ATOMIC_RELAXED);
}

/* For roster.c: whether a slice's activity file names a live process (0), or -1 when it
 * cannot be read. */
int activity_any_alive(const char *path, int *alive) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return -1;
    activity_t a;
    ssize_t n = pread(fd, &a, sizeof a, 0);
    close(fd);
    if (n != (ssize_t)sizeof a || a.magic != ACT_MAGIC) return -1;
    *alive = 0;
    for (int i = 0; i < ACT_PROCS && !*alive; i++)
        *alive = a.procs[i].pid && qgpu_proc_alive(a.procs[i].pid, a.procs[i].start_time);
    return 0;
}

/* -- the other slices ------------------------------------------------------------------ */

static int open_neighbour(const char *slice_id) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s.activity", gpu_dir, slice_id);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (qgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* nb_lock held: the roster changed; keep the files of slices still listed. */
static void reload_roster(void) {
    static roster_entry_t listed[ROSTER_MAX];
    uint64_t seq;
    int n = roster_read(roster, listed, &seq);
    if (n < 0) return;
    static neighbour_t next[ROSTER_MAX];
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (strncmp(listed[i].slice_id, lim->slice_id, sizeof listed[i].slice_id) == 0) continue;
        neighbour_t x = {listed[i], -1, 0, 0, 0, 0, 0};
        for (int k = 0; k < nnb; k++) {
            if (nb[k].fd >= 0 && strcmp(nb[k].who.slice_id, x.who.slice_id) == 0) {
                x.fd = nb[k].fd;
                nb[k].fd = -1;
                break;
            }
        }
        next[m++] = x;
    }
    for (int k = 0; k < nnb; k++)
        if (nb[k].fd >= 0) close(nb[k].fd);
    memcpy(nb, next, (size_t)m * sizeof nb[0]);
    nnb = m;
    nb_seq = seq;
}

/* nb_lock held: one neighbour's public part; idle when it cannot be read (its liar only
 * hides itself). */
static void read_neighbour(neighbour_t *x, int64_t now) {
    x->last_launch_ns = x->pending_until = 0;
    x->gated = 0;
    if (x->fd < 0) {
        if (now < x->retry_at) return;
        x->retry_at = now + REOPEN_NS;
        if ((x->fd = open_neighbour(x->who.slice_id)) < 0) return;
    }
    unsigned char buf[ACT_PUBLIC];
    if (pread(x->fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf) {
        if (errno == EBADF) x->fd = -1; /* the program closed it under us */
        return;
    }
    uint64_t magic;
    memcpy(&magic, buf, 8);
    if (magic != ACT_MAGIC) return;
    memcpy(&x->last_launch_ns, buf + 16, 8);
    memcpy(&x->pending_until, buf + 24, 8);
    int32_t gated;
    memcpy(&gated, buf + 32, 4);
    x->gated = gated != 0;
}

/* nb_lock held: which slices the agent's busy list names, re-read when it changed (each
 * watchdog scan) or the roster did. */
static void mark_busy(int reloaded) {
    static busy_list_t next;
    if (!busy || (!reloaded && busy_seq(busy) == busy_list.seq)) return;
    if (busy_read(busy, &next) != 0) return; /* being written: the list read before */
    memcpy(&busy_list, &next, sizeof next);
    for (int i = 0; i < nnb; i++) nb[i].busy = busy_lists(&busy_list, nb[i].who.slice_id);
    own_busy = busy_lists(&busy_list, lim->slice_id);
}

static int busy_now(int listed, int64_t now) {
    return listed && now < busy_list.valid_until_ns;
}

/* nb_lock held: re-read the roster when it changed, the others' files at most every
 * SNAPSHOT_NS, and the busy list when it changed. */
static void refresh_locked(int64_t coarse) {
    if (nb_at && coarse - nb_at < SNAPSHOT_NS && coarse >= nb_at) return;
    nb_at = coarse;
    int reloaded = roster_seq(roster) != nb_seq;
    if (reloaded) reload_roster();
    for (int i = 0; i < nnb; i++) read_neighbour(&nb[i], coarse);
    mark_busy(reloaded);
}

static int guaranteed(int policy, int core) { return policy != POLICY_BEST_EFFORT && core < 100; }

int region_contenders(int64_t now) {
    act_proc_t *me = entry();
    int n = 0;
    int64_t coarse = qgpu_now_coarse_ns();
    if (A) { /* this slice's other processes, one each */
        uint32_t used = __atomic_load_n(&A->used, __ATOMIC_RELAXED);
        for (uint32_t i = 0; i < used && i < ACT_PROCS; i++) {
            act_proc_t *p = &A->procs[i];
            if (p == me || !p->pid) continue;
            if (__atomic_load_n(&p->gated, __ATOMIC_RELAXED)) {
                if (__atomic_load_n(&p->pending_until, __ATOMIC_RELAXED) > now) n++;
            } else if (coarse - __atomic_load_n(&p->last_launch_ns, __ATOMIC_RELAXED) <
                       UNGATED_BUSY_NS) {
                n++;
            }
        }
    }
    if (!__atomic_load_n(&gpu_known, __ATOMIC_ACQUIRE)) return n;
    pthread_mutex_lock(&nb_lock);
    refresh_locked(coarse);
    for (int i = 0; i < nnb; i++) /* other slices: one each, whatever they write */
        n += nb[i].gated ? nb[i].pending_until > now
                         : nb[i].last_launch_ns > coarse - UNGATED_BUSY_NS;
    pthread_mutex_unlock(&nb_lock);
    return n;
}

/* Who else is active on the GPU, counted per slice. Packed in one word so the launch path
 * reads it without a lock. */
static uint64_t cached;
static int64_t cached_at;

static uint64_t pack(region_summary_t s) {
    return (uint64_t)(uint16_t)s.other_slices | (uint64_t)(uint16_t)s.guaranteed_slices << 16 |
           (uint64_t)(uint16_t)s.best_effort_slices << 32 |
           (uint64_t)(uint16_t)s.guaranteed_share << 48;
}

static region_summary_t unpack(uint64_t v) {
    region_summary_t s = {(int)(v & 0xffff), (int)((v >> 16) & 0xffff), (int)((v >> 32) & 0xffff),
                          (int)(v >> 48)};
    return s;
}

static void count(region_summary_t *s, int own, int policy, int core) {
    if (!own) s->other_slices++;
    if (guaranteed(policy, core)) {
        if (!own) s->guaranteed_slices++;
        s->guaranteed_share += core;
    } else {
        s->best_effort_slices++;
    }
}

region_summary_t region_summary(void) {
    int64_t now = qgpu_now_coarse_ns();
    if (now - __atomic_load_n(&cached_at, __ATOMIC_ACQUIRE) < SUMMARY_EVERY_NS)
        return unpack(__atomic_load_n(&cached, __ATOMIC_RELAXED));
    region_summary_t s = {0, 0, 0, 0};
    if (!__atomic_load_n(&gpu_known, __ATOMIC_ACQUIRE)) {
        /* unknown GPU: assume contention (never over the share) */
        s.other_slices = s.guaranteed_slices = 1;
        return s;
    }
    int64_t since = now - ACTIVE_WINDOW_NS;
    pthread_mutex_lock(&nb_lock);
    refresh_locked(now);
    /* active: launched through the hook lately (what the slice says) or seen running by the
     * agent (what the driver says); the others' policy and share from the roster only */
    if ((A && __atomic_load_n(&A->last_launch_ns, __ATOMIC_RELAXED) > since) ||
        busy_now(own_busy, now))
        count(&s, 1, lim->policy, lim->core);
    for (int i = 0; i < nnb; i++) /* (never `now - t`: t is whatever its slice wrote) */
        if (nb[i].last_launch_ns > since || busy_now(nb[i].busy, now))
            count(&s, 0, nb[i].who.policy, nb[i].who.core);
    pthread_mutex_unlock(&nb_lock);
    if (s.guaranteed_share > 0xffff) s.guaranteed_share = 0xffff;
    __atomic_store_n(&cached, pack(s), __ATOMIC_RELAXED);
    __atomic_store_n(&cached_at, now, __ATOMIC_RELEASE);
    return s;
}
