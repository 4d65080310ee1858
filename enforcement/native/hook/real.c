/* Finding the real driver: libc's own dlsym/dlvsym (we export both), the real libcuda.so.1 /
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

/* libc's dlsym and dlvsym (libc_sym.c), never the wrappers this library exports. */
void *hook_real_dlsym(void *handle, const char *name) { return hook_libc_dlsym(handle, name); }

void *hook_real_dlvsym(void *handle, const char *name, const char *version) {
    return hook_libc_dlvsym(handle, name, version);
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

int hook_is_own(void *p) {
    for (size_t i = 0; i < NWRAPPED; i++)
        if (wrappers[i] == p) return 1;
    return 0;
}

static void resolve(void *lib, const char *prefix) {
    size_t n = strlen(prefix);
    for (int i = 0; i < HIDX_COUNT; i++) {
        if (strncmp(hook_fn_names[i], prefix, n) != 0) continue;
        void *p = hook_real_dlsym(lib, hook_fn_names[i]);
        hook_real_fn[i] = hook_is_own(p) ? NULL : p; /* never forward to ourselves */
    }
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int driver_version;

static void load_cuda(void) {
    hook_state(); /* a trusted limits file may name the real driver */
    const char *path = g_lim.real_libcuda[0] ? g_lim.real_libcuda : "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "qgpu: cannot load the CUDA driver %s: %s\n", path, dlerror());
        return;
    }
    resolve(lib, "cu");
    int v = 0;
    if (HAVE_REAL(cuDriverGetVersion) && REAL(cuDriverGetVersion)(&v) == CUDA_SUCCESS)
        driver_version = v;
}

static void load_nvml(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib) resolve(lib, "nvml");
}

void hook_load_cuda(void) { pthread_once(&cuda_once, load_cuda); }
void hook_load_nvml(void) { pthread_once(&nvml_once, load_nvml); }

int hook_driver_version(void) {
    hook_load_cuda();
    return driver_version ? driver_version : 99999; /* unknown: every form the table knows */
}
