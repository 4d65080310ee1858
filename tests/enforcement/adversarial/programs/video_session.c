/* A process that encodes (or captures the frame buffer) on its GPU: it opens `argv[1]`
 * encoder sessions at `argv[2]` frames per second and `argv[3]` capture sessions, through
 * the simulated driver's stand-in for the Video Codec and Capture SDKs, reports its pid and
 * keeps them open until stdin closes. */
#include "hostile.h"

CUresult qgpuSimVideoSessionOpen(CUdevice dev, unsigned int kind, unsigned int fps,
                                 unsigned int latency_us);

int main(int argc, char **argv) {
    int enc = argc > 1 ? atoi(argv[1]) : 1, fbc = argc > 3 ? atoi(argv[3]) : 0;
    unsigned fps = argc > 2 ? (unsigned)atoi(argv[2]) : 60;
    setup();
    for (int i = 0; i < enc; i++) say("encoder", qgpuSimVideoSessionOpen(0, 0, fps, 1000 * fps));
    for (int i = 0; i < fbc; i++) say("fbc", qgpuSimVideoSessionOpen(0, 1, 30, 2000));
    say("pid", getpid());
    hold();
    return 0;
}
