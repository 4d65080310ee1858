/* Many threads racing the cap (issue 17, our addition): 16 threads allocate 256 MiB pieces
 * at once until refused, then free and allocate again for many rounds. Reports what the
 * threads held together at the peak ("peak"), and the slice's free memory once everything
 * is freed ("free"). */
#include <pthread.h>

#include "hostile.h"

#define THREADS 16
#define PIECE (256 * MIB)
#define MAX_PIECES 64

static CUcontext ctx;
static pthread_barrier_t barrier;
static unsigned long long held_now, peak;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void add(long long d) {
    pthread_mutex_lock(&lock);
    held_now += d;
    if (held_now > peak) peak = held_now;
    pthread_mutex_unlock(&lock);
}

static void *worker(void *arg) {
    (void)arg;
    cuCtxSetCurrent(ctx);
    CUdeviceptr mine[MAX_PIECES];
    for (int round = 0; round < 20; round++) {
        int n = 0;
        pthread_barrier_wait(&barrier);
        while (n < MAX_PIECES && cuMemAlloc(&mine[n], PIECE) == CUDA_SUCCESS) {
            add(PIECE);
            n++;
        }
        pthread_barrier_wait(&barrier);
        for (int i = 0; i < n; i++) {
            add(-(long long)PIECE);
            cuMemFree(mine[i]);
        }
    }
    return NULL;
}

int main(void) {
    ctx = setup();
    pthread_barrier_init(&barrier, NULL, THREADS);
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, NULL);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    size_t free_b, total;
    cuMemGetInfo(&free_b, &total);
    say("peak", (long long)peak);
    say("free", (long long)free_b);
    say("total", (long long)total);
    hold();
    return 0;
}
