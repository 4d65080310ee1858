/* Context memory: a CUDA context costs device memory (hundreds of MiB on real cards), so each
 * context a slice's process creates is charged QGPU_CONTEXT_MEMORY (default 512 MiB):
 * cuCtxCreate (v1..v4) and green contexts when created, a primary context when it is first
 * retained (again after a reset). Raising a context's limits reserves more: the malloc heap
 * and printf FIFO by their growth, the stack by its growth times every thread the device can
 * hold at once (SMs x threads per SM). All of it is charged before the driver call (refused
 * with CUDA_ERROR_OUT_OF_MEMORY over the cap) and given back when the context is destroyed
 * (cuCtxDestroy, the last primary release, a primary reset, cuGreenCtxDestroy), together with
 * the allocations the driver frees with it. A context on a device other than the slice's GPU
 * is refused (CUDA_ERROR_INVALID_DEVICE). */
#include "hook.h"

#define MAX_DEVICES 64
#define STACK_DEFAULT 1024ULL
#define PRINTF_FIFO_DEFAULT (1ULL << 20)
#define MALLOC_HEAP_DEFAULT (8ULL << 20)
#define ATTR_MULTIPROCESSOR_COUNT 16
#define ATTR_MAX_THREADS_PER_MULTIPROCESSOR 39

static qgpu_table_t ctx_charge = QGPU_TABLE_INIT; /* context -> bytes charged for it */
static qgpu_table_t green_ctx = QGPU_TABLE_INIT;  /* green context -> its CUcontext */
static struct {
    int refs, active;
    CUcontext ctx;
} primary[MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

static int take_context_charge(void) {
    return ledger_reserve(g_lim.context_memory) == 0 ? 0 : -1;
}

static void note_context(CUcontext ctx, uint64_t bytes) {
    if (qgpu_table_put(&ctx_charge, (uintptr_t)ctx, bytes, 0) != 0) return; /* kept for good */
}

/* The driver destroyed `ctx`: its own charge and the memory allocated in it come back. */
static void context_gone(CUcontext ctx) {
    uint64_t bytes;
    if (qgpu_table_take(&ctx_charge, (uintptr_t)ctx, &bytes, NULL) == 0) ledger_release(bytes);
    mem_forget_ctx(ctx);
    ipc_forget_ctx(ctx);
}

#define CTX_CREATE(name, params, args)                                                       \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, args);                                                              \
        if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;                      \
        if (take_context_charge() != 0) return CUDA_ERROR_OUT_OF_MEMORY;                     \
        CUresult r = REAL(name)(args);                                                       \
        if (r != CUDA_SUCCESS || !pctx) {                                                    \
            ledger_release(g_lim.context_memory);                                            \
            return r;                                                                        \
        }                                                                                    \
        note_context(*pctx, g_lim.context_memory);                                           \
        return r;                                                                            \
    }
#define ARGS(...) __VA_ARGS__
CTX_CREATE(cuCtxCreate, (CUcontext * pctx, unsigned int flags, CUdevice dev), ARGS(pctx, flags, dev))
CTX_CREATE(cuCtxCreate_v2, (CUcontext * pctx, unsigned int flags, CUdevice dev),
           ARGS(pctx, flags, dev))
CTX_CREATE(cuCtxCreate_v3,
           (CUcontext * pctx, void *params, int nparams, unsigned int flags, CUdevice dev),
           ARGS(pctx, params, nparams, flags, dev))
CTX_CREATE(cuCtxCreate_v4, (CUcontext * pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev),
           ARGS(pctx, params, flags, dev))

#define CTX_DESTROY(name)                                                                    \
    QGPU_EXPORT CUresult name(CUcontext ctx) {                                               \
        HOOK_ENTER(name, ctx);                                                               \
        CUresult r = REAL(name)(ctx);                                                        \
        if (r == CUDA_SUCCESS) context_gone(ctx);                                            \
        return r;                                                                            \
    }
CTX_DESTROY(cuCtxDestroy)
CTX_DESTROY(cuCtxDestroy_v2)

QGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    HOOK_ENTER(cuDevicePrimaryCtxRetain, pctx, dev);
    if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (dev < 0 || dev >= MAX_DEVICES) return REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    pthread_mutex_lock(&primary_lock);
    int creates = !primary[dev].active;
    if (creates && take_context_charge() != 0) {
        pthread_mutex_unlock(&primary_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    if (r != CUDA_SUCCESS || !pctx) {
        if (creates) ledger_release(g_lim.context_memory);
    } else {
        primary[dev].refs++;
        if (creates) {
            primary[dev].active = 1;
            primary[dev].ctx = *pctx;
            note_context(*pctx, g_lim.context_memory);
        }
    }
    pthread_mutex_unlock(&primary_lock);
    return r;
}

static void primary_gone_locked(CUdevice dev) {
    if (!primary[dev].active) return;
    primary[dev].active = 0;
    context_gone(primary[dev].ctx);
}

#define PRIMARY_RELEASE(name)                                                                \
    QGPU_EXPORT CUresult name(CUdevice dev) {                                                \
        HOOK_ENTER(name, dev);                                                               \
        CUresult r = REAL(name)(dev);                                                        \
        if (r != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES) return r;                    \
        pthread_mutex_lock(&primary_lock);                                                   \
        if (primary[dev].refs > 0 && --primary[dev].refs == 0) primary_gone_locked(dev);     \
        pthread_mutex_unlock(&primary_lock);                                                 \
        return r;                                                                            \
    }
PRIMARY_RELEASE(cuDevicePrimaryCtxRelease)
PRIMARY_RELEASE(cuDevicePrimaryCtxRelease_v2)

/* A reset destroys the primary context now; retains stay counted and the next use creates
 * (and is charged for) a new one. */
#define PRIMARY_RESET(name)                                                                  \
    QGPU_EXPORT CUresult name(CUdevice dev) {                                                \
        HOOK_ENTER(name, dev);                                                               \
        CUresult r = REAL(name)(dev);                                                        \
        if (r != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES) return r;                    \
        pthread_mutex_lock(&primary_lock);                                                   \
        primary_gone_locked(dev);                                                            \
        pthread_mutex_unlock(&primary_lock);                                                 \
        return r;                                                                            \
    }
PRIMARY_RESET(cuDevicePrimaryCtxReset)
PRIMARY_RESET(cuDevicePrimaryCtxReset_v2)

QGPU_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *out, CUdevResourceDesc desc, CUdevice dev,
                                      unsigned int flags) {
    HOOK_ENTER(cuGreenCtxCreate, out, desc, dev, flags);
    if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (take_context_charge() != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuGreenCtxCreate)(out, desc, dev, flags);
    if (r != CUDA_SUCCESS || !out) {
        ledger_release(g_lim.context_memory);
        return r;
    }
    note_context((CUcontext)(void *)*out, g_lim.context_memory);
    CUcontext as_ctx = NULL;
    if (HAVE_REAL(cuCtxFromGreenCtx) && REAL(cuCtxFromGreenCtx)(&as_ctx, *out) == CUDA_SUCCESS)
        qgpu_table_put(&green_ctx, (uintptr_t)*out, (uint64_t)(uintptr_t)as_ctx, 0);
    return r;
}

QGPU_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx g) {
    HOOK_ENTER(cuGreenCtxDestroy, g);
    CUresult r = REAL(cuGreenCtxDestroy)(g);
    if (r != CUDA_SUCCESS) return r;
    uint64_t as_ctx = 0;
    if (qgpu_table_take(&green_ctx, (uintptr_t)g, &as_ctx, NULL) == 0 && as_ctx)
        context_gone((CUcontext)(uintptr_t)as_ctx);
    context_gone((CUcontext)(void *)g);
    return r;
}

/* ---- limits that reserve device memory ---- */

static uint64_t threads_on_device(void) {
    CUdevice dev;
    int sms = 0, per = 0;
    if (!HAVE_REAL(cuCtxGetDevice) || !HAVE_REAL(cuDeviceGetAttribute) ||
        REAL(cuCtxGetDevice)(&dev) != CUDA_SUCCESS ||
        REAL(cuDeviceGetAttribute)(&sms, ATTR_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
        REAL(cuDeviceGetAttribute)(&per, ATTR_MAX_THREADS_PER_MULTIPROCESSOR, dev) != CUDA_SUCCESS ||
        sms <= 0 || per <= 0)
        return 2048ULL * 256; /* unknown: a large GPU */
    return (uint64_t)sms * (uint64_t)per;
}

/* device memory a limit value reserves beyond what the context's own cost covers;
 * UINT64_MAX when it cannot be represented */
static uint64_t limit_cost(int limit, uint64_t value) {
    uint64_t base = limit == CU_LIMIT_STACK_SIZE       ? STACK_DEFAULT
                    : limit == CU_LIMIT_PRINTF_FIFO_SIZE ? PRINTF_FIFO_DEFAULT
                                                         : MALLOC_HEAP_DEFAULT;
    if (value <= base) return 0;
    uint64_t per = limit == CU_LIMIT_STACK_SIZE ? threads_on_device() : 1, cost;
    return hook_mul(value - base, per, &cost) ? UINT64_MAX : cost;
}

QGPU_EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    HOOK_ENTER(cuCtxSetLimit, limit, value);
    if (limit < CU_LIMIT_STACK_SIZE || limit > CU_LIMIT_MALLOC_HEAP_SIZE || !HAVE_REAL(cuCtxGetLimit))
        return REAL(cuCtxSetLimit)(limit, value);
    size_t old = 0;
    if (REAL(cuCtxGetLimit)(&old, limit) != CUDA_SUCCESS) return REAL(cuCtxSetLimit)(limit, value);
    uint64_t before = limit_cost(limit, old), after = limit_cost(limit, value);
    if (after == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    if (after > before && ledger_reserve(after - before) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuCtxSetLimit)(limit, value);
    if (r != CUDA_SUCCESS) {
        if (after > before) ledger_release(after - before);
        return r;
    }
    CUcontext ctx = mem_current_ctx();
    uint64_t held = 0;
    qgpu_table_get(&ctx_charge, (uintptr_t)ctx, &held, NULL);
    if (after < before) {
        ledger_release(before - after);
        held = held > before - after ? held - (before - after) : 0;
    } else {
        held += after - before;
    }
    qgpu_table_put(&ctx_charge, (uintptr_t)ctx, held, 0);
    return r;
}
