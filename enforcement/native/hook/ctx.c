/* Context memory: a CUDA context costs device memory (hundreds of MiB on real cards, more on
 * GPUs that hold more threads, depending on driver and limits), and the driver takes it
 * through no allocation call. Each context a slice's process creates (cuCtxCreate v1..v4, a
 * green context, a primary context when it is first retained and again after a reset) is
 * charged the larger of QGPU_CONTEXT_MEMORY (default 512 MiB) and what the driver took for
 * it, measured like a load of device code (module.c: this process's memory in NVML's
 * per-process list before and after, under the process's memory lock held exclusively; the
 * libraries eager loading brings into the new context are in it too):
 *  - the configured size is a floor, charged before the driver is called: a slice without
 *    room for it never reaches the driver (no window in which the driver holds a context the
 *    slice cannot pay for), and where nothing can be measured (no NVML and no context yet to
 *    ask cuMemGetInfo) or the fallback measurement (the device's used memory) is made
 *    smaller by other processes' frees, the charge is still that;
 *  - what the driver took beyond it is charged after the call; when that does not fit, the
 *    context is destroyed again (released, for a primary context) and the call returns
 *    CUDA_ERROR_OUT_OF_MEMORY.
 * A green context is measured on its own: the hook retains the device's primary context first
 * (measured and charged as a primary context when that creates it), so the green context's
 * measurement is its own cost, and releases that retain when the green context is destroyed.
 * Raising a context's limits reserves more: the malloc heap
 * and printf FIFO by their growth, the stack by its growth times every thread the device can
 * hold at once (SMs x threads per SM), and the device runtime's pending launches and sync
 * depth by what the driver reserves for them (devrt_* below: a bound, or what the driver's
 * free memory shows it took, whichever is larger). All of it is given back when the context
 * is destroyed (cuCtxDestroy, the last primary release, a primary reset, cuGreenCtxDestroy),
 * together with the allocations the driver frees with it. A context on a device other than
 * the slice's GPU is refused (CUDA_ERROR_INVALID_DEVICE). */
#include "hook.h"

#define MAX_DEVICES 64
#define STACK_DEFAULT 1024ULL
#define PRINTF_FIFO_DEFAULT (1ULL << 20)
#define MALLOC_HEAP_DEFAULT (8ULL << 20)
#define ATTR_MULTIPROCESSOR_COUNT 16
#define ATTR_MAX_THREADS_PER_MULTIPROCESSOR 39

static qgpu_table_t ctx_charge = QGPU_TABLE_INIT; /* context -> bytes charged for it */
/* context | limit (3, 4) -> bytes charged for that device runtime limit (in ctx_charge too) */
static qgpu_table_t devrt_charge = QGPU_TABLE_INIT;
/* green context -> its CUcontext (tag: 1 + the device whose primary context the hook
 * retained for it, 0 when none) */
static qgpu_table_t green_ctx = QGPU_TABLE_INIT;
static struct {
    int refs, active;
    CUcontext ctx;
} primary[MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- a creation's charge: the configured floor before, what the driver took after ---- */

static int take_floor(void) { return ledger_reserve(g_lim.context_memory) == 0 ? 0 : -1; }

static void give_floor(void) { ledger_release(g_lim.context_memory); }

/* After the driver's call (the floor charged, the measurement begun): the context's charge
 * in *bytes, the larger of the floor and what the call took. 0, or -1 when what it took
 * beyond the floor does not fit (only the floor is charged then: undo the creation). The
 * memory lock stays held (measure_call_done). */
static int settle_created(measure_t *m, CUresult r, uint64_t *bytes) {
    uint64_t took = measure_call_took(m, r);
    *bytes = g_lim.context_memory;
    if (r != CUDA_SUCCESS || took <= *bytes) return 0;
    if (ledger_reserve(took - *bytes) != 0) return -1;
    *bytes = took;
    return 0;
}

static void note_context(CUcontext ctx, uint64_t bytes) {
    if (qgpu_table_put(&ctx_charge, (uintptr_t)ctx, bytes, 0) != 0) return; /* kept for good */
}

/* The driver destroyed `ctx`: its own charge and the memory allocated in it come back. */
static void context_gone(CUcontext ctx) {
    uint64_t bytes;
    if (qgpu_table_take(&ctx_charge, (uintptr_t)ctx, &bytes, NULL) == 0) ledger_release(bytes);
    qgpu_table_take(&devrt_charge, (uintptr_t)ctx | CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH, NULL, NULL);
    qgpu_table_take(&devrt_charge, (uintptr_t)ctx | CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, NULL,
                    NULL);
    mem_forget_ctx(ctx);
    ipc_forget_ctx(ctx);
    pool_forget_ctx(ctx);
    module_forget_ctx(ctx);
    lmem_forget(ctx);
}

#define CTX_CREATE(name, params, args)                                                       \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, args);                                                              \
        if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;                      \
        if (take_floor() != 0) return CUDA_ERROR_OUT_OF_MEMORY;                              \
        measure_t m;                                                                         \
        measure_call_begin(&m);                                                              \
        CUresult r = REAL(name)(args);                                                       \
        uint64_t bytes;                                                                      \
        int over = settle_created(&m, r, &bytes);                                            \
        if (r == CUDA_SUCCESS && pctx && over) { /* it took more than the slice has */       \
            if (HAVE_REAL(cuCtxDestroy_v2)) REAL(cuCtxDestroy_v2)(*pctx);                    \
            module_forget_ctx(*pctx);                                                        \
            r = CUDA_ERROR_OUT_OF_MEMORY;                                                    \
        }                                                                                    \
        measure_call_done();                                                                 \
        if (r != CUDA_SUCCESS || !pctx) {                                                    \
            give_floor();                                                                    \
            return r;                                                                        \
        }                                                                                    \
        note_context(*pctx, bytes);                                                          \
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
        HOOK_MEM_OP();                                                                       \
        CUresult r = REAL(name)(ctx);                                                        \
        if (r == CUDA_SUCCESS) context_gone(ctx);                                            \
        return r;                                                                            \
    }
CTX_DESTROY(cuCtxDestroy)
CTX_DESTROY(cuCtxDestroy_v2)

/* ---- primary contexts ----
 *
 * primary_lock is held around the driver's retain, release and reset, so the hook's view
 * (active, refs) changes together with the driver's. The memory lock is always taken first:
 * shared for a retain of an active primary context, a release or a reset; exclusively (a
 * measurement) for a retain that creates it. */

static CUresult primary_retain(CUcontext *pctx, CUdevice dev) {
    if (dev < 0 || dev >= MAX_DEVICES) return REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    for (;;) {
        int measured = !__atomic_load_n(&primary[dev].active, __ATOMIC_ACQUIRE), shared = 0;
        measure_t m;
        if (measured) measure_call_begin(&m);
        else shared = memop_begin();
        pthread_mutex_lock(&primary_lock);
        int creates = !primary[dev].active;
        if (creates && !measured) { /* reset meanwhile: measure this one */
            pthread_mutex_unlock(&primary_lock);
            memop_end(&shared);
            continue;
        }
        if (creates && take_floor() != 0) {
            pthread_mutex_unlock(&primary_lock);
            measure_call_done();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        CUresult r = REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
        uint64_t bytes = 0;
        int over = 0;
        if (creates) over = settle_created(&m, r, &bytes);
        if (r == CUDA_SUCCESS && pctx && over) { /* it took more than the slice has */
            if (HAVE_REAL(cuDevicePrimaryCtxRelease_v2)) REAL(cuDevicePrimaryCtxRelease_v2)(dev);
            module_forget_ctx(*pctx);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (r != CUDA_SUCCESS || !pctx) {
            if (creates) give_floor();
        } else {
            primary[dev].refs++;
            if (creates) {
                __atomic_store_n(&primary[dev].active, 1, __ATOMIC_RELEASE);
                primary[dev].ctx = *pctx;
                note_context(*pctx, bytes);
            }
        }
        pthread_mutex_unlock(&primary_lock);
        if (measured) measure_call_done();
        else memop_end(&shared);
        return r;
    }
}

QGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    HOOK_ENTER(cuDevicePrimaryCtxRetain, pctx, dev);
    if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return primary_retain(pctx, dev);
}

static void primary_gone_locked(CUdevice dev) {
    if (!primary[dev].active) return;
    __atomic_store_n(&primary[dev].active, 0, __ATOMIC_RELEASE);
    context_gone(primary[dev].ctx);
}

typedef CUresult (*device_fn)(CUdevice);

static CUresult primary_release(device_fn real, CUdevice dev) {
    HOOK_MEM_OP();
    if (dev < 0 || dev >= MAX_DEVICES) return real(dev);
    pthread_mutex_lock(&primary_lock);
    CUresult r = real(dev);
    if (r == CUDA_SUCCESS && primary[dev].refs > 0 && --primary[dev].refs == 0)
        primary_gone_locked(dev);
    pthread_mutex_unlock(&primary_lock);
    return r;
}

#define PRIMARY_RELEASE(name)                                                                \
    QGPU_EXPORT CUresult name(CUdevice dev) {                                                \
        HOOK_ENTER(name, dev);                                                               \
        return primary_release(REAL(name), dev);                                             \
    }
PRIMARY_RELEASE(cuDevicePrimaryCtxRelease)
PRIMARY_RELEASE(cuDevicePrimaryCtxRelease_v2)

/* A reset destroys the primary context now; retains stay counted and the next use creates
 * (and is charged for) a new one. */
#define PRIMARY_RESET(name)                                                                  \
    QGPU_EXPORT CUresult name(CUdevice dev) {                                                \
        HOOK_ENTER(name, dev);                                                               \
        HOOK_MEM_OP();                                                                       \
        if (dev < 0 || dev >= MAX_DEVICES) return REAL(name)(dev);                           \
        pthread_mutex_lock(&primary_lock);                                                   \
        CUresult r = REAL(name)(dev);                                                        \
        if (r == CUDA_SUCCESS) primary_gone_locked(dev);                                     \
        pthread_mutex_unlock(&primary_lock);                                                 \
        return r;                                                                            \
    }
PRIMARY_RESET(cuDevicePrimaryCtxReset)
PRIMARY_RESET(cuDevicePrimaryCtxReset_v2)

/* ---- green contexts ---- */

/* the hook's own retain of `dev`'s primary context for a green context, given back */
static void green_release_primary(CUdevice dev) {
    if (HAVE_REAL(cuDevicePrimaryCtxRelease_v2))
        primary_release(REAL(cuDevicePrimaryCtxRelease_v2), dev);
}

QGPU_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *out, CUdevResourceDesc desc, CUdevice dev,
                                      unsigned int flags) {
    HOOK_ENTER(cuGreenCtxCreate, out, desc, dev, flags);
    if (hook_foreign_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    /* the primary context it retains, first: charged as a primary context if it creates it */
    CUcontext prim;
    int retained = dev >= 0 && dev < MAX_DEVICES && HAVE_REAL(cuDevicePrimaryCtxRetain);
    if (retained) {
        CUresult p = primary_retain(&prim, dev);
        if (p != CUDA_SUCCESS) return p;
    }
    if (take_floor() != 0) {
        if (retained) green_release_primary(dev);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    measure_t m;
    measure_call_begin(&m);
    CUresult r = REAL(cuGreenCtxCreate)(out, desc, dev, flags);
    CUcontext as_ctx = NULL;
    if (r == CUDA_SUCCESS && out && HAVE_REAL(cuCtxFromGreenCtx))
        REAL(cuCtxFromGreenCtx)(&as_ctx, *out);
    uint64_t bytes;
    int over = settle_created(&m, r, &bytes);
    if (r == CUDA_SUCCESS && out && over) { /* it took more than the slice has */
        if (HAVE_REAL(cuGreenCtxDestroy)) REAL(cuGreenCtxDestroy)(*out);
        module_forget_ctx(as_ctx);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    measure_call_done();
    if (r != CUDA_SUCCESS || !out) {
        give_floor();
        if (retained) green_release_primary(dev);
        return r;
    }
    note_context((CUcontext)(void *)*out, bytes);
    /* not remembered (no room in the table): the retain and the charge are kept for good */
    qgpu_table_put(&green_ctx, (uintptr_t)*out, (uint64_t)(uintptr_t)as_ctx,
                   retained ? (int64_t)dev + 1 : 0);
    return r;
}

QGPU_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx g) {
    HOOK_ENTER(cuGreenCtxDestroy, g);
    HOOK_MEM_OP();
    CUresult r = REAL(cuGreenCtxDestroy)(g);
    if (r != CUDA_SUCCESS) return r;
    uint64_t as_ctx = 0;
    int64_t dev1 = 0;
    if (qgpu_table_take(&green_ctx, (uintptr_t)g, &as_ctx, &dev1) == 0 && as_ctx)
        context_gone((CUcontext)(uintptr_t)as_ctx);
    context_gone((CUcontext)(void *)g);
    if (dev1 > 0) green_release_primary((CUdevice)(dev1 - 1));
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

uint64_t ctx_stack_cost(CUcontext ctx, uint64_t per_thread) {
    CUcontext cur = mem_current_ctx();
    int pushed = ctx && ctx != cur && HAVE_REAL(cuCtxPushCurrent_v2) &&
                 REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS; /* its device's threads */
    uint64_t cost = limit_cost(CU_LIMIT_STACK_SIZE, per_thread);
    if (pushed) {
        CUcontext popped;
        REAL(cuCtxPopCurrent_v2)(&popped);
    }
    return cost;
}

/* ---- the device runtime's reservations ----
 *
 * CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT and CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH make the
 * driver reserve device memory (cuda.h: "large amounts"), how much per launch or level
 * NVIDIA does not publish. The hook charges the larger of:
 *  - a bound: 16 KiB per pending launch above the default 2048 (a launch record and up to
 *    4 KiB of parameters, with room to spare), and 8 KiB per thread the device can hold at
 *    once per sync level above the default 2 (the saved state of every live parent thread);
 *  - what the driver took: the card's free memory (the driver's own cuMemGetInfo) just before
 *    and just after the call. Another process freeing memory at that moment makes the
 *    difference smaller, never the charge (the bound stays); one allocating makes it larger
 *    (an over-charge of this slice, never of another).
 * The bound is charged before the call (refused over the cap); more, when the driver shows
 * it took more, after it: if that does not fit, the limit is set back and the call refused.
 * Lowering a limit gives back its share: the bound for the new value, or the old charge
 * scaled to the new value, whichever is larger. Calls are serialised in the process, so two
 * threads' measurements never overlap. */
#define SYNC_DEPTH_DEFAULT 2ULL
#define SYNC_DEPTH_MAX 24ULL
#define PENDING_DEFAULT 2048ULL
#define DEVRT_LAUNCH_BOUND (16ULL << 10)
#define DEVRT_SYNC_THREAD_BOUND (8ULL << 10)

static pthread_mutex_t devrt_lock = PTHREAD_MUTEX_INITIALIZER;

void ctx_charge_add(CUcontext ctx, uint64_t bytes) {
    if (!bytes) return;
    pthread_mutex_lock(&devrt_lock); /* one writer of the context's charge at a time */
    uint64_t held = 0;
    qgpu_table_get(&ctx_charge, (uintptr_t)ctx, &held, NULL);
    if (qgpu_table_put(&ctx_charge, (uintptr_t)ctx, held + bytes, 0) != 0) { /* kept for good */
    }
    pthread_mutex_unlock(&devrt_lock);
}

static uint64_t devrt_default(int limit) {
    return limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH ? SYNC_DEPTH_DEFAULT : PENDING_DEFAULT;
}

/* the hook's bound for a value (UINT64_MAX when it cannot be represented) */
static uint64_t devrt_bound(int limit, uint64_t value) {
    uint64_t base = devrt_default(limit), per = DEVRT_LAUNCH_BOUND, cost;
    if (limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH && value > SYNC_DEPTH_MAX)
        value = SYNC_DEPTH_MAX; /* cuda.h's maximum: the driver refuses or clamps above it */
    if (value <= base) return 0;
    if (limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH &&
        hook_mul(threads_on_device(), DEVRT_SYNC_THREAD_BOUND, &per) != 0)
        return UINT64_MAX;
    return hook_mul(value - base, per, &cost) ? UINT64_MAX : cost;
}

/* the card's free memory as the driver reports it; 0 when it cannot say */
static int card_free(uint64_t *out) {
    size_t f = 0, t = 0;
    if (!HAVE_REAL(cuMemGetInfo_v2) || REAL(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS) return -1;
    *out = f;
    return 0;
}

/* held for `old`, scaled to `now` (both above the default) */
static uint64_t scaled(uint64_t held, uint64_t old, uint64_t now, uint64_t base) {
    if (old <= base || now <= base) return 0;
    return (uint64_t)((unsigned __int128)held * (now - base) / (old - base));
}

/* The charge for the limit after the driver set it to `now` (was `old`, charged `held`). */
static uint64_t devrt_target(int limit, uint64_t old, uint64_t now, uint64_t held, int measured,
                             uint64_t took) {
    uint64_t target = devrt_bound(limit, now);
    if (now > old && measured && held + took > target) target = held + took;
    if (now < old) {
        uint64_t keep = scaled(held, old, now, devrt_default(limit));
        if (keep > target) target = keep;
    }
    return target;
}

static CUresult set_devrt_limit(int limit, size_t value) {
    size_t old = devrt_default(limit);
    /* a limit the device does not have (the sync depth from compute capability 9.0) is
     * refused as the driver would, before anything is charged or reaches it */
    if (HAVE_REAL(cuCtxGetLimit) && REAL(cuCtxGetLimit)(&old, limit) == CUDA_ERROR_UNSUPPORTED_LIMIT)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    CUcontext ctx = mem_current_ctx();
    uint64_t key = (uintptr_t)ctx | (uint64_t)limit, held = 0;
    pthread_mutex_lock(&devrt_lock);
    qgpu_table_get(&devrt_charge, key, &held, NULL);
    uint64_t want = devrt_bound(limit, value), pre = want > held ? want - held : 0;
    if (want == UINT64_MAX || (pre && ledger_reserve(pre) != 0)) {
        pthread_mutex_unlock(&devrt_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t f0 = 0, f1 = 0;
    int m0 = card_free(&f0);
    CUresult r = REAL(cuCtxSetLimit)(limit, value);
    int m1 = card_free(&f1);
    if (r != CUDA_SUCCESS) {
        ledger_release(pre);
        pthread_mutex_unlock(&devrt_lock);
        return r;
    }
    size_t now = value; /* what the driver set (it may clamp or round) */
    if (HAVE_REAL(cuCtxGetLimit)) REAL(cuCtxGetLimit)(&now, limit);
    uint64_t target = devrt_target(limit, old, now, held, m0 == 0 && m1 == 0,
                                   f0 > f1 ? f0 - f1 : 0);
    uint64_t have = held + pre;
    if (target > have && ledger_reserve(target - have) != 0) {
        REAL(cuCtxSetLimit)(limit, old); /* the driver took more than the slice has */
        ledger_release(pre);
        pthread_mutex_unlock(&devrt_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (target < have) ledger_release(have - target);
    if (target) qgpu_table_put(&devrt_charge, key, target, 0);
    else qgpu_table_take(&devrt_charge, key, NULL, NULL);
    uint64_t total = 0;
    qgpu_table_get(&ctx_charge, (uintptr_t)ctx, &total, NULL);
    if (target >= held)
        total += target - held;
    else
        total = total > held - target ? total - (held - target) : 0;
    qgpu_table_put(&ctx_charge, (uintptr_t)ctx, total, 0);
    pthread_mutex_unlock(&devrt_lock);
    return r;
}

QGPU_EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    HOOK_ENTER(cuCtxSetLimit, limit, value);
    HOOK_MEM_OP();
    if (limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH || limit == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT)
        return set_devrt_limit(limit, value);
    if (limit < CU_LIMIT_STACK_SIZE || limit > CU_LIMIT_MALLOC_HEAP_SIZE || !HAVE_REAL(cuCtxGetLimit))
        return REAL(cuCtxSetLimit)(limit, value);
    size_t old = 0;
    if (REAL(cuCtxGetLimit)(&old, limit) != CUDA_SUCCESS) return REAL(cuCtxSetLimit)(limit, value);
    CUcontext ctx = mem_current_ctx();
    uint64_t was = old, will = value; /* the stack: the context's local memory (lmem.c) */
    if (limit == CU_LIMIT_STACK_SIZE) lmem_stack_reservation(ctx, value, &was, &will);
    uint64_t before = limit_cost(limit, was), after = limit_cost(limit, will);
    if (after == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    if (after > before && ledger_reserve(after - before) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuCtxSetLimit)(limit, value);
    if (r != CUDA_SUCCESS) {
        if (after > before) ledger_release(after - before);
        return r;
    }
    if (limit == CU_LIMIT_STACK_SIZE) lmem_stack_set(ctx, value);
    uint64_t held = 0;
    pthread_mutex_lock(&devrt_lock); /* one writer of the context's charge at a time */
    qgpu_table_get(&ctx_charge, (uintptr_t)ctx, &held, NULL);
    if (after < before) {
        ledger_release(before - after);
        held = held > before - after ? held - (before - after) : 0;
    } else {
        held += after - before;
    }
    qgpu_table_put(&ctx_charge, (uintptr_t)ctx, held, 0);
    pthread_mutex_unlock(&devrt_lock);
    return r;
}
