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
#define LIB_MAGIC 0x4c494252u
#define KERNEL_MAGIC 0x4b45524eu
#define LINK_MAGIC 0x4c494e4bu
#define NODE_MAGIC 0x474e4f44u
#define SIM_GRANULE (2ULL << 20) /* physical memory is mapped in 2 MiB granules */

/* A device code image, read by image.c: what loading it takes and what it defines. */
typedef struct {
    char *name;
    uint64_t offset; /* in the module's data block */
    uint64_t size;
    int managed;
} sim_sym_t;

typedef struct {
    int builtin;         /* the simulator's own image: no data, every kernel name exists */
    int sm;              /* SASS architecture of the cubin used (75 = sm_75) */
    uint64_t data_bytes; /* device memory for its globals and constant banks */
    int nfuncs;
    char **funcs; /* kernel (entry) names */
    int nsyms;
    sim_sym_t *syms; /* globals */
} sim_image_t;

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
    uint64_t limits[5];  /* CU_LIMIT_STACK_SIZE .. DEV_RUNTIME_PENDING_LAUNCH_COUNT */
    uint64_t charged;    /* device memory this context holds (its cost + its limits) */
    /* the most local memory per thread a kernel launched in it needed (CUDA grows the
     * context's local memory for such a kernel at its launch; kept, as with
     * CU_CTX_LMEM_RESIZE_TO_MAX): with limits[STACK], what it reserves per thread */
    uint64_t lmem_grown;
    int queue;           /* its index in the process slot's ctx_end (timesliced) */
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

/* A module loaded into a context (cuModuleLoad*), or a library's instance in a context. */
struct CUmod_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    struct CUlib_st *lib; /* the library it is an instance of, or NULL */
    sim_image_t img;
    uint64_t base;           /* device address of its data block (img.data_bytes) */
    struct CUfunc_st *funcs; /* functions handed out, freed with the module */
    struct CUmod_st *next;   /* every live module of the process (module.c) */
    uint64_t code_charged;   /* its functions' code loaded so far (given back with it) */
};

struct CUlib_st {
    uint32_t magic;
    unsigned char *code; /* a copy of the image: instances are made from it per device */
    size_t len;
    sim_image_t img;     /* its names, read for the device current at load */
    struct CUkern_st *kernels;
    struct CUlib_st *next;
};

struct CUkern_st {
    uint32_t magic; /* first, like CUfunc_st: a CUkernel may be passed where a CUfunction goes */
    struct CUlib_st *lib;
    char *name;
    struct CUkern_st *next;
};

struct CUlinkState_st {
    uint32_t magic;
    int cc_major, cc_minor; /* the target: the current context's device at cuLinkCreate */
    int inputs;
    unsigned char *cubin; /* the one input, as a plain cubin */
    size_t cubin_len;
};

struct CUfunc_st {
    uint32_t magic;
    int busy_kernel; /* named qgpu_sim_busy: first param is nanoseconds */
    /* local memory per thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES): the built-in image's
     * qgpu_sim_lmem_<bytes>; 0 for the others */
    uint64_t local_bytes;
    /* its code (the built-in image's qgpu_sim_code_<bytes> kernels; 0 for the others), loaded
     * onto the GPU at its first launch, graph node or cuFuncLoad, as CUDA's lazy loading does
     * (cuFuncIsLoaded) */
    uint64_t code_bytes;
    int loaded;
    struct CUmod_st *mod;
    char *name;
    struct CUfunc_st *next; /* in its module's list */
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
    uint64_t lmem;                  /* kernel: its function's local memory per thread */
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
    uint64_t lmem; /* the most local memory per thread of its kernels */
    int mem_gidx; /* the device of its allocation nodes (-1: none) */
    /* its graph memory (graphmem.c): the allocations it leaves allocated (no free node for
     * them in the graph), the physical size of those it frees itself, and the addresses of
     * other graphs' allocations its free nodes free */
    uint64_t id;
    uint64_t *keep;
    int nkeep;
    uint64_t keep_backed;
    uint64_t temp_backed;
    uint64_t *frees;
    int nfrees;
    /* its work (graph.c): what its nodes' launch descriptors and parameters keep on a GPU
     * (g_sim_cfg.graph_node_bytes per node, child graphs' and bodies' nodes too), from the
     * instantiation to cuGraphExecDestroy */
    uint64_t work_bytes;
    int work_gidx;
    int work_taken;
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

/* checkpoint.c: the restore thread (started by cuInit) and the gate of a locked process */
QGPU_HIDDEN void sim_checkpoint_start(void);
QGPU_HIDDEN void sim_checkpoint_gate(void); /* waits while the process is locked */

/* ctx.c */
QGPU_HIDDEN struct CUctx_st *sim_current_ctx(void);
/* before a launch in `c` of work needing `per_thread` bytes of local memory per thread: the
   context's local memory grown to it (charged; CUDA_ERROR_OUT_OF_MEMORY when it does not fit) */
QGPU_HIDDEN CUresult sim_ctx_local_memory(struct CUctx_st *c, uint64_t per_thread);
QGPU_HIDDEN void sim_set_current_ctx(struct CUctx_st *ctx);

/* mem.c */
QGPU_HIDDEN uint64_t sim_next_address(uint64_t size);
QGPU_HIDDEN CUresult sim_charge(int gidx, uint64_t bytes);
QGPU_HIDDEN void sim_uncharge(int gidx, uint64_t bytes);
/* managed memory's blocks onto / off a GPU for this process: never evicts anything, and
   NVML's per-process lists leave it out (sim_proc_t.managed_bytes) */
QGPU_HIDDEN CUresult sim_charge_managed(int gidx, uint64_t bytes);
QGPU_HIDDEN void sim_uncharge_managed(int gidx, uint64_t bytes);
/* what the driver evicted of this process's managed memory on GPU `gidx` since it last
   asked (sim_state_make_room), now on the host */
QGPU_HIDDEN uint64_t sim_take_evicted(int gidx);

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

/* image.c */
extern QGPU_HIDDEN const char sim_builtin_image[];
/* Reads an image (len 0: a bare pointer, whose headers give its extent) for a device of
 * compute capability cc_major.cc_minor (-1: any). */
QGPU_HIDDEN CUresult sim_image_parse(const void *image, size_t len, int cc_major, int cc_minor,
                                     sim_image_t *out);
QGPU_HIDDEN CUresult sim_image_extent(const void *image, size_t *len);
/* The plain cubin the device would run from an image (malloc'd copy). */
QGPU_HIDDEN CUresult sim_image_cubin(const void *image, size_t len, int cc_major, int cc_minor,
                                     unsigned char **out, size_t *out_len);
QGPU_HIDDEN int sim_image_has_kernel(const sim_image_t *img, const char *name);
QGPU_HIDDEN const sim_sym_t *sim_image_symbol(const sim_image_t *img, const char *name);
QGPU_HIDDEN void sim_image_free(sim_image_t *img);

/* module.c */
QGPU_HIDDEN CUresult sim_modules_ctx_created(struct CUctx_st *ctx); /* eager libraries */
QGPU_HIDDEN void sim_modules_ctx_gone(struct CUctx_st *ctx);        /* its modules unload */
/* The function a CUkernel is in `ctx` (its library loaded there first if it is not). */
/* module.c: a function's code loaded onto its module's GPU if it is not (lazy loading) */
QGPU_HIDDEN CUresult sim_function_load(struct CUfunc_st *f);
QGPU_HIDDEN CUresult sim_kernel_function(struct CUkern_st *k, struct CUctx_st *ctx,
                                         struct CUfunc_st **out);

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

/* graphmem.c: graph allocations and the per-device graph memory pool (locked inside) */
QGPU_HIDDEN uint64_t sim_gmem_backed(uint64_t size); /* whole granules (UINT64_MAX: too big) */
QGPU_HIDDEN uint64_t sim_gmem_new_exec_id(void);
QGPU_HIDDEN CUresult sim_gmem_node_added(struct CUgraphNode_st *node, uint64_t dptr,
                                         uint64_t size, int gidx);
QGPU_HIDDEN void sim_gmem_node_gone(struct CUgraphNode_st *node); /* an original node freed */
/* 0 with the allocation node that made dptr (NULL once destroyed) and whether a free node
 * for it is in another graph; -1 when dptr is no graph allocation's address */
QGPU_HIDDEN int sim_gmem_lookup(uint64_t dptr, struct CUgraphNode_st **node, int *freed_elsewhere);
QGPU_HIDDEN void sim_gmem_freed_elsewhere(uint64_t dptr);
QGPU_HIDDEN CUresult sim_gmem_upload(struct CUgraphExec_st *e, int gidx);
/* before a launch queues its work (refusals, growth), and after (what it frees) */
QGPU_HIDDEN CUresult sim_gmem_launch(struct CUgraphExec_st *e, int gidx);
QGPU_HIDDEN void sim_gmem_launched(struct CUgraphExec_st *e, int gidx, struct CUctx_st *c,
                                   struct CUstream_st *s);
/* cuMemFree (async 0) / cuMemFreeAsync of a graph allocation: -1 when dptr is none, else
 * the CUresult */
QGPU_HIDDEN int sim_gmem_free(uint64_t dptr, struct CUctx_st *c, struct CUstream_st *s, int async);
QGPU_HIDDEN int sim_gmem_range(uint64_t addr, uint64_t *base, uint64_t *size);

/* graph.c: what stream capture records */
QGPU_HIDDEN struct CUgraph_st *sim_graph_new(int gidx);
QGPU_HIDDEN CUresult sim_graph_capture_begin(struct CUgraph_st *g); /* capture into a graph */
QGPU_HIDDEN void sim_graph_capture_end(struct CUgraph_st *g);
QGPU_HIDDEN CUresult sim_graph_capture_kernel(struct CUgraph_st *g, int64_t ns, uint64_t lmem);
QGPU_HIDDEN CUresult sim_graph_capture_alloc(struct CUgraph_st *g, int gidx, uint64_t size,
                                             CUdeviceptr *dptr);
QGPU_HIDDEN CUresult sim_graph_capture_free(struct CUgraph_st *g, CUdeviceptr dptr);

#endif
