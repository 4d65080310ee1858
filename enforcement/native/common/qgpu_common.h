/* Helpers shared by the interposer and the simulated driver: clocks, process identity
 * (pid + start time, so a reused pid is not mistaken for a live one), and shared state files
 * (an mmap'd file holding a process-shared robust mutex). Everything here is hidden. */
#ifndef QGPU_COMMON_H
#define QGPU_COMMON_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define QGPU_HIDDEN __attribute__((visibility("hidden")))
#define QGPU_EXPORT __attribute__((visibility("default")))

QGPU_HIDDEN int64_t qgpu_now_ns(void);        /* CLOCK_MONOTONIC */
QGPU_HIDDEN int64_t qgpu_now_coarse_ns(void); /* CLOCK_MONOTONIC_COARSE */
QGPU_HIDDEN void qgpu_sleep_until_ns(int64_t deadline_ns);
QGPU_HIDDEN void qgpu_sleep_ns(int64_t ns);

/* Start time of a process (field 22 of /proc/<pid>/stat, clock ticks since boot), 0 when the
 * process does not exist or is a zombie. */
QGPU_HIDDEN uint64_t qgpu_proc_start_time(int pid);
/* 1 if pid is alive and still the process that started at start_time. */
QGPU_HIDDEN int qgpu_proc_alive(int pid, uint64_t start_time);

/* Map a shared state file of `size` bytes, creating and initialising it under flock when
 * new. `mutex_offset` is where a pthread_mutex_t lives inside; `magic` the first 8 bytes.
 * init_cb (may be NULL) fills a fresh file. Returns NULL and sets errno on failure. */
typedef void (*qgpu_init_cb)(void *base, void *arg);
QGPU_HIDDEN void *qgpu_map_state(const char *path, size_t size, uint64_t magic,
                                 size_t mutex_offset, qgpu_init_cb init_cb, void *arg);

/* Lock a robust process-shared mutex; returns 1 when the previous owner died holding it
 * (the caller must repair derived totals), 0 otherwise. */
QGPU_HIDDEN int qgpu_lock(pthread_mutex_t *m);
QGPU_HIDDEN void qgpu_unlock(pthread_mutex_t *m);

/* mkdir -p with mode 01777 for the leaf (a sticky shared directory). */
QGPU_HIDDEN int qgpu_mkdirs(const char *path);

/* Format / parse "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx". */
QGPU_HIDDEN void qgpu_uuid_format(const unsigned char bytes[16], char out[41]);
QGPU_HIDDEN int qgpu_uuid_parse(const char *text, unsigned char bytes[16]);

/* A process-local map key -> (size, tag), thread-safe (allocation bookkeeping). */
typedef struct {
    uint64_t key; /* 0 = empty, 1 = deleted */
    uint64_t size;
    int64_t tag;
} qgpu_entry_t;

typedef struct {
    pthread_mutex_t lock;
    qgpu_entry_t *slots;
    size_t cap, used, live;
} qgpu_table_t;

#define QGPU_TABLE_INIT {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0}

QGPU_HIDDEN int qgpu_table_put(qgpu_table_t *t, uint64_t key, uint64_t size, int64_t tag);
/* Removes key; returns 0 and fills size/tag when found, -1 otherwise. */
QGPU_HIDDEN int qgpu_table_take(qgpu_table_t *t, uint64_t key, uint64_t *size, int64_t *tag);
QGPU_HIDDEN int qgpu_table_get(qgpu_table_t *t, uint64_t key, uint64_t *size, int64_t *tag);

#endif
