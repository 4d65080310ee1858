/* Reading the driver's symbol table (our addition): a program can find the driver's entry
 * points without the loader's help, from libcuda's ELF dynamic symbol table in memory
 * (dl_iterate_phdr), exactly as the hook itself finds libc's dlsym. No user-space hook can
 * take that away; only the node agent's watchdog can stop the program. It takes 8 GiB in
 * 1 GiB pieces through the raw cuMemAlloc_v2. */
#include "raw_driver.h"

typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

int main(void) {
    setup();
    void *found = raw_driver_symbol("cuMemAlloc_v2");
    say("found", found != NULL);
    if (found)
        for (int i = 0; i < 8; i++) {
            CUdeviceptr p;
            say("grab", ((alloc_t)found)(&p, GIB));
        }
    hold();
    return 0;
}
