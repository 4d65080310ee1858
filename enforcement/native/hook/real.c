/* Finding the real driver: the real dlsym (we override dlsym), the real libcuda.so.1 /
 * libnvidia-ml.so.1 and every function the hook wraps or calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "hook.h"

QGPU_HIDDEN void *hook_real_fn[HIDX_COUNT];
QGPU_HIDDEN const char *const hook_fn_names[HIDX_COUNT] = {
#define HOOK_NAME(name) #name,
    HOOK_WRAPPED(HOOK_NAME) HOOK_INTERNAL(HOOK_NAME)
#undef HOOK_NAME
};

static void *const wrappers[] = {
#define HOOK_PTR(name) (void *)name,
    HOOK_WRAPPED(HOOK_PTR)
#undef HOOK_PTR
};
#define NWRAPPED (sizeof wrappers / sizeof wrappers[0])

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;

static void find_dlsym(void) {
    real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

void *hook_real_dlsym(void *handle, const char *name) {
    pthread_once(&dlsym_once, find_dlsym);
    return real_dlsym ? real_dlsym(handle, name) : NULL;
}

int hook_index_of(const char *name) {
    for (int i = 0; i < HIDX_COUNT; i++)
        if (strcmp(hook_fn_names[i], name) == 0) return i;
    return -1;
}

void *hook_wrapper_for(const char *name) {
    int i = hook_index_of(name);
    return (i >= 0 && (size_t)i < NWRAPPED) ? wrappers[i] : NULL;
}

static int is_own(void *p) {
    for (size_t i = 0; i < NWRAPPED; i++)
        if (wrappers[i] == p) return 1;
    return 0;
}

static void resolve(void *lib, const char *prefix) {
    size_t n = strlen(prefix);
    for (int i = 0; i < HIDX_COUNT; i++) {
        if (strncmp(hook_fn_names[i], prefix, n) != 0) continue;
        void *p = hook_real_dlsym(lib, hook_fn_names[i]);
        hook_real_fn[i] = is_own(p) ? NULL : p; /* never forward to ourselves */
    }
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

static void load_cuda(void) {
    hook_state(); /* a trusted limits file may name the real driver */
    const char *path = g_lim.real_libcuda[0] ? g_lim.real_libcuda : "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "qgpu: cannot load the CUDA driver %s: %s\n", path, dlerror());
        return;
    }
    resolve(lib, "cu");
}

static void load_nvml(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib) resolve(lib, "nvml");
}

void hook_load_cuda(void) { pthread_once(&cuda_once, load_cuda); }
void hook_load_nvml(void) { pthread_once(&nvml_once, load_nvml); }
