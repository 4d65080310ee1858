/* Device code images as NVIDIA's driver receives them (cuModuleLoad*, cuLibraryLoad*,
 * cuLinkAdd*): what the simulated driver must allocate for one, and which kernels and
 * globals it defines. This file owns reading the formats, nothing else:
 *  - a cubin: an ELF64 image for EM_CUDA (190). Its SASS architecture is in e_flags (bits
 *    8..15 from ELF ABI version 8, CUDA 13; bits 0..7 before). It runs on a device of the
 *    same major compute capability and no lower minor (sm_75 on 7.5, not sm_90 on 7.5).
 *    The device memory it needs at load is its data: `.nv.global` (NOBITS: __device__
 *    variables, zero-filled), `.nv.global.init` (initialised __device__ variables) and every
 *    constant bank `.nv.constant<N>[.<kernel>]` but bank 0 (a kernel's parameters, which
 *    travel with each launch). Code is not counted. Kernels are STT_FUNC symbols with
 *    STO_CUDA_ENTRY (0x10) in st_other; globals are STT_OBJECT symbols in those sections.
 *  - a fatbin (magic 0xBA55ED50): entries of SASS (kind 2) and PTX (kind 1) per
 *    architecture; the best compatible SASS entry is used. zstd-compressed entries (flag
 *    0x8000, what nvcc 13 writes) are decompressed with the system's libzstd.so.1 when it
 *    is there; LZ4-compressed ones (flag 0x2000, older nvcc) are refused with
 *    CUDA_ERROR_NOT_SUPPORTED.
 *  - the runtime's fatbin wrapper (magic 0x466243b1) pointing at a fatbin.
 *  - PTX (text): a real driver JIT-compiles it; this one has no JIT compiler and answers
 *    CUDA_ERROR_JIT_COMPILER_NOT_FOUND, like a driver installed without one.
 *  - the simulator's own built-in image, the NUL-terminated text "qgpu-sim-module...": no
 *    data, and every kernel name exists in it (the demos' and tests' "qgpu_sim_busy").
 * A malformed image gives CUDA_ERROR_INVALID_IMAGE; every offset and size is checked
 * against the image's extent without wrapping. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define EM_CUDA 190
#define SHT_SYMTAB 2
#define SHT_NOBITS 8
#define STT_OBJECT 1
#define STT_FUNC 2
#define STO_CUDA_ENTRY 0x10
#define STO_CUDA_MANAGED 0x04
#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243b1u
#define FATBIN_KIND_PTX 1
#define FATBIN_KIND_ELF 2
#define FATBIN_FLAG_64BIT 0x1ULL
#define FATBIN_FLAG_LZ4 0x2000ULL
#define FATBIN_FLAG_ZSTD 0x8000ULL
#define DATA_ALIGN 256ULL
#define MAX_DECOMPRESSED (1ULL << 32) /* a 4 GiB cubin is already absurd */

const char sim_builtin_image[] = "qgpu-sim-module";

static uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* [off, off + n) lies inside [0, len) */
static int inside(uint64_t len, uint64_t off, uint64_t n) { return off <= len && n <= len - off; }

static int is_elf(const unsigned char *p) { return memcmp(p, "\x7f" "ELF", 4) == 0; }

/* ---- extents: how many bytes an image spans (a copy must keep them all) ---- */

static CUresult elf_extent(const unsigned char *p, size_t *len) {
    if (p[4] != 2 || p[5] != 1) return CUDA_ERROR_INVALID_IMAGE; /* ELF64, little endian */
    uint64_t shoff = rd64(p + 0x28), phoff = rd64(p + 0x20);
    uint16_t shent = rd16(p + 0x3a), shnum = rd16(p + 0x3c), phent = rd16(p + 0x36),
             phnum = rd16(p + 0x38);
    if (shent != 64 || shnum == 0 || shoff > (1ULL << 40) || phoff > (1ULL << 40))
        return CUDA_ERROR_INVALID_IMAGE;
    uint64_t end = shoff + (uint64_t)shnum * 64;
    if (phnum && phoff + (uint64_t)phnum * phent > end) end = phoff + (uint64_t)phnum * phent;
    for (unsigned i = 0; i < shnum; i++) {
        const unsigned char *sh = p + shoff + (uint64_t)i * 64;
        uint64_t off = rd64(sh + 0x18), size = rd64(sh + 0x20);
        if (rd32(sh + 4) == SHT_NOBITS) continue;
        if (off > (1ULL << 40) || size > (1ULL << 40)) return CUDA_ERROR_INVALID_IMAGE;
        if (off + size > end) end = off + size;
    }
    if (end < 64) end = 64;
    *len = (size_t)end;
    return CUDA_SUCCESS;
}

CUresult sim_image_extent(const void *image, size_t *len) {
    const unsigned char *p = image;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (is_elf(p)) return elf_extent(p, len);
    if (rd32(p) == FATBIN_MAGIC) {
        uint64_t hs = rd16(p + 6), fat = rd64(p + 8);
        if (hs < 16 || fat > (1ULL << 40)) return CUDA_ERROR_INVALID_IMAGE;
        *len = (size_t)(hs + fat);
        return CUDA_SUCCESS;
    }
    if (rd32(p) == FATBIN_WRAPPER_MAGIC) {
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        if (!data || rd32(data) != FATBIN_MAGIC) return CUDA_ERROR_INVALID_IMAGE;
        return sim_image_extent(data, len);
    }
    *len = strlen((const char *)p) + 1; /* text: PTX, or the built-in image */
    return CUDA_SUCCESS;
}

/* ---- cubin ---- */

static int arch_runs_on(unsigned sm, int cc_major, int cc_minor) {
    return (int)(sm / 10) == cc_major && (int)(sm % 10) <= cc_minor;
}

static unsigned elf_sm(const unsigned char *p) {
    uint32_t flags = rd32(p + 0x30);
    return p[8] >= 8 ? (flags >> 8) & 0xff : flags & 0xff; /* EI_ABIVERSION 8: CUDA 13 */
}

static char *dup_name(const char *s, uint64_t room) {
    size_t n = strnlen(s, room);
    if (n == room) return NULL; /* not terminated inside its table */
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int data_section(const char *name) {
    if (strcmp(name, ".nv.global") == 0 || strcmp(name, ".nv.global.init") == 0) return 1;
    return strncmp(name, ".nv.constant", 12) == 0 && name[12] != '0' && name[12] != 0;
}

static CUresult elf_symbols(const unsigned char *p, uint64_t len, uint64_t shoff, unsigned shnum,
                            const uint64_t *sec_off, sim_image_t *out) {
    const uint64_t *sec_size = sec_off + shnum;
    for (unsigned i = 0; i < shnum; i++) {
        const unsigned char *sh = p + shoff + (uint64_t)i * 64;
        if (rd32(sh + 4) != SHT_SYMTAB) continue;
        uint64_t off = rd64(sh + 0x18), size = rd64(sh + 0x20), ent = rd64(sh + 0x38);
        uint32_t link = rd32(sh + 0x28);
        if (ent != 24 || !inside(len, off, size) || link >= shnum) return CUDA_ERROR_INVALID_IMAGE;
        const unsigned char *strsh = p + shoff + (uint64_t)link * 64;
        uint64_t soff = rd64(strsh + 0x18), ssize = rd64(strsh + 0x20);
        if (!inside(len, soff, ssize)) return CUDA_ERROR_INVALID_IMAGE;
        uint64_t n = size / 24;
        out->funcs = calloc(n ? n : 1, sizeof *out->funcs);
        out->syms = calloc(n ? n : 1, sizeof *out->syms);
        if (!out->funcs || !out->syms) return CUDA_ERROR_OUT_OF_MEMORY;
        for (uint64_t k = 1; k < n; k++) {
            const unsigned char *s = p + off + k * 24;
            uint32_t name = rd32(s);
            unsigned type = s[4] & 0xf, other = s[5];
            uint16_t shndx = rd16(s + 6);
            if (name >= ssize) return CUDA_ERROR_INVALID_IMAGE;
            const char *nm = (const char *)p + soff + name;
            if (type == STT_FUNC && (other & STO_CUDA_ENTRY)) {
                if (!(out->funcs[out->nfuncs] = dup_name(nm, ssize - name)))
                    return CUDA_ERROR_INVALID_IMAGE;
                out->nfuncs++;
            } else if (type == STT_OBJECT && shndx < shnum && sec_off[shndx] != UINT64_MAX) {
                sim_sym_t *y = &out->syms[out->nsyms];
                uint64_t value = rd64(s + 8), bytes = rd64(s + 16);
                if (value > sec_size[shndx] || bytes > sec_size[shndx] - value ||
                    !(y->name = dup_name(nm, ssize - name)))
                    return CUDA_ERROR_INVALID_IMAGE;
                y->offset = sec_off[shndx] + value;
                y->size = bytes;
                y->managed = (other & STO_CUDA_MANAGED) != 0;
                out->nsyms++;
            }
        }
        return CUDA_SUCCESS; /* a cubin has one symbol table */
    }
    return CUDA_SUCCESS;
}

static CUresult parse_elf(const unsigned char *p, uint64_t len, int cc_major, int cc_minor,
                          sim_image_t *out) {
    if (len < 64 || !is_elf(p)) return CUDA_ERROR_INVALID_IMAGE;
    if (p[4] != 2 || p[5] != 1 || rd16(p + 0x12) != EM_CUDA) return CUDA_ERROR_INVALID_IMAGE;
    unsigned sm = elf_sm(p);
    out->sm = (int)sm;
    if (cc_major >= 0 && !arch_runs_on(sm, cc_major, cc_minor)) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    uint64_t shoff = rd64(p + 0x28);
    unsigned shnum = rd16(p + 0x3c), shstr = rd16(p + 0x3e);
    if (rd16(p + 0x3a) != 64 || !shnum || shstr >= shnum || !inside(len, shoff, (uint64_t)shnum * 64))
        return CUDA_ERROR_INVALID_IMAGE;
    const unsigned char *strsh = p + shoff + (uint64_t)shstr * 64;
    uint64_t noff = rd64(strsh + 0x18), nsize = rd64(strsh + 0x20);
    if (!inside(len, noff, nsize)) return CUDA_ERROR_INVALID_IMAGE;
    uint64_t *sec_off = malloc(2 * shnum * sizeof *sec_off); /* offsets, then sizes */
    if (!sec_off) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = CUDA_SUCCESS;
    uint64_t total = 0;
    for (unsigned i = 0; i < shnum && !r; i++) {
        const unsigned char *sh = p + shoff + (uint64_t)i * 64;
        uint32_t name = rd32(sh);
        uint64_t off = rd64(sh + 0x18), size = rd64(sh + 0x20);
        sec_off[i] = UINT64_MAX;
        sec_off[shnum + i] = size;
        if (name >= nsize || !memchr(p + noff + name, 0, nsize - name)) {
            r = CUDA_ERROR_INVALID_IMAGE;
            break;
        }
        if (rd32(sh + 4) != SHT_NOBITS && size && !inside(len, off, size)) {
            r = CUDA_ERROR_INVALID_IMAGE;
            break;
        }
        if (!data_section((const char *)p + noff + name)) continue;
        uint64_t padded = (size + DATA_ALIGN - 1) & ~(DATA_ALIGN - 1);
        if (size > UINT64_MAX - DATA_ALIGN || total > UINT64_MAX - padded) {
            r = CUDA_ERROR_INVALID_IMAGE;
            break;
        }
        sec_off[i] = total;
        total += padded;
    }
    if (!r) {
        out->data_bytes = total;
        r = elf_symbols(p, len, shoff, shnum, sec_off, out);
    }
    free(sec_off);
    return r;
}

/* ---- fatbin ---- */

typedef size_t (*zstd_decompress_fn)(void *, size_t, const void *, size_t);
typedef unsigned (*zstd_is_error_fn)(size_t);
static zstd_decompress_fn zstd_dec;
static zstd_is_error_fn zstd_is_error;
static pthread_once_t zstd_once = PTHREAD_ONCE_INIT;

static void zstd_load(void) {
    void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    zstd_dec = (zstd_decompress_fn)dlsym(lib, "ZSTD_decompress");
    zstd_is_error = (zstd_is_error_fn)dlsym(lib, "ZSTD_isError");
}

static CUresult zstd(const unsigned char *src, uint64_t n, uint64_t want, unsigned char **out) {
    pthread_once(&zstd_once, zstd_load);
    zstd_decompress_fn dec = zstd_dec;
    zstd_is_error_fn is_error = zstd_is_error;
    if (!dec || !is_error) {
        fprintf(stderr, "qgpu-sim: a zstd-compressed fatbin entry needs libzstd.so.1, which is "
                        "not installed; use nvcc --no-compress\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!want || want > MAX_DECOMPRESSED) return CUDA_ERROR_INVALID_IMAGE;
    unsigned char *buf = malloc(want);
    if (!buf) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t got = dec(buf, want, src, n);
    if (is_error(got) || got != want) {
        free(buf);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *out = buf;
    return CUDA_SUCCESS;
}

/* The fatbin entry for the device: its plain ELF bytes (*owned set when they were
 * decompressed into a buffer the caller frees). */
static CUresult fatbin_select(const unsigned char *p, uint64_t len, int cc_major, int cc_minor,
                              const unsigned char **elf, uint64_t *elf_len, unsigned char **owned) {
    uint64_t hs = rd16(p + 6), fat = rd64(p + 8);
    if (hs < 16 || !inside(len, hs, fat)) return CUDA_ERROR_INVALID_IMAGE;
    const unsigned char *best = NULL;
    unsigned best_arch = 0;
    int ptx_fits = 0;
    for (uint64_t off = hs; off < hs + fat;) {
        if (!inside(hs + fat, off, 64)) return CUDA_ERROR_INVALID_IMAGE;
        const unsigned char *e = p + off;
        uint64_t ehs = rd32(e + 4), size = rd64(e + 8);
        if (ehs < 64 || !inside(hs + fat, off, ehs) || !inside(hs + fat, off + ehs, size))
            return CUDA_ERROR_INVALID_IMAGE;
        unsigned kind = rd16(e), arch = rd32(e + 28);
        uint64_t flags = rd64(e + 40);
        if (kind == FATBIN_KIND_ELF && (flags & FATBIN_FLAG_64BIT)) {
            if ((cc_major < 0 || arch_runs_on(arch, cc_major, cc_minor)) &&
                (!best || arch > best_arch)) {
                best = e;
                best_arch = arch;
            }
        } else if (kind == FATBIN_KIND_PTX) {
            ptx_fits |= cc_major < 0 || (int)arch <= cc_major * 10 + cc_minor;
        }
        off += ehs + size;
    }
    if (!best) return ptx_fits ? CUDA_ERROR_JIT_COMPILER_NOT_FOUND : CUDA_ERROR_NO_BINARY_FOR_GPU;
    uint64_t ehs = rd32(best + 4), size = rd64(best + 8), flags = rd64(best + 40);
    const unsigned char *payload = best + ehs;
    *owned = NULL;
    if (flags & FATBIN_FLAG_LZ4) {
        fprintf(stderr, "qgpu-sim: LZ4-compressed fatbin entries are not simulated\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (flags & FATBIN_FLAG_ZSTD) {
        uint64_t csize = rd32(best + 16), dsize = rd64(best + 56);
        if (csize > size) return CUDA_ERROR_INVALID_IMAGE;
        CUresult r = zstd(payload, csize, dsize, owned);
        if (r) return r;
        *elf = *owned;
        *elf_len = dsize;
        return CUDA_SUCCESS;
    }
    *elf = payload;
    *elf_len = size;
    return CUDA_SUCCESS;
}

/* ---- entry points ---- */

/* Resolves an image to the plain cubin for the device: *elf and *elf_len, with *owned set
 * when they live in a buffer the caller must free; *builtin for the simulator's own image. */
static CUresult resolve(const void *image, size_t len, int cc_major, int cc_minor,
                        const unsigned char **elf, uint64_t *elf_len, unsigned char **owned,
                        int *builtin) {
    const unsigned char *p = image;
    *owned = NULL;
    *builtin = 0;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (!len) { /* a bare pointer: the image's own headers say how far it goes */
        CUresult r = sim_image_extent(p, &len);
        if (r) return r;
    }
    if (len >= 4 && is_elf(p)) {
        *elf = p;
        *elf_len = len;
        return CUDA_SUCCESS;
    }
    if (len >= 16 && rd32(p) == FATBIN_MAGIC)
        return fatbin_select(p, len, cc_major, cc_minor, elf, elf_len, owned);
    if (len >= 16 && rd32(p) == FATBIN_WRAPPER_MAGIC) {
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        if (!data || rd32(data) != FATBIN_MAGIC) return CUDA_ERROR_INVALID_IMAGE;
        return resolve(data, 0, cc_major, cc_minor, elf, elf_len, owned, builtin);
    }
    if (strncmp((const char *)p, sim_builtin_image, sizeof sim_builtin_image - 1) == 0) {
        *builtin = 1;
        return CUDA_SUCCESS;
    }
    if (p[0] == '\t' || p[0] == '\n' || p[0] == '\r' || (p[0] >= 0x20 && p[0] < 0x7f))
        return CUDA_ERROR_JIT_COMPILER_NOT_FOUND; /* PTX text: no JIT compiler here */
    return CUDA_ERROR_INVALID_IMAGE;
}

CUresult sim_image_parse(const void *image, size_t len, int cc_major, int cc_minor,
                         sim_image_t *out) {
    memset(out, 0, sizeof *out);
    const unsigned char *elf = NULL;
    uint64_t elf_len = 0;
    unsigned char *owned;
    CUresult r = resolve(image, len, cc_major, cc_minor, &elf, &elf_len, &owned, &out->builtin);
    if (r || out->builtin) return r;
    r = parse_elf(elf, elf_len, cc_major, cc_minor, out);
    free(owned);
    if (r) sim_image_free(out);
    return r;
}

CUresult sim_image_cubin(const void *image, size_t len, int cc_major, int cc_minor,
                         unsigned char **out, size_t *out_len) {
    const unsigned char *elf = NULL;
    uint64_t elf_len = 0;
    unsigned char *owned;
    int builtin;
    CUresult r = resolve(image, len, cc_major, cc_minor, &elf, &elf_len, &owned, &builtin);
    if (r) return r;
    if (builtin) return CUDA_ERROR_INVALID_IMAGE; /* nothing a linker could take */
    sim_image_t check;
    memset(&check, 0, sizeof check);
    r = parse_elf(elf, elf_len, cc_major, cc_minor, &check);
    sim_image_free(&check);
    if (!r && !owned) {
        owned = malloc(elf_len ? elf_len : 1);
        if (!owned) return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(owned, elf, elf_len);
    }
    if (r) {
        free(owned);
        return r;
    }
    *out = owned;
    *out_len = (size_t)elf_len;
    return CUDA_SUCCESS;
}

int sim_image_has_kernel(const sim_image_t *img, const char *name) {
    if (img->builtin) return 1;
    for (int i = 0; i < img->nfuncs; i++)
        if (strcmp(img->funcs[i], name) == 0) return 1;
    return 0;
}

const sim_sym_t *sim_image_symbol(const sim_image_t *img, const char *name) {
    for (int i = 0; i < img->nsyms; i++)
        if (strcmp(img->syms[i].name, name) == 0) return &img->syms[i];
    return NULL;
}

void sim_image_free(sim_image_t *img) {
    for (int i = 0; i < img->nfuncs; i++) free(img->funcs[i]);
    for (int i = 0; i < img->nsyms; i++) free(img->syms[i].name);
    free(img->funcs);
    free(img->syms);
    memset(img, 0, sizeof *img);
}
