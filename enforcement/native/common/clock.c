/* Monotonic clocks and absolute sleeps. */
#include <errno.h>
#include <time.h>

#include "qgpu_common.h"

int64_t qgpu_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t qgpu_now_coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void qgpu_sleep_until_ns(int64_t deadline_ns) {
    struct timespec ts;
    ts.tv_sec = deadline_ns / 1000000000LL;
    ts.tv_nsec = deadline_ns % 1000000000LL;
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

void qgpu_sleep_ns(int64_t ns) {
    if (ns > 0) qgpu_sleep_until_ns(qgpu_now_ns() + ns);
}
