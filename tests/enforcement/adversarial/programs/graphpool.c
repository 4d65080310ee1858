/* Graph memory kept after a launch: a graph allocation without a free node in its graph
 * stays allocated after the launch (and after its graph and executable graph are
 * destroyed) until cuMemFree, cuMemFreeAsync, another graph's free node or, with
 * CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, the graph's next launch frees it; the
 * device's graph pool grows by what is in use at once and cuDeviceGraphMemTrim gives back
 * only what nothing uses. argv[1] picks a scenario; sizes are in MiB in the reports
 * ("used" / "reserved": cuDeviceGetGraphMemAttribute's USED_MEM_CURRENT and
 * RESERVED_MEM_CURRENT, read by the program itself).
 *
 * What the driver does (run without the hook; the test checks every number):
 *   lifetime       a graph keeping 1 GiB: launched, relaunched (refused while unfreed),
 *                  trimmed, destroyed, freed by cuMemFree, freed again (refused), trimmed
 *   in_flight      a graph allocating and freeing 1 GiB around a 1 s kernel: trimmed
 *                  while it runs (kept) and after (given back); then a graph like it
 *                  without the kernel launched 3 times
 *   stream_free    a kept 1 GiB freed by cuMemFreeAsync behind a 1 s kernel: in use
 *                  until the stream reaches it; then the graph relaunches
 *   free_node      a kept 1 GiB freed by another graph's free node; relaunch after
 *   auto_free      AUTO_FREE_ON_LAUNCH: relaunched 3 times, 1 GiB in use, 1 GiB reserved
 *   two_graphs     two graphs keeping 1 GiB each: 2 GiB reserved
 *   granules       100 allocation nodes of 1 byte kept: 100 granules of 2 MiB
 *   refusals       free nodes cuda.h refuses, and frees of graph memory not allocated now
 *   too_big        a graph keeping 20 GiB on a 16 GiB card: out of memory
 * Attacks on a 4 GiB slice (the context takes 512 MiB of it; "grab" then asks cuMemAlloc
 * for 512 MiB chunks):
 *   attack_two     two graphs each keeping 3 GiB ("run" twice)
 *   attack_trim    a graph keeping 3 GiB, synchronised and trimmed, then grab
 *   attack_auto    an AUTO_FREE_ON_LAUNCH graph keeping 3 GiB launched twice, then grab
 *   attack_free    a graph keeping 3 GiB, freed by cuMemFreeAsync, then a second graph
 *                  keeping 3 GiB, then grab
 *   attack_granules 3 GiB taken by cuMemAlloc first ("grab"), then one graph of 1700
 *                  allocation nodes of 4 KiB each (7 MiB asked; each takes a whole 2 MiB
 *                  granule: 3400 MiB), kept
 *   attack_upload  the same, the graph uploaded, not launched
 *   relaunch       what a workload does (each "run" must succeed): a graph allocating and
 *                  freeing 3 GiB around a 100 ms kernel launched 3 times back to back; a
 *                  graph keeping 3 GiB, freed by cuMemFree, then another, freed by
 *                  cuMemFreeAsync; an AUTO_FREE_ON_LAUNCH graph keeping 1 GiB launched 3
 *                  times; then grab */
#include "hostile.h"

static CUstream s;
static CUfunction busy;

static unsigned long long attr(CUgraphMem_attribute a) {
    cuuint64_t v = 0;
    if (cuDeviceGetGraphMemAttribute(0, a, &v)) return ~0ULL;
    return v;
}

static void report(const char *tag) {
    char k[64];
    snprintf(k, sizeof k, "used_%s", tag);
    say(k, (long long)(attr(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) / MIB));
    snprintf(k, sizeof k, "reserved_%s", tag);
    say(k, (long long)(attr(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) / MIB));
}

static CUdeviceptr alloc_node(CUgraph g, unsigned long long bytes, CUgraphNode *out) {
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    CUgraphNode n;
    if (cuGraphAddMemAllocNode(out ? out : &n, g, NULL, 0, &p)) exit(3);
    return p.dptr;
}

static void busy_node(CUgraph g, unsigned long long ns) {
    static unsigned long long arg;
    arg = ns;
    void *params[] = {&arg};
    CUDA_KERNEL_NODE_PARAMS k;
    memset(&k, 0, sizeof k);
    k.func = busy;
    k.gridDimX = k.gridDimY = k.gridDimZ = 1;
    k.blockDimX = k.blockDimY = k.blockDimZ = 1;
    k.kernelParams = params;
    CUgraphNode n;
    if (cuGraphAddKernelNode(&n, g, NULL, 0, &k)) exit(4);
}

static void busy_launch(unsigned long long ns) {
    void *params[] = {&ns};
    if (cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, params, NULL)) exit(5);
}

/* A graph keeping `bytes` (no free node), instantiated with `flags`. */
static CUgraphExec keeper(unsigned long long bytes, unsigned long long flags, CUdeviceptr *ptr,
                          CUgraph *graph) {
    CUgraph g;
    cuGraphCreate(&g, 0);
    CUdeviceptr p = alloc_node(g, bytes, NULL);
    if (ptr) *ptr = p;
    if (graph) *graph = g;
    CUgraphExec e;
    if (cuGraphInstantiateWithFlags(&e, g, flags)) exit(6);
    return e;
}

/* A graph allocating and freeing `bytes` (around a kernel of `ns`). */
static CUgraphExec temporary(unsigned long long bytes, unsigned long long ns) {
    CUgraph g;
    cuGraphCreate(&g, 0);
    CUdeviceptr p = alloc_node(g, bytes, NULL);
    if (ns) busy_node(g, ns);
    CUgraphNode n;
    if (cuGraphAddMemFreeNode(&n, g, NULL, 0, p)) exit(7);
    CUgraphExec e;
    if (cuGraphInstantiateWithFlags(&e, g, 0)) exit(8);
    return e;
}

static CUgraphExec many_small(int count, unsigned long long each) {
    CUgraph g;
    cuGraphCreate(&g, 0);
    for (int i = 0; i < count; i++) alloc_node(g, each, NULL);
    CUgraphExec e;
    if (cuGraphInstantiateWithFlags(&e, g, 0)) exit(9);
    return e;
}

static void sync_stream(void) {
    if (cuStreamSynchronize(s)) exit(10);
}

static void driver(const char *mode) {
    if (!strcmp(mode, "lifetime")) {
        CUdeviceptr p;
        CUgraph g;
        CUgraphExec e = keeper(GIB, 0, &p, &g);
        say("run", cuGraphLaunch(e, s));
        sync_stream();
        report("launched");
        say("relaunch", cuGraphLaunch(e, s));
        say("trim", cuDeviceGraphMemTrim(0));
        report("trimmed");
        cuGraphExecDestroy(e);
        cuGraphDestroy(g);
        report("destroyed");
        say("free", cuMemFree(p));
        report("freed");
        say("free_again", cuMemFree(p));
        say("trim", cuDeviceGraphMemTrim(0));
        report("end");
    } else if (!strcmp(mode, "in_flight")) {
        CUgraphExec e = temporary(GIB, 1000000000ULL);
        say("run", cuGraphLaunch(e, s));
        say("trim", cuDeviceGraphMemTrim(0));
        report("running");
        sync_stream();
        report("done");
        say("trim", cuDeviceGraphMemTrim(0));
        report("trimmed");
        CUgraphExec quick = temporary(GIB, 0);
        for (int i = 0; i < 3; i++) say("run", cuGraphLaunch(quick, s));
        sync_stream();
        report("end");
    } else if (!strcmp(mode, "stream_free")) {
        CUdeviceptr p;
        CUgraphExec e = keeper(GIB, 0, &p, NULL);
        say("run", cuGraphLaunch(e, s));
        busy_launch(1000000000ULL);
        say("free", cuMemFreeAsync(p, s));
        report("queued");
        sync_stream();
        report("reached");
        say("run", cuGraphLaunch(e, s));
        sync_stream();
        report("end");
    } else if (!strcmp(mode, "free_node")) {
        CUdeviceptr p;
        CUgraphExec e = keeper(GIB, 0, &p, NULL);
        CUgraph g2;
        cuGraphCreate(&g2, 0);
        CUgraphNode n;
        say("node", cuGraphAddMemFreeNode(&n, g2, NULL, 0, p));
        CUgraphExec f;
        if (cuGraphInstantiateWithFlags(&f, g2, 0)) exit(11);
        say("run", cuGraphLaunch(e, s));
        sync_stream();
        report("kept");
        say("run", cuGraphLaunch(f, s));
        sync_stream();
        report("freed");
        say("run", cuGraphLaunch(e, s));
        sync_stream();
        report("end");
    } else if (!strcmp(mode, "auto_free")) {
        CUgraphExec e = keeper(GIB, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, NULL, NULL);
        for (int i = 0; i < 3; i++) say("run", cuGraphLaunch(e, s));
        sync_stream();
        report("end");
    } else if (!strcmp(mode, "two_graphs")) {
        say("run", cuGraphLaunch(keeper(GIB, 0, NULL, NULL), s));
        say("run", cuGraphLaunch(keeper(GIB, 0, NULL, NULL), s));
        sync_stream();
        say("trim", cuDeviceGraphMemTrim(0));
        report("end");
    } else if (!strcmp(mode, "granules")) {
        say("run", cuGraphLaunch(many_small(100, 1), s));
        sync_stream();
        report("end");
    } else if (!strcmp(mode, "refusals")) {
        CUdeviceptr p, q;
        CUgraph own, other, third;
        cuGraphCreate(&own, 0);
        cuGraphCreate(&other, 0);
        cuGraphCreate(&third, 0);
        p = alloc_node(own, MIB, NULL);
        q = alloc_node(own, MIB, NULL);
        CUgraphNode n;
        CUdeviceptr plain;
        if (cuMemAlloc(&plain, MIB)) exit(12);
        say("bogus", cuGraphAddMemFreeNode(&n, other, NULL, 0, plain));        /* not a graph's */
        say("interior", cuGraphAddMemFreeNode(&n, other, NULL, 0, p + 4096)); /* not a base */
        say("ok", cuGraphAddMemFreeNode(&n, own, NULL, 0, p));
        say("twice", cuGraphAddMemFreeNode(&n, own, NULL, 0, p));
        say("elsewhere", cuGraphAddMemFreeNode(&n, other, NULL, 0, p)); /* freed in its own */
        say("ok", cuGraphAddMemFreeNode(&n, other, NULL, 0, q));
        say("own_after", cuGraphAddMemFreeNode(&n, own, NULL, 0, q)); /* freed in another */
        say("unlaunched_free", cuMemFree(q));                        /* not allocated yet */
        say("unlaunched_async", cuMemFreeAsync(q, s));
        CUgraphExec e;
        if (cuGraphInstantiateWithFlags(&e, own, 0)) exit(13);
        say("run", cuGraphLaunch(e, s)); /* p freed inside, q kept */
        sync_stream();
        say("temp_free", cuMemFree(p)); /* freed by its own graph: not allocated now */
        say("kept_free", cuMemFree(q));
        say("relaunch", cuGraphLaunch(e, s));
        sync_stream();
    } else if (!strcmp(mode, "too_big")) {
        say("run", cuGraphLaunch(keeper(20 * GIB, 0, NULL, NULL), s));
        report("end");
    }
}

static void attack(const char *mode) {
    if (!strcmp(mode, "attack_two")) {
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, NULL, NULL), s));
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, NULL, NULL), s));
        sync_stream();
    } else if (!strcmp(mode, "attack_trim")) {
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, NULL, NULL), s));
        sync_stream();
        say("trim", cuDeviceGraphMemTrim(0));
    } else if (!strcmp(mode, "attack_auto")) {
        CUgraphExec e = keeper(3 * GIB, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, NULL, NULL);
        say("run", cuGraphLaunch(e, s));
        say("run", cuGraphLaunch(e, s));
        sync_stream();
    } else if (!strcmp(mode, "attack_free")) {
        CUdeviceptr p;
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, &p, NULL), s));
        say("free", cuMemFreeAsync(p, s));
        sync_stream();
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, NULL, NULL), s));
        sync_stream();
    } else if (!strcmp(mode, "attack_granules")) {
        grab(512 * MIB, 6);
        say("run", cuGraphLaunch(many_small(1700, 4096), s));
        sync_stream();
    } else if (!strcmp(mode, "attack_upload")) {
        grab(512 * MIB, 6);
        say("run", cuGraphUpload(many_small(1700, 4096), s));
        sync_stream();
    } else if (!strcmp(mode, "relaunch")) {
        CUgraphExec t = temporary(3 * GIB, 100000000ULL);
        for (int i = 0; i < 3; i++) say("run", cuGraphLaunch(t, s)); /* back to back */
        sync_stream();
        cuGraphExecDestroy(t);
        CUdeviceptr p;
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, &p, NULL), s));
        sync_stream();
        say("free", cuMemFree(p));
        say("run", cuGraphLaunch(keeper(3 * GIB, 0, &p, NULL), s));
        say("free", cuMemFreeAsync(p, s));
        CUgraphExec a = keeper(GIB, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, NULL, NULL);
        for (int i = 0; i < 3; i++) say("run", cuGraphLaunch(a, s));
        sync_stream();
    }
    report("end");
    grab(512 * MIB, 8);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    setup();
    CUmodule mod;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&busy, mod, "qgpu_sim_busy")) exit(14);
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (!strncmp(argv[1], "attack_", 7) || !strcmp(argv[1], "relaunch"))
        attack(argv[1]);
    else
        driver(argv[1]);
    hold();
    return 0;
}
