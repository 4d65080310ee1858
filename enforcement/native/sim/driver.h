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

struct CUctx_st {
    uint32_t magic;
    CUdevice dev; /* visible ordinal */
    int gidx;     /* index in the config */
    int primary;
    int refcount;
    int64_t last_end_ns; /* end of the last op queued by this context */
};

struct CUstream_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    int64_t last_end_ns;
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    int recorded;
    int64_t ts_ns;
};

struct CUmod_st {
    uint32_t magic;
};

struct CUfunc_st {
    uint32_t magic;
    int busy_kernel; /* named qgpu_sim_busy: first param is nanoseconds */
    char name[128];
};

struct CUgraph_st {
    uint32_t magic;
    int nodes;
    int64_t total_ns;
};

struct CUgraphExec_st {
    uint32_t magic;
    int nodes;
    int64_t total_ns;
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int gidx;
};

extern QGPU_HIDDEN sim_config_t g_sim_cfg;
extern QGPU_HIDDEN int g_sim_nvis;
extern QGPU_HIDDEN int g_sim_vis[SIM_MAX_GPUS];
extern QGPU_HIDDEN sim_gpu_state_t *g_sim_state[SIM_MAX_GPUS];
extern QGPU_HIDDEN qgpu_table_t g_sim_allocs;

QGPU_HIDDEN CUresult sim_check_init(void);
QGPU_HIDDEN struct CUctx_st *sim_current_ctx(void);
QGPU_HIDDEN CUresult sim_device_gidx(CUdevice dev, int *gidx);
QGPU_HIDDEN int64_t sim_enqueue(struct CUctx_st *ctx, struct CUstream_st *s, int64_t dur_ns,
                               int kernels);
QGPU_HIDDEN struct CUctx_st *sim_stream_ctx(CUstream s);
QGPU_HIDDEN uint64_t sim_next_address(uint64_t size);

#endif
