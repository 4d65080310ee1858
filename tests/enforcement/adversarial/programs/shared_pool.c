/* Memory pools shared between processes (our addition). A pool created with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR can be exported to a file descriptor
 * (cuMemPoolExportToShareableHandle) and its allocations named to another process
 * (cuMemPoolExportPointer), which imports the pool (cuMemPoolImportFromShareableHandle) and
 * the pointers (cuMemPoolImportPointer). The pool's memory then stays while any of the
 * exporter's pool, a descriptor, an imported pool or an imported pointer exists, in any
 * process: an interposer that gives a pool's charge back when the exporter lets go of it, or
 * that charges nothing for an import, is credited for memory still held. Modes:
 *   send SOCK MIB exit|hold   a pool of its own with MIB allocated from it, exported; the
 *                             descriptor and the pointer's export data sent over the unix
 *                             socket SOCK (SCM_RIGHTS); then it exits, or holds and serves
 *   recv SOCK                 imports the pool and the pointer that arrive on SOCK
 * Then it serves commands on stdin, one per line, each answered with `ready`: `grab MIB`
 * (cuMemAlloc), `release` (cuMemFree of the imported pointer, cuMemPoolDestroy of the
 * imported pool), `drop` (cuMemPoolDestroy of the imported pool alone), `freeasync NS`
 * (a kernel of NS nanoseconds on a stream, then cuMemFreeAsync of the imported pointer on
 * it), `sync` (cuCtxSynchronize). EOF ends it. */
#include <sys/socket.h>

#include "hostile.h"

static CUmemoryPool pool, imported_pool;
static CUdeviceptr imported_ptr;

static void send_msg(int sock, const void *data, size_t n, int fd) {
    struct iovec iov = {(void *)data, n};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(ctl, 0, sizeof ctl);
        m.msg_control = ctl;
        m.msg_controllen = sizeof ctl;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    if (sendmsg(sock, &m, 0) < 0) say("sendmsg_errno", 1);
}

static int recv_msg(int sock, void *data, size_t n) {
    struct iovec iov = {data, n};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    int fd = -1;
    ssize_t got = recvmsg(sock, &m, 0);
    struct cmsghdr *c = got > 0 ? CMSG_FIRSTHDR(&m) : NULL;
    if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* as NVIDIA's streamOrderedAllocationIPC sample shares a pool */
static void send_pool(int sock, size_t size) {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUresult r = cuMemPoolCreate(&pool, &props);
    say("pool", r);
    CUdeviceptr p = 0;
    if (r == CUDA_SUCCESS) {
        r = cuMemAllocFromPoolAsync(&p, size, pool, NULL);
        if (r == CUDA_SUCCESS) r = cuStreamSynchronize(NULL);
        say("alloc", r);
    }
    CUmemPoolPtrExportData data;
    memset(&data, 0, sizeof data);
    int fd = -1;
    if (r == CUDA_SUCCESS) {
        r = cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        say("export", r);
    }
    if (r == CUDA_SUCCESS) say("exportptr", cuMemPoolExportPointer(&data, p));
    send_msg(sock, &data, sizeof data, r == CUDA_SUCCESS ? fd : -1);
    if (fd >= 0) close(fd);
}

static void recv_pool(int sock) {
    CUmemPoolPtrExportData data;
    memset(&data, 0, sizeof data);
    int fd = recv_msg(sock, &data, sizeof data);
    say("descriptor", fd >= 0);
    if (fd < 0) return;
    CUresult r = cuMemPoolImportFromShareableHandle(&imported_pool, (void *)(intptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    say("import", r);
    close(fd);
    if (r == CUDA_SUCCESS) say("importptr", cuMemPoolImportPointer(&imported_ptr, imported_pool, &data));
}

static void serve(void) {
    say("ready", 0);
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long mib = 0;
        if (sscanf(line, "grab %llu", &mib) == 1) {
            CUdeviceptr p;
            say("grab", cuMemAlloc(&p, mib * MIB));
        } else if (strncmp(line, "drop", 4) == 0) {
            say("destroy", cuMemPoolDestroy(imported_pool));
        } else if (sscanf(line, "freeasync %llu", &mib) == 1) {
            CUstream s;
            CUmodule mod;
            CUfunction busy;
            cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
            cuModuleLoadData(&mod, "qgpu-sim-module");
            cuModuleGetFunction(&busy, mod, "qgpu_sim_busy"); /* runs for its argument, in ns */
            unsigned long long ns = mib;
            void *args[] = {&ns};
            say("launch", cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
            say("free", cuMemFreeAsync(imported_ptr, s));
        } else if (strncmp(line, "sync", 4) == 0) {
            say("sync", cuCtxSynchronize());
        } else if (strncmp(line, "release", 7) == 0) {
            say("free", cuMemFree(imported_ptr));
            say("destroy", cuMemPoolDestroy(imported_pool));
        }
        say("ready", 0);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    setup();
    const char *mode = argv[1];
    if (!strcmp(mode, "send") && argc == 5) {
        send_pool(atoi(argv[2]), strtoull(argv[3], NULL, 10) * MIB);
        if (!strcmp(argv[4], "exit")) {
            say("ready", 0);
            return 0;
        }
    } else if (!strcmp(mode, "recv") && argc == 3) {
        recv_pool(atoi(argv[2]));
    } else {
        return 2;
    }
    serve();
    return 0;
}
