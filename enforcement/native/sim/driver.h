/* Internal state of the simulated libcuda.so.1 (one process). */
#ifndef QGPU_SIM_DRIVER_H
#define QGPU_SIM_DRIVER_H

#include "sim.h"

#define SIM_EXPORT QGPU_EXPORT
#define CTX_MAGIC 0x43545831u
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u
#define FUNC_MAGIC 0x46554e43u
#define MOD_MAGIC 0x4d4f4455u
#define GRAPH_MAGIC 0x47524150u
#define EXEC_MAGIC 0x47455843u
#define POOL_MAGIC 0x504f4f4cu
#define GREEN_MAGIC 0x4752454eu
#define DESC_MAGIC 0x44455343u

/* A point in a process's queue: an event, or a stream-ordered free. fifo: its time is known
 * when recorded; timesliced: it completes when the process's queue reaches it while the
 * process holds the device (sim_state_advance writes the time into the shared slot). */
typedef struct {
    int gidx;
    int ts_mode;
    int slot;     /* the process slot (timesliced) */
    uint64_t seq; /* marker sequence number (timesliced) */
    int64_t ts;   /* completion time, once known */
    int done;
} sim_marker_t;

struct CUctx_st {
    uint32_t magic;
    CUdevice dev; /* visible ordinal */
    int gidx;     /* index in the config */
    int primary;
    int green;
    unsigned flags;
    int64_t last_end_ns; /* fifo: end of the last op queued by this context */
    uint64_t limits[3];  /* CU_LIMIT_STACK_SIZE, PRINTF_FIFO_SIZE, MALLOC_HEAP_SIZE */
    uint64_t charged;    /* device memory this context holds (its cost + its limits) */
};

struct CUstream_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    int64_t last_end_ns;
    struct CUgraph_st *capture; /* the graph being captured, or NULL */
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    int recorded;
    sim_marker_t m;
};

struct CUmod_st {
    uint32_t magic;
};

struct CUfunc_st {
    uint32_t magic;
    int busy_kernel; /* named qgpu_sim_busy: first param is nanoseconds */
    char name[128];
    /* legacy launch state (cuFuncSetBlockShape, cuParamSet*) */
    int bx, by, bz;
    unsigned param_size;
    unsigned char params[256];
};

#define SIM_GRAPH_ALLOCS 64
struct CUgraph_st {
    uint32_t magic;
    int nodes;
    int64_t total_ns;
    int nallocs;
    uint64_t alloc_size[SIM_GRAPH_ALLOCS]; /* memory alloc nodes */
    uint64_t alloc_ptr[SIM_GRAPH_ALLOCS];
    int gidx;     /* the device its kernels run on (its context's) */
    int mem_gidx; /* the device its allocation nodes' location names (-1: none yet) */
};

struct CUgraphExec_st {
    uint32_t magic;
    int nodes;
    int64_t total_ns;
    uint64_t alloc_bytes; /* what its memory nodes need from the graph pool */
    int gidx;
    int mem_gidx; /* where that memory is (-1: the kernels' device) */
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int gidx;
    int is_default;
    int imported;          /* cuMemPoolImportFromShareableHandle: no allocations of its own */
    uint32_t handle_types; /* CUmemPoolProps.handleTypes: what it may be exported to */
    int share;             /* its entry in the GPU's shared table (shared.c), -1: not shared */
    uint64_t share_id;
    uint64_t reserved; /* physical memory the pool holds (charged to the device) */
    uint64_t used;     /* handed out and not yet freed in stream order */
    uint64_t threshold;
    uint64_t reserved_high, used_high;
    uint64_t max_size; /* CUmemPoolProps.maxSize: it never grows past this (0: the device) */
};

struct CUgreenCtx_st {
    uint32_t magic;
    struct CUctx_st ctx;
};

struct CUdevResourceDesc_st {
    uint32_t magic;
    unsigned sms;
};

extern QGPU_HIDDEN sim_config_t g_sim_cfg;
extern QGPU_HIDDEN int g_sim_nvis;
extern QGPU_HIDDEN int g_sim_vis[SIM_MAX_GPUS];
extern QGPU_HIDDEN sim_gpu_state_t *g_sim_state[SIM_MAX_GPUS];
extern QGPU_HIDDEN qgpu_table_t g_sim_allocs;

/* driver.c */
QGPU_HIDDEN CUresult sim_check_init(void);
QGPU_HIDDEN CUresult sim_device_gidx(CUdevice dev, int *gidx);
QGPU_HIDDEN int sim_config_loaded(void); /* loads the config for calls allowed before cuInit */

/* ctx.c */
QGPU_HIDDEN struct CUctx_st *sim_current_ctx(void);
QGPU_HIDDEN void sim_set_current_ctx(struct CUctx_st *ctx);

/* mem.c */
QGPU_HIDDEN uint64_t sim_next_address(uint64_t size);
QGPU_HIDDEN CUresult sim_charge(int gidx, uint64_t bytes);
QGPU_HIDDEN void sim_uncharge(int gidx, uint64_t bytes);

QGPU_HIDDEN CUresult sim_graph_alloc_node(struct CUgraph_st *g, uint64_t size, CUdeviceptr *dptr);
QGPU_HIDDEN CUresult sim_graph_mem_reserve(int gidx, uint64_t bytes); /* at upload/launch */

/* driver.c: the visible ordinal of GPU index gidx (-1: not visible) */
QGPU_HIDDEN int sim_visible_ordinal(int gidx);

/* managed.c: where managed memory lives */
QGPU_HIDDEN CUresult sim_managed_new(uint64_t base, uint64_t size, int gidx); /* on gidx */
QGPU_HIDDEN int sim_managed_free(uint64_t base); /* 1: it was managed, its memory is freed */
QGPU_HIDDEN void sim_managed_touch(int gidx);    /* a kernel launched on gidx */

/* mem.c: the base of a cuMemAlloc'ed allocation (what cuIpcGetMemHandle may export) */
QGPU_HIDDEN CUresult sim_ipc_source(uint64_t ptr, uint64_t *size, int *gidx);
QGPU_HIDDEN CUresult sim_free_plain(uint64_t ptr); /* cuMemFree of a plain allocation */

/* pool.c: pools, the stream-ordered allocator, pools shared between processes */
QGPU_HIDDEN void sim_pools_on_sync(struct CUctx_st *ctx); /* release thresholds apply */
QGPU_HIDDEN int sim_pool_range(uint64_t addr, uint64_t *base, uint64_t *size);
QGPU_HIDDEN int sim_pool_import_free(uint64_t ptr); /* 1: an imported pointer, let go */
QGPU_HIDDEN void sim_pool_forget_ctx(struct CUctx_st *ctx); /* its imported pointers go */

/* ipc.c: legacy IPC */
QGPU_HIDDEN int sim_ipc_freed(uint64_t ptr); /* 1: exported, its shared entry let go of it */
QGPU_HIDDEN void sim_ipc_forget_ctx(struct CUctx_st *ctx); /* closes what ctx opened */
QGPU_HIDDEN int sim_ipc_range(uint64_t addr, uint64_t *base, uint64_t *size);

/* exec.c */
QGPU_HIDDEN struct CUctx_st *sim_stream_ctx(CUstream s);
QGPU_HIDDEN struct CUstream_st *sim_real_stream(CUstream s);
QGPU_HIDDEN void sim_submit(struct CUctx_st *ctx, struct CUstream_st *s, int64_t dur_ns,
                            int kernels);
QGPU_HIDDEN void sim_marker_record(struct CUctx_st *ctx, struct CUstream_st *s, sim_marker_t *m);
QGPU_HIDDEN int sim_marker_poll(sim_marker_t *m); /* 1 once completed (m->ts set) */
QGPU_HIDDEN void sim_marker_wait(sim_marker_t *m);
QGPU_HIDDEN void sim_wait_idle(struct CUctx_st *ctx, struct CUstream_st *s);

#endif
