/* Memory that outlives the charge through shared handles (our addition). On NVIDIA's driver
 * a VMM allocation exported to a POSIX file descriptor (cuMemExportToShareableHandle) is
 * freed only when every handle, mapping and descriptor of it, in every process, is gone; and
 * memory opened through a legacy IPC handle (cuIpcOpenMemHandle) may be kept by the importer
 * after the exporter frees it or dies. An interposer that gives a handle's charge back when
 * its own process lets go of it is then credited for memory that is still held. Modes:
 *   loop N MIB            one process: N times cuMemCreate, export, import, release the
 *                         original (the imported handle keeps the memory)
 *   send SOCK N MIB keep|release
 *                         N times cuMemCreate + export, the descriptor sent over the unix
 *                         socket SOCK (SCM_RIGHTS), then the original released or kept
 *   recv SOCK MIB         imports and maps every descriptor that arrives on SOCK
 *   ipc_send SOCK MIB     cuMemAlloc + cuIpcGetMemHandle, the handle sent over SOCK
 *   ipc_recv SOCK         cuIpcOpenMemHandle of the handle that arrives on SOCK
 * Then it serves commands on stdin, one per line, answering each with `ready`: `grab MIB`
 * (cuMemAlloc), `free` (cuMemFree of what it allocated first), `close` (cuIpcCloseMemHandle
 * of what it opened), `release` (cuMemRelease + unmap of what it imported). EOF ends it. */
#include <sys/socket.h>

#include "hostile.h"

#define MAXH 16

static CUdeviceptr first_alloc, opened;
static CUmemGenericAllocationHandle imported[MAXH];
static CUdeviceptr imported_va[MAXH];
static size_t imported_size[MAXH];
static int nimported;

static CUmemAllocationProp exportable(void) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}

static void send_bytes(int sock, const void *data, size_t n, int fd) {
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

/* one message: its bytes (up to n) and the descriptor it carried (-1: none); 0 at EOF */
static ssize_t recv_bytes(int sock, void *data, size_t n, int *fd) {
    struct iovec iov = {data, n};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    ssize_t got = recvmsg(sock, &m, 0);
    *fd = -1;
    struct cmsghdr *c = got > 0 ? CMSG_FIRSTHDR(&m) : NULL;
    if (c && c->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(c), sizeof *fd);
    return got;
}

/* import a descriptor, then map it as NVIDIA's memMapIPCDrv sample does (the size travels
 * out of band in real programs: here it is an argument) */
static void import_fd(int fd, size_t size) {
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    say("import", r);
    if (r != CUDA_SUCCESS || nimported == MAXH) return;
    CUmemAllocationProp p;
    say("props", cuMemGetAllocationPropertiesFromHandle(&p, h));
    CUdeviceptr va = 0;
    r = cuMemAddressReserve(&va, size, 0, 0, 0);
    if (r == CUDA_SUCCESS) r = cuMemMap(va, size, 0, h, 0);
    say("map", r);
    imported[nimported] = h;
    imported_va[nimported] = va;
    imported_size[nimported++] = r == CUDA_SUCCESS ? size : 0;
}

static int do_export(CUmemGenericAllocationHandle h, int *fd) {
    CUresult r = cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    say("export", r);
    return r == CUDA_SUCCESS;
}

static void loop(int n, size_t size) {
    CUmemAllocationProp p = exportable();
    for (int i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h;
        CUresult r = cuMemCreate(&h, size, &p, 0);
        say("create", r);
        if (r != CUDA_SUCCESS) continue;
        int fd;
        if (do_export(h, &fd)) {
            import_fd(fd, size);
            close(fd);
        }
        say("release", cuMemRelease(h));
    }
}

static void send_handles(int sock, int n, size_t size, int keep) {
    CUmemAllocationProp p = exportable();
    for (int i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h;
        CUresult r = cuMemCreate(&h, size, &p, 0);
        say("create", r);
        if (r != CUDA_SUCCESS) continue;
        int fd;
        if (do_export(h, &fd)) {
            send_bytes(sock, "F", 1, fd);
            close(fd);
            say("sent", 1);
        }
        if (!keep) say("release", cuMemRelease(h));
    }
    send_bytes(sock, "E", 1, -1);
}

static void recv_handles(int sock, size_t size) {
    for (;;) {
        char c = 0;
        int fd;
        if (recv_bytes(sock, &c, 1, &fd) <= 0 || c == 'E') break;
        if (fd >= 0) {
            import_fd(fd, size);
            close(fd);
        }
    }
}

static void ipc_send(int sock, size_t size) {
    CUresult r = cuMemAlloc(&first_alloc, size);
    say("alloc", r);
    CUipcMemHandle ipc;
    memset(&ipc, 0, sizeof ipc);
    if (r == CUDA_SUCCESS) say("gethandle", cuIpcGetMemHandle(&ipc, first_alloc));
    send_bytes(sock, &ipc, sizeof ipc, -1);
}

static void ipc_recv(int sock) {
    CUipcMemHandle ipc;
    int fd;
    if (recv_bytes(sock, &ipc, sizeof ipc, &fd) != (ssize_t)sizeof ipc) {
        say("handle_missing", 1);
        return;
    }
    say("open", cuIpcOpenMemHandle(&opened, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
}

static void serve(void) {
    say("ready", 0);
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long mib = 0;
        if (sscanf(line, "grab %llu", &mib) == 1) {
            CUdeviceptr p;
            CUresult r = cuMemAlloc(&p, mib * MIB);
            if (r == CUDA_SUCCESS && !first_alloc) first_alloc = p;
            say("grab", r);
        } else if (strncmp(line, "free", 4) == 0) {
            say("free", cuMemFree(first_alloc));
            first_alloc = 0;
        } else if (strncmp(line, "close", 5) == 0) {
            say("close", cuIpcCloseMemHandle(opened));
        } else if (strncmp(line, "release", 7) == 0) {
            for (int i = 0; i < nimported; i++) {
                if (imported_size[i]) cuMemUnmap(imported_va[i], imported_size[i]);
                say("release", cuMemRelease(imported[i]));
            }
            nimported = 0;
        }
        say("ready", 0);
    }
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    setup();
    const char *mode = argv[1];
    if (!strcmp(mode, "loop") && argc == 4) {
        loop(atoi(argv[2]), strtoull(argv[3], NULL, 10) * MIB);
    } else if (!strcmp(mode, "send") && argc == 6) {
        send_handles(atoi(argv[2]), atoi(argv[3]), strtoull(argv[4], NULL, 10) * MIB,
                     !strcmp(argv[5], "keep"));
    } else if (!strcmp(mode, "recv") && argc == 4) {
        recv_handles(atoi(argv[2]), strtoull(argv[3], NULL, 10) * MIB);
    } else if (!strcmp(mode, "ipc_send") && argc == 4) {
        ipc_send(atoi(argv[2]), strtoull(argv[3], NULL, 10) * MIB);
    } else if (!strcmp(mode, "ipc_recv") && argc == 3) {
        ipc_recv(atoi(argv[2]));
    } else {
        return 2;
    }
    serve();
    return 0;
}
