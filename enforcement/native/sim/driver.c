/* Simulated driver: configuration, initialisation, versions, devices, attributes, export
 * tables, error strings. Contexts live in ctx.c, memory in mem.c, execution in exec.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"

QGPU_HIDDEN sim_config_t g_sim_cfg;
QGPU_HIDDEN int g_sim_nvis;
QGPU_HIDDEN int g_sim_vis[SIM_MAX_GPUS];
QGPU_HIDDEN sim_gpu_state_t *g_sim_state[SIM_MAX_GPUS];
QGPU_HIDDEN qgpu_table_t g_sim_allocs = QGPU_TABLE_INIT;

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static int config_ok;
static char config_err[600];
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static int init_called;
static int forked; /* a child of a process that had initialised CUDA: CUDA is not fork-safe */

static void mark_forked(void) { forked = 1; }

static void load_config(void) {
    const char *path = getenv("QGPU_SIM_CONFIG");
    if (!path || !*path) {
        snprintf(config_err, sizeof config_err, "QGPU_SIM_CONFIG is not set: no simulated GPUs");
        return;
    }
    config_ok = sim_config_load(path, &g_sim_cfg, config_err, sizeof config_err) == 0;
}

int sim_config_loaded(void) {
    pthread_once(&config_once, load_config);
    return config_ok;
}

/* CUDA_VISIBLE_DEVICES: indices or (prefixes of) UUIDs, stopping at the first bad entry. */
static void parse_visible(void) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    g_sim_nvis = 0;
    if (!env) {
        for (int i = 0; i < g_sim_cfg.ngpus; i++) g_sim_vis[g_sim_nvis++] = i;
        return;
    }
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        int found = -1;
        char *end;
        long idx = strtol(tok, &end, 10);
        if (*tok && *end == 0) {
            if (idx >= 0 && idx < g_sim_cfg.ngpus) found = (int)idx;
        } else {
            size_t n = strlen(tok);
            int matches = 0;
            for (int i = 0; i < g_sim_cfg.ngpus && n > 0; i++) {
                const char *u = g_sim_cfg.gpus[i].uuid;
                const char *t = tok;
                if (strncmp(t, "GPU-", 4) != 0) u += 4; /* allow the bare hex form */
                if (strncmp(u, t, strlen(t)) == 0) {
                    found = i;
                    matches++;
                }
            }
            if (matches != 1) found = -1;
        }
        if (found < 0) break;
        int dup = 0;
        for (int j = 0; j < g_sim_nvis; j++) dup |= g_sim_vis[j] == found;
        if (dup) break;
        g_sim_vis[g_sim_nvis++] = found;
    }
}

static void release_own_slots(void) {
    int pid = getpid();
    for (int i = 0; i < SIM_MAX_GPUS; i++) {
        sim_gpu_state_t *st = g_sim_state[i];
        if (!st) continue;
        sim_state_lock(st);
        sim_proc_t *p = sim_state_proc_slot(st, 0);
        if (p && p->pid == pid) sim_state_drop_slot(st, (int)(p - st->procs));
        sim_state_unlock(st);
    }
}

/* MPS, as far as a client's initialisation goes: NVIDIA's driver makes a process the client
 * of the MPS control daemon whose pipe directory it finds (CUDA_MPS_PIPE_DIRECTORY, else the
 * default /tmp/nvidia-mps) and runs without MPS when there is none there. The simulator has
 * no MPS server; a control daemon is modelled as a FIFO named `control` in the directory,
 * and connecting as appending this process's pid to `clients` beside it (what the daemon's
 * owner would read with `get_client_list`). Nothing else about the process changes. */
static void connect_mps(void) {
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (!dir || !*dir) dir = g_sim_cfg.mps_pipe_directory;
    char path[1200];
    struct stat st;
    snprintf(path, sizeof path, "%s/control", dir);
    if (stat(path, &st) != 0 || !S_ISFIFO(st.st_mode)) return; /* no daemon: no MPS */
    snprintf(path, sizeof path, "%s/clients", dir);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    /* a client tells its server the caps its environment asks for (MPS applies the lower of
     * them and the daemon's): what the tests read of what a client got */
    const char *pct = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    const char *mem = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    char line[160];
    int n = snprintf(line, sizeof line, "%d %.16s %.64s\n", (int)getpid(), pct && *pct ? pct : "-",
                     mem && *mem ? mem : "-");
    ssize_t written = write(fd, line, (size_t)n); /* a short write: the daemon misses it */
    (void)written;
    close(fd);
}

static void do_init(void) {
    if (!sim_config_loaded()) {
        fprintf(stderr, "qgpu-sim: %s\n", config_err);
        init_result = getenv("QGPU_SIM_CONFIG") && *getenv("QGPU_SIM_CONFIG")
                          ? CUDA_ERROR_NOT_INITIALIZED
                          : CUDA_ERROR_NO_DEVICE;
        return;
    }
    parse_visible();
    connect_mps();
    for (int v = 0; v < g_sim_nvis; v++) {
        int g = g_sim_vis[v];
        g_sim_state[g] = sim_state_open(&g_sim_cfg.gpus[g], &g_sim_cfg);
        if (!g_sim_state[g]) {
            fprintf(stderr, "qgpu-sim: cannot open state file %s\n", g_sim_cfg.gpus[g].state_path);
            init_result = CUDA_ERROR_NOT_INITIALIZED;
            return;
        }
    }
    atexit(release_own_slots);
    pthread_atfork(NULL, NULL, mark_forked);
    sim_checkpoint_start();
    init_result = CUDA_SUCCESS;
}

/* Like the real driver, CUDA cannot be used in a child forked after initialisation: every
 * call there, cuInit included, fails with CUDA_ERROR_NOT_INITIALIZED. */
CUresult sim_check_init(void) {
    if (!__atomic_load_n(&init_called, __ATOMIC_ACQUIRE) || forked) return CUDA_ERROR_NOT_INITIALIZED;
    if (init_result == CUDA_SUCCESS) sim_checkpoint_gate(); /* locked: wait for the unlock */
    return init_result;
}

SIM_EXPORT CUresult cuInit(unsigned int flags) {
    if (forked) return CUDA_ERROR_NOT_INITIALIZED;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&init_once, do_init);
    __atomic_store_n(&init_called, 1, __ATOMIC_RELEASE);
    return init_result;
}

/* Allowed before cuInit (NVIDIA's runtime asks first): the configured CUDA version. */
SIM_EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = sim_config_loaded() ? g_sim_cfg.cuda_version : 13000;
    return CUDA_SUCCESS;
}

int sim_visible_ordinal(int gidx) {
    for (int v = 0; v < g_sim_nvis; v++)
        if (g_sim_vis[v] == gidx) return v;
    return -1;
}

CUresult sim_device_gidx(CUdevice dev, int *gidx) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (dev < 0 || dev >= g_sim_nvis) return CUDA_ERROR_INVALID_DEVICE;
    *gidx = g_sim_vis[dev];
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_sim_nvis;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    CUresult r = sim_check_init();
    if (r) return r;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_sim_nvis) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", g_sim_cfg.gpus[g].name);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    qgpu_uuid_parse(g_sim_cfg.gpus[g].uuid, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_sim_cfg.gpus[g].memory;
    return CUDA_SUCCESS;
}

/* v1 (CUDA 2.0 ABI): 32-bit size, saturated on cards of 4 GiB and more. */
SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t b = 0;
    CUresult r = cuDeviceTotalMem_v2(bytes ? &b : NULL, dev);
    if (r == CUDA_SUCCESS) *bytes = b > 0xFFFFFFFFu ? 0xFFFFFFFFu : (unsigned int)b;
    return r;
}

/* resident blocks per SM by compute capability (CUDA C++ Programming Guide, table of
 * technical specifications) */
static int blocks_per_sm(const sim_gpu_config_t *c) {
    int cc = c->cc_major * 10 + c->cc_minor;
    if (cc == 75 || cc == 86 || cc == 87) return 16;
    if (cc == 89) return 24;
    return 32;
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    const sim_gpu_config_t *c = &g_sim_cfg.gpus[g];
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case 2: case 3: *value = 1024; break;       /* MAX_BLOCK_DIM_X/Y */
    case 4: *value = 64; break;                 /* MAX_BLOCK_DIM_Z */
    case 5: *value = 2147483647; break;         /* MAX_GRID_DIM_X */
    case 6: case 7: *value = 65535; break;      /* MAX_GRID_DIM_Y/Z */
    case 8: *value = 49152; break;              /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: *value = 65536; break;              /* TOTAL_CONSTANT_MEMORY */
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE:
        *value = (int)__atomic_load_n(&g_sim_state[g]->compute_mode, __ATOMIC_ACQUIRE);
        break;
    case 12: *value = 65536; break;             /* MAX_REGISTERS_PER_BLOCK */
    case 13: *value = 1755000; break;           /* CLOCK_RATE (kHz) */
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = c->sms; break;
    case 36: *value = 2619000; break;           /* MEMORY_CLOCK_RATE */
    case 37: *value = 5120; break;              /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: *value = 50 << 20; break;          /* L2_CACHE_SIZE */
    case 39: *value = c->threads_per_sm; break; /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 41: *value = 1; break;                 /* UNIFIED_ADDRESSING */
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = c->pci_bus; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = c->cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = c->cc_minor; break;
    case 81: *value = 228 << 10; break;         /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: *value = 65536; break;             /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: /* Pascal and later, on Linux */
        *value = c->cc_major >= 6;
        break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case 102: /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: cuMemExportToShareableHandle */
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *value = 1; break;
    case 106: *value = blocks_per_sm(c); break; /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    default:
        if (attrib <= 0 || attrib > 200) return CUDA_ERROR_INVALID_VALUE;
        *value = 0;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev) {
    int g;
    CUresult r = sim_device_gidx(dev, &g);
    if (r) return r;
    if (!bus || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(bus, (size_t)len, "0000:%02x:00.0", g_sim_cfg.gpus[g].pci_bus);
    return CUDA_SUCCESS;
}

/* NVIDIA's runtime asks for private tables by UUID. The simulator has none of them: every
 * request is answered CUDA_ERROR_NOT_FOUND, as a driver without the table would. With
 * QGPU_SIM_TRACE_EXPORT_TABLES set, each requested UUID is printed on stderr (that is how
 * docs/enforcement.md records what the runtime asks for). */
SIM_EXPORT CUresult cuGetExportTable(const void **table, const CUuuid *id) {
    if (!table || !id) return CUDA_ERROR_INVALID_VALUE;
    *table = NULL;
    if (getenv("QGPU_SIM_TRACE_EXPORT_TABLES")) {
        char hex[33];
        for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", (unsigned char)id->bytes[i]);
        fprintf(stderr, "qgpu-sim: cuGetExportTable %s: not found\n", hex);
    }
    return CUDA_ERROR_NOT_FOUND;
}

/* ---- errors ---- */

static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU",
     "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_JIT_COMPILER_NOT_FOUND, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
     "PTX JIT compiler library not found"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
     "the graph update was not performed because it included changes which violated "
     "constraints specific to instantiated graph update"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

SIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].text;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].name;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
