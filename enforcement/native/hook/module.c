/* Device memory that loading device code takes: a module's __device__ globals and constant
 * banks are allocated by the driver itself when a module is loaded (cuModuleLoad,
 * LoadData, LoadDataEx, LoadFatBinary, and so the output of cuLinkComplete), when a library
 * is loaded into a context (cuLibraryLoadData / LoadFromFile under eager loading; under
 * lazy loading, NVIDIA's default, at cuLibraryGetModule / GetGlobal / GetManaged,
 * cuKernelGetFunction or the first launch or graph node of one of its CUkernels in that
 * context, a graph kernel node changed to one of them). No allocation call the hook sees is
 * made for it. The same measurement serves ctx.c for what a context's creation takes (the
 * context itself, and the libraries eager loading brings into it).
 *
 * The hook does not read the image (a cubin, a fatbin, compressed or not, PTX the driver
 * compiles): it measures what the driver took. Around each such call it holds the process's
 * memory lock exclusively (every wrapper that makes the driver allocate or free device memory
 * holds it shared, so no other thread of the process changes the process's device memory
 * through the hook meanwhile), reads the process's own device memory before and after, and
 * charges the difference to the slice. The source is NVML's per-process list for the
 * slice's GPU (this pid's usedGpuMemory: what other processes do in the meantime does not
 * count); where NVML does not list this pid (no NVML, another pid namespace) it is the
 * device's used memory (NVML, else cuMemGetInfo), which other processes' frees during the
 * call can make smaller. Memory that pools give back at a synchronisation (which is not
 * locked) is taken out: pool reserved memory is read before and after in an order that can
 * only make the charge larger. Over the cap the call is undone (the module or library
 * unloaded) and CUDA_ERROR_OUT_OF_MEMORY returned: the driver held
 * the memory between the call and the undo. The charge is given back at cuModuleUnload,
 * cuLibraryUnload (every charge of the library) or the context's destruction (what was
 * loaded into it). */
#include <stdlib.h>
#include <unistd.h>

#include "hook.h"

#define MAX_PROCS 1024

/* ---- the process's memory lock ---- */

static pthread_rwlock_t memop_lock = PTHREAD_RWLOCK_INITIALIZER;
static __thread int memop_depth __attribute__((tls_model("initial-exec")));
static __thread int memop_writer __attribute__((tls_model("initial-exec")));

/* A child forked while another thread held the lock must not inherit it held. */
static void memop_after_fork(void) {
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER;
    memop_lock = fresh;
    memop_depth = memop_writer = 0;
}
static pthread_once_t memop_once = PTHREAD_ONCE_INIT;
static void memop_setup(void) { pthread_atfork(NULL, NULL, memop_after_fork); }

int memop_begin(void) {
    pthread_once(&memop_once, memop_setup);
    if (memop_writer) return 0; /* this thread measures: it holds the lock exclusively */
    if (memop_depth++ == 0) pthread_rwlock_rdlock(&memop_lock);
    return 1;
}

void memop_end(int *held) {
    if (*held && --memop_depth == 0) pthread_rwlock_unlock(&memop_lock);
}

static void memop_exclusive(void) {
    pthread_once(&memop_once, memop_setup);
    if (memop_writer++ == 0) pthread_rwlock_wrlock(&memop_lock);
}

static void memop_release(void) {
    if (--memop_writer == 0) pthread_rwlock_unlock(&memop_lock);
}

/* ---- what the process holds on the device ---- */

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static nvmlDevice_t nvml_dev;
static int nvml_ok;

static void nvml_open(void) {
    hook_load_nvml();
    if (!HAVE_REAL(nvmlInit_v2) || REAL(nvmlInit_v2)() != 0) return;
    nvmlReturn_t r = -1;
    if (g_lim.device_uuid[0] && HAVE_REAL(nvmlDeviceGetHandleByUUID))
        r = REAL(nvmlDeviceGetHandleByUUID)(g_lim.device_uuid, &nvml_dev);
    else if (HAVE_REAL(nvmlDeviceGetHandleByIndex_v2))
        r = REAL(nvmlDeviceGetHandleByIndex_v2)(0, &nvml_dev);
    nvml_ok = r == 0;
}

/* This pid's device memory in NVML's per-process list; 0 when it is not listed. */
static int own_usage(uint64_t *out) {
    pthread_once(&nvml_once, nvml_open);
    if (!nvml_ok) return 0;
    static nvmlProcessInfo_t buf[MAX_PROCS]; /* under the exclusive lock */
    unsigned n = MAX_PROCS;
    nvmlReturn_t r = -1;
    if (HAVE_REAL(nvmlDeviceGetComputeRunningProcesses_v3))
        r = REAL(nvmlDeviceGetComputeRunningProcesses_v3)(nvml_dev, &n, buf);
    else if (HAVE_REAL(nvmlDeviceGetComputeRunningProcesses_v2))
        r = REAL(nvmlDeviceGetComputeRunningProcesses_v2)(nvml_dev, &n, buf);
    if (r != 0) return 0;
    unsigned pid = (unsigned)getpid();
    for (unsigned i = 0; i < n && i < MAX_PROCS; i++)
        if (buf[i].pid == pid && buf[i].usedGpuMemory != ~0ULL) {
            *out = buf[i].usedGpuMemory;
            return 1;
        }
    return 0;
}

/* The device's used memory (everyone's): NVML, else the driver's cuMemGetInfo. */
static int device_usage(uint64_t *out) {
    pthread_once(&nvml_once, nvml_open);
    nvmlMemory_t m;
    if (nvml_ok && HAVE_REAL(nvmlDeviceGetMemoryInfo) && REAL(nvmlDeviceGetMemoryInfo)(nvml_dev, &m) == 0) {
        *out = m.used;
        return 1;
    }
    size_t free_b = 0, total = 0;
    if (HAVE_REAL(cuMemGetInfo_v2) && REAL(cuMemGetInfo_v2)(&free_b, &total) == CUDA_SUCCESS &&
        total >= free_b) {
        *out = total - free_b;
        return 1;
    }
    return 0;
}

/* Before: pools first, then the process (a pool shrinking in between only adds). */
static void measure_begin(measure_t *m) {
    memop_exclusive();
    m->pools = pool_reserved_total();
    m->own_ok = own_usage(&m->own);
    m->dev_ok = !m->own_ok && device_usage(&m->dev); /* only needed when NVML lacks us */
}

/* After: the process first, then pools. What the call took, or 0. The lock stays held. */
static uint64_t measure_took(measure_t *m, CUresult r) {
    uint64_t own = 0, dev = 0;
    int own_ok = own_usage(&own), dev_ok = !own_ok && m->dev_ok && device_usage(&dev);
    uint64_t pools = pool_reserved_total();
    if (r != CUDA_SUCCESS) return 0;
    int64_t grew;
    if (own_ok) /* not listed before: it held nothing on the device */
        grew = (int64_t)(own - (m->own_ok ? m->own : 0));
    else if (dev_ok && m->dev_ok)
        grew = (int64_t)(dev - m->dev);
    else
        return 0; /* nothing to measure with */
    grew -= (int64_t)(pools - m->pools); /* pool growth is the pools' own charge */
    return grew > 0 ? (uint64_t)grew : 0;
}

/* ---- charges: (module or library, context) -> bytes ---- */

typedef struct {
    void *handle;  /* a CUmodule or CUlibrary; NULL: libraries a new context brought in */
    CUcontext ctx; /* NULL: a library loaded eagerly into every context there was */
    uint64_t bytes;
} charge_t;

static charge_t *charges;
static size_t ncharges, cap_charges;
static pthread_mutex_t charge_lock = PTHREAD_MUTEX_INITIALIZER;

static void record(void *handle, CUcontext ctx, uint64_t bytes);

/* 0, or -1 when `bytes` do not fit under the cap (nothing charged then) */
static int charge(void *handle, CUcontext ctx, uint64_t bytes) {
    if (bytes && ledger_reserve(bytes) != 0) return -1;
    record(handle, ctx, bytes);
    return 0;
}

/* what (handle, ctx) took, already charged: given back with the handle or the context */
static void record(void *handle, CUcontext ctx, uint64_t bytes) {
    pthread_mutex_lock(&charge_lock);
    if (ncharges == cap_charges) {
        size_t nc = cap_charges ? cap_charges * 2 : 32;
        charge_t *n = realloc(charges, nc * sizeof *n);
        if (!n) { /* cannot be given back later: kept for good */
            pthread_mutex_unlock(&charge_lock);
            return;
        }
        charges = n;
        cap_charges = nc;
    }
    charges[ncharges++] = (charge_t){handle, ctx, bytes};
    pthread_mutex_unlock(&charge_lock);
}

static int charged(void *handle, CUcontext ctx) {
    int found = 0;
    pthread_mutex_lock(&charge_lock);
    for (size_t i = 0; i < ncharges && !found; i++)
        found = charges[i].handle == handle && charges[i].ctx == ctx;
    pthread_mutex_unlock(&charge_lock);
    return found;
}

/* Gives back every charge of `handle` (when non-NULL) or of `ctx` (when non-NULL). */
static void give_back(void *handle, CUcontext ctx) {
    pthread_mutex_lock(&charge_lock);
    for (size_t i = 0; i < ncharges;) {
        charge_t *c = &charges[i];
        if ((handle && c->handle == handle) || (ctx && c->ctx == ctx)) {
            ledger_release(c->bytes);
            *c = charges[--ncharges];
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&charge_lock);
}

/* Bumped whenever a context, a module or a library goes: launches then check their kernels
 * again (here, and their local memory in lmem.c: a handle may come back naming other code). */
static uint64_t generation;

uint64_t module_generation(void) { return __atomic_load_n(&generation, __ATOMIC_ACQUIRE); }

void module_forget_ctx(CUcontext ctx) {
    if (!ctx) return;
    give_back(NULL, ctx);
    __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
}

/* ---- kernels: CUkernel -> its library ---- */

/* CUkernel -> (CUlibrary, the context its library was last seen loaded in, with the
 * generation then: see seen_tag) */
static qgpu_table_t kernels = QGPU_TABLE_INIT;
static int kernels_known;

static void note_kernel(CUkernel k, CUlibrary lib) {
    if (k && qgpu_table_put(&kernels, (uintptr_t)k, (uint64_t)(uintptr_t)lib, 0) == 0)
        __atomic_store_n(&kernels_known, 1, __ATOMIC_RELEASE);
}

static uint64_t gone_lib;
static int kernel_of_gone(uint64_t key, uint64_t size, int64_t tag) {
    (void)key;
    (void)tag;
    return size == gone_lib;
}

static void library_gone(CUlibrary lib) {
    give_back(lib, NULL);
    __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    gone_lib = (uint64_t)(uintptr_t)lib;
    qgpu_entry_t out[64];
    while (qgpu_table_take_if(&kernels, kernel_of_gone, out, 64) == 64) {
    }
    pthread_mutex_unlock(&lock);
}

static CUlibrary library_of(CUkernel k) {
    uint64_t lib = 0;
    if (qgpu_table_get(&kernels, (uintptr_t)k, &lib, NULL) == 0) return (CUlibrary)(uintptr_t)lib;
    CUlibrary l = NULL;
    if (HAVE_REAL(cuKernelGetLibrary) && REAL(cuKernelGetLibrary)(&l, k) == CUDA_SUCCESS && l) {
        note_kernel(k, l);
        return l;
    }
    return NULL;
}

/* ---- module loads ---- */

static CUresult module_loaded(CUresult r, measure_t *m, CUmodule *mod) {
    uint64_t took = measure_took(m, r);
    if (r == CUDA_SUCCESS && mod && charge(*mod, mem_current_ctx(), took) != 0) {
        if (HAVE_REAL(cuModuleUnload)) REAL(cuModuleUnload)(*mod);
        *mod = NULL;
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    memop_release();
    return r;
}

#define MODULE_LOAD(name, params, args)                                                      \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, args);                                                              \
        measure_t m;                                                                         \
        measure_begin(&m);                                                                   \
        CUresult r = REAL(name)(args);                                                       \
        return module_loaded(r, &m, mod);                                                    \
    }
#define ARGS(...) __VA_ARGS__
MODULE_LOAD(cuModuleLoad, (CUmodule * mod, const char *path), ARGS(mod, path))
MODULE_LOAD(cuModuleLoadData, (CUmodule * mod, const void *image), ARGS(mod, image))
MODULE_LOAD(cuModuleLoadDataEx,
            (CUmodule * mod, const void *image, unsigned int n, CUjit_option *opts, void **vals),
            ARGS(mod, image, n, opts, vals))
MODULE_LOAD(cuModuleLoadFatBinary, (CUmodule * mod, const void *fatbin), ARGS(mod, fatbin))

QGPU_EXPORT CUresult cuModuleUnload(CUmodule mod) {
    HOOK_ENTER(cuModuleUnload, mod);
    HOOK_MEM_OP();
    CUresult r = REAL(cuModuleUnload)(mod);
    if (r == CUDA_SUCCESS && mod) give_back(mod, NULL);
    if (r == CUDA_SUCCESS) /* its functions' handles may come back, naming other code */
        __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
    return r;
}

/* ---- libraries ---- */

static CUresult library_loaded(CUresult r, measure_t *m, CUlibrary *lib) {
    uint64_t took = measure_took(m, r);
    if (r == CUDA_SUCCESS && lib && charge(*lib, NULL, took) != 0) {
        if (HAVE_REAL(cuLibraryUnload)) REAL(cuLibraryUnload)(*lib);
        *lib = NULL;
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    memop_release();
    return r;
}

QGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, CUjit_option *jit,
                                       void **jitv, unsigned int njit, CUlibraryOption *lopt,
                                       void **lval, unsigned int nlib) {
    HOOK_ENTER(cuLibraryLoadData, lib, code, jit, jitv, njit, lopt, lval, nlib);
    measure_t m;
    measure_begin(&m);
    CUresult r = REAL(cuLibraryLoadData)(lib, code, jit, jitv, njit, lopt, lval, nlib);
    return library_loaded(r, &m, lib);
}

QGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *path, CUjit_option *jit,
                                           void **jitv, unsigned int njit, CUlibraryOption *lopt,
                                           void **lval, unsigned int nlib) {
    HOOK_ENTER(cuLibraryLoadFromFile, lib, path, jit, jitv, njit, lopt, lval, nlib);
    measure_t m;
    measure_begin(&m);
    CUresult r = REAL(cuLibraryLoadFromFile)(lib, path, jit, jitv, njit, lopt, lval, nlib);
    return library_loaded(r, &m, lib);
}

QGPU_EXPORT CUresult cuLibraryUnload(CUlibrary lib) {
    HOOK_ENTER(cuLibraryUnload, lib);
    HOOK_MEM_OP();
    CUresult r = REAL(cuLibraryUnload)(lib);
    if (r == CUDA_SUCCESS && lib) library_gone(lib);
    return r;
}

/* A call that may load `lib` into `ctx` (lazy loading): measured the first time for that
 * pair. Over the cap the whole library is unloaded (an instance cannot be unloaded alone). */
typedef CUresult (*use_fn)(void *arg);

static CUresult library_use(CUlibrary lib, CUcontext ctx, use_fn call, void *arg) {
    if (!lib || !ctx || charged(lib, ctx)) return call(arg);
    measure_t m;
    measure_begin(&m);
    CUresult r = call(arg);
    uint64_t took = measure_took(&m, r);
    if (r == CUDA_SUCCESS && charge(lib, ctx, took) != 0) {
        if (HAVE_REAL(cuLibraryUnload) && REAL(cuLibraryUnload)(lib) == CUDA_SUCCESS)
            library_gone(lib);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    memop_release();
    return r;
}

typedef struct {
    CUmodule *mod;
    CUlibrary lib;
    CUdeviceptr *dptr;
    size_t *bytes;
    const char *name;
    CUfunction *fn;
    CUkernel k;
} use_args_t;

static CUresult call_get_module(void *p) {
    use_args_t *a = p;
    return REAL(cuLibraryGetModule)(a->mod, a->lib);
}
static CUresult call_get_global(void *p) {
    use_args_t *a = p;
    return REAL(cuLibraryGetGlobal)(a->dptr, a->bytes, a->lib, a->name);
}
static CUresult call_get_managed(void *p) {
    use_args_t *a = p;
    return REAL(cuLibraryGetManaged)(a->dptr, a->bytes, a->lib, a->name);
}
static CUresult call_kernel_function(void *p) {
    use_args_t *a = p;
    return REAL(cuKernelGetFunction)(a->fn, a->k);
}

QGPU_EXPORT CUresult cuLibraryGetModule(CUmodule *mod, CUlibrary lib) {
    HOOK_ENTER(cuLibraryGetModule, mod, lib);
    use_args_t a = {.mod = mod, .lib = lib};
    return library_use(lib, mem_current_ctx(), call_get_module, &a);
}

QGPU_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
                                        const char *name) {
    HOOK_ENTER(cuLibraryGetGlobal, dptr, bytes, lib, name);
    use_args_t a = {.dptr = dptr, .bytes = bytes, .lib = lib, .name = name};
    return library_use(lib, mem_current_ctx(), call_get_global, &a);
}

QGPU_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
                                         const char *name) {
    HOOK_ENTER(cuLibraryGetManaged, dptr, bytes, lib, name);
    use_args_t a = {.dptr = dptr, .bytes = bytes, .lib = lib, .name = name};
    return library_use(lib, mem_current_ctx(), call_get_managed, &a);
}

QGPU_EXPORT CUresult cuKernelGetFunction(CUfunction *fn, CUkernel k) {
    HOOK_ENTER(cuKernelGetFunction, fn, k);
    use_args_t a = {.fn = fn, .k = k};
    return library_use(library_of(k), mem_current_ctx(), call_kernel_function, &a);
}

QGPU_EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name) {
    HOOK_ENTER(cuLibraryGetKernel, k, lib, name);
    CUresult r = REAL(cuLibraryGetKernel)(k, lib, name);
    if (r == CUDA_SUCCESS && k) note_kernel(*k, lib);
    return r;
}

QGPU_EXPORT CUresult cuLibraryEnumerateKernels(CUkernel *ks, unsigned int n, CUlibrary lib) {
    HOOK_ENTER(cuLibraryEnumerateKernels, ks, n, lib);
    CUresult r = REAL(cuLibraryEnumerateKernels)(ks, n, lib);
    for (unsigned i = 0; r == CUDA_SUCCESS && ks && i < n; i++) note_kernel(ks[i], lib);
    return r;
}

/* ---- a CUkernel used where a CUfunction goes (launches, graph kernel nodes) ---- */

typedef struct {
    CUkernel k;
    CUcontext ctx; /* where it is used */
    CUcontext cur;
} preload_t;

/* The library loaded into the context by the driver's own call, so the launch that follows
 * takes nothing more. */
static CUresult call_preload(void *p) {
    preload_t *a = p;
    int pushed = a->ctx != a->cur && HAVE_REAL(cuCtxPushCurrent_v2) &&
                 REAL(cuCtxPushCurrent_v2)(a->ctx) == CUDA_SUCCESS;
    CUfunction fn;
    CUresult r = HAVE_REAL(cuKernelGetFunction) ? REAL(cuKernelGetFunction)(&fn, a->k)
                                                : CUDA_SUCCESS;
    CUcontext popped;
    if (pushed && HAVE_REAL(cuCtxPopCurrent_v2)) REAL(cuCtxPopCurrent_v2)(&popped);
    return r;
}

/* A context pointer and the generation it was seen in (a context made later at the same
 * address, or a library unloaded meanwhile, makes the tag stale). */
static int64_t seen_tag(CUcontext ctx) {
    uint64_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    return (int64_t)((gen << 48) ^ (uint64_t)(uintptr_t)ctx);
}

/* A CUkernel the hook learnt (cuLibraryGetKernel, cuLibraryEnumerateKernels), not a
 * CUfunction: a CUfunction query on it would resolve it, loading its library unmeasured. */
static int is_kernel(void *f) {
    return f && __atomic_load_n(&kernels_known, __ATOMIC_ACQUIRE) &&
           qgpu_table_get(&kernels, (uintptr_t)f, NULL, NULL) == 0;
}

/* `f` used in context `ctx` (NULL: the current one) when it is a CUkernel: one table
 * look-up, and only the first use of a kernel in a context (or after a context or library
 * went) goes further. */
static CUresult kernel_use_in(void *f, CUcontext ctx) {
    if (!f || !__atomic_load_n(&kernels_known, __ATOMIC_ACQUIRE)) return CUDA_SUCCESS;
    uint64_t lib = 0;
    int64_t seen = 0;
    if (qgpu_table_get(&kernels, (uintptr_t)f, &lib, &seen) != 0) return CUDA_SUCCESS;
    preload_t a = {.k = (CUkernel)f, .cur = mem_current_ctx()};
    a.ctx = ctx ? ctx : a.cur;
    int64_t tag = seen_tag(a.ctx);
    if (a.ctx && seen == tag) return CUDA_SUCCESS;
    CUresult r = library_use((CUlibrary)(uintptr_t)lib, a.ctx, call_preload, &a);
    if (r == CUDA_SUCCESS) qgpu_table_put(&kernels, (uintptr_t)f, lib, tag);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? r : CUDA_SUCCESS; /* the call reports the rest */
}

/* ---- a function's code, loaded lazily (cuda.h: cuFuncIsLoaded, cuFuncLoad) ----
 *
 * Under lazy loading (CUDA's default since 12.2) a function's code reaches the GPU at its
 * first launch, not with its module: memory no allocation call shows, as large as the
 * tenant's kernels (a generated kernel of a million instructions takes megabytes, and a
 * module can hold thousands). Before a function is launched or put into a graph node for the
 * first time in its context, the hook loads it itself (cuFuncLoad), measured like a module
 * load, and charges it to its module (its library for a CUkernel): given back at
 * cuModuleUnload / cuLibraryUnload or with the context. A load cannot be undone: over the cap
 * the code stays charged past it and the launch is refused, and no code is loaded while the
 * slice is at its cap (at most one function's code past it). Drivers before CUDA 12.4 have
 * no cuFuncLoad: nothing is measured there. A thread's last (function, context) costs one
 * comparison. */
static __thread void *code_f __attribute__((tls_model("initial-exec")));
static __thread CUcontext code_ctx __attribute__((tls_model("initial-exec")));
static __thread uint64_t code_gen __attribute__((tls_model("initial-exec")));

static CUresult function_code_use(void *f, CUcontext ctx, int kernel);

static CUresult load_code(CUfunction fn, void *owner, CUcontext ctx) {
    int state = 1;
    if (REAL(cuFuncIsLoaded)(&state, fn) != CUDA_SUCCESS || state != 0) return CUDA_SUCCESS;
    if (ledger_used() >= g_lim.mem_limit) return CUDA_ERROR_OUT_OF_MEMORY; /* at the cap */
    measure_t m;
    measure_begin(&m);
    CUresult r = REAL(cuFuncLoad)(fn);
    uint64_t took = measure_took(&m, r);
    if (r == CUDA_SUCCESS && took && charge(owner, ctx, took) != 0) {
        ledger_force(took); /* the driver holds it: charged past the cap */
        record(owner, ctx, took);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    memop_release();
    return r;
}

/* The application's own cuFuncLoad: measured the same way (a CUfunction, or a CUkernel cast
 * to one, in the current context). */
QGPU_EXPORT CUresult cuFuncLoad(CUfunction f) {
    HOOK_ENTER(cuFuncLoad, f);
    return function_code_use((void *)f, NULL, is_kernel((void *)f));
}

/* Calls that name a function and may load its code as a launch does (cuda.h does not say
 * they do not): its library (a CUkernel's) and its code loaded first, measured. */
static CUresult code_before_query(void *f) {
    int kernel = is_kernel(f);
    CUresult r = kernel_use_in(f, NULL);
    return r != CUDA_SUCCESS ? r : function_code_use(f, NULL, kernel);
}

#define LOADS_CODE(name, params, f, ...)                                                     \
    QGPU_EXPORT CUresult name params {                                                       \
        HOOK_ENTER(name, __VA_ARGS__);                                                       \
        CUresult r = code_before_query((void *)(f));                                         \
        return r != CUDA_SUCCESS ? r : REAL(name)(__VA_ARGS__);                              \
    }
LOADS_CODE(cuFuncSetAttribute, (CUfunction f, CUfunction_attribute a, int v), f, f, a, v)
LOADS_CODE(cuFuncSetCacheConfig, (CUfunction f, int c), f, f, c)
LOADS_CODE(cuOccupancyMaxActiveBlocksPerMultiprocessor, (int *n, CUfunction f, int b, size_t m),
           f, n, f, b, m)
LOADS_CODE(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,
           (int *n, CUfunction f, int b, size_t m, unsigned int fl), f, n, f, b, m, fl)
LOADS_CODE(cuOccupancyMaxPotentialBlockSize,
           (int *g, int *b, CUfunction f, CUoccupancyB2DSize c, size_t m, int l), f, g, b, f, c, m, l)
LOADS_CODE(cuOccupancyMaxPotentialBlockSizeWithFlags,
           (int *g, int *b, CUfunction f, CUoccupancyB2DSize c, size_t m, int l, unsigned int fl), f,
           g, b, f, c, m, l, fl)
LOADS_CODE(cuOccupancyAvailableDynamicSMemPerBlock, (size_t *s, CUfunction f, int n, int b), f, s,
           f, n, b)
LOADS_CODE(cuOccupancyMaxPotentialClusterSize, (int *c, CUfunction f, const CUlaunchConfig *k), f,
           c, f, k)
LOADS_CODE(cuOccupancyMaxActiveClusters, (int *c, CUfunction f, const CUlaunchConfig *k), f, c, f, k)

static CUresult function_code_use(void *f, CUcontext ctx, int kernel) {
    if (!f || !HAVE_REAL(cuFuncIsLoaded) || !HAVE_REAL(cuFuncLoad)) return CUDA_SUCCESS;
    CUcontext cur = mem_current_ctx();
    if (!ctx) ctx = cur;
    uint64_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    if (f == code_f && ctx == code_ctx && gen == code_gen) return CUDA_SUCCESS;
    int pushed = ctx && ctx != cur && HAVE_REAL(cuCtxPushCurrent_v2) &&
                 REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
    CUfunction fn = (CUfunction)f;
    void *owner = NULL;
    CUresult r = CUDA_SUCCESS;
    if (kernel) {
        owner = library_of((CUkernel)f);
        r = HAVE_REAL(cuKernelGetFunction) ? REAL(cuKernelGetFunction)(&fn, (CUkernel)f)
                                           : CUDA_ERROR_NOT_FOUND;
    } else {
        CUmodule mod = NULL;
        if (HAVE_REAL(cuFuncGetModule) && REAL(cuFuncGetModule)(&mod, fn) == CUDA_SUCCESS)
            owner = mod;
    }
    if (r == CUDA_SUCCESS && owner) r = load_code(fn, owner, ctx);
    else r = CUDA_SUCCESS; /* not a function the driver knows: its launch reports it */
    if (pushed) {
        CUcontext popped;
        REAL(cuCtxPopCurrent_v2)(&popped);
    }
    if (r == CUDA_SUCCESS) {
        code_f = f;
        code_ctx = ctx;
        code_gen = gen;
    }
    return r;
}

/* On every launch once CUkernels are known; a stream other than a default one names the
 * context the kernel runs (and its library loads) in. */
CUresult module_kernel_use(void *f, CUstream s) {
    if (!f) return CUDA_SUCCESS;
    CUcontext c = NULL;
    if ((uintptr_t)s > 2 && HAVE_REAL(cuStreamGetCtx) && REAL(cuStreamGetCtx)(s, &c) != CUDA_SUCCESS)
        c = NULL;
    if (!c) c = mem_current_ctx(); /* looked up once for the three */
    int kernel = is_kernel(f);
    CUresult r = kernel_use_in(f, c); /* its library first, then its code: measured */
    if (r == CUDA_SUCCESS) r = function_code_use(f, c, kernel);
    return r != CUDA_SUCCESS ? r : lmem_before(f, c, kernel); /* then its local memory */
}

/* A kernel node's kernel, as cuda.h's CUDA_KERNEL_NODE_PARAMS (v2, and the generic node's v3)
 * names it: `func` (a CUfunction, or a CUkernel cast to one, in the current context), or,
 * when func is NULL, `kern` in `ctx` (the current context when NULL). */
CUresult module_node_kernel_use(void *func, void *kern, CUcontext ctx) {
    void *f = func ? func : kern;
    CUcontext c = func ? NULL : ctx;
    int kernel = is_kernel(f);
    CUresult r = kernel_use_in(f, c);
    if (r == CUDA_SUCCESS) r = function_code_use(f, c, kernel);
    return r != CUDA_SUCCESS ? r : lmem_before(f, c, kernel);
}

/* the kernel of CUDA 11's CUDA_KERNEL_NODE_PARAMS (func only) and of the v2 form */
#define NODE_KERNEL_V1(p) ((p) ? module_node_kernel_use((void *)(p)->func, NULL, NULL) : 0)
#define NODE_KERNEL_V2(p) ((p) ? module_node_kernel_use((void *)(p)->func, (p)->kern, (p)->ctx) : 0)

QGPU_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *p) {
    HOOK_ENTER(cuGraphAddKernelNode, node, g, deps, ndeps, p);
    CUresult r = NODE_KERNEL_V1(p);
    return r ? r : REAL(cuGraphAddKernelNode)(node, g, deps, ndeps, p);
}

QGPU_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                             size_t ndeps, const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    HOOK_ENTER(cuGraphAddKernelNode_v2, node, g, deps, ndeps, p);
    CUresult r = NODE_KERNEL_V2(p);
    return r ? r : REAL(cuGraphAddKernelNode_v2)(node, g, deps, ndeps, p);
}

/* A kernel node changed to a CUkernel (of a graph, or of an executable graph's copy): its
 * library is loaded into the node's context first, measured, as for a new node. */
QGPU_EXPORT CUresult cuGraphKernelNodeSetParams(CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p) {
    HOOK_ENTER(cuGraphKernelNodeSetParams, node, p);
    CUresult r = NODE_KERNEL_V1(p);
    return r ? r : REAL(cuGraphKernelNodeSetParams)(node, p);
}

QGPU_EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode node,
                                                   const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    HOOK_ENTER(cuGraphKernelNodeSetParams_v2, node, p);
    CUresult r = NODE_KERNEL_V2(p);
    return r ? r : REAL(cuGraphKernelNodeSetParams_v2)(node, p);
}

QGPU_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec e, CUgraphNode node,
                                                    const CUDA_KERNEL_NODE_PARAMS *p) {
    HOOK_ENTER(cuGraphExecKernelNodeSetParams, e, node, p);
    CUresult r = NODE_KERNEL_V1(p);
    return r ? r : REAL(cuGraphExecKernelNodeSetParams)(e, node, p);
}

QGPU_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode node,
                                                       const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    HOOK_ENTER(cuGraphExecKernelNodeSetParams_v2, e, node, p);
    CUresult r = NODE_KERNEL_V2(p);
    return r ? r : REAL(cuGraphExecKernelNodeSetParams_v2)(e, node, p);
}

/* ---- calls other files measure (context creation, ctx.c) ---- */

void measure_call_begin(measure_t *m) { measure_begin(m); }

uint64_t measure_call_took(measure_t *m, CUresult r) { return measure_took(m, r); }

void measure_call_done(void) { memop_release(); }
