/* interpose_linux.c: count CPU tensor bytes by patching libc10's GOT entries for posix_memalign and free. */
#include "counters.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/*
 * Facts about PyTorch relied on (checked on torch 2.13, x86_64):
 *   - c10::alloc_cpu (c10/core/impl/alloc_cpu.cpp), the DefaultCPUAllocator
 *     behind every CPU tensor storage, allocates with
 *     posix_memalign(&data, c10_compute_alignment(nbytes), nbytes) (64-byte
 *     alignment, a page for the transparent-huge-page path, which then also
 *     calls madvise), and returns NULL without allocating for 0 bytes.
 *   - c10::free_cpu releases with free(data).
 *   - `readelf -r --use-dynamic libc10.so` shows posix_memalign as one
 *     R_X86_64_JUMP_SLOT; free as one JUMP_SLOT and one GLOB_DAT (its address
 *     taken by c10::demangle and the backtrace symbolizer). alloc_cpu is the
 *     only caller of posix_memalign in libc10, so every pointer it returns is
 *     a tensor storage; libc10's other frees meet pointers that are not in the
 *     table and are ignored.
 * So patching those slots of libc10 alone sees every CPU storage allocation
 * and free, from any thread, without touching the rest of the process.
 *
 * The saved originals stay valid after uninstalling: a copy of &free taken
 * through the GLOB_DAT slot while patched keeps calling our hook, which then
 * only forwards.
 */

#if defined(__x86_64__)
#define MT_R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define MT_R_GLOB_DAT R_X86_64_GLOB_DAT
#define MT_ARCH_OK 1
#elif defined(__aarch64__)
#define MT_R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define MT_R_GLOB_DAT R_AARCH64_GLOB_DAT
#define MT_ARCH_OK 1
#else
#define MT_ARCH_OK 0
#endif

#define MT_MAX_SLOTS 8

typedef int (*mt_posix_memalign_fn)(void **, size_t, size_t);
typedef void (*mt_free_fn)(void *);

/* The real functions the hooks forward to; set before the first patching and
 * never cleared (a stale copy of a hook must keep working). */
static _Atomic(mt_posix_memalign_fn) mt_real_posix_memalign;
static _Atomic(mt_free_fn) mt_real_free;

static int
mt_hook_posix_memalign(void **out, size_t alignment, size_t size)
{
    mt_posix_memalign_fn real = atomic_load_explicit(&mt_real_posix_memalign,
                                                     memory_order_acquire);
    int rc = real(out, alignment, size);
    if (rc == 0 && *out != NULL) {
        mt_counters_on_alloc(*out, size);
    }
    return rc;
}

static void
mt_hook_free(void *ptr)
{
    mt_free_fn real = atomic_load_explicit(&mt_real_free, memory_order_acquire);
    if (ptr != NULL) {
        /* Before the real free: the address cannot be reused meanwhile. */
        mt_counters_on_free(ptr, 1);
    }
    real(ptr);
}

/* One imported function: its GOT slots in libc10 and what they held. */
typedef struct {
    const char *name;
    void *hook;
    void **slots[MT_MAX_SLOTS];
    void *saved[MT_MAX_SLOTS];
    int in_relro[MT_MAX_SLOTS];
    int nslots;
} mt_target;

static mt_target mt_targets[2] = {
    {"posix_memalign", (void *)mt_hook_posix_memalign},
    {"free", (void *)mt_hook_free},
};

/* What dl_iterate_phdr found about libc10. */
typedef struct {
    int found;
    ElfW(Addr) base;
    const ElfW(Phdr) *phdr;
    ElfW(Half) phnum;
    char path[512];
} mt_lib;

static int mt_patched;  /* under all table locks (counters.c) */

/* "libc10.so" or "libc10.so.<version>", not libc10_cuda.so. */
static int
mt_is_libc10(const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    return strncmp(base, "libc10.so", 9) == 0 && (base[9] == '\0' || base[9] == '.');
}

static int
mt_find_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    mt_lib *lib = (mt_lib *)data;
    if (info->dlpi_name == NULL || !mt_is_libc10(info->dlpi_name)) {
        return 0;
    }
    lib->found = 1;
    lib->base = info->dlpi_addr;
    lib->phdr = info->dlpi_phdr;
    lib->phnum = info->dlpi_phnum;
    snprintf(lib->path, sizeof(lib->path), "%s", info->dlpi_name);
    return 1;
}

/* 1 if addr lies in one of lib's loaded segments (e.g. a lazy-binding PLT
 * stub: calling that would re-resolve and overwrite our patch). */
static int
mt_in_lib(const mt_lib *lib, uintptr_t addr)
{
    for (int i = 0; i < lib->phnum; i++) {
        const ElfW(Phdr) *p = &lib->phdr[i];
        if (p->p_type == PT_LOAD) {
            uintptr_t lo = lib->base + p->p_vaddr;
            if (addr >= lo && addr < lo + p->p_memsz) {
                return 1;
            }
        }
    }
    return 0;
}

/* glibc rewrites the d_ptr entries of a loaded object's dynamic section to
 * absolute addresses; other loaders leave them relative to the base. */
static uintptr_t
mt_dyn_ptr(const mt_lib *lib, ElfW(Addr) p)
{
    return (p < lib->base) ? lib->base + p : p;
}

/* Find libc10 and the GOT slots of every target; fills mt_targets' slots.
 * 0 on success, -1 with a reason in err. */
static int
mt_locate(mt_lib *lib, char *err, size_t errlen)
{
    if (!MT_ARCH_OK) {
        snprintf(err, errlen, "GOT patching is not implemented for this CPU architecture");
        goto error;
    }
    memset(lib, 0, sizeof(*lib));
    dl_iterate_phdr(mt_find_cb, lib);
    if (!lib->found) {
        snprintf(err, errlen, "libc10 is not loaded in this process (import torch first)");
        goto error;
    }
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < lib->phnum; i++) {
        if (lib->phdr[i].p_type == PT_DYNAMIC) {
            dyn = (const ElfW(Dyn) *)(lib->base + lib->phdr[i].p_vaddr);
        }
        else if (lib->phdr[i].p_type == PT_GNU_RELRO) {
            relro_lo = lib->base + lib->phdr[i].p_vaddr;
            relro_hi = relro_lo + lib->phdr[i].p_memsz;
        }
    }
    if (dyn == NULL) {
        snprintf(err, errlen, "%s has no dynamic section", lib->path);
        goto error;
    }
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    uintptr_t jmprel = 0, rela = 0;
    size_t pltrelsz = 0, relasz = 0;
    long pltrel = DT_RELA;
    for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB:
            symtab = (const ElfW(Sym) *)mt_dyn_ptr(lib, d->d_un.d_ptr);
            break;
        case DT_STRTAB:
            strtab = (const char *)mt_dyn_ptr(lib, d->d_un.d_ptr);
            break;
        case DT_JMPREL:
            jmprel = mt_dyn_ptr(lib, d->d_un.d_ptr);
            break;
        case DT_PLTRELSZ:
            pltrelsz = d->d_un.d_val;
            break;
        case DT_PLTREL:
            pltrel = (long)d->d_un.d_val;
            break;
        case DT_RELA:
            rela = mt_dyn_ptr(lib, d->d_un.d_ptr);
            break;
        case DT_RELASZ:
            relasz = d->d_un.d_val;
            break;
        default:
            break;
        }
    }
    if (symtab == NULL || strtab == NULL || pltrel != DT_RELA) {
        snprintf(err, errlen, "%s: unexpected dynamic section layout", lib->path);
        goto error;
    }
    for (int t = 0; t < 2; t++) {
        mt_targets[t].nslots = 0;
    }
    const struct {
        uintptr_t start;
        size_t size;
    } tables[2] = {{jmprel, pltrelsz}, {rela, relasz}};
    for (int k = 0; k < 2; k++) {
        const ElfW(Rela) *r = (const ElfW(Rela) *)tables[k].start;
        size_t n = tables[k].start ? tables[k].size / sizeof(ElfW(Rela)) : 0;
        for (size_t i = 0; i < n; i++) {
            unsigned long type = ELF64_R_TYPE(r[i].r_info);
            if (type != MT_R_JUMP_SLOT && type != MT_R_GLOB_DAT) {
                continue;
            }
            const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(r[i].r_info)];
            if (sym->st_shndx != SHN_UNDEF) {
                continue;  /* defined in libc10 itself: not an import */
            }
            const char *name = strtab + sym->st_name;
            for (int t = 0; t < 2; t++) {
                mt_target *tg = &mt_targets[t];
                if (strcmp(name, tg->name) == 0 && tg->nslots < MT_MAX_SLOTS) {
                    uintptr_t addr = lib->base + r[i].r_offset;
                    tg->slots[tg->nslots] = (void **)addr;
                    tg->in_relro[tg->nslots] = addr >= relro_lo && addr < relro_hi;
                    tg->nslots++;
                }
            }
        }
    }
    for (int t = 0; t < 2; t++) {
        if (mt_targets[t].nslots == 0) {
            snprintf(err, errlen, "%s does not import %s (unusual build)", lib->path,
                     mt_targets[t].name);
            goto error;
        }
    }
    return 0;
error:
    return -1;
}

/* Write one GOT slot, making a RELRO page writable for the time of the
 * write. 0 or -1 with errno set. */
static int
mt_write_slot(void **slot, int in_relro, void *value)
{
    long pagesize = sysconf(_SC_PAGESIZE);
    uintptr_t page = (uintptr_t)slot & ~((uintptr_t)pagesize - 1);
    if (in_relro && mprotect((void *)page, (size_t)pagesize, PROT_READ | PROT_WRITE) != 0) {
        return -1;
    }
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (in_relro) {
        (void)mprotect((void *)page, (size_t)pagesize, PROT_READ);
    }
    return 0;
}

const char *
mt_interpose_mechanism(void)
{
    return MT_ARCH_OK ? "libc10-got" : NULL;
}

int
mt_interpose_probe(char *err, size_t errlen)
{
    mt_lib lib;
    if (mt_patched) {
        return 0;
    }
    return mt_locate(&lib, err, errlen);
}

/* The function a target really calls: a saved slot value that is resolved
 * (not a PLT stub inside libc10), else what the dynamic linker would bind
 * (under ASan that is ASan's interceptor, as it is for libc10). */
static void *
mt_resolve_real(const mt_lib *lib, mt_target *tg)
{
    for (int i = 0; i < tg->nslots; i++) {
        void *v = tg->saved[i];
        if (v != NULL && v != tg->hook && !mt_in_lib(lib, (uintptr_t)v)) {
            return v;
        }
    }
    return dlsym(RTLD_DEFAULT, tg->name);
}

int
mt_interpose_patch(char *err, size_t errlen)
{
    mt_lib lib;
    if (mt_patched) {
        snprintf(err, errlen, "already installed");
        goto error;
    }
    if (mt_locate(&lib, err, errlen) < 0) {
        goto error;
    }
    for (int t = 0; t < 2; t++) {
        mt_target *tg = &mt_targets[t];
        for (int i = 0; i < tg->nslots; i++) {
            tg->saved[i] = __atomic_load_n(tg->slots[i], __ATOMIC_SEQ_CST);
            if (tg->saved[i] == tg->hook) {
                /* Refuse double installation (e.g. a second copy of the
                 * counters state): we would forward to ourselves. */
                snprintf(err, errlen, "libc10's %s is already patched by memtorch", tg->name);
                goto error;
            }
        }
    }
    void *real_pm = mt_resolve_real(&lib, &mt_targets[0]);
    void *real_free = mt_resolve_real(&lib, &mt_targets[1]);
    if (real_pm == NULL || real_free == NULL) {
        snprintf(err, errlen, "cannot resolve the real posix_memalign/free");
        goto error;
    }
    atomic_store_explicit(&mt_real_posix_memalign, (mt_posix_memalign_fn)real_pm,
                          memory_order_release);
    atomic_store_explicit(&mt_real_free, (mt_free_fn)real_free, memory_order_release);
    for (int t = 0; t < 2; t++) {
        mt_target *tg = &mt_targets[t];
        for (int i = 0; i < tg->nslots; i++) {
            if (mt_write_slot(tg->slots[i], tg->in_relro[i], tg->hook) < 0) {
                int e = errno;
                /* Put back what was already written, then fail whole. */
                for (int u = 0; u <= t; u++) {
                    int upto = (u == t) ? i : mt_targets[u].nslots;
                    for (int j = 0; j < upto; j++) {
                        (void)mt_write_slot(mt_targets[u].slots[j], mt_targets[u].in_relro[j],
                                            mt_targets[u].saved[j]);
                    }
                }
                snprintf(err, errlen, "mprotect of libc10's GOT failed: %s", strerror(e));
                goto error;
            }
        }
    }
    mt_patched = 1;
    return 0;
error:
    return -1;
}

void
mt_interpose_unpatch(void)
{
    if (!mt_patched) {
        return;
    }
    for (int t = 0; t < 2; t++) {
        mt_target *tg = &mt_targets[t];
        for (int i = 0; i < tg->nslots; i++) {
            /* Only put back our own entry: if another tool patched the slot
             * after us, it forwards to our hook, which keeps forwarding. */
            if (__atomic_load_n(tg->slots[i], __ATOMIC_SEQ_CST) == tg->hook) {
                (void)mt_write_slot(tg->slots[i], tg->in_relro[i], tg->saved[i]);
            }
        }
    }
    mt_patched = 0;
}

int
mt_interpose_slot_info(const char *name, uintptr_t vals[4])
{
    mt_lib lib;
    char err[256];
    mt_target *tg = NULL;
    for (int t = 0; t < 2; t++) {
        if (strcmp(name, mt_targets[t].name) == 0) {
            tg = &mt_targets[t];
        }
    }
    if (tg == NULL) {
        return -1;
    }
    if (!mt_patched && mt_locate(&lib, err, sizeof(err)) < 0) {
        return -1;
    }
    vals[0] = (uintptr_t)__atomic_load_n(tg->slots[0], __ATOMIC_SEQ_CST);
    vals[1] = mt_patched ? (uintptr_t)tg->saved[0] : vals[0];
    vals[2] = (tg == &mt_targets[0])
                  ? (uintptr_t)atomic_load(&mt_real_posix_memalign)
                  : (uintptr_t)atomic_load(&mt_real_free);
    vals[3] = (uintptr_t)tg->hook;
    return 0;
}

int
mt_interpose_bench(long n, size_t size, double *direct_ns, double *hooked_ns)
{
    mt_posix_memalign_fn real_pm = atomic_load(&mt_real_posix_memalign);
    mt_free_fn real_free = atomic_load(&mt_real_free);
    void *p = NULL;
    if (real_pm == NULL || real_free == NULL) {
        return -1;  /* never installed: nothing resolved yet */
    }
    int64_t t0 = mt_monotonic_ns();
    for (long i = 0; i < n; i++) {
        if (real_pm(&p, 64, size) == 0) {
            real_free(p);
        }
    }
    int64_t t1 = mt_monotonic_ns();
    for (long i = 0; i < n; i++) {
        if (mt_hook_posix_memalign(&p, 64, size) == 0) {
            mt_hook_free(p);
        }
    }
    int64_t t2 = mt_monotonic_ns();
    *direct_ns = (double)(t1 - t0) / (double)n;
    *hooked_ns = (double)(t2 - t1) / (double)n;
    return 0;
}

void
mt_platform_rss(int64_t *current, int64_t *hwm)
{
    struct rusage ru;
    long resident = -1;
    FILE *f = fopen("/proc/self/statm", "r");
    *current = -1;
    *hwm = -1;
    if (f != NULL) {
        long size;
        if (fscanf(f, "%ld %ld", &size, &resident) == 2) {
            *current = (int64_t)resident * (int64_t)sysconf(_SC_PAGESIZE);
        }
        fclose(f);
    }
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        *hwm = (int64_t)ru.ru_maxrss * 1024;  /* Linux: KiB */
    }
}

int64_t
mt_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
