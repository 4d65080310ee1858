/* The limits contract: QGPU_* keys from the environment or from a KEY=VALUE limits file.
 * A limits file owned by root and not writable by group/other is authoritative for the
 * slice keys (a workload cannot raise its caps through the environment); any other file has
 * the environment's authority, with the environment winning per key. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "hook.h"

#ifndef QGPU_DEFAULT_LIMITS_FILE /* tests build a copy with another default */
#define QGPU_DEFAULT_LIMITS_FILE "/etc/qgpu/limits.conf"
#endif
#define DEFAULT_LIMITS_FILE QGPU_DEFAULT_LIMITS_FILE
#define DEFAULT_STATE_DIR "/tmp/qgpu-state"

#define DEFAULT_CONTEXT_MEMORY (512ULL << 20) /* what a context costs, unless told */

enum {
    K_SLICE, K_UUID, K_MEM, K_CORE, K_ISO, K_STATE, K_FILE, K_REAL, K_SIM, K_CTXMEM, K_SHARING,
    K_SLICE_US, K_MPS, K_COUNT
};
static const char *const keys[K_COUNT] = {
    "QGPU_SLICE_ID",     "QGPU_DEVICE_UUID",    "QGPU_MEMORY_LIMIT", "QGPU_CORE_LIMIT",
    "QGPU_ISOLATION",    "QGPU_STATE_DIR",      "QGPU_LIMITS_FILE",  "QGPU_REAL_LIBCUDA",
    "QGPU_SIM_CONFIG",   "QGPU_CONTEXT_MEMORY", "QGPU_DEVICE_SHARING", "QGPU_TIMESLICE_US",
    "QGPU_MPS_PIPE_DIRECTORY"};
/* keys a trusted file controls exclusively */
static const int slice_keys[] = {K_SLICE, K_UUID, K_MEM, K_CORE, K_ISO, K_STATE, K_REAL,
                                 K_CTXMEM, K_SHARING, K_SLICE_US, K_MPS};

typedef struct {
    char val[K_COUNT][1024];
    int set[K_COUNT];
} kv_t;

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

static int parse_file(const char *path, kv_t *kv, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "QGPU_LIMITS_FILE=%s: cannot be read (%s)", path, strerror(errno));
        return -1;
    }
    char line[2048];
    int lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            snprintf(err, errlen, "QGPU_LIMITS_FILE=%s line %d: line too long", path, lineno);
            fclose(f);
            return -1;
        }
        char *s = trim(line);
        if (!*s || *s == '#') continue;
        char *eq = strchr(s, '=');
        int k = -1;
        if (eq) {
            *eq = 0;
            char *key = trim(s);
            for (int i = 0; i < K_COUNT; i++)
                if (strcmp(key, keys[i]) == 0) k = i;
            if (k < 0) {
                snprintf(err, errlen,
                         "QGPU_LIMITS_FILE=%s line %d: unknown key '%.64s' (rule: KEY=VALUE lines "
                         "with QGPU_* keys of the limits contract)",
                         path, lineno, key);
                fclose(f);
                return -1;
            }
        }
        if (!eq) {
            snprintf(err, errlen,
                     "QGPU_LIMITS_FILE=%s line %d: '%.64s' is not KEY=VALUE (rule: KEY=VALUE "
                     "lines, # comments)",
                     path, lineno, s);
            fclose(f);
            return -1;
        }
        snprintf(kv->val[k], sizeof kv->val[k], "%s", trim(eq + 1));
        kv->set[k] = 1;
    }
    fclose(f);
    return 0;
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

/* [A-Za-z0-9][A-Za-z0-9._-]{0,63}: it names a directory, so never ".", ".." or ".x" */
static int valid_slice_id(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64 || !isalnum((unsigned char)s[0])) return 0;
    for (const char *p = s; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '.' && *p != '_' && *p != '-') return 0;
    return 1;
}

int hook_config_load(hook_limits_t *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    kv_t env = {0}, file = {0}, eff = {0};
    const char *src[K_COUNT];
    for (int i = 0; i < K_COUNT; i++) {
        const char *v = getenv(keys[i]);
        if (v) {
            snprintf(env.val[i], sizeof env.val[i], "%s", v);
            env.set[i] = 1;
        }
    }
    const char *path = env.set[K_FILE] && env.val[K_FILE][0] ? env.val[K_FILE] : DEFAULT_LIMITS_FILE;
    struct stat st;
    int have_file = 0, trusted = 0;
    /* A trusted file at the default path is authoritative whatever the environment says:
     * pointing QGPU_LIMITS_FILE elsewhere must not escape it. */
    if (qgpu_stat(DEFAULT_LIMITS_FILE, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0 &&
        !(st.st_mode & (S_IWGRP | S_IWOTH)))
        path = DEFAULT_LIMITS_FILE;
    if (qgpu_stat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode)) {
            snprintf(err, errlen, "QGPU_LIMITS_FILE=%s: not a regular file", path);
            return -1;
        }
        if (parse_file(path, &file, err, errlen) != 0) return -1;
        have_file = 1;
        trusted = st.st_uid == 0 && !(st.st_mode & (S_IWGRP | S_IWOTH));
    } else if (env.set[K_FILE]) {
        snprintf(err, errlen, "QGPU_LIMITS_FILE=%s: file does not exist (rule: must name an "
                 "existing limits file)", path);
        return -1;
    }
    for (int i = 0; i < K_COUNT; i++) {
        int from_file = 0;
        if (trusted) {
            int slice_key = 0;
            for (size_t j = 0; j < sizeof slice_keys / sizeof slice_keys[0]; j++)
                slice_key |= slice_keys[j] == i;
            from_file = slice_key ? 1 : (file.set[i] && !env.set[i]);
            if (slice_key && !file.set[i]) {
                src[i] = path;
                continue; /* unset: the environment may not fill it in */
            }
        } else {
            from_file = have_file && file.set[i] && !env.set[i];
        }
        if (from_file && file.set[i]) {
            memcpy(eff.val[i], file.val[i], sizeof eff.val[i]);
            eff.set[i] = 1;
            src[i] = path;
        } else if (env.set[i]) {
            memcpy(eff.val[i], env.val[i], sizeof eff.val[i]);
            eff.set[i] = 1;
            src[i] = "environment";
        } else {
            src[i] = "default";
        }
    }
    snprintf(out->real_libcuda, sizeof out->real_libcuda, "%s", eff.set[K_REAL] ? eff.val[K_REAL] : "");
    if (!eff.set[K_SLICE] || !eff.val[K_SLICE][0]) return 0; /* no slice: pass-through */

#define BAD(k, rule)                                                                          \
    do {                                                                                      \
        snprintf(err, errlen, "%s=%.128s (from %s): %s", keys[k], eff.val[k], src[k], rule); \
        return -1;                                                                            \
    } while (0)

    if (!valid_slice_id(eff.val[K_SLICE])) BAD(K_SLICE, "must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}");
    snprintf(out->slice_id, sizeof out->slice_id, "%s", eff.val[K_SLICE]);
    if (!eff.set[K_MEM]) {
        out->mem_limit = UINT64_MAX; /* whole-GPU slices: no memory cap (the card's size) */
    } else if (parse_u64(eff.val[K_MEM], &out->mem_limit) != 0 || out->mem_limit == 0) {
        BAD(K_MEM, "must be an integer number of bytes > 0");
    }
    snprintf(out->mem_source, sizeof out->mem_source, "%s", src[K_MEM]);
    out->context_memory = DEFAULT_CONTEXT_MEMORY;
    if (eff.set[K_CTXMEM] && parse_u64(eff.val[K_CTXMEM], &out->context_memory) != 0)
        BAD(K_CTXMEM, "must be an integer number of bytes (what one CUDA context costs)");
    out->timesliced = 1;
    if (eff.set[K_SHARING]) {
        if (!strcmp(eff.val[K_SHARING], "timesliced"))
            out->timesliced = 1;
        else if (!strcmp(eff.val[K_SHARING], "serial"))
            out->timesliced = 0;
        else
            BAD(K_SHARING, "must be timesliced (processes take turns on the device, as on "
                           "NVIDIA GPUs) or serial (one queue for all processes)");
    }
    uint64_t slice_us = 2000;
    if (eff.set[K_SLICE_US] &&
        (parse_u64(eff.val[K_SLICE_US], &slice_us) != 0 || slice_us < 1 || slice_us > 1000000))
        BAD(K_SLICE_US, "must be an integer 1..1000000 (microseconds of one time slice)");
    out->timeslice_ns = (int64_t)slice_us * 1000;
    if (eff.set[K_MPS]) {
        if (eff.val[K_MPS][0] != '/' || strlen(eff.val[K_MPS]) >= sizeof out->mps_pipe_directory)
            BAD(K_MPS, "must be an absolute path shorter than 1024 bytes (the MPS control "
                       "daemon's pipe directory of the slice's GPU)");
        snprintf(out->mps_pipe_directory, sizeof out->mps_pipe_directory, "%s", eff.val[K_MPS]);
    }
    uint64_t core = 100;
    if (eff.set[K_CORE] && (parse_u64(eff.val[K_CORE], &core) != 0 || core < 1 || core > 100))
        BAD(K_CORE, "must be an integer 1..100 (100 = no compute cap)");
    out->core = (int)core;
    out->policy = POLICY_BEST_EFFORT;
    if (eff.set[K_ISO]) {
        const char *v = eff.val[K_ISO];
        if (!strcmp(v, "best-effort") || !strcmp(v, "be"))
            out->policy = POLICY_BEST_EFFORT;
        else if (!strcmp(v, "fixed-share") || !strcmp(v, "fs"))
            out->policy = POLICY_FIXED_SHARE;
        else if (!strcmp(v, "burst-share") || !strcmp(v, "bs"))
            out->policy = POLICY_BURST_SHARE;
        else
            BAD(K_ISO, "must be one of best-effort (be), fixed-share (fs), burst-share (bs)");
    }
    if (eff.set[K_UUID] && eff.val[K_UUID][0]) {
        unsigned char b[16];
        if (qgpu_uuid_parse(eff.val[K_UUID], b) != 0)
            BAD(K_UUID, "must be a GPU UUID such as GPU-5f3c2a1b-...");
        qgpu_uuid_format(b, out->device_uuid);
    }
    snprintf(out->state_dir, sizeof out->state_dir, "%s",
             eff.set[K_STATE] && eff.val[K_STATE][0] ? eff.val[K_STATE] : DEFAULT_STATE_DIR);
    out->active = 1;
    return 0;
#undef BAD
}
