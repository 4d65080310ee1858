/* Graph memory nodes (issue 17): an allocation node takes device memory when its graph is
 * uploaded or launched, not when it is added. The tenant first takes 3 GiB with cuMemAlloc,
 * then builds a graph with one 3 GiB allocation node (never freed in the graph) and runs it
 * one way (argv[1]); "run" reports the CUresult of the step that allocates:
 *   launch, upload        cuGraphInstantiateWithFlags, then cuGraphLaunch / cuGraphUpload
 *   params                cuGraphInstantiateWithParams with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
 *   legacy                cuGraphInstantiate_v2 (through cuGetProcAddress at 11000), launch
 *   launch_ptsz, upload_ptsz, params_ptsz
 *                         the per-thread-default-stream forms, from cuGetProcAddress with
 *                         CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, as runtimes built
 *                         with --default-stream per-thread get them
 *   addnode, addnode_v2   the node added by CUDA 12.2+'s generic cuGraphAddNode (12020, from
 *                         cuGetProcAddress) / cuGraphAddNode_v2, then instantiate and launch */
#include "hostile.h"

typedef CUresult (*launch_t)(CUgraphExec, CUstream);
typedef CUresult (*params_t)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
typedef CUresult (*inst_v2_t)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*addnode_t)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                              CUgraphNodeParams *);

static void *proc(const char *name, int version, cuuint64_t flags) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    cuGetProcAddress(name, &p, version, flags, &st);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    int ptsz = strstr(mode, "_ptsz") != NULL;
    cuuint64_t flags = ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    setup();
    grab(3 * GIB, 1);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    CUgraph g;
    cuGraphCreate(&g, 0);
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = 3 * GIB;
    CUgraphNode node;
    if (!strncmp(mode, "addnode", 7)) {
        CUgraphNodeParams np;
        memset(&np, 0, sizeof np);
        np.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
        memcpy(&np.alloc, &p, sizeof p); /* the v1 and v2 layouts are the same */
        if (!strcmp(mode, "addnode_v2"))
            say("node", cuGraphAddNode_v2(&node, g, NULL, NULL, 0, &np));
        else
            say("node", ((addnode_t)proc("cuGraphAddNode", 12020, 0))(&node, g, NULL, 0, &np));
    } else {
        say("node", cuGraphAddMemAllocNode(&node, g, NULL, 0, &p));
    }
    CUgraphExec e = NULL;
    if (!strncmp(mode, "params", 6)) {
        CUDA_GRAPH_INSTANTIATE_PARAMS ip;
        memset(&ip, 0, sizeof ip);
        ip.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
        ip.hUploadStream = s;
        params_t f = (params_t)proc("cuGraphInstantiateWithParams", 12000, flags);
        say("run", f(&e, g, &ip));
    } else {
        if (!strcmp(mode, "legacy"))
            say("instantiate", ((inst_v2_t)proc("cuGraphInstantiate", 11000, 0))(&e, g, NULL, NULL, 0));
        else
            say("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
        int upload = !strncmp(mode, "upload", 6);
        launch_t f = (launch_t)proc(upload ? "cuGraphUpload" : "cuGraphLaunch", 12000, flags);
        say("run", f(e, ptsz ? NULL : s));
    }
    cuStreamSynchronize(s);
    hold();
    return 0;
}
