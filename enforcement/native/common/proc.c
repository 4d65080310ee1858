/* Process identity from /proc: a pid plus its start time survives pid reuse. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qgpu_common.h"

uint64_t qgpu_proc_start_time(int pid) {
    char path[64], buf[1024];
    if (pid <= 0) return 0;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    char state = *p;
    if (state == 'Z' || state == 'X' || state == 'x') return 0;
    /* p is at field 3 (state); field 22 is starttime: skip 19 more fields. */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

int qgpu_proc_alive(int pid, uint64_t start_time) {
    uint64_t now = qgpu_proc_start_time(pid);
    return now != 0 && now == start_time;
}
