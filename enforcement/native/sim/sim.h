/* Simulated CUDA driver: shared declarations.
 *
 * The simulated GPUs come from the file named by QGPU_SIM_CONFIG (written by
 * enforcement/sim.py). Each GPU has a state file (sim_gpu_state_t, mmap'd, shared by every
 * process using that GPU) holding its memory accounting, its device timeline and a slot
 * per process. The layout is read by enforcement/sim.py: keep the offsets in sync.
 *
 * Two device models (config key `scheduler`):
 *  - fifo: one hardware queue; every op is placed at max(now, tail) in submission order
 *    across processes.
 *  - timesliced (the default, what a real GPU does between processes): each process has its
 *    own queue, run in stream order; the device runs one process at a time for a time slice
 *    (`timeslice_us`) and then switches round-robin to the next process with work; a process
 *    whose queue empties yields at once. A kernel longer than the slice is preempted and
 *    resumed in the process's next slice. An event recorded by a process completes when that
 *    process's queue reaches it while it holds the device, so a pair of events around a
 *    preempted kernel spans the other processes' slices, as on real hardware. */
#ifndef QGPU_SIM_H
#define QGPU_SIM_H

#include <pthread.h>
#include <stdint.h>

#include "../common/qgpu_common.h"
#include "../include/qgpu_cuda.h"

#define SIM_MAX_GPUS 64
#define SIM_MAX_PROCS 64
#define SIM_SNAPSHOTS 16
#define SIM_STATE_MAGIC 0x364d495355504751ULL /* "QGPUSIM6" little endian */
#define SIM_STATE_VERSION 7
#define SIM_PROC_RING 32
#define SIM_MARKERS 512 /* outstanding event/free markers per process (timesliced model) */
#define SIM_USNAPS 8     /* per-process utilisation samples (NVML) */
#define SIM_CTX_QUEUES 16 /* contexts per process told apart by the timesliced scheduler */
#define SIM_USNAP_NS 100000000LL
#define SIM_ACCT_RECORDS 128 /* NVML accounting: processes remembered per GPU */
#define SIM_BAR1_PER_CONTEXT (2ULL << 20) /* BAR1 a context maps (NVML's bar1Used) */

enum { SIM_SCHED_FIFO = 0, SIM_SCHED_TIMESLICED = 1 };
enum { SIM_PROCADDR_INTERNAL = 0, SIM_PROCADDR_EXPORTED = 1 };

typedef struct {
    char uuid[48];
    char name[96];
    uint64_t memory;
    uint64_t context_memory; /* device memory a regular or primary context costs */
    int context_memory_set;
    uint64_t green_context_memory; /* what a green context costs beyond its primary context */
    int green_context_memory_set;
    /* device runtime reservations (cuCtxSetLimit): per pending launch above the default
     * 2048, and per resident thread per sync-depth level above the default 2 */
    uint64_t devrt_launch_bytes;
    uint64_t devrt_sync_thread_bytes;
    int devrt_launch_set, devrt_sync_set;
    int sms;
    int threads_per_sm;
    int cc_major, cc_minor;
    int pci_bus;
    uint64_t bar1; /* BAR1 aperture, bytes (NVML) */
    char state_path[4096];
} sim_gpu_config_t;

typedef struct {
    int ngpus;
    char node[128];
    char driver_version[64];
    int cuda_version;
    int scheduler;   /* SIM_SCHED_* */
    int64_t timeslice_ns;
    int procaddr;    /* SIM_PROCADDR_* */
    int accounting;  /* NVML accounting mode of a GPU whose state file is new */
    /* where a client looks for an MPS control daemon when CUDA_MPS_PIPE_DIRECTORY is unset
     * (NVIDIA's default: /tmp/nvidia-mps) */
    char mps_pipe_directory[1024];
    /* device memory an executable graph keeps per node from its instantiation to its
     * destruction (its launch descriptors and the parameters the driver keeps for them) */
    uint64_t graph_node_bytes;
    int graph_work_at_use; /* 1: kept from its first upload or launch, 0: from instantiation */
    sim_gpu_config_t gpus[SIM_MAX_GPUS];
} sim_config_t;

typedef struct {
    int32_t pid;         /* 0: 0 = free */
    uint32_t ring_head;  /* 4: next ring slot (fifo) */
    uint64_t start_time; /* 8: /proc/<pid>/stat field 22 */
    uint64_t mem_used;   /* 16: bytes */
    uint64_t busy_ns;    /* 24: device time of the work this process submitted */
    int64_t last_end_ns; /* 32: end of its last op on the timeline (fifo) */
    uint64_t launches;   /* 40 */
    uint64_t done_ns;    /* 48: device time of its work the device has run so far */
    uint64_t contexts;   /* 56: live contexts (each costs context_memory) */
    /* 64: fifo: its last SIM_PROC_RING ops on the timeline */
    int64_t ring_start[SIM_PROC_RING];
    int64_t ring_end[SIM_PROC_RING];
    /* 576: timesliced: markers (events, stream-ordered frees) at a position of its queue */
    uint64_t mk_next; /* next sequence number */
    uint64_t mk_done; /* markers below this have completed */
    /* 592: utilisation samples: (time, done_ns) every SIM_USNAP_NS */
    int64_t usnap_t[SIM_USNAPS];
    uint64_t usnap_done[SIM_USNAPS];
    uint32_t usnap_head;
    uint32_t pad0;
    uint64_t mk_pos[SIM_MARKERS];
    int64_t mk_ts[SIM_MARKERS];
    /* timesliced: per context (its queue index), the queue position its last work ends at;
       a context whose end is past done_ns has work queued and gets its own slice */
    uint64_t ctx_end[SIM_CTX_QUEUES];
    /* video engines: its open encoder (NVENC) and frame-buffer capture sessions and what
       they report, opened with qgpuSimVideoSessionOpen (video.c), closed when it ends */
    uint32_t enc_sessions;
    uint32_t enc_fps;
    uint32_t enc_latency_us;
    uint32_t fbc_sessions;
    /* managed memory (managed.c): the part of mem_used that is its managed blocks on this
       GPU, which NVIDIA's NVML leaves out of the per-process lists, and what another
       allocation evicted of it to the host that this process has not yet moved its blocks'
       record for (the bytes already left mem_used) */
    uint64_t managed_bytes;
    uint64_t evicted_bytes;
} sim_proc_t;

#define SIM_PROC_SIZE (760 + 16 * SIM_MARKERS + 8 * SIM_CTX_QUEUES)

/* An allocation that more than one process may keep alive (shared.c): a VMM allocation
 * exported to a file descriptor, a cuMemAlloc'ed allocation with a legacy IPC handle, or the
 * memory of a pool exported to a file descriptor. Its
 * memory is charged to one process that holds a reference (`charged`); when that process
 * lets go or dies, the charge moves to another holder; when only open file descriptors keep
 * it, to no process (the header's `unowned`). It is freed when no process holds a reference
 * and no descriptor is open. */
#define SIM_MAX_SHARED 256
enum { SIM_SHARE_VMM = 1, SIM_SHARE_IPC = 2, SIM_SHARE_POOL = 3 };
enum { SIM_CHARGED_NONE = -1, SIM_CHARGED_PENDING = -2 };

typedef struct {
    uint64_t id;    /* 0 = free entry */
    uint64_t token; /* random: names the entry together with id */
    uint64_t size;
    int32_t charged;       /* the slot holding the charge, or SIM_CHARGED_* */
    uint32_t kind;         /* SIM_SHARE_* */
    uint32_t handle_types; /* VMM: CUmemAllocationProp.requestedHandleTypes */
    uint32_t has_file;     /* VMM: exported at least once (descriptors may be open) */
    int32_t refs[SIM_MAX_PROCS]; /* per process slot: handles + mappings (VMM), the
                                    allocation + open IPC mappings (IPC) */
} sim_shared_t;

#define SIM_SHARED_SIZE (40 + 4 * SIM_MAX_PROCS)

/* NVML accounting: one process's record, kept after it ends until the ring wraps. */
typedef struct {
    int32_t pid;         /* 0 = unused */
    uint32_t running;    /* its slot is still live */
    uint64_t proc_start; /* /proc/<pid>/stat field 22: which process of that pid */
    int64_t start_ns;    /* CLOCK_MONOTONIC when it took its slot */
    int64_t end_ns;      /* when its slot went */
    uint64_t start_us;   /* CPU time, microseconds since the epoch (startTime) */
    uint64_t max_mem;    /* most device memory it held */
    uint64_t done_ns;    /* device time of its work, at its end */
} sim_acct_t;

typedef struct {
    uint64_t magic;          /* 0 */
    uint32_t version;        /* 8 */
    uint32_t max_procs;      /* 12 */
    uint64_t mem_total;      /* 16 */
    uint64_t mem_used;       /* 24 */
    int64_t tail_ns;         /* 32: fifo: end of the last op queued on the device */
    uint64_t busy_total_ns;  /* 40: device time of all ops ever queued */
    uint64_t launches;       /* 48 */
    int64_t created_ns;      /* 56 */
    char lock_area[64];      /* 64: pthread_mutex_t */
    int64_t snap_t[SIM_SNAPSHOTS];     /* 128: (time, busy completed) samples for NVML */
    uint64_t snap_busy[SIM_SNAPSHOTS]; /* 256 */
    uint32_t snap_head;      /* 384 */
    uint32_t scheduler;      /* 388: SIM_SCHED_* */
    int64_t slice_ns;        /* 392: timesliced: slice length */
    int64_t ts_time;         /* 400: timesliced: the device is simulated up to here */
    int64_t ts_slice_start;  /* 408: when the running process's slice began */
    int32_t ts_cur;          /* 416: the running process's slot, -1 = idle */
    uint32_t pad0;           /* 420 */
    uint64_t done_total_ns;  /* 424: device time run so far, all processes (both models) */
    uint64_t unowned;        /* 432: shared memory kept only by open descriptors (in mem_used) */
    uint64_t share_next_id;  /* 440: last shared-allocation id handed out */
    uint32_t acct_mode;      /* 448: NVML accounting mode (NVML_FEATURE_*) */
    uint32_t compute_mode;   /* 452: CU_COMPUTEMODE_* (set through NVML, root only) */
    uint64_t acct_next;      /* 456: accounting records ever begun (the ring's next slot) */
    char pad[48];            /* 464 .. 512 */
    sim_proc_t procs[SIM_MAX_PROCS]; /* 512 */
    sim_shared_t shared[SIM_MAX_SHARED];
    char state_path[4096];   /* this file's path: shared.c names descriptor files after it */
    sim_acct_t acct[SIM_ACCT_RECORDS]; /* NVML accounting, a ring (acct.c) */
} sim_gpu_state_t;

_Static_assert(sizeof(sim_proc_t) == SIM_PROC_SIZE, "sim_proc_t layout");
_Static_assert(__builtin_offsetof(sim_proc_t, mk_next) == 576, "sim_proc_t layout");
_Static_assert(__builtin_offsetof(sim_proc_t, usnap_t) == 592, "sim_proc_t layout");
_Static_assert(__builtin_offsetof(sim_proc_t, mk_pos) == 728, "sim_proc_t layout");
_Static_assert(sizeof(pthread_mutex_t) <= 64, "mutex fits");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, done_total_ns) == 424, "header layout");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, procs) == 512, "procs offset");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, unowned) == 432, "header layout");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, acct_mode) == 448, "header layout");
_Static_assert(sizeof(sim_shared_t) == SIM_SHARED_SIZE, "sim_shared_t layout");
_Static_assert(__builtin_offsetof(sim_gpu_state_t, shared) == 512 + SIM_MAX_PROCS * SIM_PROC_SIZE,
               "shared offset");

#define SIM_LOCK(st) ((pthread_mutex_t *)(st)->lock_area)

/* config.c */
QGPU_HIDDEN int sim_config_load(const char *path, sim_config_t *cfg, char *err, size_t errlen);

/* state.c */
QGPU_HIDDEN sim_gpu_state_t *sim_state_open(const sim_gpu_config_t *gpu, const sim_config_t *cfg);
QGPU_HIDDEN void sim_state_lock(sim_gpu_state_t *st);
QGPU_HIDDEN void sim_state_unlock(sim_gpu_state_t *st);
QGPU_HIDDEN int sim_state_reclaim_dead(sim_gpu_state_t *st); /* locked; returns slots freed */
QGPU_HIDDEN sim_proc_t *sim_state_proc_slot(sim_gpu_state_t *st, int create); /* locked */
/* Locked. Brings the device model up to `now`: runs queued work (timesliced), completes
 * markers, updates done_ns and the utilisation samples. */
QGPU_HIDDEN void sim_state_advance(sim_gpu_state_t *st, int64_t now);
QGPU_HIDDEN unsigned sim_state_utilization(sim_gpu_state_t *st, int64_t now); /* locked */
/* Locked. Charge/uncharge device memory to this process; overflow-safe. */
QGPU_HIDDEN CUresult sim_state_charge(sim_gpu_state_t *st, uint64_t bytes);
QGPU_HIDDEN void sim_state_uncharge(sim_gpu_state_t *st, uint64_t bytes);
/* locked: room for `bytes` more of the driver's own (not managed) memory, managed memory
   evicted to the host as needed; 0 when it does not fit even then */
QGPU_HIDDEN int sim_state_make_room(sim_gpu_state_t *st, uint64_t bytes);
/* locked: managed memory moving onto or off this GPU for this process (never evicts) */
QGPU_HIDDEN CUresult sim_state_charge_managed(sim_gpu_state_t *st, uint64_t bytes);
QGPU_HIDDEN void sim_state_uncharge_managed(sim_gpu_state_t *st, uint64_t bytes);
/* locked: what was evicted of this process's managed memory since it last asked (zeroed) */
QGPU_HIDDEN uint64_t sim_state_take_evicted(sim_gpu_state_t *st);
/* what NVML's per-process lists show of a process: its memory without its managed blocks */
QGPU_HIDDEN uint64_t sim_proc_listed_memory(const sim_proc_t *p);
/* Locked. Frees slot i (its process exited or died): what it held goes, shared allocations
 * it held keep their memory while others hold them. */
QGPU_HIDDEN void sim_state_drop_slot(sim_gpu_state_t *st, int i);

/* acct.c (locked): NVML accounting records, kept while accounting mode is on */
QGPU_HIDDEN void sim_acct_begin(sim_gpu_state_t *st, const sim_proc_t *p);
QGPU_HIDDEN void sim_acct_memory(sim_gpu_state_t *st, const sim_proc_t *p);
QGPU_HIDDEN void sim_acct_end(sim_gpu_state_t *st, const sim_proc_t *p, int64_t now);
/* the live process record of slot p, or NULL */
QGPU_HIDDEN sim_acct_t *sim_acct_running(sim_gpu_state_t *st, const sim_proc_t *p);
/* forget every record (all = 1) or those of processes that ended */
QGPU_HIDDEN void sim_acct_clear(sim_gpu_state_t *st, int all);

/* shared.c (locked unless said otherwise) */
QGPU_HIDDEN void sim_shared_forget_slot(sim_gpu_state_t *st, int slot); /* before a slot goes */
QGPU_HIDDEN void sim_shared_settle(sim_gpu_state_t *st); /* place pending charges, free dead */
/* A new entry for an allocation of `size` this process is already charged for, holding
 * `refs` references; returns its index, or -1 when the table is full. */
QGPU_HIDDEN int sim_shared_publish(sim_gpu_state_t *st, uint64_t size, uint32_t kind,
                                   uint32_t handle_types, int refs, uint64_t *id);
/* 1 if entry idx is alive and is `id` */
QGPU_HIDDEN int sim_shared_alive(const sim_gpu_state_t *st, int idx, uint64_t id);
/* This process's references to entry idx change by delta; a process taking a reference to
 * memory nobody is charged for takes the charge; the holder letting go passes it on. */
QGPU_HIDDEN void sim_shared_ref(sim_gpu_state_t *st, int idx, int delta);
/* Not locked: a new descriptor for entry idx (creates its file on first use); -1 on error. */
QGPU_HIDDEN int sim_shared_open_fd(sim_gpu_state_t *st, int gidx, int idx, uint64_t id);
/* Not locked: reads what a descriptor says it names (its GPU, entry, id, token). */
QGPU_HIDDEN int sim_shared_read_fd(int fd, int ngpus, int *gidx, int *idx, uint64_t *id,
                                   uint64_t *token);
/* 1 if `fd` is a descriptor of live entry idx of `kind` (its file, not a copy of its contents) */
QGPU_HIDDEN int sim_shared_fd_is(const sim_gpu_state_t *st, int idx, uint64_t id, uint64_t token,
                                 int fd, uint32_t kind);
/* Entry idx grows (delta > 0; CUDA_ERROR_OUT_OF_MEMORY when the GPU has no room) or shrinks;
 * whoever holds its charge (a process or `unowned`) holds the difference. */
QGPU_HIDDEN CUresult sim_shared_resize(sim_gpu_state_t *st, int idx, int64_t delta);
/* 1 when a live process other than this one holds a reference to entry idx */
QGPU_HIDDEN int sim_shared_held_elsewhere(sim_gpu_state_t *st, int idx);

#endif
