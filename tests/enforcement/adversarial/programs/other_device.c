/* Another GPU of the node (our addition): a slice belongs to one GPU, but a bare process
 * (Ray, Dask, a shell on the node) can drop CUDA_VISIBLE_DEVICES and see every GPU. The
 * tenant then looks for a device that is not its slice's (argv[1], a UUID) and takes
 * memory there through each way of getting onto it: a primary context (argv[2] = "primary"),
 * cuCtxCreate ("create"), or, from its own GPU's context, VMM memory placed on the other
 * device ("vmm"), a memory pool created there ("pool"), the device's default pool
 * ("default", cuDeviceGetDefaultMemPool) or the location's pool ("location", CUDA 13's
 * cuMemGetMemPool) or a graph allocation node placed there ("graph", cuGraphAddNode_v2,
 * then launched). Or it takes managed memory on its own GPU (charged to its slice there)
 * and moves it to the other device: cuMemPrefetchAsync in each ABI form ("prefetch", the
 * CUDA 13 form with a CUmemLocation; "prefetch_getproc", that form from cuGetProcAddress;
 * "prefetch_ptsz"; "prefetch_v1", the CUdevice form;
 * "prefetch_v1_ptsz"), CUDA 13's batches ("batch", "batch_ptsz", "discard_prefetch",
 * "discard_prefetch_ptsz"), or advice naming the other device ("preferred", "preferred_v1":
 * SET_PREFERRED_LOCATION; "accessed_by", "accessed_by_v1": SET_ACCESSED_BY), followed by a
 * kernel on its own GPU (a fault; after a prefetch, SET_ACCESSED_BY its own GPU first keeps
 * the memory where it went while the kernel uses it). "own" does all of that with its own GPU and the host as
 * the destination. Reports the results, then holds. */
#include "hostile.h"

typedef CUresult (*prefetch_v1_t)(CUdeviceptr, size_t, CUdevice, CUstream);
typedef CUresult (*prefetch_v2_t)(CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream);
typedef CUresult (*batch_t)(CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,
                            unsigned long long, CUstream);
typedef CUresult (*advise_v1_t)(CUdeviceptr, size_t, CUmem_advise, CUdevice);

/* an entry point by its exported name, as a program built against older headers links it */
static void *driver_fn(const char *name) {
    static void *lib;
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    void *f = lib ? dlsym(lib, name) : NULL;
    if (!f) {
        say("missing", 1);
        exit(6);
    }
    return f;
}

static CUdevice other_device(const char *mine) {
    int n = 0;
    cuDeviceGetCount(&n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        CUuuid u;
        char text[64];
        if (cuDeviceGet(&d, i) || cuDeviceGetUuid(&u, d)) continue;
        const unsigned char *b = (const unsigned char *)u.bytes;
        snprintf(text, sizeof text,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
        if (strcmp(text, mine) != 0) return d;
    }
    return -1;
}

static CUdevice own_device(const char *mine) {
    int n = 0;
    cuDeviceGetCount(&n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        if (cuDeviceGet(&d, i) == CUDA_SUCCESS && d != other_device(mine)) return d;
    }
    return -1;
}

/* one way of moving [p, p + size) to device `to` (CU_DEVICE_CPU: the host) */
static CUresult move(const char *way, CUdeviceptr p, size_t size, CUdevice to, CUstream s) {
    CUmemLocation loc = {to == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                         to == CU_DEVICE_CPU ? 0 : to};
    size_t first = 0;
    if (!strcmp(way, "prefetch")) return cuMemPrefetchAsync(p, size, loc, 0, s);
    if (!strcmp(way, "prefetch_getproc")) { /* as CUDA 13 runtimes and cuda-bindings find it */
        void *fn = NULL;
        CUdriverProcAddressQueryResult st;
        if (cuGetProcAddress("cuMemPrefetchAsync", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st) ||
            !fn) {
            say("missing", 1);
            exit(6);
        }
        return ((prefetch_v2_t)fn)(p, size, loc, 0, s);
    }
    if (!strcmp(way, "prefetch_ptsz"))
        return ((prefetch_v2_t)driver_fn("cuMemPrefetchAsync_v2_ptsz"))(p, size, loc, 0, NULL);
    if (!strcmp(way, "prefetch_v1"))
        return ((prefetch_v1_t)driver_fn("cuMemPrefetchAsync"))(p, size, to, s);
    if (!strcmp(way, "prefetch_v1_ptsz"))
        return ((prefetch_v1_t)driver_fn("cuMemPrefetchAsync_ptsz"))(p, size, to, NULL);
    if (!strcmp(way, "batch")) return cuMemPrefetchBatchAsync(&p, &size, 1, &loc, &first, 1, 0, s);
    if (!strcmp(way, "batch_ptsz"))
        return ((batch_t)driver_fn("cuMemPrefetchBatchAsync_ptsz"))(&p, &size, 1, &loc, &first, 1,
                                                                    0, NULL);
    if (!strcmp(way, "discard_prefetch"))
        return cuMemDiscardAndPrefetchBatchAsync(&p, &size, 1, &loc, &first, 1, 0, s);
    if (!strcmp(way, "discard_prefetch_ptsz"))
        return ((batch_t)driver_fn("cuMemDiscardAndPrefetchBatchAsync_ptsz"))(
            &p, &size, 1, &loc, &first, 1, 0, NULL);
    if (!strcmp(way, "preferred"))
        return cuMemAdvise(p, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc);
    if (!strcmp(way, "preferred_v1"))
        return ((advise_v1_t)driver_fn("cuMemAdvise"))(p, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                                                       to);
    if (!strcmp(way, "accessed_by")) return cuMemAdvise(p, size, CU_MEM_ADVISE_SET_ACCESSED_BY, loc);
    if (!strcmp(way, "accessed_by_v1"))
        return ((advise_v1_t)driver_fn("cuMemAdvise"))(p, size, CU_MEM_ADVISE_SET_ACCESSED_BY, to);
    say("unknown_way", 1);
    exit(7);
}

static const char *const MOVES[] = {"prefetch", "prefetch_getproc", "prefetch_ptsz", "prefetch_v1", "prefetch_v1_ptsz",
                                    "batch", "batch_ptsz", "discard_prefetch",
                                    "discard_prefetch_ptsz", "preferred", "preferred_v1",
                                    "accessed_by", "accessed_by_v1"};
#define NMOVES (sizeof MOVES / sizeof MOVES[0])

static int is_move(const char *way) {
    for (size_t i = 0; i < NMOVES; i++)
        if (!strcmp(way, MOVES[i])) return 1;
    return !strcmp(way, "own");
}

/* a kernel on the current context's GPU: on the simulator it may touch any managed memory */
static void fault(CUstream s) {
    CUmodule mod;
    CUfunction f;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&f, mod, "touch")) return;
    say("launch", cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
    cuStreamSynchronize(s);
}

/* 3 GiB of managed memory on its own GPU (charged to the slice), moved to `other` */
static void managed(const char *way, CUdevice own, CUdevice other) {
    CUdeviceptr p;
    size_t size = 3 * GIB;
    CUresult r = cuMemAllocManaged(&p, size, CU_MEM_ATTACH_GLOBAL);
    say("managed", r);
    if (r) return;
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (!strcmp(way, "own")) { /* every way, to its own GPU and to the host */
        for (size_t i = 0; i < NMOVES; i++) {
            say("own", move(MOVES[i], p, size, own, s));
            say("host", move(MOVES[i], p, size, CU_DEVICE_CPU, s));
        }
        say("own", move("prefetch", p, size, own, s));
    } else {
        say("grab", move(way, p, size, other, s));
        if (!strstr(way, "preferred") && !strstr(way, "accessed_by")) {
            /* its own GPU maps the memory where it now is: kernels use it there, it stays */
            CUmemLocation mine = {CU_MEM_LOCATION_TYPE_DEVICE, own};
            say("pin", cuMemAdvise(p, size, CU_MEM_ADVISE_SET_ACCESSED_BY, mine));
        }
    }
    cuStreamSynchronize(s);
    fault(s);
    int last = CU_DEVICE_INVALID;
    cuMemRangeGetAttribute(&last, sizeof last, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, p, size);
    say("last_prefetch", last);
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *way = argv[2];
    CUresult r = cuInit(0);
    if (r) {
        say("init", r);
        return 3;
    }
    int n = 0;
    cuDeviceGetCount(&n);
    say("devices", n);
    CUdevice other = other_device(argv[1]);
    say("other", other);
    if (other < 0) return 4;
    CUcontext ctx = NULL;
    if (!strcmp(way, "primary") || !strcmp(way, "create")) {
        r = !strcmp(way, "primary") ? cuDevicePrimaryCtxRetain(&ctx, other)
                                    : cuCtxCreate(&ctx, NULL, 0, other);
        say("context", r);
        if (r == CUDA_SUCCESS) {
            cuCtxSetCurrent(ctx);
            grab(GIB, 4);
        }
    } else {
        CUdevice own = own_device(argv[1]);
        if (cuDevicePrimaryCtxRetain(&ctx, own)) return 5;
        cuCtxSetCurrent(ctx);
        if (is_move(way)) {
            managed(way, own, other);
        } else if (!strcmp(way, "graph")) {
            CUgraph g;
            CUgraphNode node;
            CUgraphExec e;
            CUgraphNodeParams np;
            memset(&np, 0, sizeof np);
            np.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
            np.alloc.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            np.alloc.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            np.alloc.poolProps.location.id = other;
            np.alloc.bytesize = 3 * GIB;
            cuGraphCreate(&g, 0);
            r = cuGraphAddNode_v2(&node, g, NULL, NULL, 0, &np);
            say("grab", r);
            if (r == CUDA_SUCCESS && cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS)
                say("launch", cuGraphLaunch(e, NULL));
        } else if (!strcmp(way, "vmm")) {
            CUmemAllocationProp prop = {0};
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = other;
            for (int i = 0; i < 4; i++) {
                CUmemGenericAllocationHandle h;
                say("grab", cuMemCreate(&h, GIB, &prop, 0));
            }
        } else {
            CUmemoryPool pool;
            if (!strcmp(way, "pool")) {
                CUmemPoolProps props = {0};
                props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
                props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                props.location.id = other;
                r = cuMemPoolCreate(&pool, &props);
            } else if (!strcmp(way, "default")) {
                r = cuDeviceGetDefaultMemPool(&pool, other);
            } else {
                CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, other};
                r = cuMemGetMemPool(&pool, &loc, CU_MEM_ALLOCATION_TYPE_PINNED);
            }
            say("pool", r);
            if (r == CUDA_SUCCESS)
                for (int i = 0; i < 4; i++) {
                    CUdeviceptr p;
                    say("grab", cuMemAllocFromPoolAsync(&p, GIB, pool, NULL));
                }
            cuCtxSynchronize();
        }
    }
    hold();
    return 0;
}
