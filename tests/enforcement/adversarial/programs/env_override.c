/* Raising the caps from the environment (issue 17, our addition): before cuInit the tenant
 * sets QGPU_* variables (a larger memory limit, another slice, no limits file) and then takes
 * 1 GiB pieces. A root-owned, read-only limits file at the default path must win. */
#include "hostile.h"

int main(void) {
    setenv("QGPU_MEMORY_LIMIT", "17179869184", 1);
    setenv("QGPU_SLICE_ID", "escape", 1);
    unsetenv("QGPU_LIMITS_FILE");
    setup();
    grab(GIB, 4);
    hold();
    return 0;
}
