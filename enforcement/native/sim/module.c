/* Simulated modules, libraries and the JIT linker, with the device memory NVIDIA's driver
 * gives them (images are read by image.c):
 *  - cuModuleLoad / LoadData / LoadDataEx / LoadFatBinary load into the current context and
 *    allocate the module's data (its __device__ globals and constant banks) at once ("the
 *    CUDA driver API does not attempt to lazily allocate the resources needed by a module",
 *    cuda.h), refused with CUDA_ERROR_OUT_OF_MEMORY when the card has no room; the memory is
 *    held until cuModuleUnload or the context's destruction.
 *  - cuLibraryLoadData / LoadFromFile are context-independent: under CUDA_MODULE_LOADING=
 *    EAGER the library is loaded into every context now and into contexts created later;
 *    otherwise (LAZY, NVIDIA's default since CUDA 12.2) into a context when something needs
 *    it there: cuLibraryGetModule, cuLibraryGetGlobal, cuLibraryGetManaged,
 *    cuKernelGetFunction, or a launch (or graph kernel node) of one of its CUkernels. Each
 *    instance holds the library's data on its context's device until cuLibraryUnload or the
 *    context's destruction.
 *  - cuLinkCreate / AddData / AddFile / Complete / Destroy: one cubin or fatbin input is
 *    "linked" into the cubin for the target device (the output that cuModuleLoadData then
 *    loads); linking several inputs, PTX, host objects and archives are not simulated
 *    (CUDA_ERROR_NOT_SUPPORTED, or CUDA_ERROR_JIT_COMPILER_NOT_FOUND for PTX). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

static pthread_mutex_t mod_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUmod_st *modules;   /* every live module and library instance */
static struct CUlib_st *libraries; /* every live library */
static struct CUctx_st **contexts; /* every live context (eager loading reaches them all) */
static size_t ncontexts, cap_contexts;

static int eager(void) {
    static int mode; /* 0 unknown, CU_MODULE_EAGER_LOADING or CU_MODULE_LAZY_LOADING */
    int m = __atomic_load_n(&mode, __ATOMIC_RELAXED);
    if (!m) {
        const char *env = getenv("CUDA_MODULE_LOADING");
        m = env && strcmp(env, "EAGER") == 0 ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
        __atomic_store_n(&mode, m, __ATOMIC_RELAXED);
    }
    return m == CU_MODULE_EAGER_LOADING;
}

static void device_cc(const struct CUctx_st *ctx, int *major, int *minor) {
    *major = g_sim_cfg.gpus[ctx->gidx].cc_major;
    *minor = g_sim_cfg.gpus[ctx->gidx].cc_minor;
}

static CUresult read_file(const char *path, unsigned char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    unsigned char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 65536;
            unsigned char *b = realloc(buf, nc + 1);
            if (!b) {
                free(buf);
                fclose(f);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            buf = b;
            cap = nc;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    buf[n] = 0; /* a PTX file's text ends here */
    *out = buf;
    *len = n;
    return n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_IMAGE;
}

/* ---- modules (mod_lock held) ---- */

/* Takes `img` (moved into the module); its data is charged to the context's device. */
static CUresult module_new(struct CUctx_st *ctx, sim_image_t *img, struct CUlib_st *lib,
                           struct CUmod_st **out) {
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = sim_charge(ctx->gidx, img->data_bytes);
    if (r) {
        free(m);
        return r;
    }
    m->magic = MOD_MAGIC;
    m->ctx = ctx;
    m->lib = lib;
    m->img = *img;
    memset(img, 0, sizeof *img);
    m->base = m->img.data_bytes ? sim_next_address(m->img.data_bytes) : 0;
    m->next = modules;
    modules = m;
    *out = m;
    return CUDA_SUCCESS;
}

static void module_free(struct CUmod_st *m) {
    for (struct CUmod_st **pp = &modules; *pp; pp = &(*pp)->next)
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    sim_uncharge(m->ctx->gidx, m->img.data_bytes + m->code_charged);
    for (struct CUfunc_st *f = m->funcs, *n; f; f = n) {
        n = f->next;
        f->magic = 0;
        free(f->name);
        free(f);
    }
    sim_image_free(&m->img);
    m->magic = 0;
    free(m);
}

static int valid_module(struct CUmod_st *m) {
    for (struct CUmod_st *x = modules; x; x = x->next)
        if (x == m) return m->magic == MOD_MAGIC;
    return 0;
}

/* The same handle for the same name, like the real driver. */
static CUresult module_function(struct CUmod_st *m, const char *name, struct CUfunc_st **out) {
    for (struct CUfunc_st *f = m->funcs; f; f = f->next)
        if (strcmp(f->name, name) == 0) {
            *out = f;
            return CUDA_SUCCESS;
        }
    if (!sim_image_has_kernel(&m->img, name)) return CUDA_ERROR_NOT_FOUND;
    struct CUfunc_st *f = calloc(1, sizeof *f);
    if (!f || !(f->name = strdup(name))) {
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    f->magic = FUNC_MAGIC;
    f->busy_kernel = strcmp(name, "qgpu_sim_busy") == 0;
    if (strncmp(name, "qgpu_sim_lmem_", 14) == 0) f->local_bytes = strtoull(name + 14, NULL, 10);
    if (strncmp(name, "qgpu_sim_code_", 14) == 0) f->code_bytes = strtoull(name + 14, NULL, 10);
    f->mod = m;
    f->next = m->funcs;
    m->funcs = f;
    *out = f;
    return CUDA_SUCCESS;
}

static CUresult load_into_current(CUmodule *mod, const void *image, size_t len) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!mod || !image) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    int major, minor;
    device_cc(c, &major, &minor);
    sim_image_t img;
    r = sim_image_parse(image, len, major, minor, &img);
    if (r) return r;
    pthread_mutex_lock(&mod_lock);
    r = module_new(c, &img, NULL, mod);
    pthread_mutex_unlock(&mod_lock);
    if (r) sim_image_free(&img);
    return r;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
    return load_into_current(mod, image, 0);
}

SIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int nopts,
                                       CUjit_option *opts, void **vals) {
    if (nopts && (!opts || !vals)) return CUDA_ERROR_INVALID_VALUE;
    return load_into_current(mod, image, 0);
}

SIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *mod, const void *fatbin) {
    return load_into_current(mod, fatbin, 0);
}

SIM_EXPORT CUresult cuModuleLoad(CUmodule *mod, const char *path) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!mod || !path) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_current_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    unsigned char *buf;
    size_t len;
    r = read_file(path, &buf, &len);
    if (r) return r;
    r = load_into_current(mod, buf, len);
    free(buf);
    return r;
}

SIM_EXPORT CUresult cuModuleUnload(CUmodule mod) {
    CUresult r = sim_check_init();
    if (r) return r;
    pthread_mutex_lock(&mod_lock);
    if (!valid_module(mod)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (mod->lib) r = CUDA_ERROR_NOT_PERMITTED; /* a library's: cuLibraryUnload */
    else module_free(mod);
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!fn || !name) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    r = valid_module(mod) ? module_function(mod, name, fn) : CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

static CUresult symbol(struct CUmod_st *m, const char *name, int managed, CUdeviceptr *dptr,
                       size_t *bytes) {
    const sim_sym_t *s = sim_image_symbol(&m->img, name);
    if (!s || (managed && !s->managed)) return CUDA_ERROR_NOT_FOUND;
    if (dptr) *dptr = m->base + s->offset;
    if (bytes) *bytes = s->size;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule mod,
                                         const char *name) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!name || (!dptr && !bytes)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    r = valid_module(mod) ? symbol(mod, name, 0, dptr, bytes) : CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = eager() ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

/* ---- libraries ---- */

static int valid_library(struct CUlib_st *l) {
    for (struct CUlib_st *x = libraries; x; x = x->next)
        if (x == l) return l->magic == LIB_MAGIC;
    return 0;
}

/* mod_lock held: the library's instance in ctx, loaded (and its data charged) if new */
static CUresult instance(struct CUlib_st *l, struct CUctx_st *ctx, struct CUmod_st **out) {
    for (struct CUmod_st *m = modules; m; m = m->next)
        if (m->lib == l && m->ctx == ctx) {
            *out = m;
            return CUDA_SUCCESS;
        }
    int major, minor;
    device_cc(ctx, &major, &minor);
    sim_image_t img;
    CUresult r = sim_image_parse(l->code, l->len, major, minor, &img);
    if (r) return r;
    r = module_new(ctx, &img, l, out);
    if (r) sim_image_free(&img);
    return r;
}

static void library_free(struct CUlib_st *l) {
    for (struct CUmod_st *m = modules, *n; m; m = n) {
        n = m->next;
        if (m->lib == l) module_free(m);
    }
    for (struct CUlib_st **pp = &libraries; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    for (struct CUkern_st *k = l->kernels, *n; k; k = n) {
        n = k->next;
        k->magic = 0;
        free(k->name);
        free(k);
    }
    sim_image_free(&l->img);
    free(l->code);
    l->magic = 0;
    free(l);
}

/* Takes `code` (a malloc'd copy of `len` bytes). */
static CUresult library_load(CUlibrary *out, unsigned char *code, size_t len) {
    struct CUlib_st *l = calloc(1, sizeof *l);
    if (!l) {
        free(code);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    l->magic = LIB_MAGIC;
    l->code = code;
    l->len = len;
    /* checked against the device a context is current on, else the first visible one */
    struct CUctx_st *c = sim_current_ctx();
    int gidx = c ? c->gidx : g_sim_vis[0];
    CUresult r = sim_image_parse(code, len, g_sim_cfg.gpus[gidx].cc_major,
                                 g_sim_cfg.gpus[gidx].cc_minor, &l->img);
    pthread_mutex_lock(&mod_lock);
    l->next = libraries;
    libraries = l;
    if (!r && eager()) {
        struct CUmod_st *m;
        for (size_t i = 0; i < ncontexts && !r; i++) r = instance(l, contexts[i], &m);
    }
    if (r) library_free(l);
    else *out = l;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

static CUresult library_args(CUlibrary *lib, unsigned njit, CUjit_option *jit, void **jitv,
                             unsigned nlib, CUlibraryOption *lopt, void **lval) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!lib || (njit && (!jit || !jitv)) || (nlib && (!lopt || !lval)))
        return CUDA_ERROR_INVALID_VALUE;
    return g_sim_nvis ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, CUjit_option *jit,
                                      void **jitv, unsigned int njit, CUlibraryOption *lopt,
                                      void **lval, unsigned int nlib) {
    CUresult r = library_args(lib, njit, jit, jitv, nlib, lopt, lval);
    if (r) return r;
    if (!code) return CUDA_ERROR_INVALID_VALUE;
    size_t len;
    r = sim_image_extent(code, &len);
    if (r) return r;
    unsigned char *copy = malloc(len + 1);
    if (!copy) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(copy, code, len);
    copy[len] = 0;
    return library_load(lib, copy, len);
}

SIM_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *path, CUjit_option *jit,
                                          void **jitv, unsigned int njit, CUlibraryOption *lopt,
                                          void **lval, unsigned int nlib) {
    CUresult r = library_args(lib, njit, jit, jitv, nlib, lopt, lval);
    if (r) return r;
    if (!path) return CUDA_ERROR_INVALID_VALUE;
    unsigned char *code;
    size_t len;
    r = read_file(path, &code, &len);
    if (r) return r;
    return library_load(lib, code, len);
}

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary lib) {
    CUresult r = sim_check_init();
    if (r) return r;
    pthread_mutex_lock(&mod_lock);
    if (valid_library(lib)) library_free(lib);
    else r = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

/* mod_lock taken: the library's instance in the current context */
static CUresult current_instance(struct CUlib_st *l, struct CUmod_st **m) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mod_lock);
    r = valid_library(l) ? instance(l, c, m) : CUDA_ERROR_INVALID_HANDLE;
    if (r) pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuLibraryGetModule(CUmodule *mod, CUlibrary lib) {
    if (!mod) return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m;
    CUresult r = current_instance(lib, &m);
    if (r) return r;
    *mod = m;
    pthread_mutex_unlock(&mod_lock);
    return CUDA_SUCCESS;
}

static CUresult library_symbol(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib, const char *name,
                               int managed) {
    if (!name || (!dptr && !bytes)) return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m;
    CUresult r = current_instance(lib, &m);
    if (r) return r;
    r = symbol(m, name, managed, dptr, bytes);
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
                                       const char *name) {
    return library_symbol(dptr, bytes, lib, name, 0);
}

SIM_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
                                        const char *name) {
    return library_symbol(dptr, bytes, lib, name, 1);
}

/* mod_lock held */
static CUresult kernel_of(struct CUlib_st *l, const char *name, struct CUkern_st **out) {
    for (struct CUkern_st *k = l->kernels; k; k = k->next)
        if (strcmp(k->name, name) == 0) {
            *out = k;
            return CUDA_SUCCESS;
        }
    if (!sim_image_has_kernel(&l->img, name)) return CUDA_ERROR_NOT_FOUND;
    struct CUkern_st *k = calloc(1, sizeof *k);
    if (!k || !(k->name = strdup(name))) {
        free(k);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    k->magic = KERNEL_MAGIC;
    k->lib = l;
    k->next = l->kernels;
    l->kernels = k;
    *out = k;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *out, CUlibrary lib, const char *name) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    r = valid_library(lib) ? kernel_of(lib, name, out) : CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuLibraryGetKernelCount(unsigned int *count, CUlibrary lib) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    if (valid_library(lib)) *count = (unsigned)lib->img.nfuncs;
    else r = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuLibraryEnumerateKernels(CUkernel *kernels, unsigned int n, CUlibrary lib) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!kernels || !n) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    if (!valid_library(lib)) r = CUDA_ERROR_INVALID_HANDLE;
    for (unsigned i = 0; !r && i < n && i < (unsigned)lib->img.nfuncs; i++)
        r = kernel_of(lib, lib->img.funcs[i], &kernels[i]);
    pthread_mutex_unlock(&mod_lock);
    return r;
}

static int valid_kernel(struct CUkern_st *k) {
    if (!k) return 0;
    for (struct CUlib_st *l = libraries; l; l = l->next)
        for (struct CUkern_st *x = l->kernels; x; x = x->next)
            if (x == k) return k->magic == KERNEL_MAGIC;
    return 0;
}

CUresult sim_kernel_function(struct CUkern_st *k, struct CUctx_st *ctx, struct CUfunc_st **out) {
    pthread_mutex_lock(&mod_lock);
    struct CUmod_st *m;
    CUresult r = valid_kernel(k) ? instance(k->lib, ctx, &m) : CUDA_ERROR_INVALID_HANDLE;
    if (!r) r = module_function(m, k->name, out);
    pthread_mutex_unlock(&mod_lock);
    return r;
}

SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *out, CUkernel k) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return sim_kernel_function(k, c, out);
}

/* ---- lazy loading of a function's code ---- */

CUresult sim_function_load(struct CUfunc_st *f) {
    pthread_mutex_lock(&mod_lock);
    CUresult r = CUDA_SUCCESS;
    if (!f->loaded && f->code_bytes) {
        r = sim_charge(f->mod->ctx->gidx, f->code_bytes);
        if (!r) f->mod->code_charged += f->code_bytes;
    }
    if (!r) f->loaded = 1;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

/* a CUfunction, or a CUkernel cast to one (its function in the current context) */
static CUresult function_of(CUfunction f, struct CUfunc_st **out) {
    if (!f || (f->magic != FUNC_MAGIC && f->magic != KERNEL_MAGIC)) return CUDA_ERROR_INVALID_HANDLE;
    if (f->magic == FUNC_MAGIC) {
        *out = f;
        return CUDA_SUCCESS;
    }
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return sim_kernel_function((struct CUkern_st *)(void *)f, c, out);
}

SIM_EXPORT CUresult cuFuncIsLoaded(int *state, CUfunction f) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&mod_lock);
    *state = fn->loaded ? 1 : 0; /* CU_FUNCTION_LOADING_STATE_LOADED / _UNLOADED */
    pthread_mutex_unlock(&mod_lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncLoad(CUfunction f) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    return sim_function_load(fn);
}

/* Calls that name a function load its code first, as a driver may (cuda.h does not say they
 * do not): what a cap must expect. */
SIM_EXPORT CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attr, int value) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    if (attr != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
        attr != CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
        return CUDA_ERROR_INVALID_VALUE; /* read-only, or not simulated */
    if (value < 0) return CUDA_ERROR_INVALID_VALUE;
    return sim_function_load(fn);
}

SIM_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, int config) {
    CUresult r = sim_check_init();
    if (r) return r;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    if (config < 0 || config > 3) return CUDA_ERROR_INVALID_VALUE; /* CU_FUNC_CACHE_PREFER_* */
    return sim_function_load(fn);
}

SIM_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, CUfunction f,
                                                                int block_size, size_t smem) {
    (void)smem;
    CUresult r = sim_check_init();
    if (r) return r;
    if (!blocks || block_size <= 0 || block_size > 1024) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    if ((r = sim_function_load(fn)) != CUDA_SUCCESS) return r;
    struct CUctx_st *c = sim_current_ctx();
    int per_sm = c ? g_sim_cfg.gpus[c->gidx].threads_per_sm : 2048;
    *blocks = per_sm / block_size;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncGetModule(CUmodule *mod, CUfunction f) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!mod) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *fn;
    if ((r = function_of(f, &fn)) != CUDA_SUCCESS) return r;
    *mod = fn->mod;
    return CUDA_SUCCESS;
}

/* A function's attributes as cuda.h lists them; the simulated device code uses no registers
 * beyond 32, no static shared or constant memory, and local memory only in the built-in
 * image's qgpu_sim_lmem_<bytes> kernels. */
static CUresult function_attribute(int *out, int attr, uint64_t local_bytes, const struct CUctx_st *c) {
    const sim_gpu_config_t *g = c ? &g_sim_cfg.gpus[c->gidx] : &g_sim_cfg.gpus[0];
    switch (attr) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *out = 1024; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *out = 0; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES:
        *out = local_bytes > INT32_MAX ? INT32_MAX : (int)local_bytes;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *out = 32; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *out = g->cc_major * 10 + g->cc_minor; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuFuncGetAttribute(int *out, CUfunction_attribute attr, CUfunction f) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (!f || (f->magic != FUNC_MAGIC && f->magic != KERNEL_MAGIC)) return CUDA_ERROR_INVALID_HANDLE;
    struct CUctx_st *c = sim_current_ctx();
    if (f->magic == KERNEL_MAGIC) { /* a CUkernel cast: its function in the current context */
        if (!c) return CUDA_ERROR_INVALID_CONTEXT;
        r = sim_kernel_function((struct CUkern_st *)(void *)f, c, &f);
        if (r) return r;
    }
    return function_attribute(out, (int)attr, f->local_bytes, c);
}

/* The kernel's attribute on `dev`; read from its name, without loading its library. */
SIM_EXPORT CUresult cuKernelGetAttribute(int *out, CUfunction_attribute attr, CUkernel k,
                                         CUdevice dev) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    int gidx;
    if ((r = sim_device_gidx(dev, &gidx)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&mod_lock);
    int ok = valid_kernel(k);
    uint64_t local = ok && strncmp(k->name, "qgpu_sim_lmem_", 14) == 0
                         ? strtoull(k->name + 14, NULL, 10) : 0;
    pthread_mutex_unlock(&mod_lock);
    if (!ok) return CUDA_ERROR_INVALID_HANDLE;
    struct CUctx_st probe = {0};
    probe.gidx = gidx;
    return function_attribute(out, (int)attr, local, &probe);
}

SIM_EXPORT CUresult cuKernelGetLibrary(CUlibrary *out, CUkernel k) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mod_lock);
    if (valid_kernel(k)) *out = k->lib;
    else r = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&mod_lock);
    return r;
}

/* ---- contexts ---- */

CUresult sim_modules_ctx_created(struct CUctx_st *ctx) {
    pthread_mutex_lock(&mod_lock);
    CUresult r = CUDA_SUCCESS;
    if (ncontexts == cap_contexts) {
        size_t nc = cap_contexts ? cap_contexts * 2 : 16;
        struct CUctx_st **n = realloc(contexts, nc * sizeof *n);
        if (!n) r = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            contexts = n;
            cap_contexts = nc;
        }
    }
    if (!r) contexts[ncontexts++] = ctx;
    if (!r && eager()) { /* every library loaded so far goes into a new context */
        struct CUmod_st *m;
        for (struct CUlib_st *l = libraries; l && !r; l = l->next) r = instance(l, ctx, &m);
    }
    pthread_mutex_unlock(&mod_lock);
    if (r) sim_modules_ctx_gone(ctx);
    return r;
}

void sim_modules_ctx_gone(struct CUctx_st *ctx) {
    pthread_mutex_lock(&mod_lock);
    for (struct CUmod_st *m = modules, *n; m; m = n) {
        n = m->next;
        if (m->ctx == ctx) module_free(m);
    }
    for (size_t i = 0; i < ncontexts; i++)
        if (contexts[i] == ctx) {
            contexts[i] = contexts[--ncontexts];
            break;
        }
    pthread_mutex_unlock(&mod_lock);
}

/* ---- the JIT linker ---- */

SIM_EXPORT CUresult cuLinkCreate_v2(unsigned int nopts, CUjit_option *opts, void **vals,
                                    CUlinkState *out) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!out || (nopts && (!opts || !vals))) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUlinkState_st *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = LINK_MAGIC;
    device_cc(c, &s->cc_major, &s->cc_minor);
    *out = s;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLinkCreate(unsigned int nopts, CUjit_option *opts, void **vals,
                                 CUlinkState *out) {
    return cuLinkCreate_v2(nopts, opts, vals, out);
}

SIM_EXPORT CUresult cuLinkAddData_v2(CUlinkState s, CUjitInputType type, void *data, size_t size,
                                     const char *name, unsigned int nopts, CUjit_option *opts,
                                     void **vals) {
    (void)name;
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!data || !size || (nopts && (!opts || !vals))) return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_JIT_INPUT_PTX || type == CU_JIT_INPUT_NVVM) return CUDA_ERROR_JIT_COMPILER_NOT_FOUND;
    if (type != CU_JIT_INPUT_CUBIN && type != CU_JIT_INPUT_FATBINARY) {
        if (type == CU_JIT_INPUT_OBJECT || type == CU_JIT_INPUT_LIBRARY)
            fprintf(stderr, "qgpu-sim: linking host objects and archives is not simulated\n");
        return type <= CU_JIT_INPUT_LIBRARY ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
    }
    unsigned char *cubin;
    size_t len;
    CUresult r = sim_image_cubin(data, size, s->cc_major, s->cc_minor, &cubin, &len);
    if (r) return r;
    if (++s->inputs > 1) { /* kept as the first input; cuLinkComplete will refuse */
        free(cubin);
        return CUDA_SUCCESS;
    }
    s->cubin = cubin;
    s->cubin_len = len;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLinkAddData(CUlinkState s, CUjitInputType type, void *data, size_t size,
                                  const char *name, unsigned int nopts, CUjit_option *opts,
                                  void **vals) {
    return cuLinkAddData_v2(s, type, data, size, name, nopts, opts, vals);
}

SIM_EXPORT CUresult cuLinkAddFile_v2(CUlinkState s, CUjitInputType type, const char *path,
                                     unsigned int nopts, CUjit_option *opts, void **vals) {
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!path) return CUDA_ERROR_INVALID_VALUE;
    unsigned char *buf;
    size_t len;
    CUresult r = read_file(path, &buf, &len);
    if (r) return r;
    r = cuLinkAddData_v2(s, type, buf, len, path, nopts, opts, vals);
    free(buf);
    return r;
}

SIM_EXPORT CUresult cuLinkAddFile(CUlinkState s, CUjitInputType type, const char *path,
                                  unsigned int nopts, CUjit_option *opts, void **vals) {
    return cuLinkAddFile_v2(s, type, path, nopts, opts, vals);
}

SIM_EXPORT CUresult cuLinkComplete(CUlinkState s, void **out, size_t *size) {
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (!out || !size || !s->inputs) return CUDA_ERROR_INVALID_VALUE;
    if (s->inputs > 1) {
        fprintf(stderr, "qgpu-sim: linking more than one input is not simulated\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    *out = s->cubin; /* owned by the link state until cuLinkDestroy, as documented */
    *size = s->cubin_len;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLinkDestroy(CUlinkState s) {
    if (!s || s->magic != LINK_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s->cubin);
    free(s);
    return CUDA_SUCCESS;
}
