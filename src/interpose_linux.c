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
 *
 * The GLOB_DAT slot of free gets its own hook: the frees made through it
 * (c10::demangle's deleter of __cxa_demangle buffers, used by
 * AccumulateGrad.name() and the profiler) are never tensor storage, so an
 * unknown pointer met there is no "unseen free" of a tensor.
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
#define MT_FN_PM 0
#define MT_FN_FREE 1

typedef int (*mt_posix_memalign_fn)(void **, size_t, size_t);
typedef void (*mt_free_fn)(void *);

/*
 * Sharing the slots with other tools (memray, pytest-memray, sanitizers,
 * anything that patches import tables):
 *   - install chains to whatever each slot holds when memtorch patches it
 *     (mt_real_*), never assuming it is libc's;
 *   - uninstall puts back what it saved only where the slot still holds
 *     memtorch's hook; where another tool sat on top, memtorch leaves it:
 *     that tool forwards to memtorch's hook, which then only forwards (the
 *     hooks and mt_real_* stay valid for the life of the process);
 *   - a reinstall adopts a slot that still holds its hook, else patches on
 *     top of what is there (whatever it is: nothing proves that it leads
 *     to us);
 *   - a tool that chains back to memtorch's hook after memtorch chained to
 *     it (install, tool, uninstall, install) would recurse forever: a
 *     per-thread depth guard sends a hook entered again from inside its own
 *     forwarding to what memtorch forwarded to before its last patch
 *     (mt_prev_*), and a third entry to the bottom function (what the
 *     dynamic linker binds the name to), so every chain ends;
 *   - mt_interpose_check() tells whether each slot still leads to memtorch
 *     (memray, when it stops, writes libc's functions into every slot it
 *     knows, memtorch's included), and mt_interpose_repair() patches on top
 *     of what is there now.
 */

/* What the hooks forward to (the slot's previous holder) and the bottom
 * functions used to break a cycle. Set before the first patching, changed
 * only by a patch or a repair, never cleared: a stale copy of a hook (a
 * saved &free, another tool's saved original) must keep working. */
static _Atomic(mt_posix_memalign_fn) mt_real_posix_memalign;
static _Atomic(mt_free_fn) mt_real_free;
static _Atomic(mt_posix_memalign_fn) mt_prev_posix_memalign;
static _Atomic(mt_free_fn) mt_prev_free;
static _Atomic(mt_posix_memalign_fn) mt_bottom_posix_memalign;
static _Atomic(mt_free_fn) mt_bottom_free;

/* Per-thread depth of the hooks' own forwarding (see above). */
static _Thread_local int mt_fwd_pm;
static _Thread_local int mt_fwd_free;

/* The forwarding when another tool lies under us (a cycle is possible):
 * kept out of line so that the fast path stays a leaf-like call. */
static __attribute__((noinline)) int
mt_pm_slow(void **out, size_t alignment, size_t size, mt_posix_memalign_fn real)
{
    int depth = mt_fwd_pm, rc;
    mt_posix_memalign_fn next = NULL;
    if (depth == 0) {
        next = real;
    }
    else if (depth == 1) {
        /* Entered again from our own forwarding: a tool chains back to us.
         * Counted by the outer call already; go on where we went before. */
        next = atomic_load_explicit(&mt_prev_posix_memalign, memory_order_acquire);
    }
    if (next == NULL) {
        next = atomic_load_explicit(&mt_bottom_posix_memalign, memory_order_acquire);
    }
    mt_fwd_pm = depth + 1;
    rc = next(out, alignment, size);
    mt_fwd_pm = depth;
    if (depth == 0 && rc == 0 && *out != NULL) {
        mt_counters_on_alloc(*out, size);
    }
    else if (depth == 0 && rc != 0) {
        mt_counters_on_fail(size);
    }
    return rc;
}

static int
mt_hook_posix_memalign(void **out, size_t alignment, size_t size)
{
    mt_posix_memalign_fn real =
        atomic_load_explicit(&mt_real_posix_memalign, memory_order_acquire);
    int rc;
    if (real != atomic_load_explicit(&mt_bottom_posix_memalign, memory_order_relaxed)) {
        return mt_pm_slow(out, alignment, size, real);
    }
    /* Fast path, nothing under us but the bottom function: no cycle possible. */
    rc = real(out, alignment, size);
    if (rc == 0 && *out != NULL) {
        mt_counters_on_alloc(*out, size);
    }
    else if (rc != 0) {
        mt_counters_on_fail(size);
    }
    return rc;
}

static __attribute__((noinline)) void
mt_free_slow(void *ptr, int kind, mt_free_fn real)
{
    int depth = mt_fwd_free;
    mt_free_fn next = NULL;
    if (depth == 0) {
        if (ptr != NULL) {
            /* Before the real free: the address cannot be reused meanwhile. */
            mt_counters_on_free(ptr, kind);
        }
        next = real;
    }
    else if (depth == 1) {
        next = atomic_load_explicit(&mt_prev_free, memory_order_acquire);
    }
    if (next == NULL) {
        next = atomic_load_explicit(&mt_bottom_free, memory_order_acquire);
    }
    mt_fwd_free = depth + 1;
    next(ptr);
    mt_fwd_free = depth;
}

static inline void
mt_free_common(void *ptr, int kind)
{
    mt_free_fn real = atomic_load_explicit(&mt_real_free, memory_order_acquire);
    if (real != atomic_load_explicit(&mt_bottom_free, memory_order_relaxed)) {
        mt_free_slow(ptr, kind, real);
        return;
    }
    if (ptr != NULL) {
        /* Before the real free: the address cannot be reused meanwhile. */
        mt_counters_on_free(ptr, kind);
    }
    real(ptr);
}

/* libc10's direct calls of free (c10::free_cpu among them). */
static void
mt_hook_free(void *ptr)
{
    mt_free_common(ptr, MT_FREE_DIRECT);
}

/* libc10's address-taken &free (a GLOB_DAT slot): c10::demangle's deleter
 * for __cxa_demangle's buffers, never c10::free_cpu. */
static void
mt_hook_free_ref(void *ptr)
{
    mt_free_common(ptr, MT_FREE_REF);
}

/* One import slot of the target library. */
typedef struct {
    void **addr;
    int in_relro;
    int fn;     /* MT_FN_PM or MT_FN_FREE */
    int is_ref; /* a GLOB_DAT slot (address taken), not a JUMP_SLOT */
} mt_slot;

/* What dl_iterate_phdr found about the target library, and its slots. */
typedef struct {
    int found;
    ElfW(Addr) base;
    const ElfW(Phdr) *phdr;
    ElfW(Half) phnum;
    char path[512];
    mt_slot slots[MT_MAX_SLOTS];
    int nslots;
    int nfn[2]; /* slots per function */
} mt_lib;

/* memtorch's own state, under the GIL and all table locks (counters.c). */
static mt_lib mt_lib_now;              /* located by mt_interpose_prepare */
static int mt_located;                 /* mt_lib_now is valid */
static void *mt_saved[MT_MAX_SLOTS];   /* what each slot held when patched */
static int mt_patched;

/* Basename of the library whose imports are patched: "libc10.so", or a
 * test's stand-in (_counters_set_target). Changed only while unpatched. */
static char mt_target[64] = "libc10.so";

static void *
mt_hook_of(const mt_slot *s)
{
    if (s->fn == MT_FN_PM) {
        return (void *)mt_hook_posix_memalign;
    }
    return s->is_ref ? (void *)mt_hook_free_ref : (void *)mt_hook_free;
}

/* "libc10.so" or "libc10.so.<version>", not libc10_cuda.so. */
static int
mt_is_target(const char *path)
{
    const char *base = strrchr(path, '/');
    size_t n = strlen(mt_target);
    base = base ? base + 1 : path;
    return strncmp(base, mt_target, n) == 0 && (base[n] == '\0' || base[n] == '.');
}

static int
mt_find_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    mt_lib *lib = (mt_lib *)data;
    if (info->dlpi_name == NULL || !mt_is_target(info->dlpi_name)) {
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

static const char *const mt_fn_names[2] = {"posix_memalign", "free"};

/* Find the target library and the GOT slots of posix_memalign and free into
 * *lib. 0 on success, -1 with a reason in err. Takes the dynamic linker's
 * lock (dl_iterate_phdr): never call with the table locks held. */
static int
mt_locate(mt_lib *lib, char *err, size_t errlen)
{
    memset(lib, 0, sizeof(*lib));
    if (!MT_ARCH_OK) {
        snprintf(err, errlen, "GOT patching is not implemented for this CPU architecture");
        goto error;
    }
    dl_iterate_phdr(mt_find_cb, lib);
    if (!lib->found) {
        snprintf(err, errlen, "%s is not loaded in this process (import torch first)", mt_target);
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
                continue; /* defined in the library itself: not an import */
            }
            const char *name = strtab + sym->st_name;
            for (int f = 0; f < 2; f++) {
                if (strcmp(name, mt_fn_names[f]) == 0 && lib->nslots < MT_MAX_SLOTS) {
                    uintptr_t addr = lib->base + r[i].r_offset;
                    mt_slot *s = &lib->slots[lib->nslots++];
                    s->addr = (void **)addr;
                    s->in_relro = addr >= relro_lo && addr < relro_hi;
                    s->fn = f;
                    s->is_ref = type == MT_R_GLOB_DAT;
                    lib->nfn[f]++;
                }
            }
        }
    }
    for (int f = 0; f < 2; f++) {
        if (lib->nfn[f] == 0) {
            /* torch's aarch64 libc10 links mimalloc and imports no
             * posix_memalign: nothing to interpose, say so. */
            snprintf(err, errlen, "%s does not import %s (unusual build)", lib->path,
                     mt_fn_names[f]);
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
mt_write_slot(const mt_slot *s, void *value)
{
    long pagesize = sysconf(_SC_PAGESIZE);
    uintptr_t page = (uintptr_t)s->addr & ~((uintptr_t)pagesize - 1);
    if (s->in_relro && mprotect((void *)page, (size_t)pagesize, PROT_READ | PROT_WRITE) != 0) {
        return -1;
    }
    __atomic_store_n(s->addr, value, __ATOMIC_SEQ_CST);
    if (s->in_relro) {
        (void)mprotect((void *)page, (size_t)pagesize, PROT_READ);
    }
    return 0;
}

static void *
mt_load_slot(const mt_slot *s)
{
    return __atomic_load_n(s->addr, __ATOMIC_SEQ_CST);
}

/* The function a slot value stands for: itself, unless it is a lazy PLT
 * stub inside the library (calling that would re-resolve and overwrite the
 * slot), then the bottom function. */
static void *
mt_resolve(const mt_lib *lib, void *v, int fn)
{
    if (v == NULL || mt_in_lib(lib, (uintptr_t)v)) {
        return fn == MT_FN_PM ? (void *)atomic_load(&mt_bottom_posix_memalign)
                              : (void *)atomic_load(&mt_bottom_free);
    }
    return v;
}

static int
mt_is_ours(void *v)
{
    return v == (void *)mt_hook_posix_memalign || v == (void *)mt_hook_free ||
           v == (void *)mt_hook_free_ref;
}

/* Forward fn to v from now on; what we forwarded to before becomes the
 * target of a re-entered hook. */
static void
mt_set_real(int fn, void *v)
{
    if (mt_is_ours(v)) {
        v = NULL; /* never forward to ourselves: the bottom function */
    }
    if (fn == MT_FN_PM) {
        mt_posix_memalign_fn old = atomic_load(&mt_real_posix_memalign);
        if (v == NULL) {
            v = (void *)atomic_load(&mt_bottom_posix_memalign);
        }
        if (old != NULL && (void *)old != v) {
            atomic_store_explicit(&mt_prev_posix_memalign, old, memory_order_release);
        }
        atomic_store_explicit(&mt_real_posix_memalign, (mt_posix_memalign_fn)v,
                              memory_order_release);
    }
    else {
        mt_free_fn old = atomic_load(&mt_real_free);
        if (v == NULL) {
            v = (void *)atomic_load(&mt_bottom_free);
        }
        if (old != NULL && (void *)old != v) {
            atomic_store_explicit(&mt_prev_free, old, memory_order_release);
        }
        atomic_store_explicit(&mt_real_free, (mt_free_fn)v, memory_order_release);
    }
}

const char *
mt_interpose_mechanism(void)
{
    if (!MT_ARCH_OK) {
        return NULL;
    }
    /* Named after what is patched, or would be: not where the target lacks
     * an import (aarch64 libc10 with mimalloc). */
    return (mt_patched || (mt_located && mt_lib_now.found)) ? "libc10-got" : NULL;
}

int
mt_interpose_prepare(char *err, size_t errlen)
{
    mt_lib lib;
    if (mt_patched) {
        return 0; /* located already; the library cannot go away */
    }
    if (mt_locate(&lib, err, errlen) < 0) {
        mt_located = 0;
        goto error;
    }
    /* The bottom functions: what the dynamic linker binds the names to
     * (libc's, or a sanitizer's interceptors). dlsym takes the loader's
     * lock: done here, never under the table locks. */
    if (atomic_load(&mt_bottom_posix_memalign) == NULL) {
        void *pm = dlsym(RTLD_DEFAULT, "posix_memalign");
        void *fr = dlsym(RTLD_DEFAULT, "free");
        if (pm == NULL || fr == NULL) {
            snprintf(err, errlen, "cannot resolve posix_memalign/free");
            goto error;
        }
        atomic_store(&mt_bottom_posix_memalign, (mt_posix_memalign_fn)pm);
        atomic_store(&mt_bottom_free, (mt_free_fn)fr);
    }
    mt_lib_now = lib;
    mt_located = 1;
    return 0;
error:
    return -1;
}

int
mt_interpose_probe(char *err, size_t errlen)
{
    return mt_interpose_prepare(err, errlen);
}

/* Patch slot i on top of what it holds now; 0 or -1 with errno set. */
static int
mt_patch_slot(int i)
{
    const mt_slot *s = &mt_lib_now.slots[i];
    void *cur = mt_load_slot(s);
    mt_saved[i] = cur;
    mt_set_real(s->fn, mt_resolve(&mt_lib_now, cur, s->fn));
    return mt_write_slot(s, mt_hook_of(s));
}

int
mt_interpose_patch(char *err, size_t errlen)
{
    if (mt_patched) {
        /* Double installation: the counters are refcounted above this. */
        snprintf(err, errlen, "already installed");
        goto error;
    }
    if (!mt_located) {
        snprintf(err, errlen, "the allocator was not located (internal error)");
        goto error;
    }
    /* A slot still holding our hook (a tool that patched after us put it
     * back) is adopted as is; every other slot is patched on top of what it
     * holds, and the function forwards to that. */
    for (int i = 0; i < mt_lib_now.nslots; i++) {
        const mt_slot *s = &mt_lib_now.slots[i];
        if (mt_load_slot(s) == mt_hook_of(s)) {
            continue;
        }
        if (mt_patch_slot(i) < 0) {
            int e = errno;
            for (int j = 0; j < i; j++) {
                const mt_slot *t = &mt_lib_now.slots[j];
                if (mt_load_slot(t) == mt_hook_of(t)) {
                    (void)mt_write_slot(t, mt_saved[j]);
                }
            }
            snprintf(err, errlen, "mprotect of %s's GOT failed: %s", mt_target, strerror(e));
            goto error;
        }
    }
    if (atomic_load(&mt_real_posix_memalign) == NULL || atomic_load(&mt_real_free) == NULL) {
        snprintf(err, errlen, "no function to forward to (internal error)");
        goto error;
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
    for (int i = 0; i < mt_lib_now.nslots; i++) {
        const mt_slot *s = &mt_lib_now.slots[i];
        void *cur = mt_load_slot(s);
        /* Where another tool patched the slot after us, it forwards to our
         * hook: cutting it out would silence it. Leave it; our hook keeps
         * forwarding. */
        if (cur == mt_hook_of(s)) {
            (void)mt_write_slot(s, mt_saved[i]);
        }
    }
    mt_patched = 0;
}

int
mt_interpose_check(uintptr_t *found)
{
    int lost = 0;
    if (!mt_patched) {
        return 0;
    }
    for (int i = 0; i < mt_lib_now.nslots; i++) {
        const mt_slot *s = &mt_lib_now.slots[i];
        void *cur = mt_load_slot(s);
        if (cur != mt_hook_of(s)) {
            if (lost == 0 && found != NULL) {
                *found = (uintptr_t)cur;
            }
            lost++;
        }
    }
    return lost;
}

int
mt_interpose_repair(void)
{
    int failed = 0;
    if (!mt_patched) {
        return 0;
    }
    for (int i = 0; i < mt_lib_now.nslots; i++) {
        const mt_slot *s = &mt_lib_now.slots[i];
        if (mt_load_slot(s) != mt_hook_of(s)) {
            /* Chain to what is there now. If it chains back to our hook,
             * the re-entrancy guard stops the cycle. */
            if (mt_patch_slot(i) < 0) {
                failed++;
            }
        }
    }
    return failed ? -1 : 0;
}

int
mt_interpose_describe(uintptr_t v, char *path, size_t pathlen, char *sym, size_t symlen)
{
    Dl_info info;
    path[0] = sym[0] = '\0';
    if (v == 0 || dladdr((void *)v, &info) == 0) {
        return -1;
    }
    if (info.dli_fname != NULL) {
        snprintf(path, pathlen, "%s", info.dli_fname);
    }
    if (info.dli_sname != NULL) {
        snprintf(sym, symlen, "%s", info.dli_sname);
    }
    return 0;
}

int
mt_interpose_set_target(const char *name)
{
    if (mt_patched || strlen(name) == 0 || strlen(name) >= sizeof(mt_target)) {
        return -1;
    }
    snprintf(mt_target, sizeof(mt_target), "%s", name);
    mt_located = 0;
    memset(mt_saved, 0, sizeof(mt_saved));
    return 0;
}

int
mt_interpose_slot_info(const char *name, uintptr_t vals[4])
{
    const mt_slot *s = NULL;
    int idx = -1;
    int fn = strcmp(name, "posix_memalign") == 0 ? MT_FN_PM : strcmp(name, "free") == 0 ? MT_FN_FREE : -1;
    if (fn < 0 || !mt_located) {
        return -1;
    }
    for (int i = 0; i < mt_lib_now.nslots && s == NULL; i++) {
        if (mt_lib_now.slots[i].fn == fn) {
            s = &mt_lib_now.slots[i];
            idx = i;
        }
    }
    if (s == NULL) {
        return -1;
    }
    vals[0] = (uintptr_t)mt_load_slot(s);
    vals[1] = mt_patched ? (uintptr_t)mt_saved[idx] : vals[0];
    vals[2] = (fn == MT_FN_PM) ? (uintptr_t)atomic_load(&mt_real_posix_memalign)
                               : (uintptr_t)atomic_load(&mt_real_free);
    vals[3] = (uintptr_t)mt_hook_of(s);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* A stand-in for another tool that patches the same slots (tests only):     */
/* MT_TOOL_CHAIN forwards to what it found and, uninstalling, puts it back    */
/* only where its own hook still sits; MT_TOOL_NAIVE puts it back anyway;    */
/* MT_TOOL_LIBC forwards to the bottom functions and restores them (what     */
/* memray does). Not thread-safe against itself: tests call it from one      */
/* thread.                                                                   */

static _Atomic long mt_tool_calls;
static _Atomic(mt_posix_memalign_fn) mt_tool_next_pm;
static _Atomic(mt_free_fn) mt_tool_next_free;
static mt_lib mt_tool_lib;
static void *mt_tool_saved[MT_MAX_SLOTS];
static int mt_tool_mode; /* 0: not installed */

static int
mt_tool_pm(void **out, size_t alignment, size_t size)
{
    atomic_fetch_add(&mt_tool_calls, 1);
    return atomic_load(&mt_tool_next_pm)(out, alignment, size);
}

static void
mt_tool_free(void *ptr)
{
    atomic_fetch_add(&mt_tool_calls, 1);
    atomic_load(&mt_tool_next_free)(ptr);
}

int
mt_interpose_tool(int action, char *err, size_t errlen)
{
    if (action != MT_TOOL_UNINSTALL) {
        void *next[2] = {NULL, NULL};
        if (mt_tool_mode != 0) {
            snprintf(err, errlen, "the test tool is already installed");
            goto error;
        }
        if (mt_interpose_prepare(err, errlen) < 0 && !mt_patched) {
            goto error;
        }
        if (mt_locate(&mt_tool_lib, err, errlen) < 0) {
            goto error;
        }
        for (int i = 0; i < mt_tool_lib.nslots; i++) {
            const mt_slot *s = &mt_tool_lib.slots[i];
            mt_tool_saved[i] = mt_load_slot(s);
            if (next[s->fn] == NULL) {
                next[s->fn] = (action == MT_TOOL_LIBC) ? NULL : mt_tool_saved[i];
            }
        }
        atomic_store(&mt_tool_next_pm, (mt_posix_memalign_fn)mt_resolve(&mt_tool_lib, next[0], MT_FN_PM));
        atomic_store(&mt_tool_next_free, (mt_free_fn)mt_resolve(&mt_tool_lib, next[1], MT_FN_FREE));
        for (int i = 0; i < mt_tool_lib.nslots; i++) {
            const mt_slot *s = &mt_tool_lib.slots[i];
            if (mt_write_slot(s, s->fn == MT_FN_PM ? (void *)mt_tool_pm : (void *)mt_tool_free) < 0) {
                snprintf(err, errlen, "mprotect failed: %s", strerror(errno));
                goto error;
            }
        }
        mt_tool_mode = action;
        return 0;
    }
    if (mt_tool_mode == 0) {
        snprintf(err, errlen, "the test tool is not installed");
        goto error;
    }
    for (int i = 0; i < mt_tool_lib.nslots; i++) {
        const mt_slot *s = &mt_tool_lib.slots[i];
        void *mine = s->fn == MT_FN_PM ? (void *)mt_tool_pm : (void *)mt_tool_free;
        void *value = mt_tool_saved[i];
        if (mt_tool_mode == MT_TOOL_CHAIN && mt_load_slot(s) != mine) {
            continue;
        }
        if (mt_tool_mode == MT_TOOL_LIBC) {
            value = mt_resolve(&mt_tool_lib, NULL, s->fn);
        }
        (void)mt_write_slot(s, value);
    }
    mt_tool_mode = 0;
    return 0;
error:
    return -1;
}

long
mt_interpose_tool_calls(void)
{
    return atomic_load(&mt_tool_calls);
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
