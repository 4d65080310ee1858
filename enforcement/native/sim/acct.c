/* NVML accounting mode on a simulated GPU: a record per process that took a slot while the
 * mode was on (what nvmlDeviceGetAccountingPids / nvmlDeviceGetAccountingStats report),
 * kept after the process ends in a ring of SIM_ACCT_RECORDS, newest overwriting oldest (as
 * NVML's circular buffer). Everything here runs under the GPU's lock. */
#include <string.h>
#include <time.h>

#include "sim.h"

static uint64_t epoch_us(void) {
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    return (uint64_t)rt.tv_sec * 1000000u + (uint64_t)rt.tv_nsec / 1000u;
}

void sim_acct_begin(sim_gpu_state_t *st, const sim_proc_t *p) {
    if (!st->acct_mode) return;
    sim_acct_t *a = &st->acct[st->acct_next % SIM_ACCT_RECORDS];
    memset(a, 0, sizeof *a);
    a->pid = p->pid;
    a->running = 1;
    a->proc_start = p->start_time;
    a->start_ns = qgpu_now_ns();
    a->start_us = epoch_us();
    a->max_mem = sim_proc_listed_memory(p);
    st->acct_next++;
}

sim_acct_t *sim_acct_running(sim_gpu_state_t *st, const sim_proc_t *p) {
    for (int i = 0; i < SIM_ACCT_RECORDS; i++) {
        sim_acct_t *a = &st->acct[i];
        if (a->running && a->pid == p->pid && a->proc_start == p->start_time) return a;
    }
    return NULL;
}

void sim_acct_memory(sim_gpu_state_t *st, const sim_proc_t *p) {
    if (!st->acct_mode) return;
    sim_acct_t *a = sim_acct_running(st, p);
    if (a && p->mem_used > a->max_mem) a->max_mem = sim_proc_listed_memory(p);
}

void sim_acct_end(sim_gpu_state_t *st, const sim_proc_t *p, int64_t now) {
    sim_acct_t *a = sim_acct_running(st, p);
    if (!a) return;
    a->running = 0;
    a->end_ns = now;
    a->done_ns = p->done_ns;
}

void sim_acct_clear(sim_gpu_state_t *st, int all) {
    for (int i = 0; i < SIM_ACCT_RECORDS; i++)
        if (all || !st->acct[i].running) memset(&st->acct[i], 0, sizeof st->acct[i]);
}
