/* A statically linked program (issue 17): the dynamic loader never runs for it, so
 * LD_PRELOAD (and /etc/ld.so.preload) never load the hook. On a real GPU such a program
 * carries its own way to the device (ioctls on /dev/nvidia*); here the simulated driver is
 * linked into it. It takes 8 GiB in 1 GiB pieces. Only the node agent's watchdog can stop
 * it. */
#include "hostile.h"

int main(void) {
    setup();
    grab(GIB, 8);
    hold();
    return 0;
}
