/* Simulated CUDA driver: shared declarations.
 *
 * The simulated GPUs come from the file named by QGPU_SIM_CONFIG (written by
 * enforcement/sim.py). Each GPU has a state file (sim_gpu_state_t, mmap'd, shared by every
 * process using that GPU) holding its memory accounting, its device timeline and a slot
 * per process. The layout is read by enforcement/sim.py: keep the offsets in sync. */
#ifndef QGPU_SIM_H
#define QGPU_SIM_H

#include <pthread.h>
#include <stdint.h>

#include "../common/qgpu_common.h"
#include "../include/qgpu_cuda.h"

#define SIM_MAX_GPUS 64
#define SIM_MAX_PROCS 64
#define SIM_SNAPSHOTS 16
#define SIM_STATE_MAGIC 0x324d495355504751ULL /* "QGPUSIM2" little endian */
#define SIM_STATE_VERSION 2

typedef struct {
    char uuid[48];
    char name[96];
    uint64_t memory;
    int sms;
    int cc_major, cc_minor;
    int pci_bus;
    char state_path[4096];
} sim_gpu_config_t;

typedef struct {
    int ngpus;
    char node[128];
    char driver_version[64];
    int cuda_version;
    sim_gpu_config_t gpus[SIM_MAX_GPUS];
} sim_config_t;

#define SIM_PROC_RING 32

typedef struct {
    int32_t pid;        /* 0 = free */
    uint32_t ring_head;  /* next ring slot */
    uint64_t start_time; /* /proc/<pid>/stat field 22 */
    uint64_t mem_used;   /* bytes */
    uint64_t busy_ns;    /* device time of this process's work (scheduled) */
    int64_t last_end_ns; /* end of its last op on the timeline */
    uint64_t launches;
    uint64_t reserved[2];
    /* its last SIM_PROC_RING ops on the timeline: work not finished at time t is
     * sum(max(0, end - max(start, t))), so "busy up to t" is exact */
    int64_t ring_start[SIM_PROC_RING];
    int64_t ring_end[SIM_PROC_RING];
} sim_proc_t; /* 576 bytes */

typedef struct {
    uint64_t magic;          /* 0 */
    uint32_t version;        /* 8 */
    uint32_t max_procs;      /* 12 */
    uint64_t mem_total;      /* 16 */
    uint64_t mem_used;       /* 24 */
    int64_t tail_ns;         /* 32: end of the last op queued on the device */
    uint64_t busy_total_ns;  /* 40: device time of all ops ever queued */
    uint64_t launches;       /* 48 */
    int64_t created_ns;      /* 56 */
    char lock_area[64];      /* 64: pthread_mutex_t */
    int64_t snap_t[SIM_SNAPSHOTS];     /* 128: (time, busy completed) samples for NVML */
    uint64_t snap_busy[SIM_SNAPSHOTS]; /* 256 */
    uint32_t snap_head;      /* 384 */
    uint32_t pad0;
    char pad[120];           /* 392 .. 512 */
    sim_proc_t procs[SIM_MAX_PROCS]; /* 512 */
} sim_gpu_state_t;

_Static_assert(sizeof(sim_proc_t) == 576, "sim_proc_t layout");
_Static_assert(sizeof(pthread_mutex_t) <= 64, "mutex fits");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, procs) == 512, "procs offset");

#define SIM_LOCK(st) ((pthread_mutex_t *)(st)->lock_area)

/* config.c */
QGPU_HIDDEN int sim_config_load(const char *path, sim_config_t *cfg, char *err, size_t errlen);

/* state.c */
QGPU_HIDDEN sim_gpu_state_t *sim_state_open(const sim_gpu_config_t *gpu);
QGPU_HIDDEN void sim_state_lock(sim_gpu_state_t *st);
QGPU_HIDDEN void sim_state_unlock(sim_gpu_state_t *st);
QGPU_HIDDEN int sim_state_reclaim_dead(sim_gpu_state_t *st); /* locked; returns slots freed */
QGPU_HIDDEN sim_proc_t *sim_state_proc_slot(sim_gpu_state_t *st, int create); /* locked */
QGPU_HIDDEN uint64_t sim_state_busy_completed(const sim_gpu_state_t *st, int64_t now);
QGPU_HIDDEN void sim_state_snapshot(sim_gpu_state_t *st, int64_t now);               /* locked */
QGPU_HIDDEN unsigned sim_state_utilization(sim_gpu_state_t *st, int64_t now);         /* locked */

#endif
