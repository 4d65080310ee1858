/* Shared per-GPU state of the simulator: memory, the device model (fifo or time-sliced),
 * per-process slots and utilisation samples. Everything here runs under the GPU's lock. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "sim.h"

#define QUEUE_GUARD 10000000 /* scheduling steps per advance: a corrupted file cannot hang us */

typedef struct {
    const sim_gpu_config_t *gpu;
    const sim_config_t *cfg;
} init_arg_t;

static void init_state(void *base, void *arg) {
    sim_gpu_state_t *st = base;
    const init_arg_t *a = arg;
    st->version = SIM_STATE_VERSION;
    st->max_procs = SIM_MAX_PROCS;
    st->mem_total = a->gpu->memory;
    st->created_ns = qgpu_now_ns();
    st->scheduler = (uint32_t)a->cfg->scheduler;
    st->slice_ns = a->cfg->timeslice_ns;
    st->ts_cur = -1;
    st->acct_mode = a->cfg->accounting ? 1 : 0; /* then nvmlDeviceSetAccountingMode's (root) */
}

sim_gpu_state_t *sim_state_open(const sim_gpu_config_t *gpu, const sim_config_t *cfg) {
    init_arg_t arg = {gpu, cfg};
    sim_gpu_state_t *st =
        qgpu_map_state(gpu->state_path, sizeof(sim_gpu_state_t), SIM_STATE_MAGIC,
                       __builtin_offsetof(sim_gpu_state_t, lock_area), init_state, &arg);
    if (st) {
        st->mem_total = gpu->memory; /* the config is authoritative for the card size */
        sim_state_lock(st);
        snprintf(st->state_path, sizeof st->state_path, "%s", gpu->state_path);
        sim_state_unlock(st);
    }
    return st;
}

static void repair(sim_gpu_state_t *st) {
    uint64_t used = st->unowned;
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (st->procs[i].pid) used += st->procs[i].mem_used;
    st->mem_used = used;
}

void sim_state_lock(sim_gpu_state_t *st) {
    if (qgpu_lock(SIM_LOCK(st))) repair(st);
}

void sim_state_unlock(sim_gpu_state_t *st) { qgpu_unlock(SIM_LOCK(st)); }

void sim_state_drop_slot(sim_gpu_state_t *st, int i) {
    sim_proc_t *p = &st->procs[i];
    sim_acct_end(st, p, qgpu_now_ns()); /* before the shared memory moves off it */
    sim_shared_forget_slot(st, i); /* what others still hold moves off this slot first */
    st->mem_used = st->mem_used >= p->mem_used ? st->mem_used - p->mem_used : 0;
    if (st->ts_cur == i) st->ts_cur = -1;
    memset(p, 0, sizeof *p);
    sim_shared_settle(st);
}

int sim_state_reclaim_dead(sim_gpu_state_t *st) {
    int freed = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &st->procs[i];
        if (!p->pid || qgpu_proc_alive(p->pid, p->start_time)) continue;
        /* the driver frees a dead process's memory and work with its contexts */
        sim_state_drop_slot(st, i);
        freed++;
    }
    sim_shared_settle(st); /* memory kept only by descriptors goes when the last one closes */
    return freed;
}

/* This process's identity, cached process-wide (no thread-local storage: see ctx.c); a
 * forked child sees another pid and looks its own start time up. */
static int cached_pid;
static uint64_t cached_start;

sim_proc_t *sim_state_proc_slot(sim_gpu_state_t *st, int create) {
    int pid = getpid();
    if (__atomic_load_n(&cached_pid, __ATOMIC_ACQUIRE) != pid) {
        __atomic_store_n(&cached_start, qgpu_proc_start_time(pid), __ATOMIC_RELAXED);
        __atomic_store_n(&cached_pid, pid, __ATOMIC_RELEASE);
    }
    sim_proc_t *free_slot = NULL;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &st->procs[i];
        if (p->pid == pid && p->start_time == cached_start) return p;
        if (!p->pid && !free_slot) free_slot = p;
    }
    if (!create) return NULL;
    if (!free_slot) {
        sim_state_reclaim_dead(st);
        for (int i = 0; i < SIM_MAX_PROCS && !free_slot; i++)
            if (!st->procs[i].pid) free_slot = &st->procs[i];
        if (!free_slot) return NULL;
    }
    memset(free_slot, 0, sizeof *free_slot);
    free_slot->pid = pid;
    free_slot->start_time = cached_start;
    sim_acct_begin(st, free_slot);
    return free_slot;
}

static int fits(const sim_gpu_state_t *st, uint64_t bytes) {
    return bytes <= st->mem_total && st->mem_used <= st->mem_total - bytes;
}

/* NVIDIA's physical allocator serves the driver's own allocations (cuMemAlloc, VMM, pools,
 * contexts, modules: everything but managed memory) by evicting managed memory to the host
 * when the GPU is full: the Unified Memory driver registers eviction callbacks with it "to
 * successfully allocate memory from the user memory pool allocated by UVM" (its source). So
 * managed memory on a GPU keeps nobody from the GPU's memory. Evicted here in whole 2 MiB
 * blocks, the largest holder first; its process moves its blocks' record to the host when it
 * next touches its managed memory (managed.c). */
#define EVICT_BLOCK (2ULL << 20)

int sim_state_make_room(sim_gpu_state_t *st, uint64_t bytes) {
    if (fits(st, bytes)) return 1;
    sim_state_reclaim_dead(st);
    while (!fits(st, bytes) && bytes <= st->mem_total) {
        sim_proc_t *most = NULL;
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            sim_proc_t *p = &st->procs[i];
            if (p->pid && p->managed_bytes && (!most || p->managed_bytes > most->managed_bytes))
                most = p;
        }
        if (!most) return 0;
        uint64_t short_by = st->mem_used - (st->mem_total - bytes);
        uint64_t n = (short_by + EVICT_BLOCK - 1) / EVICT_BLOCK * EVICT_BLOCK;
        if (n > most->managed_bytes) n = most->managed_bytes;
        most->managed_bytes -= n;
        most->mem_used = most->mem_used >= n ? most->mem_used - n : 0;
        most->evicted_bytes += n;
        st->mem_used = st->mem_used >= n ? st->mem_used - n : 0;
    }
    return fits(st, bytes);
}

static CUresult charge(sim_gpu_state_t *st, uint64_t bytes, int managed) {
    if (managed ? !fits(st, bytes) && (sim_state_reclaim_dead(st), !fits(st, bytes))
                : !sim_state_make_room(st, bytes))
        return CUDA_ERROR_OUT_OF_MEMORY;
    sim_proc_t *p = sim_state_proc_slot(st, 1);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    st->mem_used += bytes;
    p->mem_used += bytes;
    if (managed) p->managed_bytes += bytes;
    sim_acct_memory(st, p);
    return CUDA_SUCCESS;
}

static void uncharge(sim_gpu_state_t *st, uint64_t bytes, int managed) {
    sim_proc_t *p = sim_state_proc_slot(st, 0);
    st->mem_used = st->mem_used >= bytes ? st->mem_used - bytes : 0;
    if (!p) return;
    p->mem_used = p->mem_used >= bytes ? p->mem_used - bytes : 0;
    if (managed) p->managed_bytes = p->managed_bytes >= bytes ? p->managed_bytes - bytes : 0;
}

CUresult sim_state_charge(sim_gpu_state_t *st, uint64_t bytes) { return charge(st, bytes, 0); }
void sim_state_uncharge(sim_gpu_state_t *st, uint64_t bytes) { uncharge(st, bytes, 0); }
CUresult sim_state_charge_managed(sim_gpu_state_t *st, uint64_t bytes) { return charge(st, bytes, 1); }
void sim_state_uncharge_managed(sim_gpu_state_t *st, uint64_t bytes) { uncharge(st, bytes, 1); }

uint64_t sim_state_take_evicted(sim_gpu_state_t *st) {
    sim_proc_t *p = sim_state_proc_slot(st, 0);
    if (!p) return 0;
    uint64_t n = p->evicted_bytes;
    p->evicted_bytes = 0;
    return n;
}

uint64_t sim_proc_listed_memory(const sim_proc_t *p) {
    return p->mem_used >= p->managed_bytes ? p->mem_used - p->managed_bytes : 0;
}

/* ---- fifo: done = submitted minus what is still ahead on the timeline ---- */

static void fifo_advance(sim_gpu_state_t *st, int64_t now) {
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &st->procs[i];
        if (!p->pid) continue;
        uint64_t pending = 0;
        for (int k = 0; k < SIM_PROC_RING; k++) {
            int64_t s = p->ring_start[k], e = p->ring_end[k];
            if (e > now) pending += (uint64_t)(e - (s > now ? s : now));
        }
        uint64_t done = p->busy_ns >= pending ? p->busy_ns - pending : 0;
        if (done > p->done_ns) p->done_ns = done;
    }
    int64_t ahead = st->tail_ns > now ? st->tail_ns - now : 0;
    uint64_t done = st->busy_total_ns >= (uint64_t)ahead ? st->busy_total_ns - (uint64_t)ahead : 0;
    if (done > st->done_total_ns) st->done_total_ns = done;
}

/* ---- time-sliced ---- */

static int ts_pending(const sim_proc_t *p) {
    return p->pid && (p->busy_ns > p->done_ns || p->mk_done < p->mk_next);
}

/* Markers already reached by the queue complete when the process holds the device. */
static void ts_complete(sim_proc_t *p, int64_t t) {
    while (p->mk_done < p->mk_next) {
        uint32_t i = (uint32_t)(p->mk_done % SIM_MARKERS);
        if (p->mk_pos[i] > p->done_ns) break;
        p->mk_ts[i] = t;
        p->mk_done++;
    }
}

static int ts_next(const sim_gpu_state_t *st, int cur) {
    int base = cur < 0 ? SIM_MAX_PROCS - 1 : cur;
    for (int k = 1; k <= SIM_MAX_PROCS; k++) {
        int i = (base + k) % SIM_MAX_PROCS;
        if (ts_pending(&st->procs[i])) return i;
    }
    return -1;
}

/* The device time-slices between contexts, as NVIDIA's does (each context is its own
 * channel group): a process whose queue holds the work of k contexts gets k slices in a row,
 * one per context, before the next process. (Its contexts' work still runs in the order it
 * was submitted: the model keeps one queue per process.) */
static int64_t ts_slice_of(const sim_proc_t *p, int64_t slice) {
    int k = 0;
    for (int i = 0; i < SIM_CTX_QUEUES; i++)
        if (p->ctx_end[i] > p->done_ns) k++;
    return slice * (k > 1 ? k : 1);
}

static void ts_advance(sim_gpu_state_t *st, int64_t now) {
    int64_t slice = st->slice_ns > 0 ? st->slice_ns : 2000000;
    if (st->ts_time <= 0) st->ts_time = now;
    if (st->ts_cur >= SIM_MAX_PROCS) st->ts_cur = -1;
    for (long guard = 0; guard < QUEUE_GUARD; guard++) {
        int c = st->ts_cur;
        sim_proc_t *p = c >= 0 ? &st->procs[c] : NULL;
        int expired = p && st->ts_time - st->ts_slice_start >= ts_slice_of(p, slice);
        if (!p || !ts_pending(p) || expired) {
            int n = ts_next(st, c);
            if (n < 0) {
                st->ts_cur = -1;
                if (st->ts_time < now) st->ts_time = now;
                return;
            }
            st->ts_cur = n;
            st->ts_slice_start = st->ts_time;
            p = &st->procs[n];
            ts_complete(p, st->ts_time);
            if (!ts_pending(p)) continue; /* it only had markers to pass: yields */
        }
        if (st->ts_time >= now) return;
        uint64_t pend = p->busy_ns - p->done_ns;
        int64_t left = ts_slice_of(p, slice) - (st->ts_time - st->ts_slice_start);
        int64_t dt = now - st->ts_time;
        if ((uint64_t)dt > pend) dt = (int64_t)pend;
        if (dt > left) dt = left;
        uint64_t target = p->done_ns + (uint64_t)dt;
        while (p->mk_done < p->mk_next) {
            uint32_t i = (uint32_t)(p->mk_done % SIM_MARKERS);
            uint64_t pos = p->mk_pos[i];
            if (pos > target) break;
            p->mk_ts[i] = st->ts_time + (pos > p->done_ns ? (int64_t)(pos - p->done_ns) : 0);
            p->mk_done++;
        }
        p->done_ns = target;
        st->done_total_ns += (uint64_t)dt;
        st->ts_time += dt;
    }
}

/* Per-process (time, done) samples every 100 ms, for NVML's per-process utilisation. */
static void usnap(sim_gpu_state_t *st, int64_t now) {
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &st->procs[i];
        if (!p->pid) continue;
        uint32_t h = p->usnap_head % SIM_USNAPS;
        if (p->usnap_t[h] && now - p->usnap_t[h] < SIM_USNAP_NS) continue;
        uint32_t n = p->usnap_t[h] ? (h + 1) % SIM_USNAPS : h;
        p->usnap_t[n] = now;
        p->usnap_done[n] = p->done_ns;
        p->usnap_head = n;
    }
}

static void snapshot(sim_gpu_state_t *st, int64_t now) {
    uint32_t h = st->snap_head % SIM_SNAPSHOTS;
    if (st->snap_t[h] && now - st->snap_t[h] < 100000000LL) return; /* one per 100 ms */
    uint32_t n = (h + 1) % SIM_SNAPSHOTS;
    st->snap_t[n] = now;
    st->snap_busy[n] = st->done_total_ns;
    st->snap_head = n;
}

void sim_state_advance(sim_gpu_state_t *st, int64_t now) {
    if (st->scheduler == SIM_SCHED_TIMESLICED)
        ts_advance(st, now);
    else
        fifo_advance(st, now);
    usnap(st, now);
    snapshot(st, now);
}

unsigned sim_state_utilization(sim_gpu_state_t *st, int64_t now) {
    sim_state_advance(st, now);
    /* compare with the sample whose age is closest to 1 s (NVML's sampling period) */
    int64_t best_t = 0, best_d = 0;
    uint64_t best_busy = 0;
    for (int i = 0; i < SIM_SNAPSHOTS; i++) {
        int64_t t = st->snap_t[i], age = now - t;
        if (!t || age < 50000000LL) continue;
        int64_t d = age > 1000000000LL ? age - 1000000000LL : 1000000000LL - age;
        if (!best_t || d < best_d) {
            best_t = t;
            best_d = d;
            best_busy = st->snap_busy[i];
        }
    }
    if (!best_t) return 0;
    uint64_t span = (uint64_t)(now - best_t);
    uint64_t busy = st->done_total_ns - best_busy;
    unsigned pct = (unsigned)((busy * 100 + span / 2) / span);
    return pct > 100 ? 100 : pct;
}

/* Simulator extension (not a CUDA entry point), exported by both simulated libraries: bring
 * an existing GPU state file up to now, so a reader of the file (enforcement/sim.py) sees the
 * device model's current numbers. 0 on success, -1 when the file is not a GPU state file. */
QGPU_EXPORT int qgpuSimAdvance(const char *state_path) {
    if (!state_path) return -1;
    sim_gpu_state_t *st = qgpu_map_existing(state_path, sizeof(sim_gpu_state_t), SIM_STATE_MAGIC);
    if (!st) return -1;
    sim_state_lock(st);
    sim_state_reclaim_dead(st);
    sim_state_advance(st, qgpu_now_ns());
    sim_state_unlock(st);
    qgpu_unmap_state(st, sizeof(sim_gpu_state_t));
    return 0;
}
