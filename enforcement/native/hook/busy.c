/* gpu-<uuid>.busy: the slices the node agent's watchdog saw busy on this GPU in NVML's
 * per-process samples (written by enforcement/busy_view.py, read-only here). The GPU region
 * (region.c) shows only what processes publish about themselves through the hook, so it
 * misses work that bypasses the hook (the raw driver, a static binary) and the middle of a
 * kernel longer than its activity window; a burst-share or best-effort slice that cannot see
 * such a neighbour would take compute the neighbour was promised, and the watchdog, which
 * judges by NVML, would kill it. region_summary() counts every slice listed here as active.
 *
 * Trusted only when owned by root (or by this process's own user, who could edit anything
 * of its own anyway) and writable by nobody else; read under the writer's sequence counter
 * (odd while it writes); ignored once its valid_until has passed (the agent stopped). */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

#define BUSY_MAGIC 0x3159534255504751ULL /* "QGPUBSY1" */
#define BUSY_VERSION 1
#define BUSY_MAX 64
#define BUSY_TRIES 8

typedef struct {
    char slice_id[72];
    int32_t policy;
    int32_t core;
    int32_t util;
    char pad[12];
} busy_entry_t;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t count;
    uint64_t seq;
    int64_t valid_until_ns;
    char pad[32];
    busy_entry_t entries[BUSY_MAX]; /* 64 */
} busy_file_t;

_Static_assert(sizeof(busy_entry_t) == 96, "busy entry layout");
_Static_assert(sizeof(busy_file_t) == 64 + 64 * 96, "busy file layout");

static const busy_file_t *B;

void busy_open(const char *state_dir, const char *uuid) {
    char path[1200];
    snprintf(path, sizeof path, "%s/gpu-%s.busy", state_dir, uuid);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return; /* no agent on this node: the region alone */
    struct stat st;
    int ok = qgpu_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
             (size_t)st.st_size >= sizeof(busy_file_t) &&
             (st.st_uid == 0 || st.st_uid == geteuid()) && !(st.st_mode & (S_IWGRP | S_IWOTH));
    void *base = ok ? mmap(NULL, sizeof(busy_file_t), PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (base != MAP_FAILED) __atomic_store_n(&B, (const busy_file_t *)base, __ATOMIC_RELEASE);
}

/* A consistent copy of the list; returns the number of entries (0 when none is valid). */
int busy_read(busy_slice_t *out, int max, int64_t now_ns) {
    const busy_file_t *b = __atomic_load_n(&B, __ATOMIC_ACQUIRE);
    if (!b) return 0;
    for (int tries = 0; tries < BUSY_TRIES; tries++) {
        uint64_t seq = __atomic_load_n(&b->seq, __ATOMIC_ACQUIRE);
        if (seq & 1) continue; /* being written */
        if (__atomic_load_n(&b->magic, __ATOMIC_RELAXED) != BUSY_MAGIC ||
            b->version != BUSY_VERSION || b->valid_until_ns <= now_ns)
            return 0;
        uint32_t count = b->count;
        int n = 0;
        for (uint32_t i = 0; i < count && i < BUSY_MAX && n < max; i++, n++) {
            memcpy(out[n].slice_id, b->entries[i].slice_id, sizeof out[n].slice_id);
            out[n].slice_id[sizeof out[n].slice_id - 1] = 0;
            out[n].policy = b->entries[i].policy;
            out[n].core = b->entries[i].core;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&b->seq, __ATOMIC_RELAXED) == seq) return n;
    }
    return 0; /* the writer kept it busy: judge by the region alone this time */
}
