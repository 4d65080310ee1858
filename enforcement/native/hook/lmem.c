/* Local memory CUDA grows for a kernel at its launch. cuda.h: a context's local memory is
 * resized for a kernel that needs more than it has (CU_CTX_LMEM_RESIZE_TO_MAX: "not reduce
 * local memory after resizing local memory for a kernel"), and it is reserved for every
 * thread the device can hold at once, like the stack it holds (cuCtxSetLimit's
 * CU_LIMIT_STACK_SIZE): a kernel with 64 KiB of local memory per thread takes 16.5 GiB of an
 * H100 (132 SMs x 2048 threads) at its launch, through no allocation call.
 *
 * So before a kernel is launched or becomes part of a graph (a launch captured, a kernel node
 * added or changed: module.c calls lmem_before on each of those paths), its local memory per
 * thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES; cuKernelGetAttribute for a CUkernel) is read
 * and the context's reservation charged up to it: the bytes per thread beyond what the
 * context was charged for (its stack limit, or what an earlier kernel grew it to) times the
 * device's threads. Over the cap the launch is refused with CUDA_ERROR_OUT_OF_MEMORY before
 * the driver sees it. The charge is the context's until it goes, whatever the flag (a driver
 * may give the memory back after the kernel: more charged, never less). The stack limit is
 * charged against the same reservation (ctx.c). A thread's last (function, context) is
 * remembered, so a loop launching one kernel costs one comparison; unloading code or
 * destroying a context forgets it (module.c's generation: a handle may come back naming
 * other code). */
#include "hook.h"

#define STACK_DEFAULT 1024ULL

/* context -> the most local memory per thread a kernel of it needed (size) and the stack
 * limit the application set (tag; 0: the default) */
static qgpu_table_t state = QGPU_TABLE_INIT;
static pthread_mutex_t lmem_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread void *last_f __attribute__((tls_model("initial-exec")));
static __thread CUcontext last_ctx __attribute__((tls_model("initial-exec")));
static __thread uint64_t last_gen __attribute__((tls_model("initial-exec")));

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* locked: what `ctx` is charged for per thread, and its two parts */
static uint64_t reserved_locked(CUcontext ctx, uint64_t *kernels, uint64_t *stack) {
    int64_t tag = 0;
    *kernels = 0;
    qgpu_table_get(&state, (uintptr_t)ctx, kernels, &tag);
    *stack = (uint64_t)tag;
    return max3(STACK_DEFAULT, *kernels, *stack);
}

/* The function's (or CUkernel's, asked as a kernel on ctx's device, so that the query loads
 * nothing) local memory per thread; -1 when the driver cannot say. */
static int64_t local_size(void *f, CUcontext ctx, int kernel) {
    int v = 0;
    if (!kernel && HAVE_REAL(cuFuncGetAttribute) &&
        REAL(cuFuncGetAttribute)(&v, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, (CUfunction)f) ==
            CUDA_SUCCESS)
        return v > 0 ? v : 0;
    CUdevice dev = 0;
    int pushed = ctx && HAVE_REAL(cuCtxPushCurrent_v2) && REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
    int have_dev = HAVE_REAL(cuCtxGetDevice) && REAL(cuCtxGetDevice)(&dev) == CUDA_SUCCESS;
    if (pushed) {
        CUcontext popped;
        REAL(cuCtxPopCurrent_v2)(&popped);
    }
    if (have_dev && HAVE_REAL(cuKernelGetAttribute) &&
        REAL(cuKernelGetAttribute)(&v, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, (CUkernel)f, dev) ==
            CUDA_SUCCESS)
        return v > 0 ? v : 0;
    return -1;
}

CUresult lmem_before(void *f, CUcontext ctx, int kernel) {
    if (!f || !HAVE_REAL(cuFuncGetAttribute)) return CUDA_SUCCESS;
    if (!ctx) ctx = mem_current_ctx();
    uint64_t gen = module_generation(); /* code unloaded or a context gone: check again */
    if (f == last_f && ctx == last_ctx && gen == last_gen) return CUDA_SUCCESS;
    int64_t need = local_size(f, ctx, kernel);
    if (need < 0) return CUDA_SUCCESS; /* not a function the driver knows: its launch fails */
    pthread_mutex_lock(&lmem_lock);
    uint64_t kernels, stack, have = reserved_locked(ctx, &kernels, &stack);
    CUresult r = CUDA_SUCCESS;
    if ((uint64_t)need > have) {
        uint64_t cost = ctx_stack_cost(ctx, (uint64_t)need) - ctx_stack_cost(ctx, have);
        if (cost && ledger_reserve(cost) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (qgpu_table_put(&state, (uintptr_t)ctx, (uint64_t)need, (int64_t)stack) != 0) {
            ledger_release(cost); /* cannot remember it: refused rather than lost */
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            ctx_charge_add(ctx, cost);
        }
    }
    pthread_mutex_unlock(&lmem_lock);
    if (r == CUDA_SUCCESS) {
        last_f = f;
        last_ctx = ctx;
        last_gen = gen;
    }
    return r;
}

void lmem_stack_reservation(CUcontext ctx, uint64_t value, uint64_t *before, uint64_t *after) {
    pthread_mutex_lock(&lmem_lock);
    uint64_t kernels, stack;
    *before = reserved_locked(ctx, &kernels, &stack);
    *after = max3(STACK_DEFAULT, kernels, value);
    pthread_mutex_unlock(&lmem_lock);
}

void lmem_stack_set(CUcontext ctx, uint64_t value) {
    pthread_mutex_lock(&lmem_lock);
    uint64_t kernels, stack;
    reserved_locked(ctx, &kernels, &stack);
    qgpu_table_put(&state, (uintptr_t)ctx, kernels, (int64_t)value);
    pthread_mutex_unlock(&lmem_lock);
}

void lmem_forget(CUcontext ctx) {
    pthread_mutex_lock(&lmem_lock);
    qgpu_table_take(&state, (uintptr_t)ctx, NULL, NULL);
    pthread_mutex_unlock(&lmem_lock);
}
