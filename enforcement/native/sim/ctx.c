/* Simulated contexts: regular (cuCtxCreate v1..v4), primary (retain/release/reset) and green
 * contexts. Like a real driver, every context costs device memory, charged when it is created
 * and given back when it is destroyed: a regular or primary context the GPU's
 * `context_memory` (per model: more than the interposer's default charge on Hopper), a green
 * context its own `green_context_memory` plus the primary context it retains (created, and
 * costing context_memory, when it was not active; destroyed with the last release). A
 * context's limits reserve device memory too: the stack (for every thread the device can hold
 * at once), the printf FIFO and malloc heap, and the device runtime's reservations for
 * pending device-side launches and for the nesting levels a device-side synchronize may
 * reach (cuda.h: "reserve large amounts of device memory"; the sizes are not published, so
 * they are configuration: per pending launch above the default 2048, `devrt_launch_bytes`,
 * 8 KiB by default: a launch record and the up to 4 KiB of parameters a device-side launch
 * passes; per sync-depth level above the default 2, `devrt_sync_thread_bytes` per thread the
 * device can hold at once, 4 KiB by default: the saved state of every live parent thread).
 * A reservation the card cannot hold is refused (CUDA_ERROR_OUT_OF_MEMORY); the sync depth is
 * refused on compute capability 9.0 and later (CUDA_ERROR_UNSUPPORTED_LIMIT) and above 24
 * (CUDA_ERROR_INVALID_VALUE), the pending launch count below 3.5. Destroying a context frees
 * the memory allocated in it and unloads its modules (module.c). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "driver.h"

#define STACK_DEFAULT 1024ULL
#define PRINTF_FIFO_DEFAULT (1ULL << 20)
#define MALLOC_HEAP_DEFAULT (8ULL << 20)
#define SYNC_DEPTH_DEFAULT 2ULL
#define SYNC_DEPTH_MAX 24ULL
#define PENDING_LAUNCH_DEFAULT 2048ULL
#define MEMORY_LIMITS 5 /* limits 0..4 reserve device memory */
#define CTX_STACK_DEPTH 32

static struct CUctx_st primary[SIM_MAX_GPUS];
static int primary_refs[SIM_MAX_GPUS];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

/* Each thread's stack of current contexts lives in a block of a process-wide registry; the
 * thread finds its block through one initial-exec TLS pointer. No general-dynamic TLS: a
 * statically linked program that dlopens the driver has no __tls_get_addr that works for
 * it (it crashed there), while initial-exec TLS is served from glibc's static TLS surplus in
 * both kinds of program. A block whose thread has exited is reused by the next new thread,
 * and a destroyed context is taken off every thread's stack. */
typedef struct tl_ctx {
    struct tl_ctx *next;
    pid_t tid; /* the owning thread (kernel tid) */
    int depth; /* stack[depth - 1] is current; 0 = none */
    struct CUctx_st *stack[CTX_STACK_DEPTH];
} tl_ctx_t;

static __thread tl_ctx_t *tl __attribute__((tls_model("initial-exec")));
static tl_ctx_t *registry;
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

static pid_t my_tid(void) { return (pid_t)syscall(SYS_gettid); }

static int thread_gone(pid_t tid) {
    return syscall(SYS_tgkill, getpid(), tid, 0) != 0 && errno == ESRCH;
}

/* the forking thread keeps its block in the child, under its new tid */
static void tl_after_fork(void) {
    if (tl) tl->tid = my_tid();
}

/* registry_lock held: this thread's block, made (or taken over from an exited thread) */
static tl_ctx_t *tl_claim_locked(void) {
    if (tl) return tl;
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, tl_after_fork);
        atfork_done = 1;
    }
    pid_t tid = my_tid();
    tl_ctx_t *b = NULL;
    for (tl_ctx_t *r = registry; r && !b; r = r->next)
        if (r->tid == tid || thread_gone(r->tid)) b = r;
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b) return NULL;
        b->next = registry;
        registry = b;
    }
    b->tid = tid;
    b->depth = 0;
    tl = b;
    return b;
}

struct CUctx_st *sim_current_ctx(void) {
    tl_ctx_t *b = tl;
    if (!b) return NULL;
    int d = __atomic_load_n(&b->depth, __ATOMIC_ACQUIRE);
    return d > 0 ? __atomic_load_n(&b->stack[d - 1], __ATOMIC_ACQUIRE) : NULL;
}

void sim_set_current_ctx(struct CUctx_st *ctx) {
    pthread_mutex_lock(&registry_lock);
    tl_ctx_t *b = ctx ? tl_claim_locked() : tl;
    if (b) {
        if (b->depth == 0 && ctx) b->depth = 1;
        if (b->depth > 0) {
            b->stack[b->depth - 1] = ctx;
            if (!ctx) b->depth--;
        }
    }
    pthread_mutex_unlock(&registry_lock);
}

/* 0, or -1 when the stack is full (or no block could be made) */
static int push_ctx(struct CUctx_st *ctx) {
    pthread_mutex_lock(&registry_lock);
    tl_ctx_t *b = tl_claim_locked();
    int ok = b && b->depth < CTX_STACK_DEPTH;
    if (ok) b->stack[b->depth++] = ctx;
    pthread_mutex_unlock(&registry_lock);
    return ok ? 0 : -1;
}

/* 0 with the popped context, or -1 when the stack is empty */
static int pop_ctx(struct CUctx_st **out) {
    pthread_mutex_lock(&registry_lock);
    tl_ctx_t *b = tl;
    int ok = b && b->depth > 0;
    if (ok) *out = b->stack[--b->depth];
    pthread_mutex_unlock(&registry_lock);
    return ok ? 0 : -1;
}

/* A destroyed context is current nowhere any more, on no thread. */
static void forget_everywhere(struct CUctx_st *ctx) {
    pthread_mutex_lock(&registry_lock);
    for (tl_ctx_t *b = registry; b; b = b->next) {
        for (int i = 0; i < b->depth; i++)
            if (b->stack[i] == ctx) b->stack[i] = NULL;
        while (b->depth > 0 && !b->stack[b->depth - 1]) b->depth--;
    }
    pthread_mutex_unlock(&registry_lock);
}

static const uint64_t limit_default[MEMORY_LIMITS] = {
    STACK_DEFAULT, PRINTF_FIFO_DEFAULT, MALLOC_HEAP_DEFAULT, SYNC_DEPTH_DEFAULT,
    PENDING_LAUNCH_DEFAULT};

/* Device memory a limit's value reserves beyond the default (UINT64_MAX: not representable). */
static uint64_t limit_cost(const struct CUctx_st *c, int which, uint64_t value) {
    const sim_gpu_config_t *g = &g_sim_cfg.gpus[c->gidx];
    uint64_t base = limit_default[which];
    if (value <= base) return 0;
    uint64_t extra = value - base, per = 1, threads = (uint64_t)g->sms * (uint64_t)g->threads_per_sm;
    /* the stack is reserved for every thread the device can hold at once */
    if (which == CU_LIMIT_STACK_SIZE) per = threads;
    if (which == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH) per = threads * g->devrt_sync_thread_bytes;
    if (which == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT) per = g->devrt_launch_bytes;
    if (per && extra > UINT64_MAX / per) return UINT64_MAX;
    return extra * per;
}

/* What cuda.h says about a limit on this device: 0, or the error that refuses it. */
static CUresult limit_supported(const struct CUctx_st *c, int which) {
    const sim_gpu_config_t *g = &g_sim_cfg.gpus[c->gidx];
    int cc = g->cc_major * 10 + g->cc_minor;
    if (which == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH && cc >= 90) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    if (which == CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT && cc < 35)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    return CUDA_SUCCESS;
}

/* `cost`: the device memory the context itself takes (a regular or primary context the GPU's
 * context_memory; a green context its green_context_memory, beyond the primary context it
 * retains) */
/* The GPU's compute mode (nvmlDeviceSetComputeMode): PROHIBITED gives nobody a new context,
 * EXCLUSIVE_PROCESS none while another live process holds one (CUDA_ERROR_DEVICE_UNAVAILABLE,
 * as cuda.h says). Contexts made before the mode changed are kept. */
static CUresult compute_mode_allows(int gidx) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    uint32_t mode = __atomic_load_n(&st->compute_mode, __ATOMIC_ACQUIRE);
    if (mode == CU_COMPUTEMODE_PROHIBITED) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    if (mode != CU_COMPUTEMODE_EXCLUSIVE_PROCESS) return CUDA_SUCCESS;
    int me = getpid(), other = 0;
    sim_state_lock(st);
    sim_state_reclaim_dead(st);
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (st->procs[i].pid && st->procs[i].pid != me && st->procs[i].contexts) other = 1;
    sim_state_unlock(st);
    return other ? CUDA_ERROR_DEVICE_UNAVAILABLE : CUDA_SUCCESS;
}

/* Each live context of this process has its own queue index for the timesliced scheduler
 * (sim_proc_t.ctx_end); past SIM_CTX_QUEUES live contexts, indices are shared. */
static uint32_t queues_used;
static unsigned queues_next;
static pthread_mutex_t queues_lock = PTHREAD_MUTEX_INITIALIZER;

static int take_queue(void) {
    pthread_mutex_lock(&queues_lock);
    int q = -1;
    for (int i = 0; i < SIM_CTX_QUEUES && q < 0; i++)
        if (!(queues_used & (1u << i))) q = i;
    if (q < 0) q = (int)(queues_next++ % SIM_CTX_QUEUES);
    queues_used |= 1u << q;
    pthread_mutex_unlock(&queues_lock);
    return q;
}

static void give_queue(int q) {
    pthread_mutex_lock(&queues_lock);
    queues_used &= ~(1u << ((unsigned)q % SIM_CTX_QUEUES));
    pthread_mutex_unlock(&queues_lock);
}

static CUresult ctx_init(struct CUctx_st *c, CUdevice dev, int gidx, unsigned flags,
                         uint64_t cost) {
    CUresult allowed = compute_mode_allows(gidx);
    if (allowed) return allowed;
    memset(c, 0, sizeof *c);
    c->magic = CTX_MAGIC;
    c->dev = dev;
    c->gidx = gidx;
    c->flags = flags;
    c->queue = take_queue();
    for (int i = 0; i < MEMORY_LIMITS; i++) c->limits[i] = limit_default[i];
    CUresult r = sim_charge(gidx, cost);
    if (r) {
        give_queue(c->queue);
        return r;
    }
    c->charged = cost;
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    sim_proc_t *p = sim_state_proc_slot(st, 1);
    if (p) p->contexts++;
    sim_state_unlock(st);
    r = sim_modules_ctx_created(c); /* eager loading: the libraries loaded so far come in */
    if (r) {
        sim_state_lock(st);
        if (p && p->contexts) p->contexts--;
        sim_state_unlock(st);
        sim_uncharge(gidx, cost);
        give_queue(c->queue);
        c->magic = 0;
    }
    return r;
}

/* Frees what the context holds: its allocations (mem.c tags them with the context), its
 * limits' reservations and the context itself. */
QGPU_HIDDEN void sim_free_ctx_allocations(struct CUctx_st *ctx);

static void ctx_release(struct CUctx_st *c) {
    give_queue(c->queue);
    sim_modules_ctx_gone(c); /* its modules and library instances unload with it */
    sim_free_ctx_allocations(c);
    sim_uncharge(c->gidx, c->charged);
    c->charged = 0;
    sim_gpu_state_t *st = g_sim_state[c->gidx];
    sim_state_lock(st);
    sim_proc_t *p = sim_state_proc_slot(st, 0);
    if (p && p->contexts) p->contexts--;
    sim_state_unlock(st);
    c->magic = 0;
}

static CUresult create(CUcontext *pctx, unsigned flags, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = malloc(sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    r = ctx_init(c, dev, g, flags, g_sim_cfg.gpus[g].context_memory);
    if (r) {
        free(c);
        return r;
    }
    push_ctx(c); /* a created context is pushed (made current) */
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int nparams, unsigned int flags,
                                   CUdevice dev) {
    if (nparams < 0 || (nparams > 0 && !params)) return CUDA_ERROR_INVALID_VALUE;
    return create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                   CUdevice dev) {
    if (params && (params->numExecAffinityParams < 0 ||
                   (params->numExecAffinityParams > 0 && !params->execAffinityParams)))
        return CUDA_ERROR_INVALID_VALUE;
    return create(pctx, flags, dev);
}

static int valid(CUcontext ctx) { return ctx && ctx->magic == CTX_MAGIC; }

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!valid(ctx) || ctx->primary || ctx->green) return CUDA_ERROR_INVALID_CONTEXT;
    sim_wait_idle(ctx, NULL);
    forget_everywhere(ctx);
    ctx_release(ctx);
    free(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (ctx && !valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    sim_set_current_ctx(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = sim_current_ctx();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    return push_ctx(ctx) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c;
    if (pop_ctx(&c) != 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }
SIM_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetFlags(unsigned int *flags) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    if (ctx && !valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    sim_wait_idle(c, NULL);
    sim_pools_on_sync(c);
    return CUDA_SUCCESS;
}

/* CUDA 13: a given context (NULL: the current one) */
SIM_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = ctx ? ctx : sim_current_ctx();
    if (!c || !valid(c)) return CUDA_ERROR_INVALID_CONTEXT;
    sim_wait_idle(c, NULL);
    sim_pools_on_sync(c);
    return CUDA_SUCCESS;
}

/* What the context reserves per thread for local memory: its stack limit, or more when a
 * kernel launched in it needed more. */
static uint64_t lmem_reserved(const struct CUctx_st *c, uint64_t stack) {
    return stack > c->lmem_grown ? stack : c->lmem_grown;
}

/* cuda.h: CUDA resizes a context's local memory for a kernel that needs more at its launch
 * (CU_CTX_LMEM_RESIZE_TO_MAX: "not reduce local memory after resizing local memory for a
 * kernel"); the simulator keeps it, whatever the flag, which is what a cap must expect. */
CUresult sim_ctx_local_memory(struct CUctx_st *c, uint64_t per_thread) {
    uint64_t stack = c->limits[CU_LIMIT_STACK_SIZE];
    uint64_t have = lmem_reserved(c, stack);
    if (per_thread <= have) return CUDA_SUCCESS;
    uint64_t before = limit_cost(c, CU_LIMIT_STACK_SIZE, have);
    uint64_t after = limit_cost(c, CU_LIMIT_STACK_SIZE, per_thread);
    if (after == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    if (after > before) {
        CUresult r = sim_charge(c->gidx, after - before);
        if (r) return r;
        c->charged += after - before;
    }
    c->lmem_grown = per_thread;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (limit < 0 || limit >= MEMORY_LIMITS) /* L2 hints (5, 6): accepted, ignored */
        return limit >= 0 && limit <= 6 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    r = limit_supported(c, limit);
    if (r) return r;
    if (limit == CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH && value > SYNC_DEPTH_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t old = c->limits[limit], now = value;
    if (limit == CU_LIMIT_STACK_SIZE) { /* the stack is local memory: what kernels grew stays */
        old = lmem_reserved(c, old);
        now = lmem_reserved(c, now);
    }
    uint64_t before = limit_cost(c, limit, old);
    uint64_t after = limit_cost(c, limit, now);
    if (after == UINT64_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    if (after > before) {
        r = sim_charge(c->gidx, after - before);
        if (r) return r;
        c->charged += after - before;
    } else if (before > after) {
        sim_uncharge(c->gidx, before - after);
        c->charged -= before - after;
    }
    c->limits[limit] = value;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *value, int limit) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!value || limit < 0) return CUDA_ERROR_INVALID_VALUE;
    if (limit < MEMORY_LIMITS && (r = limit_supported(c, limit)) != CUDA_SUCCESS) return r;
    *value = limit < MEMORY_LIMITS ? c->limits[limit] : 0;
    return CUDA_SUCCESS;
}

/* ---- primary contexts: one per device, alive while retained ---- */

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    struct CUctx_st *c = &primary[dev];
    if (c->magic != CTX_MAGIC) {
        unsigned flags = c->flags;
        r = ctx_init(c, dev, g, flags, g_sim_cfg.gpus[g].context_memory);
        if (r) {
            pthread_mutex_unlock(&ctx_lock);
            return r;
        }
        c->primary = 1;
    }
    primary_refs[dev]++;
    pthread_mutex_unlock(&ctx_lock);
    *pctx = c;
    return CUDA_SUCCESS;
}

static void primary_destroy_locked(CUdevice dev) {
    struct CUctx_st *c = &primary[dev];
    if (c->magic != CTX_MAGIC) return;
    sim_wait_idle(c, NULL);
    forget_everywhere(c);
    unsigned flags = c->flags;
    ctx_release(c);
    c->flags = flags; /* flags survive a reset */
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] <= 0) {
        pthread_mutex_unlock(&ctx_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--primary_refs[dev] == 0) primary_destroy_locked(dev);
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&ctx_lock);
    primary_destroy_locked(dev); /* retains stay counted: the next use re-creates it */
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    *flags = primary[dev].flags;
    *active = primary[dev].magic == CTX_MAGIC;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&ctx_lock);
    primary[dev].flags = flags;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

/* ---- green contexts (CUDA 12.4): a context over a set of SMs ---- */

SIM_EXPORT CUresult cuDeviceGetDevResource(CUdevice dev, CUdevResource *res, int type) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!res || type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
    memset(res, 0, sizeof *res);
    res->type = CU_DEV_RESOURCE_TYPE_SM;
    res->sm.smCount = (unsigned)g_sim_cfg.gpus[g].sms;
    res->sm.minSmPartitionSize = 2;
    res->sm.smCoscheduledAlignment = 2;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *desc, CUdevResource *res,
                                              unsigned int n) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!desc || !res || n == 0) return CUDA_ERROR_INVALID_VALUE;
    unsigned sms = 0;
    for (unsigned i = 0; i < n; i++) {
        if (res[i].type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
        sms += res[i].sm.smCount;
    }
    struct CUdevResourceDesc_st *d = calloc(1, sizeof *d);
    if (!d) return CUDA_ERROR_OUT_OF_MEMORY;
    d->magic = DESC_MAGIC;
    d->sms = sms;
    *desc = d;
    return CUDA_SUCCESS;
}

/* As documented: CU_GREEN_CTX_DEFAULT_STREAM is required, and a green context retains the
 * device's primary context (created, and charged, if it was not active), released when the
 * green context is destroyed. */
SIM_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *out, CUdevResourceDesc desc, CUdevice dev,
                                     unsigned int flags) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!out || !desc || desc->magic != DESC_MAGIC || flags != CU_GREEN_CTX_DEFAULT_STREAM ||
        desc->sms == 0 || desc->sms > (unsigned)g_sim_cfg.gpus[g].sms)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgreenCtx_st *gc = malloc(sizeof *gc);
    if (!gc) return CUDA_ERROR_OUT_OF_MEMORY;
    CUcontext prim;
    r = cuDevicePrimaryCtxRetain(&prim, dev);
    if (r) {
        free(gc);
        return r;
    }
    r = ctx_init(&gc->ctx, dev, g, flags, g_sim_cfg.gpus[g].green_context_memory);
    if (r) {
        cuDevicePrimaryCtxRelease_v2(dev);
        free(gc);
        return r;
    }
    gc->ctx.green = 1;
    gc->magic = GREEN_MAGIC;
    *out = gc;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx gc) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!gc || gc->magic != GREEN_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    sim_wait_idle(&gc->ctx, NULL);
    forget_everywhere(&gc->ctx);
    CUdevice dev = gc->ctx.dev;
    ctx_release(&gc->ctx);
    gc->magic = 0;
    free(gc);
    cuDevicePrimaryCtxRelease_v2(dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxFromGreenCtx(CUcontext *pctx, CUgreenCtx gc) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pctx || !gc || gc->magic != GREEN_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    *pctx = &gc->ctx;
    return CUDA_SUCCESS;
}
