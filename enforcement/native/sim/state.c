/* Shared per-GPU state of the simulator: memory, timeline, per-process slots. */
#include <string.h>
#include <unistd.h>

#include "sim.h"

static void init_state(void *base, void *arg) {
    sim_gpu_state_t *st = base;
    const sim_gpu_config_t *gpu = arg;
    st->version = SIM_STATE_VERSION;
    st->max_procs = SIM_MAX_PROCS;
    st->mem_total = gpu->memory;
    st->created_ns = qgpu_now_ns();
}

sim_gpu_state_t *sim_state_open(const sim_gpu_config_t *gpu) {
    sim_gpu_state_t *st =
        qgpu_map_state(gpu->state_path, sizeof(sim_gpu_state_t), SIM_STATE_MAGIC,
                       __builtin_offsetof(sim_gpu_state_t, lock_area), init_state, (void *)gpu);
    if (st) st->mem_total = gpu->memory; /* the config is authoritative for the card size */
    return st;
}

static void repair(sim_gpu_state_t *st) {
    uint64_t used = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (st->procs[i].pid) used += st->procs[i].mem_used;
    st->mem_used = used;
}

void sim_state_lock(sim_gpu_state_t *st) {
    if (qgpu_lock(SIM_LOCK(st))) repair(st);
}

void sim_state_unlock(sim_gpu_state_t *st) { qgpu_unlock(SIM_LOCK(st)); }

int sim_state_reclaim_dead(sim_gpu_state_t *st) {
    int freed = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        sim_proc_t *p = &st->procs[i];
        if (!p->pid || qgpu_proc_alive(p->pid, p->start_time)) continue;
        /* the driver frees a dead process's memory with its context */
        st->mem_used = st->mem_used >= p->mem_used ? st->mem_used - p->mem_used : 0;
        memset(p, 0, sizeof *p);
        freed++;
    }
    return freed;
}

static __thread int cached_pid;
static __thread uint64_t cached_start;

sim_proc_t *sim_state_proc_slot(sim_gpu_state_t *st, int create) {
    int pid = getpid();
    if (cached_pid != pid) {
        cached_pid = pid;
        cached_start = qgpu_proc_start_time(pid);
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
    return free_slot;
}

uint64_t sim_state_busy_completed(const sim_gpu_state_t *st, int64_t now) {
    int64_t ahead = st->tail_ns - now;
    if (ahead < 0) ahead = 0;
    return st->busy_total_ns >= (uint64_t)ahead ? st->busy_total_ns - (uint64_t)ahead : 0;
}

void sim_state_snapshot(sim_gpu_state_t *st, int64_t now) {
    uint32_t h = st->snap_head % SIM_SNAPSHOTS;
    if (st->snap_t[h] && now - st->snap_t[h] < 100000000LL) return; /* one per 100 ms */
    uint32_t n = (h + 1) % SIM_SNAPSHOTS;
    st->snap_t[n] = now;
    st->snap_busy[n] = sim_state_busy_completed(st, now);
    st->snap_head = n;
}

unsigned sim_state_utilization(sim_gpu_state_t *st, int64_t now) {
    sim_state_snapshot(st, now);
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
    uint64_t busy = sim_state_busy_completed(st, now) - best_busy;
    unsigned pct = (unsigned)((busy * 100 + span / 2) / span);
    return pct > 100 ? 100 : pct;
}
