/* A process that starts CUDA after a tenant has started an MPS control daemon (at the
 * default pipe directory, or one named in its environment): it initialises CUDA, takes its
 * primary context and reports its pid. Whether it became the daemon's client is read from
 * the daemon's side (the simulated driver's model of MPS), not from here. */
#include "hostile.h"

int main(void) {
    setup();
    say("pid", getpid());
    hold();
    return 0;
}
