/* Device memory a module takes when it is loaded: a cubin (argv[2], built by the test with
 * nvcc) whose `__device__ char big[3 GiB]` the driver allocates at load, outside every
 * allocation API the hook charges. The tenant loads it `argv[3]` times (default 2) one way
 * (argv[1]) and reports each attempt ("load r"), then holds what it took:
 *   load, data, dataex, fatbinary   cuModuleLoad (the file) / LoadData / LoadDataEx /
 *                                   LoadFatBinary (the image in memory)
 *   link, link-file                 cuLinkCreate + cuLinkAddData / cuLinkAddFile +
 *                                   cuLinkComplete, then cuModuleLoadData of the output
 *   library, library-file           cuLibraryLoadData / cuLibraryLoadFromFile (the test sets
 *                                   CUDA_MODULE_LOADING=EAGER: loaded into the context at once)
 *   lazy-module, lazy-global,       cuLibraryLoadData under lazy loading (NVIDIA's default),
 *   lazy-kernel, lazy-launch,       then what loads it into the context: cuLibraryGetModule,
 *   lazy-graph, lazy-graph-node     cuLibraryGetGlobal, cuKernelGetFunction, a cuLaunchKernel
 *                                   of the CUkernel itself, a graph kernel node of it
 *                                   (cuGraphAddKernelNode / the generic cuGraphAddNode_v2)
 *   lazy-stream                     a CUkernel launched on a stream of a second context (it
 *                                   loads there, not in the current one)
 *   lazy-graph-kern(-ctx)           a kernel node naming the CUkernel in the `kern` field of
 *                                   CUDA_KERNEL_NODE_PARAMS (func NULL), in the current
 *                                   context or (-ctx) in a second one named by its `ctx` field
 *   lazy-node-set(-kern)            a kernel node of a plain function (the simulator's
 *                                   built-in image) changed to the CUkernel by
 *                                   cuGraphKernelNodeSetParams (as func, or -kern as kern)
 *   lazy-exec-node-set              ... in an executable graph: cuGraphExecKernelNodeSetParams
 *   lazy-generic-set                ... by the generic cuGraphNodeSetParams (kernel.kern)
 *   lazy-exec-generic-set           ... by cuGraphExecNodeSetParams (kernel.func)
 *   lazy-update                     an executable graph of a plain function node updated
 *                                   (cuGraphExecUpdate) from a graph whose node names the
 *                                   CUkernel by `kern`
 *   contexts                        one library, eager loading, then a new context per
 *                                   further attempt (each gets its own instance)
 * "cycle" instead loads and unloads `argv[3]` times (argv[4]: module, library or context:
 * how it is given back; "context" loads into a context of its own, the only one, and destroys
 * it), then reports "grab" for 3 GiB of cuMemAlloc: what was charged for the loads must have
 * come back.
 * "race" (argv[3] rounds) races the measurement: each round holds 3 GiB of cuMemAlloc, then
 * one thread loads the module while another frees those 3 GiB a few microseconds later; a
 * load measured across the free would be charged nothing (the process's memory did not
 * grow) while the free is given back, so 3 GiB more would then fit. It reports "escaped 1"
 * and holds when a 3 GiB cuMemAlloc succeeds beside a loaded module, else "escaped 0". */
#include "hostile.h"

#include <pthread.h>
#include <time.h>

static unsigned char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) exit(3);
    fclose(f);
    buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

static CUresult linked(const unsigned char *img, size_t len, const char *path, int from_file,
                       CUmodule *mod) {
    CUlinkState st;
    CUresult r = cuLinkCreate(0, NULL, NULL, &st);
    if (r) return r;
    r = from_file ? cuLinkAddFile(st, CU_JIT_INPUT_CUBIN, path, 0, NULL, NULL)
                  : cuLinkAddData(st, CU_JIT_INPUT_CUBIN, (void *)img, len, "big", 0, NULL, NULL);
    void *out = NULL;
    size_t out_len = 0;
    if (!r) r = cuLinkComplete(st, &out, &out_len);
    if (!r) r = cuModuleLoadData(mod, out);
    cuLinkDestroy(st);
    return r;
}

/* a second context, made once; the current one stays current */
static CUcontext second_context(void) {
    static CUcontext other;
    if (!other) {
        CUcontext mine;
        CUdevice dev;
        cuCtxGetCurrent(&mine);
        cuDeviceGet(&dev, 0);
        if (cuCtxCreate(&other, NULL, 0, dev) != CUDA_SUCCESS) other = NULL;
        cuCtxSetCurrent(mine);
    }
    return other;
}

static void one_block(CUDA_KERNEL_NODE_PARAMS *p, void **args) {
    memset(p, 0, sizeof *p);
    p->gridDimX = p->gridDimY = p->gridDimZ = p->blockDimX = p->blockDimY = p->blockDimZ = 1;
    p->kernelParams = args;
}

/* A graph with one kernel node of a plain function (the simulator's built-in image, which
 * takes no device memory), in *node; instantiated into *exec when exec is not NULL. */
static CUresult plain_graph(CUgraph *g, CUgraphNode *node, CUgraphExec *exec, void **args) {
    static CUmodule plain;
    static CUfunction f;
    CUresult r;
    if (!plain && ((r = cuModuleLoadData(&plain, "qgpu-sim-module")) ||
                   (r = cuModuleGetFunction(&f, plain, "touch"))))
        return r;
    CUDA_KERNEL_NODE_PARAMS p;
    one_block(&p, args);
    p.func = f;
    if ((r = cuGraphCreate(g, 0)) || (r = cuGraphAddKernelNode(node, *g, NULL, 0, &p))) return r;
    return exec ? cuGraphInstantiate(exec, *g, 0) : CUDA_SUCCESS;
}

/* The graph-node ways of bringing the library in (kern fields, parameter changes, update). */
static CUresult lazy_graph_use(const char *way, CUkernel k, void **args) {
    CUgraph g;
    CUgraphNode node;
    CUgraphExec exec;
    CUDA_KERNEL_NODE_PARAMS p;
    CUgraphNodeParams gp;
    CUresult r;
    one_block(&p, args);
    memset(&gp, 0, sizeof gp);
    gp.type = CU_GRAPH_NODE_TYPE_KERNEL;
    gp.kernel.gridDimX = gp.kernel.gridDimY = gp.kernel.gridDimZ = 1;
    gp.kernel.blockDimX = gp.kernel.blockDimY = gp.kernel.blockDimZ = 1;
    gp.kernel.kernelParams = args;
    if (!strcmp(way, "lazy-graph-kern") || !strcmp(way, "lazy-graph-kern-ctx")) {
        p.kern = k;
        if (!strcmp(way, "lazy-graph-kern-ctx") && !(p.ctx = second_context()))
            return CUDA_ERROR_OUT_OF_MEMORY;
        cuGraphCreate(&g, 0);
        return cuGraphAddKernelNode(&node, g, NULL, 0, &p);
    }
    int exec_way = !strcmp(way, "lazy-exec-node-set") || !strcmp(way, "lazy-exec-generic-set") ||
                   !strcmp(way, "lazy-update");
    if ((r = plain_graph(&g, &node, exec_way ? &exec : NULL, args))) return r;
    if (!strcmp(way, "lazy-node-set") || !strcmp(way, "lazy-exec-node-set")) {
        p.func = (CUfunction)k;
        return exec_way ? cuGraphExecKernelNodeSetParams(exec, node, &p)
                        : cuGraphKernelNodeSetParams(node, &p);
    }
    if (!strcmp(way, "lazy-node-set-kern")) {
        p.kern = k;
        return cuGraphKernelNodeSetParams(node, &p);
    }
    if (!strcmp(way, "lazy-generic-set")) {
        gp.kernel.kern = k;
        return cuGraphNodeSetParams(node, &gp);
    }
    if (!strcmp(way, "lazy-exec-generic-set")) {
        gp.kernel.func = (CUfunction)k;
        return cuGraphExecNodeSetParams(exec, node, &gp);
    }
    if (!strcmp(way, "lazy-update")) {
        CUgraph h;
        CUgraphNode hn;
        CUgraphExecUpdateResultInfo info;
        p.kern = k;
        if ((r = cuGraphCreate(&h, 0)) || (r = cuGraphAddKernelNode(&hn, h, NULL, 0, &p))) return r;
        return cuGraphExecUpdate(exec, h, &info);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* lazy loading: what brings the library into the current context (or the stream's) */
static CUresult lazy_use(const char *way, CUlibrary lib) {
    CUkernel k;
    CUresult r = cuLibraryGetKernel(&k, lib, "touch");
    if (r) return r;
    if (!strcmp(way, "lazy-module")) {
        CUmodule m;
        return cuLibraryGetModule(&m, lib);
    }
    if (!strcmp(way, "lazy-global")) {
        CUdeviceptr p;
        size_t n;
        return cuLibraryGetGlobal(&p, &n, lib, "big");
    }
    if (!strcmp(way, "lazy-kernel")) {
        CUfunction f;
        return cuKernelGetFunction(&f, k);
    }
    void *args[] = {NULL};
    CUdeviceptr none = 0;
    args[0] = &none;
    if (!strcmp(way, "lazy-launch"))
        return cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL);
    if (!strcmp(way, "lazy-stream")) { /* a stream of another context, this one current */
        static CUstream s;
        if (!s) {
            CUcontext mine, other;
            CUdevice dev;
            cuCtxGetCurrent(&mine);
            cuDeviceGet(&dev, 0);
            if ((r = cuCtxCreate(&other, NULL, 0, dev))) return r;
            cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
            cuCtxSetCurrent(mine);
        }
        return cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, s, args, NULL);
    }
    if (!strcmp(way, "lazy-graph")) {
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.func = (CUfunction)k;
        p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimX = p.blockDimY = p.blockDimZ = 1;
        p.kernelParams = args;
        cuGraphCreate(&g, 0);
        return cuGraphAddKernelNode(&node, g, NULL, 0, &p);
    }
    if (!strcmp(way, "lazy-graph-node")) {
        CUgraph g;
        CUgraphNode node;
        CUgraphNodeParams p;
        memset(&p, 0, sizeof p);
        p.type = CU_GRAPH_NODE_TYPE_KERNEL;
        p.kernel.func = (CUfunction)k;
        p.kernel.gridDimX = p.kernel.gridDimY = p.kernel.gridDimZ = 1;
        p.kernel.blockDimX = p.kernel.blockDimY = p.kernel.blockDimZ = 1;
        p.kernel.kernelParams = args;
        cuGraphCreate(&g, 0);
        return cuGraphAddNode(&node, g, NULL, NULL, 0, &p); /* cuGraphAddNode_v2 */
    }
    return lazy_graph_use(way, k, args);
}

static CUresult load_once(const char *way, const unsigned char *img, size_t len,
                          const char *path, CUmodule *mod, CUlibrary *lib) {
    if (!strcmp(way, "load")) return cuModuleLoad(mod, path);
    if (!strcmp(way, "data")) return cuModuleLoadData(mod, img);
    if (!strcmp(way, "dataex")) return cuModuleLoadDataEx(mod, img, 0, NULL, NULL);
    if (!strcmp(way, "fatbinary")) return cuModuleLoadFatBinary(mod, img);
    if (!strcmp(way, "link")) return linked(img, len, path, 0, mod);
    if (!strcmp(way, "link-file")) return linked(img, len, path, 1, mod);
    if (!strcmp(way, "library-file"))
        return cuLibraryLoadFromFile(lib, path, NULL, NULL, 0, NULL, NULL, 0);
    CUresult r = cuLibraryLoadData(lib, img, NULL, NULL, 0, NULL, NULL, 0);
    if (r || !strcmp(way, "library")) return r;
    return lazy_use(way, *lib);
}

typedef struct {
    pthread_barrier_t *go;
    CUcontext ctx;
    const void *img;
    CUmodule mod;
    CUresult r;
    CUdeviceptr held;
    int delay_us, load_delay_us; /* each side starts a little later, by round */
} racer_t;

static void spin_us(int us) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000LL + (t.tv_nsec - t0.tv_nsec) / 1000 < us);
}

static void *race_load(void *p) {
    racer_t *a = p;
    cuCtxSetCurrent(a->ctx);
    pthread_barrier_wait(a->go);
    spin_us(a->load_delay_us);
    a->r = cuModuleLoadData(&a->mod, a->img);
    return NULL;
}

static void *race_free(void *p) {
    racer_t *a = p;
    cuCtxSetCurrent(a->ctx);
    pthread_barrier_wait(a->go);
    spin_us(a->delay_us);
    cuMemFree(a->held);
    return NULL;
}

static void race(CUcontext ctx, const void *img, int rounds) {
    int loaded = 0;
    for (int i = 0; i < rounds; i++) {
        racer_t a = {.ctx = ctx, .img = img, .delay_us = i % 40, .load_delay_us = (i * 7) % 40};
        if (cuMemAlloc(&a.held, 3 * GIB) != CUDA_SUCCESS) continue;
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        a.go = &go;
        pthread_t t1, t2;
        pthread_create(&t1, NULL, race_load, &a);
        pthread_create(&t2, NULL, race_free, &a);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        pthread_barrier_destroy(&go);
        if (a.r != CUDA_SUCCESS) continue; /* refused: measured before the free */
        loaded++;
        CUdeviceptr more;
        if (cuMemAlloc(&more, 3 * GIB) == CUDA_SUCCESS) { /* the module was not charged */
            say("loaded", loaded);
            say("escaped", 1);
            return; /* holds the module and 3 GiB beside it */
        }
        cuModuleUnload(a.mod);
    }
    say("loaded", loaded);
    say("escaped", 0);
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *way = argv[1];
    int times = argc > 3 ? atoi(argv[3]) : 2;
    size_t len;
    unsigned char *img = read_all(argv[2], &len);
    if (!img) return 3;
    CUcontext primary = setup();
    if (!strcmp(way, "race")) {
        race(primary, img, times);
        hold();
        return 0;
    }
    if (!strcmp(way, "cycle")) {
        const char *back = argc > 4 ? argv[4] : "module";
        CUdevice dev0;
        cuDeviceGet(&dev0, 0);
        if (!strcmp(back, "context")) cuDevicePrimaryCtxRelease(dev0); /* one context at a time */
        for (int i = 0; i < times; i++) {
            CUmodule mod;
            CUlibrary lib;
            CUcontext ctx = NULL;
            CUdevice dev;
            cuDeviceGet(&dev, 0);
            if (!strcmp(back, "context")) cuCtxCreate(&ctx, NULL, 0, dev);
            CUresult r = !strcmp(back, "library")
                             ? cuLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0)
                             : cuModuleLoadData(&mod, img);
            if (!r && !strcmp(back, "library")) r = lazy_use("lazy-module", lib);
            say("load", r);
            if (!strcmp(back, "module")) say("unload", cuModuleUnload(mod));
            if (!strcmp(back, "library")) say("unload", cuLibraryUnload(lib));
            if (ctx) say("unload", cuCtxDestroy(ctx));
        }
        if (!strcmp(back, "context")) cuDevicePrimaryCtxRetain(&primary, dev0);
        cuCtxSetCurrent(primary);
        grab(3 * GIB, 1);
        hold();
        return 0;
    }
    if (!strcmp(way, "contexts")) { /* eager: each new context gets its own instance */
        CUlibrary lib;
        say("load", cuLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0));
        for (int i = 1; i < times; i++) {
            CUcontext ctx;
            CUdevice dev;
            cuDeviceGet(&dev, 0);
            say("load", cuCtxCreate(&ctx, NULL, 0, dev));
        }
        hold();
        return 0;
    }
    for (int i = 0; i < times; i++) {
        CUmodule mod;
        CUlibrary lib;
        say("load", load_once(way, img, len, argv[2], &mod, &lib));
    }
    hold();
    return 0;
}
