/* Parse the simulated-GPU config file (key=value lines, see enforcement/sim.py). Every value
 * is checked: a bad one names the file, the line, the key and the rule. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

#define DEFAULT_CONTEXT_MEMORY (512ULL << 20)
#define DEFAULT_GREEN_CONTEXT_MEMORY (32ULL << 20)
#define DEFAULT_DEVRT_LAUNCH_BYTES (8ULL << 10)
#define DEFAULT_DEVRT_SYNC_THREAD_BYTES (4ULL << 10)

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

static int parse_u64(const char *s, uint64_t *out) {
    if (!*s) return -1;
    uint64_t v = 0;
    for (const char *p = s; *p; p++) {
        if (!isdigit((unsigned char)*p)) return -1;
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

static int parse_int(const char *s, long lo, long hi, int *out) {
    uint64_t v;
    if (parse_u64(s, &v) != 0 || v < (uint64_t)lo || v > (uint64_t)hi) return -1;
    *out = (int)v;
    return 0;
}

int sim_config_load(const char *path, sim_config_t *cfg, char *err, size_t errlen) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->driver_version, sizeof cfg->driver_version, "580.65.06");
    cfg->cuda_version = 13000;
    cfg->scheduler = SIM_SCHED_TIMESLICED;
    cfg->timeslice_ns = 2000000;
    cfg->procaddr = SIM_PROCADDR_INTERNAL;
    snprintf(cfg->mps_pipe_directory, sizeof cfg->mps_pipe_directory, "/tmp/nvidia-mps");
    cfg->graph_node_bytes = 4096;
    cfg->graph_work_at_use = 1;
    char state_dir[4096] = "";
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: cannot open (%s)", path, strerror(errno));
        return -1;
    }
    char line[4096];
    int lineno = 0;
#define BAD(rule)                                                                              \
    do {                                                                                       \
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s line %d: %s=%.64s: %s", path, lineno, key,   \
                 val, rule);                                                                   \
        fclose(f);                                                                             \
        return -1;                                                                             \
    } while (0)
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *s = trim(line);
        if (*s == 0 || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "QGPU_SIM_CONFIG=%s line %d: expected key=value", path, lineno);
            fclose(f);
            return -1;
        }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        if (strcmp(key, "node") == 0) {
            snprintf(cfg->node, sizeof cfg->node, "%s", val);
        } else if (strcmp(key, "driver_version") == 0) {
            snprintf(cfg->driver_version, sizeof cfg->driver_version, "%s", val);
        } else if (strcmp(key, "cuda_version") == 0) {
            if (parse_int(val, 2000, 99999, &cfg->cuda_version) != 0)
                BAD("must be a CUDA version number such as 12040 or 13000");
        } else if (strcmp(key, "scheduler") == 0) {
            if (strcmp(val, "fifo") == 0)
                cfg->scheduler = SIM_SCHED_FIFO;
            else if (strcmp(val, "timesliced") == 0)
                cfg->scheduler = SIM_SCHED_TIMESLICED;
            else
                BAD("must be fifo or timesliced");
        } else if (strcmp(key, "timeslice_us") == 0) {
            int us;
            if (parse_int(val, 1, 1000000, &us) != 0) BAD("must be an integer 1..1000000");
            cfg->timeslice_ns = (int64_t)us * 1000;
        } else if (strcmp(key, "procaddr") == 0) {
            if (strcmp(val, "internal") == 0)
                cfg->procaddr = SIM_PROCADDR_INTERNAL;
            else if (strcmp(val, "exported") == 0)
                cfg->procaddr = SIM_PROCADDR_EXPORTED;
            else
                BAD("must be internal or exported");
        } else if (strcmp(key, "accounting") == 0) {
            if (strcmp(val, "enabled") == 0)
                cfg->accounting = 1;
            else if (strcmp(val, "disabled") == 0)
                cfg->accounting = 0;
            else
                BAD("must be enabled or disabled");
        } else if (strcmp(key, "mps_pipe_directory") == 0) {
            if (val[0] != '/' || strlen(val) >= sizeof cfg->mps_pipe_directory)
                BAD("must be an absolute path shorter than 1024 bytes");
            snprintf(cfg->mps_pipe_directory, sizeof cfg->mps_pipe_directory, "%s", val);
        } else if (strcmp(key, "graph_node_bytes") == 0) {
            if (parse_u64(val, &cfg->graph_node_bytes) != 0 || cfg->graph_node_bytes > (1ULL << 30))
                BAD("must be 0..1073741824 bytes");
        } else if (strcmp(key, "graph_work_at") == 0) {
            if (strcmp(val, "first_use") == 0)
                cfg->graph_work_at_use = 1;
            else if (strcmp(val, "instantiation") == 0)
                cfg->graph_work_at_use = 0;
            else
                BAD("must be first_use or instantiation");
        } else if (strcmp(key, "state_dir") == 0) {
            snprintf(state_dir, sizeof state_dir, "%s", val);
        } else if (strncmp(key, "gpu", 3) == 0 && isdigit((unsigned char)key[3])) {
            char *dot;
            long idx = strtol(key + 3, &dot, 10);
            if (*dot != '.' || idx < 0 || idx >= SIM_MAX_GPUS) BAD("bad key (gpuN.field, N < 64)");
            sim_gpu_config_t *g = &cfg->gpus[idx];
            const char *field = dot + 1;
            if (idx + 1 > cfg->ngpus) cfg->ngpus = (int)idx + 1;
            if (strcmp(field, "uuid") == 0) {
                snprintf(g->uuid, sizeof g->uuid, "%s", val);
            } else if (strcmp(field, "name") == 0) {
                snprintf(g->name, sizeof g->name, "%s", val);
            } else if (strcmp(field, "memory") == 0) {
                if (parse_u64(val, &g->memory) != 0 || g->memory == 0)
                    BAD("must be an integer number of bytes > 0");
            } else if (strcmp(field, "context_memory") == 0) {
                if (parse_u64(val, &g->context_memory) != 0) BAD("must be an integer number of bytes");
                g->context_memory_set = 1;
            } else if (strcmp(field, "green_context_memory") == 0) {
                if (parse_u64(val, &g->green_context_memory) != 0)
                    BAD("must be an integer number of bytes");
                g->green_context_memory_set = 1;
            } else if (strcmp(field, "devrt_launch_bytes") == 0) {
                if (parse_u64(val, &g->devrt_launch_bytes) != 0) BAD("must be an integer number of bytes");
                g->devrt_launch_set = 1;
            } else if (strcmp(field, "devrt_sync_thread_bytes") == 0) {
                if (parse_u64(val, &g->devrt_sync_thread_bytes) != 0)
                    BAD("must be an integer number of bytes");
                g->devrt_sync_set = 1;
            } else if (strcmp(field, "sms") == 0) {
                if (parse_int(val, 1, 100000, &g->sms) != 0) BAD("must be an integer 1..100000");
            } else if (strcmp(field, "threads_per_sm") == 0) {
                if (parse_int(val, 32, 65536, &g->threads_per_sm) != 0)
                    BAD("must be an integer 32..65536");
            } else if (strcmp(field, "cc") == 0) {
                if (sscanf(val, "%d.%d", &g->cc_major, &g->cc_minor) != 2) BAD("must be MAJOR.MINOR");
            } else if (strcmp(field, "bar1") == 0) {
                if (parse_u64(val, &g->bar1) != 0 || g->bar1 == 0)
                    BAD("must be an integer number of bytes > 0");
            } else if (strcmp(field, "pci_bus") == 0) {
                g->pci_bus = (int)strtol(val, NULL, 0);
            }
            /* other gpu fields (model) are for enforcement/sim.py */
        }
    }
#undef BAD
    fclose(f);
    if (cfg->ngpus == 0) {
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: no gpuN.* entries", path);
        return -1;
    }
    if (!state_dir[0]) snprintf(state_dir, sizeof state_dir, "%s.state", path);
    for (int i = 0; i < cfg->ngpus; i++) {
        sim_gpu_config_t *g = &cfg->gpus[i];
        unsigned char b[16];
        if (!g->uuid[0] || qgpu_uuid_parse(g->uuid, b) != 0 || g->memory == 0) {
            snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: gpu%d needs a GPU-... uuid and memory > 0",
                     path, i);
            return -1;
        }
        if (!g->name[0]) snprintf(g->name, sizeof g->name, "NVIDIA Simulated GPU");
        if (g->sms <= 0) g->sms = 80;
        if (g->threads_per_sm <= 0) g->threads_per_sm = 2048;
        if (g->cc_major <= 0) {
            g->cc_major = 8;
            g->cc_minor = 0;
        }
        if (g->pci_bus <= 0) g->pci_bus = 0x10 + i;
        if (!g->bar1) /* a large BAR: the memory rounded up to a power of two */
            for (g->bar1 = 1ULL << 20; g->bar1 < g->memory && g->bar1 < (1ULL << 62);) g->bar1 <<= 1;
        if (!g->context_memory_set) g->context_memory = DEFAULT_CONTEXT_MEMORY;
        if (!g->green_context_memory_set) g->green_context_memory = DEFAULT_GREEN_CONTEXT_MEMORY;
        if (!g->devrt_launch_set) g->devrt_launch_bytes = DEFAULT_DEVRT_LAUNCH_BYTES;
        if (!g->devrt_sync_set) g->devrt_sync_thread_bytes = DEFAULT_DEVRT_SYNC_THREAD_BYTES;
        snprintf(g->state_path, sizeof g->state_path, "%s/%s.gpu", state_dir, g->uuid);
    }
    if (qgpu_mkdirs(state_dir) != 0) {
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: cannot create state dir %s (%s)", path,
                 state_dir, strerror(errno));
        return -1;
    }
    return 0;
}
