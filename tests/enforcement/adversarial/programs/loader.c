/* RTLD_DEEPBIND and dlmopen(LM_ID_NEWLM) (issue 17): a plugin linked against libcuda and
 * loaded so that its own dependencies come first (DEEPBIND), or into a fresh link-map
 * namespace where LD_PRELOAD was never applied (dlmopen), calls the driver directly. The
 * tenant first takes 3 GiB (charged), then asks the plugin for 3 GiB more, three times.
 * argv[1]: deepbind | deepbind-local | dlmopen | dlmopen-driver; argv[2]: the plugin. */
#include "hostile.h"

typedef int (*plugin_alloc_t)(unsigned long long);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    setup();
    grab(3 * GIB, 1);
    const char *mode = argv[1];
    void *h = NULL;
    if (!strcmp(mode, "deepbind"))
        h = dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL | RTLD_DEEPBIND);
    else if (!strcmp(mode, "deepbind-local"))
        h = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    else if (!strcmp(mode, "dlmopen"))
        h = dlmopen(LM_ID_NEWLM, argv[2], RTLD_NOW);
    else if (!strcmp(mode, "dlmopen-driver"))
        h = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "load %s: %s\n", argv[2], dlerror());
        say("loaded", 0);
        return 2;
    }
    say("loaded", 1);
    for (int i = 0; i < 3; i++) {
        if (!strcmp(mode, "dlmopen-driver")) {
            /* the namespace's own driver: initialise it, then allocate */
            CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
            CUresult (*retain)(CUcontext *, CUdevice) =
                (CUresult(*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
            CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
            alloc_t alloc = (alloc_t)dlsym(h, "cuMemAlloc_v2");
            CUcontext ctx;
            CUdeviceptr p;
            init(0);
            retain(&ctx, 0);
            set(ctx);
            say("plugin", alloc(&p, 3 * GIB));
        } else {
            plugin_alloc_t f = (plugin_alloc_t)dlsym(h, "plugin_alloc");
            say("plugin", f ? f(3 * GIB) : -1);
        }
    }
    hold();
    return 0;
}
