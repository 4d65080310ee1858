/* Hook state: limits are read on the first CUDA/NVML call that goes through the hook (in
 * practice cuInit), never at load time, so a process that never uses CUDA pays nothing and
 * a worker can receive its limits before it starts CUDA. cuInit also checks the slice
 * against the card. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

QGPU_HIDDEN hook_limits_t g_lim;
QGPU_HIDDEN int g_hook_state;
QGPU_HIDDEN int g_capped;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static pthread_once_t device_once = PTHREAD_ONCE_INIT;
static int g_device_fenced;     /* the limits name the slice's GPU */
static int g_slice_device = -1; /* its ordinal among the visible devices, once found */

void hook_fail(const char *fmt, ...) {
    char line[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "qgpu: invalid limits: %s\n", line);
    __atomic_store_n(&g_hook_state, HOOK_ERROR, __ATOMIC_RELEASE);
}

/* The bind callback of Ray workers (qgpu_ray/bind.py): a worker registers a function that,
 * when it has no slice limits yet, chooses its GPU slice and puts the limits into the
 * environment (and that records the slice with the node agent either way).
 * It runs once, just before the limits are read (the first CUDA call of the process), so the
 * slice is known before the real cuInit sees CUDA_VISIBLE_DEVICES. Non-zero = refuse. */
static int (*g_bind_cb)(void);

QGPU_EXPORT int qgpu_hook_set_bind_callback(int (*cb)(void)) {
    __atomic_store_n(&g_bind_cb, cb, __ATOMIC_RELEASE);
    return 0;
}

static int run_bind_callback(void) {
    int (*cb)(void) = __atomic_load_n(&g_bind_cb, __ATOMIC_ACQUIRE);
    return cb ? cb() : 0; /* the callback also sees workers that already have a slice */
}

static void load_config(void) {
    char err[1400];
    if (run_bind_callback() != 0) {
        hook_fail("QGPU_BIND=%s: this worker could not be bound to a GPU slice (rule: its qgpu "
                  "resources must fit one GPU of its node; the reason is printed above)",
                  getenv("QGPU_BIND") ? getenv("QGPU_BIND") : "");
        return;
    }
    if (hook_config_load(&g_lim, err, sizeof err) != 0) {
        hook_fail("%s", err);
        return;
    }
    if (!g_lim.active) {
        __atomic_store_n(&g_hook_state, HOOK_PASSTHROUGH, __ATOMIC_RELEASE);
        return;
    }
    if (ledger_open(&g_lim, err, sizeof err) != 0) {
        hook_fail("%s", err);
        return;
    }
    if (g_lim.device_uuid[0]) {
        region_open(g_lim.state_dir, g_lim.device_uuid, &g_lim);
        __atomic_store_n(&g_device_fenced, 1, __ATOMIC_RELEASE);
    }
    g_capped = g_lim.policy != POLICY_BEST_EFFORT && g_lim.core < 100 && !g_lim.mps_pipe_directory[0];
    __atomic_store_n(&g_hook_state, HOOK_ACTIVE, __ATOMIC_RELEASE);
}

int hook_state(void) {
    int s = __atomic_load_n(&g_hook_state, __ATOMIC_ACQUIRE);
    if (s) return s;
    pthread_once(&config_once, load_config);
    return __atomic_load_n(&g_hook_state, __ATOMIC_ACQUIRE);
}

/* The visible device whose UUID is `uuid` (the first device when `uuid` is empty; its UUID
 * goes to `uuid_out`): its ordinal, -2 when no visible device has it, -1 when the driver
 * cannot list its devices (not initialised). */
static CUdevice visible_device(const char *uuid, char uuid_out[41]) {
    int n = 0;
    if (!HAVE_REAL(cuDeviceGetCount) || REAL(cuDeviceGetCount)(&n) != CUDA_SUCCESS || n <= 0)
        return -1;
    for (int i = 0; i < n; i++) {
        CUdevice d;
        CUuuid u;
        if (REAL(cuDeviceGet)(&d, i) != CUDA_SUCCESS || REAL(cuDeviceGetUuid)(&u, d) != CUDA_SUCCESS)
            continue;
        qgpu_uuid_format((const unsigned char *)u.bytes, uuid_out);
        if (!uuid[0] || strcmp(uuid_out, uuid) == 0) return d;
    }
    return -2;
}

/* A slice is one GPU: when its limits name the GPU, every other device is refused
 * (contexts, VMM memory and pools placed there). A process that drops CUDA_VISIBLE_DEVICES
 * sees the node's other GPUs; without the fence it took memory on them. */

int hook_foreign_device(CUdevice dev) {
    if (!__atomic_load_n(&g_device_fenced, __ATOMIC_ACQUIRE)) return 0;
    int mine = __atomic_load_n(&g_slice_device, __ATOMIC_ACQUIRE);
    if (mine < 0) {
        char uuid[41] = "";
        mine = visible_device(g_lim.device_uuid, uuid);
        if (mine == -1) return 0; /* the driver cannot answer yet: it refuses the call itself */
        if (mine == -2) return 1; /* the slice's GPU is not visible: no device is the slice's */
        __atomic_store_n(&g_slice_device, mine, __ATOMIC_RELEASE);
    }
    return dev != mine;
}

int hook_foreign_location(const CUmemLocation *loc) {
    return loc && loc->type == CU_MEM_LOCATION_TYPE_DEVICE && hook_foreign_device(loc->id);
}

/* After the real cuInit: the slice's device must be visible and big enough. */
static void check_device(void) {
    char uuid[41] = "";
    CUdevice found = visible_device(g_lim.device_uuid, uuid);
    if (found == -1) return;
    if (found < 0) {
        hook_fail("QGPU_DEVICE_UUID=%s: no visible device has this UUID (rule: the slice's GPU "
                  "must be visible; CUDA_VISIBLE_DEVICES is set to it)", g_lim.device_uuid);
        return;
    }
    size_t total = 0;
    if (REAL(cuDeviceTotalMem_v2)(&total, found) == CUDA_SUCCESS && g_lim.mem_limit == UINT64_MAX)
        g_lim.mem_limit = total; /* no memory cap given: the card */
    if (REAL(cuDeviceTotalMem_v2)(&total, found) == CUDA_SUCCESS && g_lim.mem_limit > total) {
        hook_fail("QGPU_MEMORY_LIMIT=%llu (from %s): exceeds the card's %llu bytes (rule: a "
                  "slice's memory must fit its GPU)",
                  (unsigned long long)g_lim.mem_limit, g_lim.mem_source, (unsigned long long)total);
        return;
    }
    if (!g_lim.device_uuid[0]) {
        snprintf(g_lim.device_uuid, sizeof g_lim.device_uuid, "%s", uuid);
        region_open(g_lim.state_dir, uuid, &g_lim);
    }
}

/* A slice's process is never the client of an MPS daemon it did not ask for: the driver
 * makes a process the client of the control daemon in CUDA_MPS_PIPE_DIRECTORY, and where that
 * is unset, of the one at /tmp/nvidia-mps -- which any tenant of a host where slices run as
 * one user can start. Its owner would then set the process's thread percentage and memory
 * limit, see it in its client list, and run it in a server whose context no slice is charged
 * for. So where the environment names no pipe directory, the real cuInit is handed one that
 * cannot exist (a path below /dev/null: nobody can create it, root included): the driver
 * finds no daemon and runs the process without MPS, as on a host that has none. A directory
 * the environment names is kept: whoever started the process chose it (the agent's MPS
 * backend names its own daemon's), and a tenant can name one only for its own processes. */
#define QGPU_NO_MPS_DIRECTORY "/dev/null/qgpu-slices-run-without-mps"

static int no_default_mps(void) {
    const char *now = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (now && *now) return 0;
    if (setenv("CUDA_MPS_PIPE_DIRECTORY", QGPU_NO_MPS_DIRECTORY, 1) == 0) return 0;
    fprintf(stderr, "qgpu: cannot set CUDA_MPS_PIPE_DIRECTORY (out of memory): cuInit refused, "
                    "a slice's process must not join the default MPS daemon\n");
    return -1;
}

/* The agent's MPS backend: MPS takes a client's caps from its environment and lets that only
 * lower the daemon's (NVIDIA's MPS documentation), so a process that set its own would run
 * with all of the GPU's threads and no memory limit. The caps are set here from the slice's
 * limits, over whatever the environment said, before the driver reads them. */
static int mps_from_limits(void) {
    char pct[16], mem[48];
    snprintf(pct, sizeof pct, "%d", g_lim.policy == POLICY_BEST_EFFORT ? 100 : g_lim.core);
    snprintf(mem, sizeof mem, "0=%lluM", (unsigned long long)(g_lim.mem_limit >> 20));
    if (setenv("CUDA_MPS_PIPE_DIRECTORY", g_lim.mps_pipe_directory, 1) == 0 &&
        setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", pct, 1) == 0 &&
        (!g_lim.mem_limit || setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", mem, 1) == 0))
        return 0;
    fprintf(stderr, "qgpu: cannot set the MPS caps of slice %s (out of memory): cuInit refused\n",
            g_lim.slice_id);
    return -1;
}

QGPU_EXPORT CUresult cuInit(unsigned int flags) {
    hook_load_cuda();
    if (!HAVE_REAL(cuInit)) return CUDA_ERROR_NOT_INITIALIZED;
    int s = hook_state();
    if (s == HOOK_ERROR) return CUDA_ERROR_INVALID_VALUE;
    if (s == HOOK_ACTIVE &&
        (g_lim.mps_pipe_directory[0] ? mps_from_limits() : no_default_mps()) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuInit)(flags);
    if (r != CUDA_SUCCESS || s != HOOK_ACTIVE) return r;
    pthread_once(&device_once, check_device);
    return hook_state() == HOOK_ERROR ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
