/* Shared ledgers in QGPU_STATE_DIR.
 *
 * <id>/ledger/slice-<id>.ledger: one per slice, shared by all its processes: memory charged
 * per process slot (slots of dead processes are reclaimed: pid + start time, so kill -9 and pid reuse
 * are handled) and the compute token bucket (device-ns of credit, refilled at the share).
 *
 * (What the slices of one GPU share is roster.c and region.c.)
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
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

#define LEDGER_MAGIC 0x3144454c55504751ULL /* "QGPULED1" */
#define LEDGER_VERSION 2
#define MAX_SLOTS 64
#define BUCKET_WINDOW_NS 100000000LL  /* credit saved up while idle: 100 ms of the share */

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

_Static_assert(sizeof(ledger_slot_t) == 64, "slot layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, slots) == 512, "ledger layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, oom_refusals) == 208, "ledger layout");
_Static_assert(__builtin_offsetof(slice_ledger_t, throttled_ns) == 216, "ledger layout");

static slice_ledger_t *L;
static int my_pid;
static uint64_t my_start;
static ledger_slot_t *my_slot;

#define LLOCK() ledger_lock()
#define LUNLOCK() qgpu_unlock((pthread_mutex_t *)L->lock_area)

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* the slice total is the sum of the slots (saturating: slots are in a shared file) */
static void repair(void) {
    uint64_t used = 0;
    for (int i = 0; i < MAX_SLOTS; i++)
        if (L->slots[i].pid) used = add_sat(used, L->slots[i].mem_used);
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
        memset(s, 0, sizeof *s);
        freed++;
    }
    if (freed) repair(); /* the total is the sum of the live slots */
    return freed;
}

/* What this process holds, counted in its own memory (under the ledger lock): a second
 * check that a tampered ledger cannot reset (the file is shared and writable by the slice's
 * processes; a process can also replace its own mapping of it). A fork child holds nothing. */
static uint64_t local_used;
static int warned_release;

/* getpid() is a system call: cache it, and reset the cache in fork children. */
static int cached_pid;
static void forget_pid(void) {
    cached_pid = 0;
    local_used = 0;
}

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

/* <QGPU_STATE_DIR>/<slice>/ledger/slice-<slice>.ledger: the node agent (or the device
 * plugin) creates the slice's directories and its ledger owned by the slice's uid, mode
 * 0700/0600; created here (no agent), they are private to this uid as well. */
int ledger_open(const hook_limits_t *lim, char *err, size_t errlen) {
    char dir[1200], path[1400];
    snprintf(dir, sizeof dir, "%s/%s/ledger", lim->state_dir, lim->slice_id);
    if (qgpu_mkdirs_mode(dir, 0700) != 0) {
        snprintf(err, errlen, "QGPU_STATE_DIR=%s: cannot create the slice's directory %s (%s)",
                 lim->state_dir, dir, strerror(errno));
        return -1;
    }
    pthread_atfork(NULL, NULL, forget_pid);
    snprintf(path, sizeof path, "%s/slice-%s.ledger", dir, lim->slice_id);
    L = qgpu_map_state_mode(path, sizeof(slice_ledger_t), LEDGER_MAGIC,
                            __builtin_offsetof(slice_ledger_t, lock_area), NULL, NULL, 0600);
    if (!L) {
        snprintf(err, errlen, "QGPU_STATE_DIR=%s: cannot map the slice ledger %s (%s)",
                 lim->state_dir, path, strerror(errno));
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

static int fits(uint64_t bytes) {
    uint64_t lim = g_lim.mem_limit; /* never `used + bytes`: it can wrap */
    return bytes <= lim && L->mem_used <= lim - bytes && local_used <= lim - bytes;
}

int ledger_reserve(uint64_t bytes) {
    if (bytes == 0) return 0;
    LLOCK();
    if (!fits(bytes)) {
        reclaim_dead();
        if (!fits(bytes)) {
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
    local_used += bytes;
    LUNLOCK();
    return 0;
}

void ledger_force(uint64_t bytes) {
    if (bytes == 0) return;
    LLOCK();
    ledger_slot_t *s = slot();
    if (s) s->mem_used = add_sat(s->mem_used, bytes);
    L->mem_used = add_sat(L->mem_used, bytes);
    local_used = add_sat(local_used, bytes);
    LUNLOCK();
}

int ledger_has_pid(int pid) {
    int found = 0;
    LLOCK();
    for (int i = 0; i < MAX_SLOTS && !found; i++) {
        ledger_slot_t *s = &L->slots[i];
        found = s->pid == pid && qgpu_proc_alive(s->pid, s->start_time);
    }
    LUNLOCK();
    return found;
}

/* A process gives back only what it holds: what its slot says (never another process's
 * charge, so a fork child freeing its parent's pointers or a release after tampering cannot
 * lower the slice's count below what the others hold), and the slice total by the same
 * amount. Giving back more than this process holds means the books were tampered with or
 * are wrong: said once on stderr, never wrapped. */
void ledger_release(uint64_t bytes) {
    if (bytes == 0) return;
    LLOCK();
    ledger_slot_t *s = slot();
    uint64_t give = s ? (s->mem_used < bytes ? s->mem_used : bytes) : 0;
    if (s) s->mem_used -= give;
    if (L->mem_used >= give)
        L->mem_used -= give;
    else
        repair(); /* the total was lowered behind our back: re-sum the slots */
    int over = bytes > local_used;
    local_used = over ? 0 : local_used - bytes;
    LUNLOCK();
    if (over && !__atomic_exchange_n(&warned_release, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "qgpu: slice %s: released %llu bytes more than this process held; the "
                        "excess is ignored\n", g_lim.slice_id, (unsigned long long)bytes);
}

uint64_t ledger_used(void) {
    LLOCK();
    reclaim_dead();
    uint64_t used = L->mem_used;
    LUNLOCK();
    return used;
}

int64_t ledger_compute_avail(int64_t now, int64_t inflight_ns, int share, int alone) {
    int64_t cap = BUCKET_WINDOW_NS * share / 100;
    LLOCK();
    if (L->refill_ns == 0 || now - L->refill_ns > 10 * BUCKET_WINDOW_NS) {
        /* first use, or a long idle period: start from a full bucket */
        if (L->refill_ns == 0) L->tokens_ns = 0;
        else L->tokens_ns = cap;
        L->refill_ns = now;
    } else if (now > L->refill_ns) {
        L->tokens_ns += (now - L->refill_ns) * share / 100;
        L->refill_ns = now;
        if (L->tokens_ns > cap) L->tokens_ns = cap;
    }
    if (alone && L->tokens_ns < 0) L->tokens_ns = 0; /* bursting is not a debt */
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
