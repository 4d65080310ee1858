/* Reading the driver's symbol table (our addition): a program can find the driver's entry
 * points without the loader's help, from libcuda's ELF dynamic symbol table in memory
 * (dl_iterate_phdr), exactly as the hook itself finds libc's dlsym. No user-space hook can
 * take that away; only the node agent's watchdog can stop the program. It takes 8 GiB in
 * 1 GiB pieces through the raw cuMemAlloc_v2. */
#include "hostile.h" /* first: it defines _GNU_SOURCE, which link.h needs */

#include <elf.h>
#include <link.h>

typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
static void *found;

static int visit(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    (void)arg;
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
        if (!strcmp(str + s->st_name, "cuMemAlloc_v2")) {
            found = (void *)(info->dlpi_addr + s->st_value);
            return 1;
        }
    }
    return 0;
}

int main(void) {
    setup();
    dl_iterate_phdr(visit, NULL);
    say("found", found != NULL);
    if (found)
        for (int i = 0; i < 8; i++) {
            CUdeviceptr p;
            say("grab", ((alloc_t)found)(&p, GIB));
        }
    hold();
    return 0;
}
