/* Device memory an executable graph keeps for its own work: the launch descriptors the
 * driver builds for its nodes and the kernel parameters it keeps for them (CUDA 12.1 allows
 * 32 KiB of parameters per kernel). No allocation call the hook sees is made for it, and
 * NVIDIA documents neither where, when nor how much, so it is measured as a module load is
 * (module.c): this pid's device memory in NVML before and after (the device's used memory
 * where NVML does not list the pid), under the process's memory lock held exclusively,
 * around each instantiation and around the executable graph's first upload (cuda.h: an
 * upload "uploads the work"; before a first launch the hook uploads it itself, measured).
 * The graph memory an upload allocates is the graph's own charge (graph.c), taken out by
 * the measurement with the pools' (pool_reserved_total). Over the cap an instantiation is
 * undone (the executable graph destroyed); an upload cannot be, so what it took is charged
 * past the cap (the slice's next allocations are refused, and so is every first upload
 * while the slice is at its cap: at most one graph's work past it) and the call returns
 * CUDA_ERROR_OUT_OF_MEMORY, the launch not made. Everything is given back at
 * cuGraphExecDestroy. */
#include "hook.h"

static qgpu_table_t work = QGPU_TABLE_INIT; /* CUgraphExec -> bytes its work took */
static qgpu_table_t uploaded = QGPU_TABLE_INIT; /* executable graphs past their first use */
static pthread_mutex_t work_lock = PTHREAD_MUTEX_INITIALIZER; /* adding to an entry */

static void add_work(CUgraphExec e, uint64_t bytes) {
    pthread_mutex_lock(&work_lock);
    uint64_t had = 0;
    qgpu_table_get(&work, (uintptr_t)e, &had, NULL);
    if (qgpu_table_put(&work, (uintptr_t)e, had + bytes, 0) != 0) { /* kept for good */
    }
    pthread_mutex_unlock(&work_lock);
}

void graph_work_begin(measure_t *m) { measure_call_begin(m); }

CUresult graph_work_done(CUresult r, CUgraphExec *e, measure_t *m) {
    uint64_t took = measure_call_took(m, r);
    if (r == CUDA_SUCCESS && e && *e && took) {
        if (ledger_reserve(took) != 0) {
            REAL(cuGraphExecDestroy)(*e);
            *e = NULL;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (qgpu_table_put(&work, (uintptr_t)*e, took, 0) != 0) { /* a new graph */
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
    pthread_mutex_lock(&work_lock);
    if (qgpu_table_take(&work, (uintptr_t)e, &bytes, NULL) == 0) ledger_release(bytes);
    qgpu_table_take(&uploaded, (uintptr_t)e, NULL, NULL);
    pthread_mutex_unlock(&work_lock);
}

int graph_work_first_use_begin(CUgraphExec e, CUstream s, measure_t *m) {
    if (!e || qgpu_table_get(&uploaded, (uintptr_t)e, NULL, NULL) == 0) return 0;
    int capturing = 0; /* launched into a capture: a node, nothing uploaded (later, then) */
    if (HAVE_REAL(cuStreamIsCapturing) && REAL(cuStreamIsCapturing)(s, &capturing) == CUDA_SUCCESS &&
        capturing)
        return 0;
    if (ledger_used() >= g_lim.mem_limit) return -1; /* at the cap: no more work past it */
    measure_call_begin(m);
    return 1;
}

CUresult graph_work_first_use_end(CUresult r, CUgraphExec e, measure_t *m) {
    uint64_t took = measure_call_took(m, r);
    if (r == CUDA_SUCCESS) {
        qgpu_table_put(&uploaded, (uintptr_t)e, 0, 0);
        if (took && ledger_reserve(took) != 0) {
            ledger_force(took); /* the driver holds it: charged past the cap */
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (took) add_work(e, took);
    }
    measure_call_done();
    return r;
}

void graph_work_first_use_abort(void) { measure_call_done(); }

CUresult graph_work_upload_first(CUgraphExec e, CUstream s, measure_t *m) {
    CUresult r = HAVE_REAL(cuGraphUpload) ? REAL(cuGraphUpload)(e, s) : CUDA_SUCCESS;
    return graph_work_first_use_end(r, e, m);
}
