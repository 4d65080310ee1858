/* Legacy CUDA IPC of the simulated driver: cuIpcGetMemHandle names a cuMemAlloc'ed
 * allocation with a 64-byte handle another process opens (cuIpcOpenMemHandle) and closes
 * (cuIpcCloseMemHandle). The allocation becomes an entry of the GPU's shared table (shared.c),
 * which keeps its memory while the exporter holds it or any importer has it open; freeing it
 * in the exporter first is undefined behaviour by cuda.h, and the simulator keeps it (the
 * worst case for a memory cap). Like NVIDIA's driver: only the base of a cuMemAlloc'ed
 * allocation can be exported (not managed, pool or VMM memory); a handle cannot be opened in
 * the process that exported it; opening it again in a context returns the same pointer and
 * counts a reference; a context's open mappings close with it. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"

#define IPC_MAGIC 0x3143504955504751ULL /* "QGPUIPC1" */

typedef struct {
    uint64_t magic;
    uint32_t gidx, idx;
    uint64_t id, token;
    int32_t pid; /* the exporter */
    uint32_t pad;
} ipc_blob_t;
_Static_assert(sizeof(ipc_blob_t) <= sizeof(CUipcMemHandle), "fits a CUipcMemHandle");

/* what this process exported: pointer -> (bytes, packed entry) */
static qgpu_table_t exported = QGPU_TABLE_INIT;

static int64_t pack(int gidx, int idx, uint64_t id) {
    return (int64_t)((id << 24) | ((uint64_t)idx << 8) | (uint64_t)gidx);
}
static int packed_gidx(int64_t t) { return (int)(t & 0xff); }
static int packed_idx(int64_t t) { return (int)((t >> 8) & 0xffff); }
static uint64_t packed_id(int64_t t) { return (uint64_t)t >> 24; }

typedef struct {
    uint64_t ptr, size, id;
    int gidx, idx, count;
    struct CUctx_st *ctx;
} ipc_open_t;

static ipc_open_t *opens;
static size_t nopens, cap_opens;
static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;

static void let_go(int gidx, int idx, uint64_t id) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    if (sim_shared_alive(st, idx, id)) sim_shared_ref(st, idx, -1);
    sim_state_unlock(st);
}

int sim_ipc_freed(uint64_t ptr) {
    int64_t tag;
    if (qgpu_table_take(&exported, ptr, NULL, &tag) != 0) return 0;
    let_go(packed_gidx(tag), packed_idx(tag), packed_id(tag));
    return 1;
}

void sim_ipc_forget_ctx(struct CUctx_st *ctx) {
    pthread_mutex_lock(&ipc_lock);
    for (size_t i = 0; i < nopens;) {
        if (opens[i].ctx == ctx) {
            let_go(opens[i].gidx, opens[i].idx, opens[i].id);
            opens[i] = opens[--nopens];
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&ipc_lock);
}

int sim_ipc_range(uint64_t addr, uint64_t *base, uint64_t *size) {
    int r = -1;
    pthread_mutex_lock(&ipc_lock);
    for (size_t i = 0; i < nopens && r; i++) {
        if (addr < opens[i].ptr || addr - opens[i].ptr >= opens[i].size) continue;
        *base = opens[i].ptr;
        *size = opens[i].size;
        r = 0;
    }
    pthread_mutex_unlock(&ipc_lock);
    return r;
}

SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!sim_current_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    uint64_t size;
    int gidx;
    r = sim_ipc_source(dptr, &size, &gidx);
    if (r) return r;
    sim_gpu_state_t *st = g_sim_state[gidx];
    ipc_blob_t b = {.magic = IPC_MAGIC, .gidx = (uint32_t)gidx, .pid = getpid()};
    int64_t tag;
    pthread_mutex_lock(&ipc_lock);
    sim_state_lock(st);
    if (qgpu_table_get(&exported, dptr, NULL, &tag) == 0 &&
        sim_shared_alive(st, packed_idx(tag), packed_id(tag))) { /* exported before: same handle */
        b.idx = (uint32_t)packed_idx(tag);
        b.id = packed_id(tag);
    } else {
        int idx = sim_shared_publish(st, size, SIM_SHARE_IPC, 0, 1, &b.id);
        if (idx < 0 || qgpu_table_put(&exported, dptr, size, pack(gidx, idx, b.id)) != 0) {
            if (idx >= 0) memset(&st->shared[idx], 0, sizeof st->shared[idx]); /* still ours */
            sim_state_unlock(st);
            pthread_mutex_unlock(&ipc_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        b.idx = (uint32_t)idx;
    }
    b.token = st->shared[b.idx].token;
    sim_state_unlock(st);
    pthread_mutex_unlock(&ipc_lock);
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &b, sizeof b);
    return CUDA_SUCCESS;
}

static CUresult ipc_open(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *ctx = sim_current_ctx();
    if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!pdptr || (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return CUDA_ERROR_INVALID_VALUE;
    ipc_blob_t b;
    memcpy(&b, handle.reserved, sizeof b);
    if (b.magic != IPC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    if (b.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* not in the exporting process */
    if (b.gidx >= (uint32_t)g_sim_cfg.ngpus || !g_sim_state[b.gidx]) return CUDA_ERROR_INVALID_HANDLE;
    int gidx = (int)b.gidx, idx = (int)b.idx;
    pthread_mutex_lock(&ipc_lock);
    for (size_t i = 0; i < nopens; i++) {
        if (opens[i].ctx == ctx && opens[i].gidx == gidx && opens[i].idx == idx &&
            opens[i].id == b.id) { /* opened by this context already: one more reference */
            opens[i].count++;
            *pdptr = opens[i].ptr;
            pthread_mutex_unlock(&ipc_lock);
            return CUDA_SUCCESS;
        }
    }
    if (nopens == cap_opens) {
        size_t nc = cap_opens ? cap_opens * 2 : 16;
        ipc_open_t *p = realloc(opens, nc * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&ipc_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        opens = p;
        cap_opens = nc;
    }
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    const sim_shared_t *e = &st->shared[idx < SIM_MAX_SHARED ? idx : 0];
    if (!sim_shared_alive(st, idx, b.id) || e->token != b.token || e->kind != SIM_SHARE_IPC) {
        sim_state_unlock(st);
        pthread_mutex_unlock(&ipc_lock);
        return CUDA_ERROR_INVALID_HANDLE; /* freed, or never exported */
    }
    sim_shared_ref(st, idx, 1);
    uint64_t size = e->size;
    sim_state_unlock(st);
    uint64_t ptr = sim_next_address(size);
    opens[nopens++] = (ipc_open_t){ptr, size, b.id, gidx, idx, 1, ctx};
    pthread_mutex_unlock(&ipc_lock);
    *pdptr = ptr;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                          unsigned int flags) {
    return ipc_open(pdptr, handle, flags);
}

SIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                       unsigned int flags) {
    return ipc_open(pdptr, handle, flags);
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    CUresult r = sim_check_init();
    if (r) return r;
    pthread_mutex_lock(&ipc_lock);
    for (size_t i = 0; i < nopens; i++) {
        if (opens[i].ptr != dptr) continue;
        if (--opens[i].count == 0) {
            let_go(opens[i].gidx, opens[i].idx, opens[i].id);
            opens[i] = opens[--nopens];
        }
        pthread_mutex_unlock(&ipc_lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&ipc_lock);
    return CUDA_ERROR_INVALID_VALUE;
}
