/* Simulated driver: initialisation, devices, contexts, error strings. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"

QGPU_HIDDEN sim_config_t g_sim_cfg;
QGPU_HIDDEN int g_sim_nvis;
QGPU_HIDDEN int g_sim_vis[SIM_MAX_GPUS];
QGPU_HIDDEN sim_gpu_state_t *g_sim_state[SIM_MAX_GPUS];
QGPU_HIDDEN qgpu_table_t g_sim_allocs = QGPU_TABLE_INIT;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static int init_called;
static __thread struct CUctx_st *tl_ctx;
static struct CUctx_st primary[SIM_MAX_GPUS];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

/* CUDA_VISIBLE_DEVICES: indices or (prefixes of) UUIDs, stopping at the first bad entry. */
static void parse_visible(void) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    g_sim_nvis = 0;
    if (!env) {
        for (int i = 0; i < g_sim_cfg.ngpus; i++) g_sim_vis[g_sim_nvis++] = i;
        return;
    }
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        int found = -1;
        char *end;
        long idx = strtol(tok, &end, 10);
        if (*tok && *end == 0) {
            if (idx >= 0 && idx < g_sim_cfg.ngpus) found = (int)idx;
        } else {
            size_t n = strlen(tok);
            int matches = 0;
            for (int i = 0; i < g_sim_cfg.ngpus && n > 0; i++) {
                const char *u = g_sim_cfg.gpus[i].uuid;
                const char *t = tok;
                if (strncmp(t, "GPU-", 4) != 0) u += 4; /* allow the bare hex form */
                if (strncmp(u, t, strlen(t)) == 0) {
                    found = i;
                    matches++;
                }
            }
            if (matches != 1) found = -1;
        }
        if (found < 0) break;
        int dup = 0;
        for (int j = 0; j < g_sim_nvis; j++) dup |= g_sim_vis[j] == found;
        if (dup) break;
        g_sim_vis[g_sim_nvis++] = found;
    }
}

static void release_own_slots(void) {
    int pid = getpid();
    for (int i = 0; i < SIM_MAX_GPUS; i++) {
        sim_gpu_state_t *st = g_sim_state[i];
        if (!st) continue;
        sim_state_lock(st);
        sim_proc_t *p = sim_state_proc_slot(st, 0);
        if (p && p->pid == pid) {
            st->mem_used = st->mem_used >= p->mem_used ? st->mem_used - p->mem_used : 0;
            memset(p, 0, sizeof *p);
        }
        sim_state_unlock(st);
    }
}

static void do_init(void) {
    const char *path = getenv("QGPU_SIM_CONFIG");
    char err[512];
    if (!path || !*path) {
        fprintf(stderr, "qgpu-sim: QGPU_SIM_CONFIG is not set: no simulated GPUs\n");
        init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    if (sim_config_load(path, &g_sim_cfg, err, sizeof err) != 0) {
        fprintf(stderr, "qgpu-sim: %s\n", err);
        init_result = CUDA_ERROR_NOT_INITIALIZED;
        return;
    }
    parse_visible();
    for (int v = 0; v < g_sim_nvis; v++) {
        int g = g_sim_vis[v];
        g_sim_state[g] = sim_state_open(&g_sim_cfg.gpus[g]);
        if (!g_sim_state[g]) {
            fprintf(stderr, "qgpu-sim: cannot open state file %s\n", g_sim_cfg.gpus[g].state_path);
            init_result = CUDA_ERROR_NOT_INITIALIZED;
            return;
        }
    }
    atexit(release_own_slots);
    init_result = CUDA_SUCCESS;
}

CUresult sim_check_init(void) {
    if (!__atomic_load_n(&init_called, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    return init_result;
}

SIM_EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&init_once, do_init);
    __atomic_store_n(&init_called, 1, __ATOMIC_RELEASE);
    return init_result;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = g_sim_cfg.cuda_version ? g_sim_cfg.cuda_version : 12040;
    return CUDA_SUCCESS;
}

CUresult sim_device_gidx(CUdevice dev, int *gidx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (dev < 0 || dev >= g_sim_nvis) return CUDA_ERROR_INVALID_DEVICE;
    *gidx = g_sim_vis[dev];
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_sim_nvis;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_sim_nvis) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", g_sim_cfg.gpus[g].name);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    qgpu_uuid_parse(g_sim_cfg.gpus[g].uuid, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_sim_cfg.gpus[g].memory;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    const sim_gpu_config_t *c = &g_sim_cfg.gpus[g];
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = c->sms; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = c->pci_bus; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = c->cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = c->cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *value = 1; break;
    default:
        if (attrib <= 0 || attrib > 200) return CUDA_ERROR_INVALID_VALUE;
        *value = 0;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!bus || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(bus, (size_t)len, "0000:%02x:00.0", g_sim_cfg.gpus[g].pci_bus);
    return CUDA_SUCCESS;
}

/* ---- contexts ---- */

static void attach_process(int gidx) {
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    sim_state_reclaim_dead(st);
    sim_state_proc_slot(st, 1);
    sim_state_unlock(st);
}

struct CUctx_st *sim_current_ctx(void) { return tl_ctx; }

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->dev = dev;
    c->gidx = g;
    c->refcount = 1;
    attach_process(g);
    tl_ctx = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!ctx || ctx->magic != CTX_MAGIC || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    if (tl_ctx == ctx) tl_ctx = NULL;
    ctx->magic = 0;
    free(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (ctx && ctx->magic != CTX_MAGIC) return CUDA_ERROR_INVALID_CONTEXT;
    tl_ctx = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = tl_ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) { return cuCtxSetCurrent(ctx); }

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (pctx) *pctx = tl_ctx;
    tl_ctx = NULL;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!tl_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    *dev = tl_ctx->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!tl_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    qgpu_sleep_until_ns(tl_ctx->last_end_ns);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    struct CUctx_st *c = &primary[dev];
    if (c->magic != CTX_MAGIC) {
        c->magic = CTX_MAGIC;
        c->dev = dev;
        c->gidx = g;
        c->primary = 1;
        attach_process(g);
    }
    c->refcount++;
    pthread_mutex_unlock(&ctx_lock);
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    pthread_mutex_lock(&ctx_lock);
    if (primary[dev].refcount > 0) primary[dev].refcount--;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

/* ---- modules ---- */

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!mod || !image) return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MOD_MAGIC;
    *mod = m;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule mod) {
    if (!mod || mod->magic != MOD_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    mod->magic = 0;
    free(mod);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!fn || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!mod || mod->magic != MOD_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    struct CUfunc_st *f = calloc(1, sizeof *f);
    if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
    f->magic = FUNC_MAGIC;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->busy_kernel = strcmp(name, "qgpu_sim_busy") == 0;
    *fn = f;
    return CUDA_SUCCESS;
}

/* ---- errors ---- */

static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

SIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].text;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].name;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* Older entry points with the same ABI as their _v2 successors (still exported by real
 * drivers for old binaries). */
SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }
SIM_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }
SIM_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }
SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    return cuDevicePrimaryCtxRelease_v2(dev);
}
