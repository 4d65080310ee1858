/* Legacy CUDA IPC: memory another process allocated and exported (cuIpcGetMemHandle), opened
 * here (cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2). cuda.h makes freeing it in the exporter
 * before every importer closed it undefined behaviour, and a driver may then keep it for the
 * importers, also after the exporter died: so an open mapping is charged to the importing
 * slice, its size read back with cuMemGetAddressRange, from the open until its last
 * cuIpcCloseMemHandle (the driver counts repeated opens in one context as references to one
 * pointer) or until its context is destroyed. Over the cap the open is undone and refused
 * with CUDA_ERROR_OUT_OF_MEMORY. The exporter keeps its own charge while its allocation
 * lives; memory both hold is charged twice, never not at all. */
#include <stdlib.h>

#include "hook.h"

typedef struct {
    CUdeviceptr ptr;
    uint64_t size;
    int count; /* opens not yet closed */
    CUcontext ctx;
} ipc_open_t;

static ipc_open_t *opens;
static size_t nopens, cap_opens;
static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;

static ipc_open_t *find(CUdeviceptr ptr) {
    for (size_t i = 0; i < nopens; i++)
        if (opens[i].ptr == ptr) return &opens[i];
    return NULL;
}

/* after the driver opened `ptr`: a reference more, or a new charge */
static CUresult charge_open(CUdeviceptr ptr, CUresult (*close_fn)(CUdeviceptr)) {
    CUcontext ctx = mem_current_ctx();
    pthread_mutex_lock(&ipc_lock);
    ipc_open_t *o = find(ptr);
    if (o && o->ctx == ctx) {
        o->count++;
        pthread_mutex_unlock(&ipc_lock);
        return CUDA_SUCCESS;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = HAVE_REAL(cuMemGetAddressRange_v2)
                     ? REAL(cuMemGetAddressRange_v2)(&base, &size, ptr)
                     : CUDA_ERROR_NOT_SUPPORTED;
    if (r != CUDA_SUCCESS || !size) r = CUDA_ERROR_NOT_SUPPORTED; /* cannot tell: refuse */
    else if (ledger_reserve(size) != 0) r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS && nopens == cap_opens) {
        size_t nc = cap_opens ? cap_opens * 2 : 16;
        ipc_open_t *p = realloc(opens, nc * sizeof *p);
        if (p) {
            opens = p;
            cap_opens = nc;
        } else {
            ledger_release(size);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r == CUDA_SUCCESS) opens[nopens++] = (ipc_open_t){ptr, size, 1, ctx};
    pthread_mutex_unlock(&ipc_lock);
    if (r != CUDA_SUCCESS && close_fn) close_fn(ptr); /* undo the open: nothing is held */
    return r;
}

#define IPC_OPEN(name)                                                                       \
    QGPU_EXPORT CUresult name(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags) { \
        HOOK_ENTER(name, pdptr, handle, flags);                                              \
        HOOK_MEM_OP();                                                                       \
        CUresult r = REAL(name)(pdptr, handle, flags);                                       \
        if (r != CUDA_SUCCESS || !pdptr) return r;                                           \
        return charge_open(*pdptr, REAL(cuIpcCloseMemHandle));                               \
    }

IPC_OPEN(cuIpcOpenMemHandle)
IPC_OPEN(cuIpcOpenMemHandle_v2)

QGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    HOOK_ENTER(cuIpcCloseMemHandle, dptr);
    HOOK_MEM_OP();
    CUresult r = REAL(cuIpcCloseMemHandle)(dptr);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&ipc_lock);
    ipc_open_t *o = find(dptr);
    if (o && --o->count <= 0) {
        ledger_release(o->size);
        *o = opens[--nopens];
    }
    pthread_mutex_unlock(&ipc_lock);
    return r;
}

void ipc_forget_ctx(CUcontext ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&ipc_lock);
    for (size_t i = 0; i < nopens;) {
        if (opens[i].ctx == ctx) {
            ledger_release(opens[i].size);
            opens[i] = opens[--nopens];
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&ipc_lock);
}
