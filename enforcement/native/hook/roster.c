/* <QGPU_STATE_DIR>/.gpu-<uuid>/roster: the slices placed on one GPU, each with its policy
 * and share. Only whoever places slices writes it: the node agent or the Kubernetes device
 * plugin (root-owned, read-only to workloads: enforcement/gpu_state.py writes the same
 * layout), or, where neither runs (`qgpu run`), the hooks of one user in a directory private
 * to that user. A workload therefore cannot say what another slice's policy or share is,
 * nor invent slices; what a slice does (its activity) it says in its own file (region.c).
 *
 * Layout, little endian (ROSTER_SIZE bytes, never shrunk):
 *   0 magic u64 "QGPUROS1"   8 seq u64 (odd while a writer is at work)
 *  16 version u32            20 max_entries u32        64 entries[128] of 96 bytes
 * An entry: slice_id char[72] (empty = free), policy i32, core i32, writer u32 (1 agent,
 * 2 device plugin, 3 hook), reserved. Writers take flock(LOCK_EX) on the file and bump
 * seq around their change; readers copy the entries and retry while seq moved. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

#define ROSTER_MAGIC 0x31534f5255504751ULL /* "QGPUROS1" */
#define ROSTER_VERSION 1

typedef struct {
    uint64_t magic;
    uint64_t seq;
    uint32_t version;
    uint32_t max_entries;
    char pad[40];
    roster_entry_t entries[ROSTER_MAX];
} roster_file_t;

_Static_assert(sizeof(roster_entry_t) == 96, "roster entry layout");
_Static_assert(__builtin_offsetof(roster_file_t, entries) == 64, "roster layout");

struct roster {
    const roster_file_t *map; /* read-only mapping */
};

int state_trusted(const struct stat *st) {
    return (st->st_uid == 0 || st->st_uid == geteuid()) && !(st->st_mode & (S_IWGRP | S_IWOTH));
}

/* Locked writer: the seq bump around a change of `e`. */
static void write_entry(roster_file_t *w, roster_entry_t *e, const roster_entry_t *v) {
    __atomic_store_n(&w->seq, w->seq | 1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    memcpy(e, v, sizeof *e);
    __atomic_store_n(&w->seq, (w->seq | 1) + 1, __ATOMIC_RELEASE);
}

/* A hook-listed slice is gone when no process of it is alive (its activity file says who). */
static int hook_entry_dead(const char *dir, const roster_entry_t *e) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%.72s.activity", dir, e->slice_id);
    int alive = 0;
    if (activity_any_alive(path, &alive) != 0) return 1; /* no readable file: gone */
    return !alive;
}

/* Locked: this slice's entry (policy and share from its trusted limits), in a roster its
 * own user writes. Hook entries of slices that have no live process are freed first. */
static void list_self(roster_file_t *w, const char *dir, const hook_limits_t *lim) {
    roster_entry_t me;
    memset(&me, 0, sizeof me);
    snprintf(me.slice_id, sizeof me.slice_id, "%s", lim->slice_id);
    me.policy = lim->policy;
    me.core = lim->core;
    me.writer = ROSTER_WRITER_HOOK;
    roster_entry_t *slot = NULL, *free_e = NULL;
    for (int i = 0; i < ROSTER_MAX; i++) {
        roster_entry_t *e = &w->entries[i];
        if (strncmp(e->slice_id, me.slice_id, sizeof e->slice_id) == 0) {
            slot = e;
            continue;
        }
        if (e->slice_id[0] && e->writer == ROSTER_WRITER_HOOK && hook_entry_dead(dir, e)) {
            roster_entry_t blank;
            memset(&blank, 0, sizeof blank);
            write_entry(w, e, &blank);
        }
        if (!e->slice_id[0] && !free_e) free_e = e;
    }
    if (slot) {
        if (slot->policy != me.policy || slot->core != me.core) {
            me.writer = slot->writer;
            write_entry(w, slot, &me);
        }
        return;
    }
    if (free_e) write_entry(w, free_e, &me);
}

static void init_file(roster_file_t *w) {
    w->version = ROSTER_VERSION;
    w->max_entries = ROSTER_MAX;
    __atomic_store_n(&w->magic, ROSTER_MAGIC, __ATOMIC_RELEASE);
}

/* The writable path: a roster owned by this user (the hook-made layout, or root next to the
 * agent's): created if missing, this slice listed if it is not. Errors leave it unlisted. */
static void list_in_own_roster(const char *dir, const char *path, const hook_limits_t *lim) {
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0) fchmod(fd, 0600);
        else if (errno == EEXIST) fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) return;
    struct stat st;
    if (flock(fd, LOCK_EX) != 0 || qgpu_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || !state_trusted(&st) ||
        ((size_t)st.st_size < sizeof(roster_file_t) && ftruncate(fd, sizeof(roster_file_t)) != 0)) {
        close(fd);
        return;
    }
    roster_file_t *w = mmap(NULL, sizeof *w, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w != MAP_FAILED) {
        if (__atomic_load_n(&w->magic, __ATOMIC_ACQUIRE) != ROSTER_MAGIC) init_file(w);
        list_self(w, dir, lim);
        munmap(w, sizeof *w);
    }
    close(fd); /* drops the flock */
}

roster_t *roster_open(const char *dir, const hook_limits_t *lim) {
    char path[1200];
    snprintf(path, sizeof path, "%s/roster", dir);
    list_in_own_roster(dir, path, lim);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return NULL;
    struct stat st;
    const roster_file_t *map = MAP_FAILED;
    if (qgpu_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && state_trusted(&st) &&
        (size_t)st.st_size >= sizeof(roster_file_t))
        map = mmap(NULL, sizeof(roster_file_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return NULL;
    if (__atomic_load_n(&map->magic, __ATOMIC_ACQUIRE) != ROSTER_MAGIC) {
        munmap((void *)map, sizeof(roster_file_t));
        return NULL;
    }
    roster_t *r = calloc(1, sizeof *r);
    if (!r) {
        munmap((void *)map, sizeof(roster_file_t));
        return NULL;
    }
    r->map = map;
    return r;
}

uint64_t roster_seq(const roster_t *r) { return __atomic_load_n(&r->map->seq, __ATOMIC_ACQUIRE); }

int roster_read(const roster_t *r, roster_entry_t *out, uint64_t *seq_out) {
    for (int tries = 0; tries < 64; tries++) {
        uint64_t before = roster_seq(r);
        if (before & 1) continue;
        int n = 0;
        for (int i = 0; i < ROSTER_MAX; i++) {
            roster_entry_t e;
            memcpy(&e, (const void *)&r->map->entries[i], sizeof e);
            e.slice_id[sizeof e.slice_id - 1] = 0;
            if (e.slice_id[0]) out[n++] = e;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (roster_seq(r) == before) {
            *seq_out = before;
            return n;
        }
    }
    return -1; /* a writer is at work (or died at it): keep what was read before */
}
