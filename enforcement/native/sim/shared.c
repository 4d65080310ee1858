/* Shared allocations of a simulated GPU: memory that several processes can keep alive, kept
 * in a table of the GPU's state file (sim.h) so that every process sees the same lifetime.
 *
 * Lifetimes, as NVIDIA's driver documents them (cuda.h):
 *  - a VMM allocation exported to a POSIX file descriptor (cuMemExportToShareableHandle) is
 *    freed "once all shareable handles are closed and the allocation is released": while any
 *    handle (the creator's, or one cuMemImportFromShareableHandle gave any process), mapping
 *    or descriptor of it exists, in any process, the memory stays, whoever created it and
 *    whether that process is still alive;
 *  - memory opened through a legacy IPC handle (cuIpcOpenMemHandle): freeing it in the
 *    exporter before every importer closed it is undefined behaviour; the simulator does what
 *    is worst for a memory cap and a driver may do: it keeps the memory until the last
 *    importer closes it (or dies), and so when the exporter dies;
 *  - a memory pool exported to a POSIX file descriptor (cuMemPoolExportToShareableHandle):
 *    its memory (what the pool reserves, which follows the exporter's pool while it has it)
 *    stays while the exporter's pool, a descriptor, a pool imported from one
 *    (cuMemPoolImportFromShareableHandle) or a pointer imported into one
 *    (cuMemPoolImportPointer) exists, in any process (pool.c).
 *
 * Descriptors: the first export of an entry creates a file named after it next to the GPU's
 * state file (`<state>.shared/<id>-<token>`); each export opens it anew and holds an
 * open-file-description read lock on it. A descriptor passed to another process (SCM_RIGHTS),
 * duplicated or inherited shares its description and so the lock, which goes away only when
 * the last descriptor of that description is closed, in whichever process. Whether any is
 * open is asked with F_OFD_GETLK for a write lock from a fresh description.
 *
 * The per-process view (sim_proc_t.mem_used, what NVML and the tests' ground truth read):
 * an entry is charged to exactly one live process that holds a reference to it (its creator
 * first); when that process lets go of its last reference or dies, the charge moves to
 * another process holding one; when only descriptors keep the memory, it is charged to no
 * process (the header's `unowned`, still in the GPU's used memory) until a process imports
 * it (and takes the charge) or the last descriptor is closed (freed at the next look at the
 * GPU's memory, as a dead process's is). The GPU-wide `mem_used` always counts each shared
 * allocation once while it exists. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim.h"

#define FILE_MAGIC 0x3152485355504751ULL /* "QGPUSHR1" */

typedef struct {
    uint64_t magic;
    uint32_t gidx, idx;
    uint64_t id, token;
} file_head_t;

static void entry_path(const sim_gpu_state_t *st, const sim_shared_t *e, char *out, size_t n) {
    snprintf(out, n, "%s.shared/%llx-%016llx", st->state_path, (unsigned long long)e->id,
             (unsigned long long)e->token);
}

/* 1 while some descriptor of the entry is open (or that cannot be told: keep it) */
static int descriptors_open(const sim_gpu_state_t *st, const sim_shared_t *e) {
    if (!e->has_file) return 0;
    char path[4200];
    entry_path(st, e, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int r = fcntl(fd, F_OFD_GETLK, &fl);
    close(fd);
    return r != 0 || fl.l_type != F_UNLCK;
}

static int total_refs(const sim_shared_t *e) {
    int n = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) n += e->refs[i] > 0 ? e->refs[i] : 0;
    return n;
}

static void entry_free(sim_gpu_state_t *st, sim_shared_t *e) {
    st->mem_used = st->mem_used >= e->size ? st->mem_used - e->size : 0;
    if (e->has_file) {
        char path[4200];
        entry_path(st, e, path, sizeof path);
        unlink(path);
    }
    memset(e, 0, sizeof *e);
}

/* The entry's charge is on no slot and not unowned: give it to a holder, to nobody while
 * descriptors keep it, or free it. */
static void place(sim_gpu_state_t *st, sim_shared_t *e) {
    for (int j = 0; j < SIM_MAX_PROCS; j++) {
        if (e->refs[j] > 0 && st->procs[j].pid) {
            st->procs[j].mem_used += e->size;
            e->charged = j;
            return;
        }
    }
    if (descriptors_open(st, e)) {
        st->unowned += e->size;
        e->charged = SIM_CHARGED_NONE;
        return;
    }
    entry_free(st, e);
}

void sim_shared_forget_slot(sim_gpu_state_t *st, int slot) {
    sim_proc_t *p = &st->procs[slot];
    for (int i = 0; i < SIM_MAX_SHARED; i++) {
        sim_shared_t *e = &st->shared[i];
        if (!e->id) continue;
        e->refs[slot] = 0;
        if (e->charged == slot) {
            p->mem_used = p->mem_used >= e->size ? p->mem_used - e->size : 0;
            e->charged = SIM_CHARGED_PENDING;
        }
    }
}

void sim_shared_settle(sim_gpu_state_t *st) {
    for (int i = 0; i < SIM_MAX_SHARED; i++) {
        sim_shared_t *e = &st->shared[i];
        if (!e->id) continue;
        if (e->charged == SIM_CHARGED_PENDING) {
            place(st, e);
        } else if (e->charged == SIM_CHARGED_NONE && !total_refs(e) && !descriptors_open(st, e)) {
            st->unowned = st->unowned >= e->size ? st->unowned - e->size : 0;
            entry_free(st, e);
        }
    }
}

static uint64_t random_token(void) {
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t)
        t = (uint64_t)qgpu_now_ns() * 0x9e3779b97f4a7c15ULL ^ (uint64_t)getpid();
    return t ? t : 1;
}

int sim_shared_publish(sim_gpu_state_t *st, uint64_t size, uint32_t kind, uint32_t handle_types,
                       int refs, uint64_t *id) {
    sim_proc_t *p = sim_state_proc_slot(st, 1);
    if (!p) return -1;
    for (int i = 0; i < SIM_MAX_SHARED; i++) {
        sim_shared_t *e = &st->shared[i];
        if (e->id) continue;
        memset(e, 0, sizeof *e);
        e->id = ++st->share_next_id;
        e->token = random_token();
        e->size = size;
        e->kind = kind;
        e->handle_types = handle_types;
        e->charged = (int32_t)(p - st->procs); /* it already is: it made the allocation */
        e->refs[e->charged] = refs;
        *id = e->id;
        return i;
    }
    return -1;
}

int sim_shared_alive(const sim_gpu_state_t *st, int idx, uint64_t id) {
    return idx >= 0 && idx < SIM_MAX_SHARED && id && st->shared[idx].id == id;
}

void sim_shared_ref(sim_gpu_state_t *st, int idx, int delta) {
    sim_shared_t *e = &st->shared[idx];
    sim_proc_t *p = sim_state_proc_slot(st, delta > 0);
    if (!e->id || !p) return;
    int k = (int)(p - st->procs);
    e->refs[k] = e->refs[k] + delta > 0 ? e->refs[k] + delta : 0;
    if (delta > 0 && e->charged == SIM_CHARGED_NONE) { /* memory nobody was charged for */
        st->unowned = st->unowned >= e->size ? st->unowned - e->size : 0;
        p->mem_used += e->size;
        e->charged = k;
    } else if (e->refs[k] == 0 && e->charged == k) { /* the holder let go: pass it on */
        p->mem_used = p->mem_used >= e->size ? p->mem_used - e->size : 0;
        e->charged = SIM_CHARGED_PENDING;
        place(st, e);
    }
}

int sim_shared_held_elsewhere(sim_gpu_state_t *st, int idx) {
    const sim_proc_t *me = sim_state_proc_slot(st, 0);
    for (int j = 0; j < SIM_MAX_PROCS; j++)
        if (st->shared[idx].refs[j] > 0 && &st->procs[j] != me && st->procs[j].pid) return 1;
    return 0;
}

CUresult sim_shared_resize(sim_gpu_state_t *st, int idx, int64_t delta) {
    sim_shared_t *e = &st->shared[idx];
    uint64_t n = delta < 0 ? (uint64_t)-delta : (uint64_t)delta;
    uint64_t *holder = e->charged >= 0 ? &st->procs[e->charged].mem_used
                       : e->charged == SIM_CHARGED_NONE ? &st->unowned
                                                        : NULL;
    if (delta > 0) {
        if (!sim_state_make_room(st, n)) return CUDA_ERROR_OUT_OF_MEMORY;
        st->mem_used += n;
        e->size += n;
        if (holder) *holder += n;
        return CUDA_SUCCESS;
    }
    if (n > e->size) n = e->size;
    st->mem_used = st->mem_used >= n ? st->mem_used - n : 0;
    e->size -= n;
    if (holder) *holder = *holder >= n ? *holder - n : 0;
    return CUDA_SUCCESS;
}

/* locked: the entry's file, created on its first export */
static int ensure_file(sim_gpu_state_t *st, sim_shared_t *e, int gidx, int idx) {
    if (e->has_file) return 0;
    char dir[4200], path[4200];
    snprintf(dir, sizeof dir, "%s.shared", st->state_path);
    if (qgpu_mkdirs(dir) != 0) return -1;
    entry_path(st, e, path, sizeof path);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    file_head_t h = {FILE_MAGIC, (uint32_t)gidx, (uint32_t)idx, e->id, e->token};
    int ok = pwrite(fd, &h, sizeof h, 0) == (ssize_t)sizeof h;
    close(fd);
    if (!ok) {
        unlink(path);
        return -1;
    }
    e->has_file = 1;
    return 0;
}

int sim_shared_open_fd(sim_gpu_state_t *st, int gidx, int idx, uint64_t id) {
    sim_state_lock(st);
    int fd = -1;
    if (sim_shared_alive(st, idx, id) && ensure_file(st, &st->shared[idx], gidx, idx) == 0) {
        char path[4200];
        entry_path(st, &st->shared[idx], path, sizeof path);
        fd = open(path, O_RDWR | O_CLOEXEC);
        struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        if (fd >= 0 && fcntl(fd, F_OFD_SETLK, &fl) != 0) {
            close(fd);
            fd = -1;
        }
    }
    sim_state_unlock(st);
    return fd;
}

int sim_shared_read_fd(int fd, int ngpus, int *gidx, int *idx, uint64_t *id, uint64_t *token) {
    struct stat sb;
    file_head_t h;
    if (fd < 0 || qgpu_fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return -1;
    if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || h.magic != FILE_MAGIC) return -1;
    if ((int)h.gidx < 0 || (int)h.gidx >= ngpus || h.idx >= SIM_MAX_SHARED) return -1;
    *gidx = (int)h.gidx;
    *idx = (int)h.idx;
    *id = h.id;
    *token = h.token;
    return 0;
}

int sim_shared_fd_is(const sim_gpu_state_t *st, int idx, uint64_t id, uint64_t token, int fd,
                     uint32_t kind) {
    if (!sim_shared_alive(st, idx, id)) return 0;
    const sim_shared_t *e = &st->shared[idx];
    if (e->token != token || !e->has_file || e->kind != kind) return 0;
    char path[4200];
    entry_path(st, e, path, sizeof path);
    struct stat a, b;
    return qgpu_stat(path, &a) == 0 && qgpu_fstat(fd, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}
