/* Interposition entry points: how a program reaches the driver, and how the hook keeps every
 * path leading to its wrappers.
 *  - dlsym / dlvsym: wrapped driver names give the wrappers; asking for dlsym or dlvsym
 *    themselves (any version, any handle, RTLD_NEXT) gives these functions, never libc's.
 *  - dlopen with RTLD_DEEPBIND: a library opened that way would resolve its own libcuda
 *    first and call the driver directly; the flag is dropped, so its CUDA calls resolve to
 *    the hook like everyone's (docs/enforcement.md).
 *  - dlmopen into a new link-map namespace: LD_PRELOAD is never applied there, so code
 *    loaded into it (a plugin linked against libcuda, or libcuda itself) would call the
 *    driver around the hook. In a process with a slice it is refused (NULL, errno EPERM,
 *    one line on stderr); glibc refuses RTLD_GLOBAL in such namespaces, so the hook cannot
 *    be put first there instead. dlmopen into the base namespace is dlopen.
 *  - cuGetProcAddress / cuGetProcAddress_v2 (how CUDA >= 11.3 runtimes find the driver):
 *    resolved by NVIDIA's rules (the requested name, version and flags -> the exported
 *    symbol, from the toolkit's headers), so the wrapper handed out always has the ABI the
 *    caller asked for, whatever pointer the driver returned; a pointer equal to a wrapped
 *    function's is swapped too (identity as a second check). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <stdio.h>
#include <stddef.h>
#include <string.h>

#include "hook.h"

static int interesting(const char *name) {
    return name && ((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0);
}

QGPU_EXPORT void *dlsym(void *handle, const char *name);
QGPU_EXPORT void *dlvsym(void *handle, const char *name, const char *version);
QGPU_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags);

/* The resolvers themselves: whoever asks for them gets ours. */
static void *own_resolver(const char *name, int *refuse) {
    *refuse = 0;
    if (!name) return NULL;
    /* libc's and ld.so's private entry points to the loader are no way around us */
    if (strncmp(name, "__libc_dl", 9) == 0 || strncmp(name, "_dl_", 4) == 0) {
        *refuse = 1;
        return NULL;
    }
    if (strcmp(name, "dlsym") == 0) return (void *)dlsym;
    if (strcmp(name, "dlvsym") == 0) return (void *)dlvsym;
    if (strcmp(name, "dlopen") == 0) return (void *)dlopen;
    if (strcmp(name, "dlmopen") == 0) return (void *)dlmopen;
    return NULL;
}

/* dlsym(RTLD_NEXT, ...) means "after the caller", and glibc would take us for the caller:
 * walk the link map from the real caller instead, accepting only symbols defined in each
 * object itself. */
static void *next_after(const void *caller, const char *name, const char *version) {
    Dl_info info;
    struct link_map *self = NULL;
    if (!dladdr1(caller, &info, (void **)&self, RTLD_DL_LINKMAP) || !self)
        return version ? hook_real_dlvsym(RTLD_NEXT, name, version) : hook_real_dlsym(RTLD_NEXT, name);
    for (struct link_map *l = self->l_next; l; l = l->l_next) {
        if (!l->l_name || !l->l_name[0]) continue;
        /* a link_map of a startup object is not a usable handle: ask for a real one */
        void *h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue; /* the vDSO */
        void *p = version ? hook_real_dlvsym(h, name, version) : hook_real_dlsym(h, name);
        dlclose(h);
        if (!p) continue;
        struct link_map *owner = NULL;
        if (dladdr1(p, &info, (void **)&owner, RTLD_DL_LINKMAP) && owner == l) return p;
    }
    return NULL;
}

static void *wrap_result(void *p, const char *name) {
    if (p && interesting(name)) {
        void *w = hook_wrapper_for(name);
        if (w) return w;
    }
    return p;
}

QGPU_EXPORT void *dlsym(void *handle, const char *name) {
    int refuse;
    void *own = own_resolver(name, &refuse);
    if (own || refuse) return own;
    void *p = handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name, NULL)
                                  : hook_real_dlsym(handle, name);
    return wrap_result(p, name);
}

QGPU_EXPORT void *dlvsym(void *handle, const char *name, const char *version) {
    int refuse;
    void *own = own_resolver(name, &refuse);
    if (own || refuse) return own;
    void *p = handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name, version)
                                  : hook_real_dlvsym(handle, name, version);
    return wrap_result(p, name);
}

QGPU_EXPORT void *dlopen(const char *file, int flags) {
    return hook_libc_dlopen(file, flags & ~RTLD_DEEPBIND);
}

QGPU_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int flags) {
    if (lmid != LM_ID_BASE && hook_state() == HOOK_ACTIVE) {
        fprintf(stderr, "qgpu: dlmopen of %s into a new link-map namespace refused (slice %s): "
                        "code loaded there would call the CUDA driver around the slice's caps\n",
                file ? file : "(null)", g_lim.slice_id);
        errno = EPERM;
        return NULL;
    }
    return hook_libc_dlmopen(lmid, file, flags & ~RTLD_DEEPBIND);
}

/* The wrapper for (symbol, version, flags) by NVIDIA's table, else by the pointer. */
static void *wrap_pointer(const char *symbol, int version, cuuint64_t flags, void *p) {
    if (!p) return p;
    const char *exported = qgpu_procaddr_symbol(symbol, version, flags, hook_driver_version(), NULL);
    if (exported) {
        int i = hook_index_of(exported);
        void *w = hook_wrapper_for(exported);
        if (w) {
            /* the driver's entry point serves the wrapper if dlsym found none */
            if (i >= 0 && !hook_real_fn[i] && !hook_is_own(p)) hook_real_fn[i] = p;
            return w;
        }
    }
    for (int i = 0; i < HIDX_COUNT; i++) {
        if (hook_real_fn[i] != p) continue;
        void *w = hook_wrapper_for(hook_fn_names[i]);
        if (w) return w;
    }
    return p;
}

QGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    hook_load_cuda();
    if (!HAVE_REAL(cuGetProcAddress_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS && pfn) *pfn = wrap_pointer(symbol, cudaVersion, flags, *pfn);
    return r;
}

QGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags) {
    hook_load_cuda();
    if (!HAVE_REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = wrap_pointer(symbol, cudaVersion, flags, *pfn);
    return r;
}
