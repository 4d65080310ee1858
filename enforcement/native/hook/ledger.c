/* Shared ledgers in QGPU_STATE_DIR.
 *
 * slice-<id>.ledger: one per slice, shared by all its processes: memory charged per process
 * slot (slots of dead processes are reclaimed: pid + start time, so kill -9 and pid reuse
 * are handled) and the compute token bucket (device-ns of credit, refilled at the share).
 *
 * gpu-<uuid>.region: one per physical GPU: each slice on it publishes when it last launched
 * work, so a burst-share slice knows whether it is alone.
 *
 * The slice ledger's layout is read by enforcement/agent/slice_stats.py (memory per live
 * pid, busy_ns, oom_refusals, throttled_ns): keep the offsets below stable, or change both.
 * busy_ns is the device time measured for gated launches, i.e. for capped slices only.
 *
 * Version 2 added oom_refusals and throttled_ns in what was padding in version 1 (which
 * zero-filled it), so the layout is unchanged and both versions read the same; a reader
 * reports the two counters only from a version >= 2 ledger. They are updated with atomic
 * adds outside the lock (a refusal or a throttled launch only), and sit on their own cache
 * line, away from the lock and the bucket. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

#define LEDGER_MAGIC 0x3144454c55504751ULL /* "QGPULED1" */
#define REGION_MAGIC 0x3147455255504751ULL /* "QGPUREG1" */
#define LEDGER_VERSION 2
#define MAX_SLOTS 64
#define MAX_REGION 32
#define BUCKET_WINDOW_NS 100000000LL  /* credit saved up while idle: 100 ms of the share */
#define ACTIVE_WINDOW_NS 100000000LL  /* a slice that launched in the last 100 ms is active */
#define STALE_REGION_NS 60000000000LL /* region entries idle for 60 s may be reused */

typedef struct {
    int32_t pid;
    uint32_t flags;
    uint64_t start_time;
    uint64_t mem_used;
    uint64_t busy_ns;
    uint64_t launches;
    uint64_t reserved[3];
} ledger_slot_t;

typedef struct {
    uint64_t magic;       /* 0 */
    uint32_t version;     /* 8 */
    uint32_t max_slots;   /* 12 */
    uint64_t mem_limit;   /* 16: informational, the last attached process's cap */
    uint64_t mem_used;    /* 24 */
    int64_t tokens_ns;    /* 32 */
    int64_t refill_ns;    /* 40 */
    uint64_t busy_ns;     /* 48: measured device time of the slice */
    int64_t reserved0;    /* 56 */
    char lock_area[64];   /* 64 */
    char slice_id[72];    /* 128 */
    int32_t core;         /* 200 */
    int32_t policy;       /* 204 */
    uint64_t oom_refusals; /* 208: allocations refused at the cap (v2) */
    uint64_t throttled_ns; /* 216: time launches waited for compute credit (v2) */
    char pad[288];        /* 224 .. 512 */
    ledger_slot_t slots[MAX_SLOTS]; /* 512 */
} slice_ledger_t;

typedef struct {
    char slice_id[72];
    int64_t last_launch_ns;
    int32_t policy;
    int32_t core;
    int32_t pid;
    int32_t pad;
} region_entry_t;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t max_entries;
    char pad0[48];
    char lock_area[64]; /* 64 */
    region_entry_t entries[MAX_REGION]; /* 128 */
} gpu_region_t;

_Static_assert(sizeof(ledger_slot_t) == 64, "slot layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, slots) == 512, "ledger layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, oom_refusals) == 208, "ledger layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, throttled_ns) == 216, "ledger layout");

static slice_ledger_t *L;
static gpu_region_t *R;
static region_entry_t *my_entry;
static int my_pid;
static uint64_t my_start;
static ledger_slot_t *my_slot;

#define LLOCK() ledger_lock()
#define LUNLOCK() qgpu_unlock((pthread_mutex_t *)L->lock_area)

static void repair(void) {
    uint64_t used = 0;
    for (int i = 0; i < MAX_SLOTS; i++)
        if (L->slots[i].pid) used += L->slots[i].mem_used;
    L->mem_used = used;
}

static void ledger_lock(void) {
    if (qgpu_lock((pthread_mutex_t *)L->lock_area)) repair();
}

static int reclaim_dead(void) {
    int freed = 0;
    for (int i = 0; i < MAX_SLOTS; i++) {
        ledger_slot_t *s = &L->slots[i];
        if (!s->pid || qgpu_proc_alive(s->pid, s->start_time)) continue;
        L->mem_used = L->mem_used >= s->mem_used ? L->mem_used - s->mem_used : 0;
        memset(s, 0, sizeof *s);
        freed++;
    }
    return freed;
}

/* getpid() is a system call: cache it, and reset the cache in fork children. */
static int cached_pid;
static void forget_pid(void) { cached_pid = 0; }

static int current_pid(void) {
    int pid = __atomic_load_n(&cached_pid, __ATOMIC_RELAXED);
    if (!pid) {
        pid = getpid();
        __atomic_store_n(&cached_pid, pid, __ATOMIC_RELAXED);
    }
    return pid;
}

/* Locked. The slot of this process (re-found after fork). */
static ledger_slot_t *slot(void) {
    int pid = current_pid();
    if (my_slot && my_pid == pid && my_slot->pid == pid && my_slot->start_time == my_start)
        return my_slot;
    my_pid = pid;
    my_start = qgpu_proc_start_time(pid);
    ledger_slot_t *free_slot = NULL;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < MAX_SLOTS; i++) {
            ledger_slot_t *s = &L->slots[i];
            if (s->pid == pid && s->start_time == my_start) return my_slot = s;
            if (!s->pid && !free_slot) free_slot = s;
        }
        if (free_slot) break;
        reclaim_dead();
    }
    if (!free_slot) return my_slot = NULL;
    memset(free_slot, 0, sizeof *free_slot);
    free_slot->pid = pid;
    free_slot->start_time = my_start;
    return my_slot = free_slot;
}

int ledger_open(const hook_limits_t *lim, char *err, size_t errlen) {
    char path[1200];
    if (qgpu_mkdirs(lim->state_dir) != 0) {
        snprintf(err, errlen, "QGPU_STATE_DIR=%s: cannot create the directory", lim->state_dir);
        return -1;
    }
    pthread_atfork(NULL, NULL, forget_pid);
    snprintf(path, sizeof path, "%s/slice-%s.ledger", lim->state_dir, lim->slice_id);
    L = qgpu_map_state(path, sizeof(slice_ledger_t), LEDGER_MAGIC,
                       __builtin_offsetof(slice_ledger_t, lock_area), NULL, NULL);
    if (!L) {
        snprintf(err, errlen, "QGPU_STATE_DIR=%s: cannot map the slice ledger %s", lim->state_dir,
                 path);
        return -1;
    }
    LLOCK();
    L->version = LEDGER_VERSION;
    L->max_slots = MAX_SLOTS;
    L->mem_limit = lim->mem_limit;
    L->core = lim->core;
    L->policy = lim->policy;
    snprintf(L->slice_id, sizeof L->slice_id, "%s", lim->slice_id);
    reclaim_dead();
    ledger_slot_t *s = slot();
    LUNLOCK();
    if (!s) {
        snprintf(err, errlen, "QGPU_SLICE_ID=%s: the slice already has %d live processes (the "
                 "ledger's limit)", lim->slice_id, MAX_SLOTS);
        return -1;
    }
    return 0;
}

int ledger_region_open(const char *state_dir, const char *uuid, const hook_limits_t *lim) {
    char path[1200];
    snprintf(path, sizeof path, "%s/gpu-%s.region", state_dir, uuid);
    gpu_region_t *r = qgpu_map_state(path, sizeof(gpu_region_t), REGION_MAGIC,
                                     __builtin_offsetof(gpu_region_t, lock_area), NULL, NULL);
    if (!r) return -1;
    qgpu_lock((pthread_mutex_t *)r->lock_area);
    region_entry_t *mine = NULL, *free_e = NULL;
    int64_t now = qgpu_now_ns();
    for (int i = 0; i < MAX_REGION; i++) {
        region_entry_t *e = &r->entries[i];
        if (e->slice_id[0] && strcmp(e->slice_id, lim->slice_id) == 0) {
            mine = e;
            break;
        }
        if (!free_e && (!e->slice_id[0] || now - e->last_launch_ns > STALE_REGION_NS)) free_e = e;
    }
    if (!mine && free_e) {
        mine = free_e;
        memset(mine, 0, sizeof *mine);
        snprintf(mine->slice_id, sizeof mine->slice_id, "%s", lim->slice_id);
    }
    if (mine) {
        /* registered counts as active: a fresh entry is never mistaken for a stale one */
        __atomic_store_n(&mine->last_launch_ns, qgpu_now_coarse_ns(), __ATOMIC_RELAXED);
        mine->policy = lim->policy;
        mine->core = lim->core;
        mine->pid = getpid();
    }
    qgpu_unlock((pthread_mutex_t *)r->lock_area);
    if (!mine) return -1;
    __atomic_store_n(&my_entry, mine, __ATOMIC_RELEASE);
    R = r;
    return 0;
}

int ledger_reserve(uint64_t bytes) {
    LLOCK();
    if (L->mem_used + bytes > g_lim.mem_limit) {
        reclaim_dead();
        if (L->mem_used + bytes > g_lim.mem_limit) {
            LUNLOCK();
            __atomic_fetch_add(&L->oom_refusals, 1, __ATOMIC_RELAXED);
            return -1;
        }
    }
    ledger_slot_t *s = slot();
    if (!s) {
        LUNLOCK();
        return -1;
    }
    s->mem_used += bytes;
    L->mem_used += bytes;
    LUNLOCK();
    return 0;
}

void ledger_release(uint64_t bytes) {
    LLOCK();
    ledger_slot_t *s = slot();
    if (s) s->mem_used = s->mem_used >= bytes ? s->mem_used - bytes : 0;
    L->mem_used = L->mem_used >= bytes ? L->mem_used - bytes : 0;
    LUNLOCK();
}

uint64_t ledger_used(void) {
    LLOCK();
    reclaim_dead();
    uint64_t used = L->mem_used;
    LUNLOCK();
    return used;
}

void ledger_publish_activity(void) {
    region_entry_t *e = __atomic_load_n(&my_entry, __ATOMIC_ACQUIRE);
    if (!e) return;
    int64_t now = qgpu_now_coarse_ns();
    if (__atomic_load_n(&e->last_launch_ns, __ATOMIC_RELAXED) != now)
        __atomic_store_n(&e->last_launch_ns, now, __ATOMIC_RELAXED);
}

static int others_active(int64_t now) {
    if (!R) return 1; /* unknown GPU: assume contention (never over the share) */
    for (int i = 0; i < MAX_REGION; i++) {
        region_entry_t *e = &R->entries[i];
        if (!e->slice_id[0] || strncmp(e->slice_id, g_lim.slice_id, sizeof e->slice_id) == 0)
            continue;
        if (now - __atomic_load_n(&e->last_launch_ns, __ATOMIC_RELAXED) < ACTIVE_WINDOW_NS)
            return 1;
    }
    return 0;
}

int64_t ledger_compute_avail(int64_t now, int64_t inflight_ns, int *alone) {
    int64_t cap = BUCKET_WINDOW_NS * g_lim.core / 100;
    *alone = g_lim.policy == POLICY_BURST_SHARE && !others_active(now);
    LLOCK();
    if (L->refill_ns == 0 || now - L->refill_ns > 10 * BUCKET_WINDOW_NS) {
        /* first use, or a long idle period: start from a full bucket */
        if (L->refill_ns == 0) L->tokens_ns = 0;
        else L->tokens_ns = cap;
        L->refill_ns = now;
    } else if (now > L->refill_ns) {
        L->tokens_ns += (now - L->refill_ns) * g_lim.core / 100;
        L->refill_ns = now;
        if (L->tokens_ns > cap) L->tokens_ns = cap;
    }
    if (*alone && L->tokens_ns < 0) L->tokens_ns = 0; /* bursting is not a debt */
    int64_t avail = L->tokens_ns - inflight_ns;
    LUNLOCK();
    return avail;
}

void ledger_add_throttled(int64_t held_ns) {
    if (held_ns > 0) __atomic_fetch_add(&L->throttled_ns, (uint64_t)held_ns, __ATOMIC_RELAXED);
}

void ledger_debit(int64_t busy_ns) {
    LLOCK();
    L->tokens_ns -= busy_ns;
    L->busy_ns += (uint64_t)busy_ns;
    ledger_slot_t *s = slot();
    if (s) {
        s->busy_ns += (uint64_t)busy_ns;
        s->launches++;
    }
    LUNLOCK();
}
