/* Device memory an executable graph keeps for its own work (its nodes' launch descriptors and
 * the parameters the driver keeps for them), which no allocation call shows: a graph of 64
 * kernel nodes instantiated again and again, each executable graph launched (or uploaded)
 * once and kept, until the driver (or the hook) refuses. On the arena's simulator each node
 * keeps 1 MiB, from the instantiation or from the first use (its config), so each executable
 * graph holds 64 MiB and 100 of them 6.25 GiB in a 4 GiB slice. argv[1] picks the
 * instantiation: flags (cuGraphInstantiateWithFlags), v2 (cuGraphInstantiate_v2 through
 * cuGetProcAddress at CUDA 11.0), params (cuGraphInstantiateWithParams), params_upload (the
 * same with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD), params_ptsz (its per-thread form through
 * cuGetProcAddress); argv[2] the first use: launch, upload or none. Reports "made N" and the
 * CUresult that ended it ("last"); with argv[3] "destroy", every executable graph is
 * destroyed afterwards ("destroyed N"), then 512 MiB chunks are taken ("grabbed_mib"). */
#include "hostile.h"

#define NODES 64
#define TRIES 100

typedef CUresult (*inst_v2_t)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*params_t)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);

static void *proc(const char *name, int version, cuuint64_t flags) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    cuGetProcAddress(name, &p, version, flags, &st);
    return p;
}

static CUresult instantiate(const char *mode, CUgraphExec *e, CUgraph g, CUstream s) {
    if (!strcmp(mode, "flags")) return cuGraphInstantiateWithFlags(e, g, 0);
    if (!strcmp(mode, "v2")) return ((inst_v2_t)proc("cuGraphInstantiate", 11000, 0))(e, g, NULL, NULL, 0);
    CUDA_GRAPH_INSTANTIATE_PARAMS ip;
    memset(&ip, 0, sizeof ip);
    ip.flags = !strcmp(mode, "params_upload") ? CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD : 0;
    ip.hUploadStream = s;
    params_t f = (params_t)proc("cuGraphInstantiateWithParams", 12000,
                                !strcmp(mode, "params_ptsz") ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                                             : 0);
    return f ? f(e, g, &ip) : CUDA_ERROR_NOT_FOUND;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    setup();
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    CUmodule mod;
    CUfunction k;
    if (cuModuleLoadData(&mod, "qgpu-sim-module") || cuModuleGetFunction(&k, mod, "k")) return 3;
    CUgraph g;
    if (cuGraphCreate(&g, 0)) return 4;
    for (int i = 0; i < NODES; i++)
        if (add_kernel_node(g, k)) return 5;
    static CUgraphExec execs[TRIES];
    int made = 0;
    CUresult last = CUDA_SUCCESS;
    const char *use = argc > 2 ? argv[2] : "launch";
    while (made < TRIES && (last = instantiate(argv[1], &execs[made], g, s)) == CUDA_SUCCESS) {
        if (!strcmp(use, "launch")) last = cuGraphLaunch(execs[made], s);
        else if (!strcmp(use, "upload")) last = cuGraphUpload(execs[made], s);
        made++;
        if (last != CUDA_SUCCESS) break;
    }
    cuStreamSynchronize(s);
    say("made", made);
    say("last", last);
    if (argc > 3 && !strcmp(argv[3], "destroy")) {
        int destroyed = 0;
        for (int i = 0; i < made; i++) destroyed += cuGraphExecDestroy(execs[i]) == CUDA_SUCCESS;
        say("destroyed", destroyed);
        unsigned long long got = grab(512 * MIB, 16);
        say("grabbed_mib", (long long)(got / MIB));
    }
    hold();
    return 0;
}
