/* Reading NVML around the loader: the hook's NVML views live in the tenant's own process, so
 * a tenant that takes the real entry point from libnvidia-ml's ELF symbol table in memory
 * (as symwalk.c does for libcuda) calls NVML unfiltered. It lists GPU 0's compute processes
 * through dlsym ("hooked <pid>"), dlvsym ("versioned <pid>", where the library defines the
 * version asked for; the simulated one defines none, so it finds nothing) and the symbol table
 * ("raw <pid>"). */
#include "raw_driver.h"

typedef int (*list_t)(void *, unsigned int *, void *);

static void list(const char *key, list_t f, void *dev) {
    unsigned char buf[64 * 24]; /* nvmlProcessInfo_t: 24 bytes, the pid first */
    unsigned n = 64;
    if (!f || f(dev, &n, buf) != 0) return;
    for (unsigned i = 0; i < n; i++) {
        unsigned pid;
        memcpy(&pid, buf + i * 24, sizeof pid);
        say(key, pid);
    }
}

int main(void) {
    setup();
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    int (*handle)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    void *dev = NULL;
    say("nvml", init());
    handle(0, &dev);
    const char *name = "nvmlDeviceGetComputeRunningProcesses_v3";
    list("hooked", (list_t)dlsym(nvml, name), dev);
    list("versioned", (list_t)dlvsym(nvml, name, "NVML_1.0"), dev);
    void *raw = raw_symbol("libnvidia-ml.so", name);
    say("found", raw != NULL);
    list("raw", (list_t)raw, dev);
    hold();
    return 0;
}
