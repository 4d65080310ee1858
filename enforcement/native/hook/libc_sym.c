/* libc's own loader functions (dlsym, dlvsym, dlopen, dlmopen), found without asking the
 * loader.
 *
 * The hook exports wrappers named dlsym, dlvsym, dlopen and dlmopen. The dynamic linker lets an
 * unversioned definition satisfy a versioned reference, so even `dlvsym@GLIBC_2.2.5` or
 * dlvsym(RTLD_NEXT, ...) can come back to the hook itself. Instead, the hook reads the
 * dynamic symbol table of the loaded libc (glibc >= 2.34) or libdl (older glibc) directly,
 * through dl_iterate_phdr, which the hook does not wrap. */
#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <string.h>

#include "hook.h"

typedef struct {
    const char *name;
    void *found;
} want_t;

static uintptr_t fix(uintptr_t ptr, uintptr_t base) { return ptr < base ? ptr + base : ptr; }

/* number of dynamic symbols, from DT_HASH or DT_GNU_HASH */
static size_t symbol_count(const ElfW(Word) *hash, const uint32_t *gnu) {
    if (hash) return hash[1];
    if (!gnu) return 0;
    uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom = gnu[2];
    const uint32_t *buckets = gnu + 4 + bloom * (sizeof(ElfW(Addr)) / 4);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t last = 0;
    for (uint32_t b = 0; b < nbuckets; b++)
        if (buckets[b] > last) last = buckets[b];
    if (last < symoffset) return symoffset;
    while (!(chain[last - symoffset] & 1)) last++;
    return last + 1;
}

static int visit(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    want_t *w = arg;
    const char *path = info->dlpi_name ? info->dlpi_name : "";
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (strncmp(base, "libc.so", 7) != 0 && strncmp(base, "libdl.so", 8) != 0) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!dyn) return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Word) *hash = NULL;
    const uint32_t *gnu = NULL;
    uintptr_t b = info->dlpi_addr;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)fix(dyn->d_un.d_ptr, b); break;
        case DT_STRTAB: strtab = (const char *)fix(dyn->d_un.d_ptr, b); break;
        case DT_HASH: hash = (const ElfW(Word) *)fix(dyn->d_un.d_ptr, b); break;
        case DT_GNU_HASH: gnu = (const uint32_t *)fix(dyn->d_un.d_ptr, b); break;
        default: break;
        }
    }
    if (!symtab || !strtab) return 0;
    size_t n = symbol_count(hash, gnu);
    for (size_t i = 0; i < n; i++) {
        const ElfW(Sym) *s = &symtab[i];
        if (s->st_shndx == SHN_UNDEF || ELF64_ST_TYPE(s->st_info) != STT_FUNC || !s->st_value)
            continue;
        if (strcmp(strtab + s->st_name, w->name) == 0) {
            w->found = (void *)(b + s->st_value);
            return 1;
        }
    }
    return 0;
}

static void *libc_symbol(const char *name) {
    want_t w = {name, NULL};
    dl_iterate_phdr(visit, &w);
    return w.found;
}

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
typedef void *(*dlopen_fn)(const char *, int);
typedef void *(*dlmopen_fn)(long, const char *, int);
static dlsym_fn libc_dlsym;
static dlvsym_fn libc_dlvsym;
static dlopen_fn libc_dlopen;
static dlmopen_fn libc_dlmopen;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void find(void) {
    libc_dlsym = (dlsym_fn)libc_symbol("dlsym");
    libc_dlvsym = (dlvsym_fn)libc_symbol("dlvsym");
    libc_dlopen = (dlopen_fn)libc_symbol("dlopen");
    libc_dlmopen = (dlmopen_fn)libc_symbol("dlmopen");
}

/* These tail-call libc, so libc sees the hook's caller (our wrappers) for RTLD_NEXT. */
void *hook_libc_dlsym(void *handle, const char *name) {
    pthread_once(&once, find);
    return libc_dlsym ? libc_dlsym(handle, name) : NULL;
}

void *hook_libc_dlvsym(void *handle, const char *name, const char *version) {
    pthread_once(&once, find);
    return libc_dlvsym ? libc_dlvsym(handle, name, version) : NULL;
}

void *hook_libc_dlopen(const char *file, int flags) {
    pthread_once(&once, find);
    return libc_dlopen ? libc_dlopen(file, flags) : NULL;
}

void *hook_libc_dlmopen(long lmid, const char *file, int flags) {
    pthread_once(&once, find);
    return libc_dlmopen ? libc_dlmopen(lmid, file, flags) : NULL;
}
