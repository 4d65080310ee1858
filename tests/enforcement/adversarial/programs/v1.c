/* Unversioned v1 names and cuGetProcAddress below 3020 (issue 17). Real drivers still
 * export the CUDA 2.x entry points (32-bit sizes and pointers) and cuGetProcAddress returns
 * them to a caller built for cudaVersion < 3020. argv[1]:
 *   alloc   cuMemAlloc v1, 1 GiB: by name (dlsym), through cuGetProcAddress and _v2 at 2000
 *   pitch   cuMemAllocPitch v1 (1 GiB each), the same three ways
 *   array   cuArrayCreate v1 / cuArray3DCreate v1 (1 GiB each)
 *   then 1 GiB with cuMemAlloc_v2, which must be refused (the v1 memory was charged)
 *   info    the slice's view: cuMemGetInfo v1, cuDeviceTotalMem v1
 *   resolve which library serves each (name, version, flags): "hook 1" when the hook's
 * Everything is on top of a 512 MiB context under a 4 GiB cap. */
#include "hostile.h"

#include <cudaTypedefs.h>

typedef unsigned int dptr32;
typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} desc_v1;
typedef struct {
    unsigned int Width, Height, Depth;
    CUarray_format Format;
    unsigned int NumChannels, Flags;
} desc3d_v1;
typedef CUresult (*alloc32_t)(dptr32 *, unsigned int);
typedef CUresult (*pitch32_t)(dptr32 *, unsigned int *, unsigned int, unsigned int, unsigned int);
typedef CUresult (*info32_t)(unsigned int *, unsigned int *);
typedef CUresult (*total32_t)(unsigned int *, CUdevice);
typedef CUresult (*arr_t)(CUarray *, const desc_v1 *);
typedef CUresult (*arr3_t)(CUarray *, const desc3d_v1 *);
typedef CUresult (*gpa1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void *lib;
static gpa1_t gpa1;
static gpa2_t gpa2;

/* v1 entry point of `name` through cuGetProcAddress (the v1 export of it, alternately) */
static void *at2000(const char *name, int use_v1) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    if (use_v1) gpa1(name, &p, 2000, 0);
    else gpa2(name, &p, 2000, 0, &st);
    return p;
}

static const char *owner(void *p) {
    Dl_info i;
    return p && dladdr(p, &i) && i.dli_fname ? i.dli_fname : "none";
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    setup();
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    gpa1 = (gpa1_t)dlsym(lib, "cuGetProcAddress");
    gpa2 = (gpa2_t)dlsym(lib, "cuGetProcAddress_v2");
    const char *mode = argv[1];
    int take_more = 1;
    if (!strcmp(mode, "alloc")) {
        void *f[] = {dlsym(lib, "cuMemAlloc"), at2000("cuMemAlloc", 1), at2000("cuMemAlloc", 0)};
        for (int i = 0; i < 3; i++) {
            dptr32 p;
            say("v1", f[i] ? ((alloc32_t)f[i])(&p, (unsigned)GIB) : -1);
        }
    } else if (!strcmp(mode, "pitch")) {
        void *f[] = {dlsym(lib, "cuMemAllocPitch"), at2000("cuMemAllocPitch", 0),
                     at2000("cuMemAllocPitch", 1)};
        for (int i = 0; i < 3; i++) {
            dptr32 p;
            unsigned pitch;
            say("v1", f[i] ? ((pitch32_t)f[i])(&p, &pitch, 1 << 15, 1 << 15, 4) : -1);
        }
    } else if (!strcmp(mode, "array")) {
        desc_v1 d = {16384, 16384, CU_AD_FORMAT_FLOAT, 1}; /* 1 GiB */
        desc3d_v1 d3 = {4096, 4096, 16, CU_AD_FORMAT_FLOAT, 1, 0}; /* 1 GiB */
        void *f[] = {dlsym(lib, "cuArrayCreate"), at2000("cuArrayCreate", 0),
                     at2000("cuArray3DCreate", 1)};
        for (int i = 0; i < 3; i++) {
            CUarray a;
            if (!f[i]) say("v1", -1);
            else if (i < 2) say("v1", ((arr_t)f[i])(&a, &d));
            else say("v1", ((arr3_t)f[i])(&a, &d3));
        }
    } else if (!strcmp(mode, "info")) {
        take_more = 0;
        unsigned free32 = 0, total32 = 0, dev32 = 0;
        ((info32_t)at2000("cuMemGetInfo", 0))(&free32, &total32);
        say("free", free32);
        say("total", total32);
        ((total32_t)dlsym(lib, "cuDeviceTotalMem"))(&dev32, 0);
        say("devtotal", dev32);
    } else if (!strcmp(mode, "resolve")) {
        take_more = 0;
        struct { const char *name; int version; cuuint64_t flags; } q[] = {
            {"cuMemAlloc", 2000, 0}, {"cuMemAlloc", 3020, 0}, {"cuMemAlloc", 13000, 0},
            {"cuMemGetInfo", 2000, 0}, {"cuCtxCreate", 3020, 0}, {"cuCtxCreate", 11040, 0},
            {"cuCtxCreate", 12050, 0}, {"cuMemAllocAsync", 11020, 2},
            {"cuGraphLaunch", 12000, 2}, {"cuLaunchKernel", 12000, 2},
            {"cuLaunchGrid", 2000, 0}, {"cuGetProcAddress", 11030, 0},
            {"cuGetProcAddress", 12000, 0}, {"cuMemCreate", 10020, 0},
            {"cuGreenCtxCreate", 12040, 0}, {"cuMipmappedArrayCreate", 5000, 0},
        };
        for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
            void *p = NULL;
            CUdriverProcAddressQueryResult st;
            gpa2(q[i].name, &p, q[i].version, q[i].flags, &st);
            say("hook", p && strstr(owner(p), "qgpu_hook") != NULL);
        }
    }
    if (take_more) grab(GIB, 1); /* 3 GiB through v1 + the context: no room for 1 GiB more */
    hold();
    return 0;
}
