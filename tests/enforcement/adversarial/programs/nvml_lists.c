/* NVML's process lists (issue 17): every version of the compute, graphics and MPS process
 * lists, and per-process utilisation, on every GPU of the node. A tenant must see only its
 * own slice's processes, and its GPU's memory as its slice (used never above total). Reports
 * "pid <pid>" for every process any list returns (any device), "calls <n>" for the lists the
 * library has, and the memory views. */
#include "hostile.h"

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef nvmlReturn_t (*list_t)(nvmlDevice_t, unsigned int *, void *);
typedef nvmlReturn_t (*util_t)(nvmlDevice_t, void *, unsigned int *, unsigned long long);
typedef struct {
    unsigned long long total, free, used;
} mem_v1;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} mem_v2;

static const struct {
    const char *name;
    size_t entry; /* nvmlProcessInfo_v1_t: 16 bytes; nvmlProcessInfo_t (v2, v3): 24 */
} lists[] = {
    {"nvmlDeviceGetComputeRunningProcesses", 16},
    {"nvmlDeviceGetComputeRunningProcesses_v2", 24},
    {"nvmlDeviceGetComputeRunningProcesses_v3", 24},
    {"nvmlDeviceGetGraphicsRunningProcesses", 16},
    {"nvmlDeviceGetGraphicsRunningProcesses_v2", 24},
    {"nvmlDeviceGetGraphicsRunningProcesses_v3", 24},
    {"nvmlDeviceGetMPSComputeRunningProcesses", 16},
    {"nvmlDeviceGetMPSComputeRunningProcesses_v2", 24},
    {"nvmlDeviceGetMPSComputeRunningProcesses_v3", 24},
};

int main(void) {
    setup();
    CUdeviceptr p;
    say("grab", cuMemAlloc(&p, GIB));
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))dlsym(nvml, "nvmlInit_v2");
    nvmlReturn_t (*count)(unsigned *) = (nvmlReturn_t(*)(unsigned *))dlsym(nvml, "nvmlDeviceGetCount_v2");
    nvmlReturn_t (*handle)(unsigned, nvmlDevice_t *) =
        (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    say("nvml", init());
    unsigned n = 0;
    count(&n);
    say("devices", n);
    int calls = 0;
    for (unsigned d = 0; d < n; d++) {
        nvmlDevice_t dev;
        handle(d, &dev);
        for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
            list_t f = (list_t)dlsym(nvml, lists[i].name);
            if (!f) continue;
            calls++;
            unsigned char buf[64 * 24];
            unsigned k = 0;
            nvmlReturn_t r = f(dev, &k, NULL); /* the count first, as NVML's protocol says */
            say("count", k);
            k = 64;
            r = f(dev, &k, buf);
            if (r != 0) continue;
            for (unsigned j = 0; j < k; j++) {
                unsigned pid;
                memcpy(&pid, buf + j * lists[i].entry, sizeof pid);
                say("pid", pid);
            }
        }
        util_t u = (util_t)dlsym(nvml, "nvmlDeviceGetProcessUtilization");
        if (u) {
            unsigned char samples[64 * 32];
            unsigned k = 64;
            if (u(dev, samples, &k, 0) == 0)
                for (unsigned j = 0; j < k; j++) {
                    unsigned pid;
                    memcpy(&pid, samples + j * 32, sizeof pid);
                    say("pid", pid);
                }
        }
    }
    say("calls", calls);
    nvmlDevice_t dev0;
    handle(0, &dev0);
    mem_v1 m1;
    mem_v2 m2 = {.version = (unsigned)(sizeof(mem_v2) | (2 << 24))};
    ((nvmlReturn_t(*)(nvmlDevice_t, mem_v1 *))dlsym(nvml, "nvmlDeviceGetMemoryInfo"))(dev0, &m1);
    ((nvmlReturn_t(*)(nvmlDevice_t, mem_v2 *))dlsym(nvml, "nvmlDeviceGetMemoryInfo_v2"))(dev0, &m2);
    say("total", m1.total);
    say("used", m1.used);
    say("free", m1.free);
    say("total2", m2.total);
    say("used2", m2.used);
    say("free2", m2.free);
    hold();
    return 0;
}
