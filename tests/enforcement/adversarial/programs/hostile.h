/* Shared by the hostile C programs of the adversarial corpus: report lines ("key value"),
 * the first context, and holding what was taken until the test closes stdin. Programs are
 * written as a tenant would write them: against the CUDA toolkit's cuda.h. */
#ifndef QGPU_HOSTILE_H
#define QGPU_HOSTILE_H
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GIB (1ULL << 30)
#define MIB (1ULL << 20)

__attribute__((unused)) static void say(const char *key, long long value) {
    printf("%s %lld\n", key, value);
    fflush(stdout);
}

/* cuInit and the primary context of device 0, made current */
__attribute__((unused)) static CUcontext setup(void) {
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) {
        say("init", r);
        exit(2);
    }
    CUdevice dev;
    CUcontext ctx;
    cuDeviceGet(&dev, 0);
    r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r != CUDA_SUCCESS) {
        say("ctx", r);
        exit(2);
    }
    cuCtxSetCurrent(ctx);
    return ctx;
}

/* Keep everything until the test closes stdin. */
__attribute__((unused)) static void hold(void) {
    say("ready", 0);
    char buf[256];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
}

/* Allocate `chunk` bytes with cuMemAlloc_v2 until refused (at most `max`): the bytes taken. */
__attribute__((unused)) static unsigned long long grab(unsigned long long chunk, int max) {
    unsigned long long got = 0;
    for (int i = 0; i < max; i++) {
        CUdeviceptr p;
        CUresult r = cuMemAlloc(&p, chunk);
        say("grab", r);
        if (r != CUDA_SUCCESS) break;
        got += chunk;
    }
    return got;
}
/* The raw driver's entry point `name`, read from libcuda's ELF dynamic symbol table in
 * memory (dl_iterate_phdr), without the loader's help: exactly as the hook itself finds
 * libc's dlsym. No user-space hook can take that away. NULL when not found. */
struct raw_lookup {
    const char *name;
    void *found;
};

__attribute__((unused)) static int raw_visit(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    struct raw_lookup *want = arg;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcuda.so")) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    const ElfW(Sym) *sym = NULL;
    const char *str = NULL;
    size_t strsz = 0;
    for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB) sym = (const ElfW(Sym) *)dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_STRTAB) str = (const char *)dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_STRSZ) strsz = dyn->d_un.d_val;
    }
    if (!sym || !str) return 0;
    /* the symbol table ends where the string table begins in every GNU ld output */
    for (const ElfW(Sym) *s = sym; (const char *)s < str; s++) {
        if (s->st_name >= strsz || !s->st_value) continue;
        if (!strcmp(str + s->st_name, want->name)) {
            want->found = (void *)(info->dlpi_addr + s->st_value);
            return 1;
        }
    }
    return 0;
}

__attribute__((unused)) static void *raw_driver_symbol(const char *name) {
    struct raw_lookup want = {name, NULL};
    dl_iterate_phdr(raw_visit, &want);
    return want.found;
}
#endif
