/* Parse the simulated-GPU config file (key=value lines, see enforcement/sim.py). */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

int sim_config_load(const char *path, sim_config_t *cfg, char *err, size_t errlen) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->driver_version, sizeof cfg->driver_version, "550.54.15");
    cfg->cuda_version = 12040;
    char state_dir[4096] = "";
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: cannot open (%s)", path, strerror(errno));
        return -1;
    }
    char line[4096];
    int lineno = 0;
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
            cfg->cuda_version = atoi(val);
        } else if (strcmp(key, "state_dir") == 0) {
            snprintf(state_dir, sizeof state_dir, "%s", val);
        } else if (strncmp(key, "gpu", 3) == 0 && isdigit((unsigned char)key[3])) {
            char *dot;
            long idx = strtol(key + 3, &dot, 10);
            if (*dot != '.' || idx < 0 || idx >= SIM_MAX_GPUS) {
                snprintf(err, errlen, "QGPU_SIM_CONFIG=%s line %d: bad key %s", path, lineno, key);
                fclose(f);
                return -1;
            }
            sim_gpu_config_t *g = &cfg->gpus[idx];
            const char *field = dot + 1;
            if (idx + 1 > cfg->ngpus) cfg->ngpus = (int)idx + 1;
            if (strcmp(field, "uuid") == 0)
                snprintf(g->uuid, sizeof g->uuid, "%s", val);
            else if (strcmp(field, "name") == 0)
                snprintf(g->name, sizeof g->name, "%s", val);
            else if (strcmp(field, "memory") == 0)
                g->memory = strtoull(val, NULL, 10);
            else if (strcmp(field, "sms") == 0)
                g->sms = atoi(val);
            else if (strcmp(field, "cc") == 0)
                sscanf(val, "%d.%d", &g->cc_major, &g->cc_minor);
            else if (strcmp(field, "pci_bus") == 0)
                g->pci_bus = (int)strtol(val, NULL, 0);
            /* unknown gpu fields are ignored: newer writers may add some */
        }
    }
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
        if (g->cc_major <= 0) {
            g->cc_major = 8;
            g->cc_minor = 0;
        }
        if (g->pci_bus <= 0) g->pci_bus = 0x10 + i;
        snprintf(g->state_path, sizeof g->state_path, "%s/%s.gpu", state_dir, g->uuid);
    }
    if (qgpu_mkdirs(state_dir) != 0) {
        snprintf(err, errlen, "QGPU_SIM_CONFIG=%s: cannot create state dir %s (%s)", path,
                 state_dir, strerror(errno));
        return -1;
    }
    return 0;
}
