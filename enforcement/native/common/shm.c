/* Shared state files: an mmap'd file with a robust, process-shared mutex inside. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qgpu_common.h"

int qgpu_stat(const char *path, struct stat *st) {
#if defined(SYS_newfstatat)
    return (int)syscall(SYS_newfstatat, AT_FDCWD, path, st, 0);
#else
    return (int)syscall(SYS_fstatat, AT_FDCWD, path, st, 0);
#endif
}

int qgpu_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }

static int mkdirs(const char *path, mode_t inner, mode_t leaf) {
    char tmp[PATH_MAX];
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(tmp, path, len + 1);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, inner) == 0)
            chmod(tmp, inner);
        else if (errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(tmp, leaf) == 0) {
        chmod(tmp, leaf); /* umask-proof */
    } else if (errno != EEXIST) {
        return -1;
    }
    return 0;
}

/* every user of the GPU shares the leaf directory (the simulator's device state) */
int qgpu_mkdirs(const char *path) { return mkdirs(path, 0755, 01777); }

int qgpu_mkdirs_mode(const char *path, mode_t mode) { return mkdirs(path, mode, mode); }

static void init_mutex(pthread_mutex_t *m) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(m, &attr);
    pthread_mutexattr_destroy(&attr);
}

/* widen: the shared simulator state (0666 for every user of the simulated GPU); otherwise
 * a private file: never through a symlink, never widened, created with exactly `mode`. */
static int open_state(const char *path, mode_t mode, int widen) {
    int flags = O_RDWR | O_CLOEXEC | (widen ? 0 : O_NOFOLLOW);
    int fd = open(path, flags);
    if (fd >= 0 || errno != ENOENT) {
        if (fd >= 0 && widen) fchmod(fd, mode); /* harmless when not the owner */
        return fd;
    }
    fd = open(path, flags | O_CREAT | O_EXCL, mode);
    if (fd >= 0) {
        fchmod(fd, mode); /* ours and new: exactly `mode` whatever the umask */
        return fd;
    }
    return errno == EEXIST ? open(path, flags) : -1;
}

static void *map_state(const char *path, size_t size, uint64_t magic, size_t mutex_offset,
                       qgpu_init_cb init_cb, void *arg, mode_t mode, int widen) {
    int fd = open_state(path, mode, widen);
    if (fd < 0) return NULL;
    if (flock(fd, LOCK_EX) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    struct stat st;
    if (qgpu_fstat(fd, &st) != 0 || ((size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0)) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    uint64_t *head = (uint64_t *)base;
    if (*head != magic) {
        memset(base, 0, size);
        init_mutex((pthread_mutex_t *)((char *)base + mutex_offset));
        if (init_cb) init_cb(base, arg);
        __atomic_store_n(head, magic, __ATOMIC_RELEASE);
    }
    flock(fd, LOCK_UN);
    close(fd);
    return base;
}

void *qgpu_map_state(const char *path, size_t size, uint64_t magic, size_t mutex_offset,
                     qgpu_init_cb init_cb, void *arg) {
    return map_state(path, size, magic, mutex_offset, init_cb, arg, 0666, 1);
}

void *qgpu_map_state_mode(const char *path, size_t size, uint64_t magic, size_t mutex_offset,
                          qgpu_init_cb init_cb, void *arg, mode_t mode) {
    return map_state(path, size, magic, mutex_offset, init_cb, arg, mode, 0);
}

void *qgpu_map_existing(const char *path, size_t size, uint64_t magic) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return NULL;
    struct stat st;
    if (qgpu_fstat(fd, &st) != 0 || (size_t)st.st_size < size) {
        close(fd);
        return NULL;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return NULL;
    if (__atomic_load_n((uint64_t *)base, __ATOMIC_ACQUIRE) != magic) {
        munmap(base, size);
        return NULL;
    }
    return base;
}

void qgpu_unmap_state(void *base, size_t size) {
    if (base) munmap(base, size);
}

int qgpu_lock(pthread_mutex_t *m) {
    int r = pthread_mutex_lock(m);
    if (r == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return 1;
    }
    return 0;
}

void qgpu_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

void qgpu_uuid_format(const unsigned char b[16], char out[41]) {
    snprintf(out, 41,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int qgpu_uuid_parse(const char *text, unsigned char bytes[16]) {
    if (strncmp(text, "GPU-", 4) == 0) text += 4;
    int n = 0;
    while (*text && n < 32) {
        if (*text == '-') {
            text++;
            continue;
        }
        int v = hexval(*text++);
        if (v < 0) return -1;
        if (n % 2 == 0)
            bytes[n / 2] = (unsigned char)(v << 4);
        else
            bytes[n / 2] |= (unsigned char)v;
        n++;
    }
    return (n == 32 && *text == 0) ? 0 : -1;
}
