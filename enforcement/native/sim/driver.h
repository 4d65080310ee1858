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
#define NODE_MAGIC 0x474e4f44u

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

/* Graphs (graph.c). A graph is a list of nodes in insertion order; a child graph node owns
 * its embedded graph, a conditional node its body graphs. An executable graph runs its own
 * copy of the graph it was instantiated from (updates change the copy, never the graph). */
struct CUgraphNode_st {
    uint32_t magic;
    int type;                       /* CU_GRAPH_NODE_TYPE_* */
    struct CUgraph_st *owner;       /* the graph it is in */
    int64_t ns;                     /* kernel: its duration */
    CUDA_MEM_ALLOC_NODE_PARAMS alloc; /* allocation: as added (no access descriptors kept) */
    int gidx;                       /* allocation: the device its memory is on */
    CUdeviceptr dptr;               /* free: the address it frees */
    struct CUgraph_st *child;       /* child graph node: the graph it owns */
    struct CUgraph_st **bodies;     /* conditional: its body graphs */
    unsigned nbodies;
    int cond_type;
    struct CUgraphNode_st *origin;  /* in an executable graph's copy: the node it stands for */
};

struct CUgraph_st {
    uint32_t magic;
    struct CUgraphNode_st **node;
    int nnodes, cap;
    int gidx;                       /* the device its kernels run on (its context's) */
    struct CUgraphNode_st *parent;  /* the child graph / conditional node owning it, or NULL */
    int moved;                      /* moved into its parent (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) */
    int capturing;                  /* streams capturing into it */
    int execs;                      /* live executable graphs instantiated from it */
    int destroyed;                  /* cuGraphDestroy'ed; kept while executable graphs name it */
};

struct CUgraphExec_st {
    uint32_t magic;
    struct CUgraph_st *src;  /* the graph it was instantiated from */
    struct CUgraph_st *snap; /* its own copy of that graph: what it runs */
    unsigned long long flags;
    /* what the copy needs, refreshed after every update */
    int64_t total_ns;
    int kernels;
    uint64_t alloc_bytes; /* what its allocation nodes take from the graph pool */
    int mem_gidx;         /* where (-1: no allocation nodes) */
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int gidx;
    int is_default;
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
QGPU_HIDDEN void sim_pools_on_sync(struct CUctx_st *ctx); /* release thresholds apply */
QGPU_HIDDEN CUresult sim_graph_mem_reserve(int gidx, uint64_t bytes); /* at upload/launch */

/* mem.c: the base of a cuMemAlloc'ed allocation (what cuIpcGetMemHandle may export) */
QGPU_HIDDEN CUresult sim_ipc_source(uint64_t ptr, uint64_t *size, int *gidx);

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
/* the kernel-duration rule (see exec.c) */
QGPU_HIDDEN int64_t sim_kernel_duration(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                        void **params, void **extra);

/* graph.c: what stream capture records */
QGPU_HIDDEN struct CUgraph_st *sim_graph_new(int gidx);
QGPU_HIDDEN CUresult sim_graph_capture_begin(struct CUgraph_st *g); /* capture into a graph */
QGPU_HIDDEN void sim_graph_capture_end(struct CUgraph_st *g);
QGPU_HIDDEN CUresult sim_graph_capture_kernel(struct CUgraph_st *g, int64_t ns);
QGPU_HIDDEN CUresult sim_graph_capture_alloc(struct CUgraph_st *g, int gidx, uint64_t size,
                                             CUdeviceptr *dptr);
QGPU_HIDDEN CUresult sim_graph_capture_free(struct CUgraph_st *g, CUdeviceptr dptr);

#endif
