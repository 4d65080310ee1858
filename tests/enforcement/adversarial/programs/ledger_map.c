/* Tampering with the hook's own mapping of the slice ledger (issue 17, our addition): the
 * ledger is a shared file the hook maps; a process can replace that mapping with private
 * zeroed memory (argv[1] = "swap": the hook then sees an empty ledger) or simply unmap it
 * ("unmap"). The tenant first takes 3 GiB, tampers, then asks for 3 GiB, twice. */
#include <sys/mman.h>

#include "hostile.h"

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    setup();
    grab(3 * GIB, 1);
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[4096];
    int found = 0;
    while (fgets(line, sizeof line, maps)) {
        if (!strstr(line, "/slice-") || !strstr(line, ".ledger")) continue;
        unsigned long lo, hi;
        sscanf(line, "%lx-%lx", &lo, &hi);
        void *want = (void *)lo;
        if (!strcmp(argv[1], "unmap")) {
            found = munmap(want, hi - lo) == 0;
        } else {
            void *got = mmap(want, hi - lo, PROT_READ | PROT_WRITE,
                             MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            found = got == want;
        }
    }
    fclose(maps);
    say("tampered", found);
    grab(3 * GIB, 2);
    hold();
    return 0;
}
