/* Another GPU of the node (our addition): a slice belongs to one GPU, but a bare process
 * (Ray, Dask, a shell on the node) can drop CUDA_VISIBLE_DEVICES and see every GPU. The
 * tenant then looks for a device that is not its slice's (argv[1], a UUID) and takes
 * memory there through each way of getting onto it: a primary context (argv[2] = "primary"),
 * cuCtxCreate ("create"), or, from its own GPU's context, VMM memory placed on the other
 * device ("vmm"), a memory pool created there ("pool"), the device's default pool
 * ("default", cuDeviceGetDefaultMemPool) or the location's pool ("location", CUDA 13's
 * cuMemGetMemPool) or a graph allocation node placed there ("graph", cuGraphAddNode_v2,
 * then launched). Reports the results, then holds. */
#include "hostile.h"

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
        if (!strcmp(way, "graph")) {
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
