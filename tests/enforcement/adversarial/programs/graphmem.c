/* Graph memory nodes (issue 17): an allocation node takes device memory when its graph is
 * uploaded or launched, not when it is added. The tenant first takes 3 GiB with cuMemAlloc,
 * then puts a 3 GiB allocation node (never freed in the graph) into an executable graph one
 * way (argv[1]); "run" reports the CUresult of the step that allocates:
 *   launch, upload        cuGraphInstantiateWithFlags, then cuGraphLaunch / cuGraphUpload
 *   params                cuGraphInstantiateWithParams with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
 *   legacy                cuGraphInstantiate_v2 (through cuGetProcAddress at 11000), launch
 *   launch_ptsz, upload_ptsz, params_ptsz
 *                         the per-thread-default-stream forms, from cuGetProcAddress with
 *                         CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, as runtimes built
 *                         with --default-stream per-thread get them
 *   addnode, addnode_v2   the node added by CUDA 12.2+'s generic cuGraphAddNode (12020, from
 *                         cuGetProcAddress) / cuGraphAddNode_v2, then instantiate and launch
 * Ways that never add the node to the graph that is instantiated ("node" adds it, "move"
 * moves a graph into another):
 *   child_move            in graph G1, moved into G2 as a child graph node (cuGraphAddNode_v2,
 *                         CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE, CUDA 12.9+); G2 is launched
 *   child_move_nested     G1 moved into G2, G2 moved into G3; G3 is launched
 *   capture_to_graph      cuMemAllocAsync captured into an existing graph
 *                         (cuStreamBeginCaptureToGraph, CUDA 12.3)
 *   capture_to_child      the same, into G1, which is then moved into G2
 *   raw_add               added through the raw driver's cuGraphAddMemAllocNode (libcuda's
 *                         symbol table), instantiated and launched through the hook
 * Ways that change the executable graph after instantiation: it is instantiated with a
 * 1 MiB node, then given a topologically identical graph with a 3 GiB node ("update"):
 *   exec_update, exec_update_v1  cuGraphExecUpdate (_v2; v1 through cuGetProcAddress at 10020)
 *   exec_child            the 1 MiB node in a moved child graph, replaced through
 *                         cuGraphExecChildGraphNodeSetParams
 *   exec_node             the same through cuGraphExecNodeSetParams (a child graph node)
 *   exec_child_fits       the child graph replaced three times by one with 256 MiB: fits,
 *                         as only the last replacement is in the executable graph
 * Ways cuda.h says the driver refuses (each refused step reports "node"; what is left is
 * launched, "run"):
 *   refused_child         cuGraphAddChildGraphNode and CLONE ownership of a graph with an
 *                         allocation node
 *   refused_clone         cuGraphClone of a graph with an allocation node
 *   refused_set           cuGraphNodeSetParams / cuGraphExecNodeSetParams of a 1 MiB
 *                         allocation node to 3 GiB
 *   refused_owned         an allocation node added to a moved child graph (its own handle,
 *                         and the one cuGraphChildGraphNodeGetGraph returns), a graph with an
 *                         allocation node moved into a child graph, the moved graph
 *                         instantiated on its own
 *   refused_conditional   an allocation node added to a conditional node's body, captured
 *                         into it (cuStreamBeginCaptureToGraph), and moved into it
 * And one that fits: child_move_fits moves a 256 MiB node in a child graph, launches it, and
 * then asks cuMemAlloc for 512 MiB more ("after"), which the graph memory must leave no room
 * for. */
#include "raw_driver.h"

typedef CUresult (*launch_t)(CUgraphExec, CUstream);
typedef CUresult (*params_t)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
typedef CUresult (*inst_v2_t)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*addnode_t)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                              CUgraphNodeParams *);
typedef CUresult (*update_v1_t)(CUgraphExec, CUgraph, CUgraphNode *, CUgraphExecUpdateResult *);
typedef CUresult (*alloc_node_t)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                 CUDA_MEM_ALLOC_NODE_PARAMS *);

static void *proc(const char *name, int version, cuuint64_t flags) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    cuGetProcAddress(name, &p, version, flags, &st);
    return p;
}

static CUDA_MEM_ALLOC_NODE_PARAMS alloc_params(unsigned long long bytes) {
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    return p;
}

/* a new graph holding one allocation node of `bytes` */
static CUgraph graph_with(unsigned long long bytes, CUgraphNode *node) {
    CUgraph g;
    CUgraphNode n;
    cuGraphCreate(&g, 0);
    CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_params(bytes);
    if (cuGraphAddMemAllocNode(node ? node : &n, g, NULL, 0, &p)) exit(3);
    return g;
}

static CUresult add_child(CUgraphNode *node, CUgraph parent, CUgraph child,
                          CUgraphChildGraphNodeOwnership ownership) {
    CUgraphNodeParams np;
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_GRAPH;
    np.graph.graph = child;
    np.graph.ownership = ownership;
    return cuGraphAddNode_v2(node, parent, NULL, NULL, 0, &np);
}

/* g moved into a new graph as its only node */
static CUgraph moved_into_new(CUgraph g, CUgraphNode *node) {
    CUgraph parent;
    CUgraphNode n;
    cuGraphCreate(&parent, 0);
    say("move", add_child(node ? node : &n, parent, g, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE));
    return parent;
}

static CUgraph captured_into(CUgraph g, CUstream s, unsigned long long bytes) {
    CUdeviceptr p;
    if (cuStreamBeginCaptureToGraph(s, g, NULL, NULL, 0, CU_STREAM_CAPTURE_MODE_GLOBAL)) exit(4);
    say("node", cuMemAllocAsync(&p, bytes, s));
    CUgraph out;
    if (cuStreamEndCapture(s, &out) || out != g) exit(5);
    return g;
}

static CUresult launch(CUgraph g, CUstream s, CUgraphExec *out) {
    CUgraphExec e;
    say("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
    if (out) *out = e;
    return cuGraphLaunch(e, s);
}

/* The first set of ways: the classic APIs. */
static void classic(const char *mode, CUstream s) {
    int ptsz = strstr(mode, "_ptsz") != NULL;
    cuuint64_t flags = ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    CUgraph g;
    cuGraphCreate(&g, 0);
    CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_params(3 * GIB);
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
    } else if (!strcmp(mode, "raw_add")) {
        alloc_node_t raw = (alloc_node_t)raw_driver_symbol("cuGraphAddMemAllocNode");
        say("node", raw ? (long long)raw(&node, g, NULL, 0, &p) : -1LL);
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
}

/* The executable graph is made with 1 MiB, then updated to 3 GiB. */
static void updated(const char *mode, CUstream s) {
    CUgraphExec e;
    if (!strncmp(mode, "exec_update", 11)) {
        CUgraph small = graph_with(MIB, NULL), big = graph_with(3 * GIB, NULL);
        say("instantiate", cuGraphInstantiateWithFlags(&e, small, 0));
        if (!strcmp(mode, "exec_update_v1")) {
            CUgraphNode bad;
            CUgraphExecUpdateResult res;
            say("update", ((update_v1_t)proc("cuGraphExecUpdate", 10020, 0))(e, big, &bad, &res));
        } else {
            CUgraphExecUpdateResultInfo info;
            say("update", cuGraphExecUpdate(e, big, &info));
        }
    } else {
        CUgraphNode child;
        CUgraph parent = moved_into_new(graph_with(MIB, NULL), &child);
        say("instantiate", cuGraphInstantiateWithFlags(&e, parent, 0));
        CUgraph big = graph_with(3 * GIB, NULL);
        if (!strcmp(mode, "exec_child_fits")) { /* three times 256 MiB: only the last counts */
            for (int i = 0; i < 3; i++) {
                CUgraph next = graph_with(256 * MIB, NULL);
                say("update", cuGraphExecChildGraphNodeSetParams(e, child, next));
            }
        } else if (!strcmp(mode, "exec_child")) {
            say("update", cuGraphExecChildGraphNodeSetParams(e, child, big));
        } else {
            CUgraphNodeParams np;
            memset(&np, 0, sizeof np);
            np.type = CU_GRAPH_NODE_TYPE_GRAPH;
            np.graph.graph = big;
            say("update", cuGraphExecNodeSetParams(e, child, &np));
        }
    }
    say("run", cuGraphLaunch(e, s));
}

/* What cuda.h says the driver refuses; whatever is left is launched. */
static void refused(const char *mode, CUstream s, CUcontext ctx) {
    CUgraphNode n;
    CUgraph g = NULL;
    if (!strcmp(mode, "refused_child")) {
        CUgraph with = graph_with(3 * GIB, NULL);
        cuGraphCreate(&g, 0);
        say("node", cuGraphAddChildGraphNode(&n, g, NULL, 0, with));
        say("node", add_child(&n, g, with, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE));
    } else if (!strcmp(mode, "refused_clone")) {
        say("node", cuGraphClone(&g, graph_with(3 * GIB, NULL)));
        if (!g) cuGraphCreate(&g, 0);
    } else if (!strcmp(mode, "refused_set")) {
        CUgraphNode an;
        g = graph_with(MIB, &an);
        CUgraphNodeParams np;
        memset(&np, 0, sizeof np);
        np.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
        CUDA_MEM_ALLOC_NODE_PARAMS big = alloc_params(3 * GIB);
        memcpy(&np.alloc, &big, sizeof big); /* the v1 and v2 layouts are the same */
        say("node", cuGraphNodeSetParams(an, &np));
        CUgraphExec e;
        say("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
        say("node", cuGraphExecNodeSetParams(e, an, &np));
        say("run", cuGraphLaunch(e, s));
        return;
    } else if (!strcmp(mode, "refused_owned")) {
        CUgraphNode child;
        CUgraph moved = graph_with(MIB, NULL);
        g = moved_into_new(moved, &child);
        CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_params(3 * GIB);
        say("node", cuGraphAddMemAllocNode(&n, moved, NULL, 0, &p));
        CUgraph inner = NULL;
        cuGraphChildGraphNodeGetGraph(child, &inner);
        p = alloc_params(3 * GIB);
        say("node", cuGraphAddMemAllocNode(&n, inner, NULL, 0, &p));
        say("node", add_child(&n, inner, graph_with(3 * GIB, NULL), CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE));
        CUgraphExec alone;
        say("node", cuGraphInstantiateWithFlags(&alone, moved, 0));
    } else { /* refused_conditional */
        cuGraphCreate(&g, 0);
        CUgraphConditionalHandle h;
        if (cuGraphConditionalHandleCreate(&h, g, ctx, 1, CU_GRAPH_COND_ASSIGN_DEFAULT)) exit(6);
        CUgraphNodeParams np;
        memset(&np, 0, sizeof np);
        np.type = CU_GRAPH_NODE_TYPE_CONDITIONAL;
        np.conditional.handle = h;
        np.conditional.type = CU_GRAPH_COND_TYPE_IF;
        np.conditional.size = 1;
        np.conditional.ctx = ctx;
        if (cuGraphAddNode_v2(&n, g, NULL, NULL, 0, &np)) exit(7);
        CUgraph body = np.conditional.phGraph_out[0];
        CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_params(3 * GIB);
        say("node", cuGraphAddMemAllocNode(&n, body, NULL, 0, &p));
        captured_into(body, s, 3 * GIB);
        say("node", add_child(&n, body, graph_with(3 * GIB, NULL), CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE));
    }
    say("run", launch(g, s, NULL));
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    CUcontext ctx = setup();
    grab(3 * GIB, 1);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (!strcmp(mode, "child_move")) {
        say("run", launch(moved_into_new(graph_with(3 * GIB, NULL), NULL), s, NULL));
    } else if (!strcmp(mode, "child_move_nested")) {
        CUgraph g2 = moved_into_new(graph_with(3 * GIB, NULL), NULL);
        say("run", launch(moved_into_new(g2, NULL), s, NULL));
    } else if (!strcmp(mode, "child_move_fits")) {
        say("run", launch(moved_into_new(graph_with(256 * MIB, NULL), NULL), s, NULL));
        cuStreamSynchronize(s);
        CUdeviceptr p;
        say("after", cuMemAlloc(&p, 512 * MIB));
    } else if (!strncmp(mode, "capture_to_", 11)) {
        CUgraph g;
        cuGraphCreate(&g, 0);
        captured_into(g, s, 3 * GIB);
        if (!strcmp(mode, "capture_to_child")) g = moved_into_new(g, NULL);
        say("run", launch(g, s, NULL));
    } else if (!strncmp(mode, "exec_", 5)) {
        updated(mode, s);
    } else if (!strncmp(mode, "refused_", 8)) {
        refused(mode, s, ctx);
    } else {
        classic(mode, s);
    }
    cuStreamSynchronize(s);
    hold();
    return 0;
}
