/* Helpers shared by the interposer and the simulated driver: clocks, process identity
 * (pid + start time, so a reused pid is not mistaken for a live one), and shared state files
 * (an mmap'd file holding a process-shared robust mutex). Everything here is hidden. */
#ifndef QGPU_COMMON_H
#define QGPU_COMMON_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

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

/* stat/fstat as system calls (libc has them as functions only since glibc 2.33, and the
 * interposer must load on older ones). Return 0 or -1 with errno set. */
struct stat;
QGPU_HIDDEN int qgpu_stat(const char *path, struct stat *st);
QGPU_HIDDEN int qgpu_fstat(int fd, struct stat *st);

/* Map a shared state file of `size` bytes, creating and initialising it under flock when
 * new. `mutex_offset` is where a pthread_mutex_t lives inside; `magic` the first 8 bytes.
 * init_cb (may be NULL) fills a fresh file. Returns NULL and sets errno on failure. */
typedef void (*qgpu_init_cb)(void *base, void *arg);
QGPU_HIDDEN void *qgpu_map_state(const char *path, size_t size, uint64_t magic,
                                 size_t mutex_offset, qgpu_init_cb init_cb, void *arg);
/* The same, but a file this call creates gets exactly `mode` (umask-proof), and an existing
 * file's mode is never changed: the slice ledger and a slice's activity file (0600 when the
 * hook creates them; the node agent pre-creates them for the slice's user) are never
 * world-writable. */
QGPU_HIDDEN void *qgpu_map_state_mode(const char *path, size_t size, uint64_t magic,
                                      size_t mutex_offset, qgpu_init_cb init_cb, void *arg,
                                      mode_t mode);

/* Map an existing, initialised state file (NULL when missing, short or of another magic). */
QGPU_HIDDEN void *qgpu_map_existing(const char *path, size_t size, uint64_t magic);
QGPU_HIDDEN void qgpu_unmap_state(void *base, size_t size);

/* Lock a robust process-shared mutex; returns 1 when the previous owner died holding it
 * (the caller must repair derived totals), 0 otherwise. */
QGPU_HIDDEN int qgpu_lock(pthread_mutex_t *m);
QGPU_HIDDEN void qgpu_unlock(pthread_mutex_t *m);

/* mkdir -p with mode 01777 for the leaf (a sticky shared directory). */
QGPU_HIDDEN int qgpu_mkdirs(const char *path);
/* mkdir -p where every directory this call creates gets exactly `mode` (existing ones are
 * left alone): private per-slice directories. */
QGPU_HIDDEN int qgpu_mkdirs_mode(const char *path, mode_t mode);

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
/* The entry whose [key, key + size) holds addr (a linear scan: address look-ups that are
 * not a hot path); 0 and fills key/size when found, -1 otherwise. */
QGPU_HIDDEN int qgpu_table_find_range(qgpu_table_t *t, uint64_t addr, uint64_t *key,
                                      uint64_t *size);
/* Removes up to `max` entries for which pred() holds, copying them to out; returns how many. */
QGPU_HIDDEN size_t qgpu_table_take_if(qgpu_table_t *t,
                                      int (*pred)(uint64_t key, uint64_t size, int64_t tag),
                                      qgpu_entry_t *out, size_t max);

/* cuGetProcAddress by NVIDIA's rules (procaddr.c): the exported symbol that serves `name` for
 * a caller built for `cuda_version` with `flags`, on a driver of `driver_version`; NULL when
 * none does, with *status a CUdriverProcAddressQueryResult (SYMBOL_NOT_FOUND when the name is
 * unknown to this driver, VERSION_NOT_SUFFICIENT when only newer forms exist). */
QGPU_HIDDEN const char *qgpu_procaddr_symbol(const char *name, int cuda_version, uint64_t flags,
                                             int driver_version, int *status);
QGPU_HIDDEN int qgpu_procaddr_count(void);
/* row i: returns its name and fills the rest; NULL past the end */
QGPU_HIDDEN const char *qgpu_procaddr_row(int i, const char **symbol, int *version, int *ptds);

#endif
