/* gpu-<uuid>.region: what the processes on one physical GPU tell each other (one entry per
 * process, shared by every slice on the GPU):
 *  - when it last launched work, its slice, policy and share: a slice is *active* if one of
 *    its processes launched in the last 100 ms, or if the node agent saw it busy in NVML's
 *    samples (busy.c: work that bypasses the hook, or one long kernel). Burst-share looks at
 *    the slices active besides its own; best-effort slices look at the guaranteed ones
 *    (fixed- and burst-share) to take only what they leave (launch.c);
 *  - until when it expects to have work queued on the device (`pending_until`): how many
 *    other processes contend for the device right now, which is how the compute gate turns a
 *    measured event interval into the device time the process really had on a time-sliced
 *    GPU (launch.c).
 * Entries are found by pid + start time; entries of dead processes are reused. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

#define REGION_MAGIC 0x3247455255504751ULL /* "QGPUREG2" */
#define REGION_VERSION 2
#define MAX_REGION 128
#define ACTIVE_WINDOW_NS 100000000LL  /* a slice that launched in the last 100 ms is active */
#define UNGATED_BUSY_NS 20000000LL    /* an ungated process that launched in the last 20 ms has work */
#define SUMMARY_EVERY_NS 1000000LL    /* the neighbour summary is recomputed at most every 1 ms */

typedef struct {
    char slice_id[72];      /* 0 */
    int64_t last_launch_ns; /* 72: coarse clock */
    int32_t policy;         /* 80 */
    int32_t core;           /* 84 */
    int32_t pid;            /* 88 */
    int32_t gated;          /* 92: measures its work with events (publishes pending_until) */
    uint64_t start_time;    /* 96 */
    int64_t pending_until;  /* 104: it expects work on the device until then */
    char pad[16];           /* 112 .. 128 */
} region_entry_t;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t max_entries;
    char pad0[48];
    char lock_area[64];                 /* 64 */
    region_entry_t entries[MAX_REGION]; /* 128 */
} gpu_region_t;

_Static_assert(sizeof(region_entry_t) == 128, "region entry layout");

static gpu_region_t *R;
static region_entry_t *mine;
static int mine_pid;
static const hook_limits_t *lim;

/* Locked: this process's entry (a forked child gets its own). */
static region_entry_t *claim(int pid) {
    uint64_t start = qgpu_proc_start_time(pid);
    region_entry_t *free_e = NULL;
    for (int i = 0; i < MAX_REGION; i++) {
        region_entry_t *e = &R->entries[i];
        if (e->pid == pid && e->start_time == start) return e;
        if (!free_e && (!e->pid || !qgpu_proc_alive(e->pid, e->start_time))) free_e = e;
    }
    if (!free_e) return NULL;
    memset(free_e, 0, sizeof *free_e);
    snprintf(free_e->slice_id, sizeof free_e->slice_id, "%s", lim->slice_id);
    free_e->policy = lim->policy;
    free_e->core = lim->core;
    free_e->pid = pid;
    free_e->start_time = start;
    /* registered counts as active: a new slice is seen at once */
    free_e->last_launch_ns = qgpu_now_coarse_ns();
    return free_e;
}

static region_entry_t *entry(void) {
    if (!R) return NULL;
    int pid = getpid(); /* cheap enough here: called at launches of gated processes only */
    region_entry_t *e = __atomic_load_n(&mine, __ATOMIC_ACQUIRE);
    if (e && mine_pid == pid) return e;
    qgpu_lock((pthread_mutex_t *)R->lock_area);
    e = claim(pid);
    qgpu_unlock((pthread_mutex_t *)R->lock_area);
    mine_pid = pid;
    __atomic_store_n(&mine, e, __ATOMIC_RELEASE);
    return e;
}

int region_open(const char *state_dir, const char *uuid, const hook_limits_t *limits) {
    char path[1200];
    snprintf(path, sizeof path, "%s/gpu-%s.region", state_dir, uuid);
    /* the node agent pre-creates it, shared by the GPU's workload group (mode 0660) */
    gpu_region_t *r = qgpu_map_state_mode(path, sizeof(gpu_region_t), REGION_MAGIC,
                                          __builtin_offsetof(gpu_region_t, lock_area), NULL,
                                          NULL, 0600);
    if (!r) return -1;
    r->version = REGION_VERSION;
    r->max_entries = MAX_REGION;
    lim = limits;
    R = r;
    busy_open(state_dir, uuid);
    pthread_atfork(NULL, NULL, region_forget_entry);
    return entry() ? 0 : -1;
}

void region_forget_entry(void) { __atomic_store_n(&mine, NULL, __ATOMIC_RELEASE); }

/* The launch hot path of every process: one coarse clock read, one store at most. */
void region_publish_launch(void) {
    region_entry_t *e = __atomic_load_n(&mine, __ATOMIC_ACQUIRE);
    if (!e) return;
    int64_t now = qgpu_now_coarse_ns();
    if (__atomic_load_n(&e->last_launch_ns, __ATOMIC_RELAXED) != now)
        __atomic_store_n(&e->last_launch_ns, now, __ATOMIC_RELAXED);
}

void region_publish_pending(int gated, int64_t until_ns) {
    region_entry_t *e = entry();
    if (!e) return;
    if (e->gated != gated) __atomic_store_n(&e->gated, gated, __ATOMIC_RELAXED);
    __atomic_store_n(&e->pending_until, until_ns, __ATOMIC_RELAXED);
}

int region_contenders(int64_t now) {
    region_entry_t *me = entry();
    int n = 0;
    if (!R) return 0;
    int64_t coarse = qgpu_now_coarse_ns();
    for (int i = 0; i < MAX_REGION; i++) {
        region_entry_t *e = &R->entries[i];
        if (e == me || !e->pid) continue;
        if (__atomic_load_n(&e->gated, __ATOMIC_RELAXED)) {
            if (__atomic_load_n(&e->pending_until, __ATOMIC_RELAXED) > now) n++;
        } else if (coarse - __atomic_load_n(&e->last_launch_ns, __ATOMIC_RELAXED) < UNGATED_BUSY_NS) {
            n++;
        }
    }
    return n;
}

/* Who else is active on the GPU, counted per slice (a slice may have several processes).
 * Packed in one word so the launch path reads it without a lock. */
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

#define BUSY_LISTED 64

static int seen(const char *const *ids, int n, const char *id) {
    for (int k = 0; k < n; k++)
        if (strncmp(ids[k], id, 72) == 0) return 1;
    return 0;
}

static void count_active(region_summary_t *s, const char *slice_id, int policy, int core) {
    int own = strncmp(slice_id, lim->slice_id, 72) == 0;
    if (!own) s->other_slices++;
    if (policy != POLICY_BEST_EFFORT && core < 100) {
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
    if (!R) { /* unknown GPU: assume contention (never over the share) */
        s.other_slices = s.guaranteed_slices = 1;
        return s;
    }
    const char *active[MAX_REGION + BUSY_LISTED];
    int n = 0;
    for (int i = 0; i < MAX_REGION; i++) {
        region_entry_t *e = &R->entries[i];
        if (!e->pid || now - __atomic_load_n(&e->last_launch_ns, __ATOMIC_RELAXED) >= ACTIVE_WINDOW_NS)
            continue;
        if (!seen(active, n, e->slice_id)) {
            active[n++] = e->slice_id;
            count_active(&s, e->slice_id, e->policy, e->core);
        }
    }
    /* slices the agent saw busy in NVML's samples that published nothing (the raw driver, a
     * long kernel) are active too */
    busy_slice_t busy[BUSY_LISTED];
    int nb = busy_read(busy, BUSY_LISTED, now);
    for (int i = 0; i < nb; i++) {
        if (seen(active, n, busy[i].slice_id)) continue;
        active[n++] = busy[i].slice_id;
        count_active(&s, busy[i].slice_id, busy[i].policy, busy[i].core);
    }
    __atomic_store_n(&cached, pack(s), __ATOMIC_RELAXED);
    __atomic_store_n(&cached_at, now, __ATOMIC_RELEASE);
    return s;
}
