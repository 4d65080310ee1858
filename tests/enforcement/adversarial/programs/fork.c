/* fork() after cuInit (issue 17, our addition): the child inherits the parent's view of its
 * allocations. If the child's frees (or the hook's bookkeeping copied into it) could give
 * back the parent's charge, the parent could allocate again on top of memory it still
 * holds. The parent takes 3 GiB, the child frees the parent's pointer and exits; then the
 * parent asks for 3 GiB more: that must be refused. */
#include <sys/wait.h>

#include "hostile.h"

int main(void) {
    setup();
    CUdeviceptr p;
    say("grab", cuMemAlloc(&p, 3 * GIB));
    pid_t child = fork();
    if (child == 0) {
        CUresult r = cuMemFree(p);
        printf("child_free %d\n", r);
        fflush(stdout);
        _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    say("child_exit", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    CUdeviceptr q;
    say("again", cuMemAlloc(&q, 3 * GIB));
    hold();
    return 0;
}
