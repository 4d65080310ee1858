/* Memory hard cap for plain allocations (cuMemAlloc v1/v2, pitch v1/v2, managed, arrays
 * v1/v2, 3D arrays v1/v2, mipmapped arrays): every allocation is charged to the slice ledger
 * before the real call (so concurrent processes cannot overshoot together) and released on
 * its free, or when its context is destroyed (the driver frees a context's memory with it).
 * Sizes are computed without wrapping: a size that overflows is refused. Over the cap the call
 * returns CUDA_ERROR_OUT_OF_MEMORY without reaching the driver; ledger_reserve counts each such
 * refusal in the slice ledger (oom_refusals). The slice's view of memory (cuMemGetInfo v1/v2,
 * cuDeviceTotalMem v1/v2) is the cap. */
#include "hook.h"

static qgpu_table_t allocs = QGPU_TABLE_INIT; /* address -> (bytes, context) */

CUcontext mem_current_ctx(void) {
    CUcontext c = NULL;
    if (HAVE_REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&c);
    return c;
}

static void track_in(uint64_t key, uint64_t size, CUcontext ctx) {
    if (qgpu_table_put(&allocs, key, size, (int64_t)(uintptr_t)ctx) != 0) ledger_release(size);
}

void mem_track(uint64_t key, uint64_t size) { track_in(key, size, mem_current_ctx()); }

static void untrack(uint64_t key) {
    uint64_t size;
    if (qgpu_table_take(&allocs, key, &size, NULL) == 0) ledger_release(size);
}

void mem_untrack_if_tracked(uint64_t key) { untrack(key); }

static uintptr_t dying;
static pthread_mutex_t dying_lock = PTHREAD_MUTEX_INITIALIZER;
static int of_dying(uint64_t key, uint64_t size, int64_t tag) {
    (void)key;
    (void)size;
    return (uintptr_t)tag == dying;
}

void mem_forget_ctx(CUcontext ctx) {
    if (!ctx) return;
    pthread_mutex_lock(&dying_lock);
    dying = (uintptr_t)ctx;
    qgpu_entry_t taken[256];
    size_t n;
    do {
        n = qgpu_table_take_if(&allocs, of_dying, taken, 256);
        for (size_t i = 0; i < n; i++) ledger_release(taken[i].size);
    } while (n == 256);
    pthread_mutex_unlock(&dying_lock);
}

#define CHARGE(bytes)                                                                        \
    do {                                                                                     \
        if ((bytes) == 0) break;                                                             \
        if (ledger_reserve(bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;                     \
    } while (0)

#define SETTLE(r, bytes, key)                                                                \
    do {                                                                                     \
        if ((r) == CUDA_SUCCESS)                                                             \
            mem_track((uint64_t)(key), bytes);                                               \
        else if (bytes)                                                                      \
            ledger_release(bytes);                                                           \
    } while (0)

QGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    HOOK_ENTER(cuMemAlloc_v2, dptr, size);
    HOOK_MEM_OP();
    CHARGE(size);
    CUresult r = REAL(cuMemAlloc_v2)(dptr, size);
    SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);
    return r;
}

QGPU_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size) {
    HOOK_ENTER(cuMemAlloc, dptr, size);
    HOOK_MEM_OP();
    CHARGE(size);
    CUresult r = REAL(cuMemAlloc)(dptr, size);
    SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);
    return r;
}

/* The driver picks the pitch: charge the unpadded size first, then the padding. */
static CUresult pitch_settle(CUresult r, uint64_t guess, uint64_t pitch, uint64_t height,
                             uint64_t key, int v1) {
    if (r != CUDA_SUCCESS) {
        ledger_release(guess);
        return r;
    }
    uint64_t actual;
    if (hook_mul(pitch, height, &actual) != 0 || (actual > guess && ledger_reserve(actual - guess) != 0)) {
        if (v1 && HAVE_REAL(cuMemFree)) REAL(cuMemFree)((CUdeviceptr_v1)key);
        if (!v1 && HAVE_REAL(cuMemFree_v2)) REAL(cuMemFree_v2)(key);
        ledger_release(guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < guess) ledger_release(guess - actual);
    mem_track(key, actual);
    return r;
}

QGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem) {
    HOOK_ENTER(cuMemAllocPitch_v2, dptr, pitch, width, height, elem);
    HOOK_MEM_OP();
    uint64_t guess;
    if (hook_mul(width, height, &guess) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CHARGE(guess);
    CUresult r = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem);
    return pitch_settle(r, guess, r ? 0 : *pitch, height, r ? 0 : *dptr, 0);
}

QGPU_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                     unsigned int height, unsigned int elem) {
    HOOK_ENTER(cuMemAllocPitch, dptr, pitch, width, height, elem);
    HOOK_MEM_OP();
    uint64_t guess = (uint64_t)width * height; /* 32 x 32 bits: cannot wrap */
    CHARGE(guess);
    CUresult r = REAL(cuMemAllocPitch)(dptr, pitch, width, height, elem);
    return pitch_settle(r, guess, r ? 0 : *pitch, height, r ? 0 : *dptr, 1);
}

QGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    HOOK_ENTER(cuMemAllocManaged, dptr, size, flags);
    HOOK_MEM_OP();
    CHARGE(size);
    CUresult r = REAL(cuMemAllocManaged)(dptr, size, flags);
    SETTLE(r, size, r == CUDA_SUCCESS ? *dptr : 0);
    return r;
}

QGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    HOOK_ENTER(cuMemFree_v2, dptr);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemFree_v2)(dptr);
    if (r == CUDA_SUCCESS && dptr) {
        untrack(dptr);
        pool_forget_import(dptr, 0, NULL);
    }
    return r;
}

QGPU_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr) {
    HOOK_ENTER(cuMemFree, dptr);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMemFree)(dptr);
    if (r == CUDA_SUCCESS && dptr) {
        untrack(dptr);
        pool_forget_import(dptr, 0, NULL);
    }
    return r;
}

/* ---- arrays ---- */

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_ARRAY_FORMAT_UNSIGNED_INT8:
    case CU_ARRAY_FORMAT_SIGNED_INT8: return 1;
    case CU_ARRAY_FORMAT_UNSIGNED_INT16:
    case CU_ARRAY_FORMAT_SIGNED_INT16:
    case CU_ARRAY_FORMAT_HALF: return 2;
    default: return 4; /* 32-bit formats; anything newer is charged at least this much */
    }
}

/* w x h x d elements of `channels` x format; -1 when it does not fit in 64 bits */
static int array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, uint64_t ch,
                       uint64_t *out) {
    uint64_t b;
    if (hook_mul(w, h ? h : 1, &b) || hook_mul(b, d ? d : 1, &b) || hook_mul(b, ch, &b) ||
        hook_mul(b, format_bytes(f), &b))
        return -1;
    *out = b;
    return 0;
}

#define ARRAY_CREATE(name, desc_t, W, H, D)                                                  \
    QGPU_EXPORT CUresult name(CUarray *arr, const desc_t *d) {                               \
        HOOK_ENTER(name, arr, d);                                                            \
        HOOK_MEM_OP();                                                                       \
        uint64_t bytes = 0;                                                                  \
        if (d && array_bytes(W, H, D, d->Format, d->NumChannels, &bytes) != 0)               \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                 \
        CHARGE(bytes);                                                                       \
        CUresult r = REAL(name)(arr, d);                                                     \
        SETTLE(r, bytes, r == CUDA_SUCCESS ? (uintptr_t)*arr : 0);                           \
        return r;                                                                            \
    }
ARRAY_CREATE(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, d->Width, d->Height, 1)
ARRAY_CREATE(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, d->Width, d->Height, 1)
ARRAY_CREATE(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, d->Width, d->Height, d->Depth)
ARRAY_CREATE(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, d->Width, d->Height, d->Depth)

QGPU_EXPORT CUresult cuArrayDestroy(CUarray arr) {
    HOOK_ENTER(cuArrayDestroy, arr);
    HOOK_MEM_OP();
    CUresult r = REAL(cuArrayDestroy)(arr);
    if (r == CUDA_SUCCESS) untrack((uintptr_t)arr);
    return r;
}

/* Every level of a mipmapped array: each halves the previous one (never below 1). */
QGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *out, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                            unsigned int levels) {
    HOOK_ENTER(cuMipmappedArrayCreate, out, d, levels);
    HOOK_MEM_OP();
    uint64_t total = 0;
    if (d) {
        uint64_t w = d->Width, h = d->Height, dep = d->Depth;
        for (unsigned l = 0; l < levels && l < 64; l++) {
            uint64_t b;
            if (array_bytes(w, h, dep, d->Format, d->NumChannels, &b) != 0 || total > UINT64_MAX - b)
                return CUDA_ERROR_OUT_OF_MEMORY;
            total += b;
            w = w > 1 ? w / 2 : 1;
            h = h > 1 ? h / 2 : h;
            dep = dep > 1 ? dep / 2 : dep;
        }
    }
    CHARGE(total);
    CUresult r = REAL(cuMipmappedArrayCreate)(out, d, levels);
    SETTLE(r, total, r == CUDA_SUCCESS ? (uintptr_t)*out : 0);
    return r;
}

QGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray m) {
    HOOK_ENTER(cuMipmappedArrayDestroy, m);
    HOOK_MEM_OP();
    CUresult r = REAL(cuMipmappedArrayDestroy)(m);
    if (r == CUDA_SUCCESS) untrack((uintptr_t)m);
    return r;
}

/* ---- what the slice sees ---- */

/* total = the cap, free = cap - what the slice holds (never more than the card has free) */
QGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    HOOK_ENTER(cuMemGetInfo_v2, free_bytes, total);
    CUresult r = REAL(cuMemGetInfo_v2)(free_bytes, total);
    if (r != CUDA_SUCCESS || !free_bytes || !total) return r;
    pool_settle_all();
    uint64_t used = ledger_used();
    uint64_t mine = used < g_lim.mem_limit ? g_lim.mem_limit - used : 0;
    if (mine < *free_bytes) *free_bytes = mine;
    *total = g_lim.mem_limit;
    return r;
}

static unsigned int clamp32(uint64_t v) { return v > 0xFFFFFFFFu ? 0xFFFFFFFFu : (unsigned int)v; }

QGPU_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) {
    HOOK_ENTER(cuMemGetInfo, free_bytes, total);
    CUresult r = REAL(cuMemGetInfo)(free_bytes, total);
    if (r != CUDA_SUCCESS || !free_bytes || !total) return r;
    pool_settle_all();
    uint64_t used = ledger_used();
    uint64_t mine = used < g_lim.mem_limit ? g_lim.mem_limit - used : 0;
    if (clamp32(mine) < *free_bytes) *free_bytes = clamp32(mine);
    *total = clamp32(g_lim.mem_limit);
    return r;
}

QGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    HOOK_ENTER(cuDeviceTotalMem_v2, bytes, dev);
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r == CUDA_SUCCESS && bytes && g_lim.mem_limit < *bytes) *bytes = g_lim.mem_limit;
    return r;
}

QGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    HOOK_ENTER(cuDeviceTotalMem, bytes, dev);
    CUresult r = REAL(cuDeviceTotalMem)(bytes, dev);
    if (r == CUDA_SUCCESS && bytes && clamp32(g_lim.mem_limit) < *bytes)
        *bytes = clamp32(g_lim.mem_limit);
    return r;
}
