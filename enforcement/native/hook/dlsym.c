/* Interposition entry points: dlsym (for runtimes that dlopen the driver and look entry
 * points up by name) and cuGetProcAddress / cuGetProcAddress_v2 (how CUDA >= 11.3 runtimes
 * resolve the driver). Both hand out our wrappers, including for cuGetProcAddress itself. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include "hook.h"

static int interesting(const char *name) {
    return name && ((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0);
}

/* dlsym(RTLD_NEXT, ...) means "after the caller", and glibc would take us for the caller:
 * walk the link map from the real caller instead, accepting only symbols defined in each
 * object itself. */
static void *next_after(const void *caller, const char *name) {
    Dl_info info;
    struct link_map *self = NULL;
    if (!dladdr1(caller, &info, (void **)&self, RTLD_DL_LINKMAP) || !self)
        return hook_real_dlsym(RTLD_NEXT, name);
    for (struct link_map *l = self->l_next; l; l = l->l_next) {
        if (!l->l_name || !l->l_name[0]) continue;
        /* a link_map of a startup object is not a usable handle: ask for a real one */
        void *h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue; /* the vDSO */
        void *p = hook_real_dlsym(h, name);
        dlclose(h);
        if (!p) continue;
        struct link_map *owner = NULL;
        if (dladdr1(p, &info, (void **)&owner, RTLD_DL_LINKMAP) && owner == l) return p;
    }
    return NULL;
}

QGPU_EXPORT void *dlsym(void *handle, const char *name) {
    void *p = handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name)
                                  : hook_real_dlsym(handle, name);
    if (p && interesting(name)) {
        void *w = hook_wrapper_for(name);
        if (w) return w;
    }
    return p;
}

/* A pointer the real cuGetProcAddress returned is swapped for our wrapper of the same
 * exported function: identity, not name matching, so the wrapper's ABI (_v2, _v3, _ptsz)
 * is always the one the caller asked for. */
static void *wrap_pointer(void *p) {
    if (!p) return p;
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
    if (r == CUDA_SUCCESS && pfn) *pfn = wrap_pointer(*pfn);
    return r;
}

QGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags) {
    hook_load_cuda();
    if (!HAVE_REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = wrap_pointer(*pfn);
    return r;
}
