/* dlvsym (issue 17): asking libc for a versioned `dlsym` reaches libc's real dlsym, and from
 * it the raw driver, around the hook's dlsym. The tenant first takes 3 GiB (charged), then
 * tries 3 GiB more through every versioned path it can find: each must be refused. Reports
 * -1 for a path that found no symbol. */
#include "hostile.h"

typedef void *(*dlsym_t)(void *, const char *);
typedef void *(*dlvsym_t)(void *, const char *, const char *);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

static const char *const glibc[] = {"GLIBC_2.2.5", "GLIBC_2.3.4", "GLIBC_2.17", "GLIBC_2.34"};
#define NGLIBC (sizeof glibc / sizeof glibc[0])

static void try_alloc(const char *key, void *f) {
    if (!f) {
        say(key, -1);
        return;
    }
    CUdeviceptr p;
    say(key, ((alloc_t)f)(&p, 3 * GIB));
}

int main(void) {
    setup();
    grab(3 * GIB, 1);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    for (size_t i = 0; i < NGLIBC; i++) {
        /* libc's own dlsym, by version, from every handle */
        void *handles[] = {RTLD_NEXT, RTLD_DEFAULT, dlopen("libc.so.6", RTLD_NOW),
                           dlopen("libdl.so.2", RTLD_NOW)};
        for (size_t j = 0; j < sizeof handles / sizeof handles[0]; j++) {
            if (!handles[j] && j >= 2) continue;
            dlsym_t real = (dlsym_t)dlvsym(handles[j], "dlsym", glibc[i]);
            try_alloc("via_dlsym", real ? real(lib, "cuMemAlloc_v2") : NULL);
            dlvsym_t realv = (dlvsym_t)dlvsym(handles[j], "dlvsym", glibc[i]);
            try_alloc("via_dlvsym", realv ? realv(lib, "cuMemAlloc_v2", glibc[i]) : NULL);
        }
    }
    /* the driver's symbol itself, asked for with a version */
    try_alloc("direct", dlvsym(lib, "cuMemAlloc_v2", "libcuda.so.1"));
    try_alloc("direct", dlvsym(RTLD_DEFAULT, "cuMemAlloc_v2", "GLIBC_2.2.5"));
    hold();
    return 0;
}
