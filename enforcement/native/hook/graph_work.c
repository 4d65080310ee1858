/* Device memory an executable graph keeps for its own work: the launch descriptors the
 * driver builds for its nodes and the kernel parameters it keeps for them (CUDA 12.1 allows
 * 32 KiB of parameters per kernel). No allocation call the hook sees is made for it, and
 * NVIDIA documents neither where nor how much, so it is measured as a module load is
 * (module.c): around each instantiation, under the process's memory lock held exclusively,
 * this pid's device memory in NVML before and after (the device's used memory where NVML
 * does not list the pid). The graph memory an instantiation with
 * CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD allocates is the graph's own charge (graph.c), taken
 * out by the measurement with the pools' (pool_reserved_total). Over the cap the executable
 * graph is destroyed and CUDA_ERROR_OUT_OF_MEMORY returned; the charge is given back at
 * cuGraphExecDestroy. */
#include "hook.h"

static qgpu_table_t work = QGPU_TABLE_INIT; /* CUgraphExec -> bytes its work took */

void graph_work_begin(measure_t *m) { measure_call_begin(m); }

CUresult graph_work_done(CUresult r, CUgraphExec *e, measure_t *m) {
    uint64_t took = measure_call_took(m, r);
    if (r == CUDA_SUCCESS && e && *e && took) {
        if (ledger_reserve(took) != 0) {
            REAL(cuGraphExecDestroy)(*e);
            *e = NULL;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (qgpu_table_put(&work, (uintptr_t)*e, took, 0) != 0) {
            ledger_release(took); /* no room to remember it: refused rather than lost */
            REAL(cuGraphExecDestroy)(*e);
            *e = NULL;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    measure_call_done();
    return r;
}

void graph_work_release(CUgraphExec e) {
    uint64_t bytes;
    if (qgpu_table_take(&work, (uintptr_t)e, &bytes, NULL) == 0) ledger_release(bytes);
}
