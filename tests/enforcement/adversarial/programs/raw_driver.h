/* The raw driver for the hostile programs that go around the hook: include it first (it
 * includes hostile.h, which defines _GNU_SOURCE before any system header). */
#ifndef QGPU_RAW_DRIVER_H
#define QGPU_RAW_DRIVER_H
#include "hostile.h"

#include <elf.h>
#include <link.h>

/* The raw driver's entry point `name`, read from libcuda's (or another loaded library's)
 * ELF dynamic symbol table in memory (dl_iterate_phdr), without the loader's help: exactly as
 * the hook itself finds libc's dlsym. No user-space hook can take that away. NULL when not
 * found. */
struct raw_lookup {
    const char *lib; /* a substring of the library's path */
    const char *name;
    void *found;
};

__attribute__((unused)) static int raw_visit(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    struct raw_lookup *want = arg;
    if (!info->dlpi_name || !strstr(info->dlpi_name, want->lib)) return 0;
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

__attribute__((unused)) static void *raw_symbol(const char *lib, const char *name) {
    struct raw_lookup want = {lib, name, NULL};
    dl_iterate_phdr(raw_visit, &want);
    return want.found;
}

__attribute__((unused)) static void *raw_driver_symbol(const char *name) {
    return raw_symbol("libcuda.so", name);
}
#endif
