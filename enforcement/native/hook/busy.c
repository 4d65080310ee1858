/* <QGPU_STATE_DIR>/.gpu-<uuid>/busy: the slices of one GPU that the node agent's watchdog
 * saw run in NVML's per-process samples at its last scan, written only by the agent
 * (enforcement/busy_view.py writes the same layout; keep them together). It shows what a
 * slice's own activity file cannot: work that bypasses the hook (the raw driver, a static
 * binary) and the middle of a kernel longer than the activity window. region.c counts a
 * slice active if its activity says so OR it is listed here, so a tenant that hides its
 * activity cannot make a neighbour take what it was promised.
 *
 * Opened like the roster: only when root (or this user, in a layout it made itself) owns
 * it and nobody else may write it; mapped read-only (the agent never shrinks it). A list
 * names slices only: their policy and share come from the roster.
 *
 * Layout, little endian (BUSY_SIZE bytes):
 *   0 magic u64 "QGPUBSY1"   8 version u32   12 count u32 (entries in use)
 *  16 seq u64 (odd while the agent writes)
 *  24 valid_until_ns i64 (CLOCK_MONOTONIC; after it the list says nothing: the agent stopped)
 *  64 entries[64] of 80 bytes: slice_id char[72], util i32 (NVML SM %), reserved u32 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

#define BUSY_MAGIC 0x3159534255504751ULL /* "QGPUBSY1" */
#define BUSY_VERSION 1
#define BUSY_TRIES 8

typedef struct {
    char slice_id[72];
    int32_t util;
    uint32_t reserved;
} busy_entry_t;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t count;
    uint64_t seq;
    int64_t valid_until_ns;
    char pad[32];
    busy_entry_t entries[BUSY_MAX];
} busy_file_t;

_Static_assert(sizeof(busy_entry_t) == 80, "busy entry layout");
_Static_assert(sizeof(busy_file_t) == 64 + BUSY_MAX * 80, "busy file layout");

struct busy {
    const busy_file_t *map;
};

busy_t *busy_open(const char *dir) {
    char path[1200];
    snprintf(path, sizeof path, "%s/busy", dir);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return NULL; /* no agent on this node (or an older one): activity alone */
    struct stat st;
    const busy_file_t *map = MAP_FAILED;
    if (qgpu_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && state_trusted(&st) &&
        (size_t)st.st_size >= sizeof(busy_file_t))
        map = mmap(NULL, sizeof(busy_file_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return NULL;
    busy_t *b = calloc(1, sizeof *b);
    if (!b) {
        munmap((void *)map, sizeof(busy_file_t));
        return NULL;
    }
    b->map = map;
    return b;
}

uint64_t busy_seq(const busy_t *b) { return __atomic_load_n(&b->map->seq, __ATOMIC_ACQUIRE); }

int busy_read(const busy_t *b, busy_list_t *out) {
    const busy_file_t *f = b->map;
    for (int tries = 0; tries < BUSY_TRIES; tries++) {
        uint64_t seq = busy_seq(b);
        if (seq & 1) continue; /* being written */
        out->seq = seq;
        out->count = 0;
        out->valid_until_ns = 0;
        if (__atomic_load_n(&f->magic, __ATOMIC_RELAXED) != BUSY_MAGIC ||
            f->version != BUSY_VERSION)
            return 0; /* not (yet) a busy list: it lists nobody */
        out->valid_until_ns = f->valid_until_ns;
        uint32_t count = f->count < BUSY_MAX ? f->count : BUSY_MAX;
        for (uint32_t i = 0; i < count; i++) {
            memcpy(out->slice_id[i], f->entries[i].slice_id, sizeof out->slice_id[i]);
            out->slice_id[i][sizeof out->slice_id[i] - 1] = 0;
        }
        out->count = (int)count;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (busy_seq(b) == seq) return 0;
    }
    return -1; /* the writer kept it busy (or died at it): keep the list read before */
}

int busy_lists(const busy_list_t *l, const char *slice_id) {
    for (int i = 0; i < l->count; i++)
        if (strncmp(l->slice_id[i], slice_id, sizeof l->slice_id[i]) == 0) return 1;
    return 0;
}
