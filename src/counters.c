/* counters.c: process-wide CPU allocation counters: pointer -> size table, atomic current/peak, scopes. */
#include "mt.h"
#include "counters.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <malloc.h>

/*
 * PROCESS-WIDE STATE. Everything in this file is global on purpose: the
 * allocator that is interposed is one per process, so are its counters.
 * (STYLE.md: the one process-wide resource of memtorch._C; installation is
 * refcounted and a second patching of the same entries is refused.)
 *
 * Semantics, exactly:
 *   - Counting runs while installed (refcount > 0). Installing (0 -> 1) empties
 *     the table and sets current and peak to 0; uninstalling (1 -> 0) restores
 *     the original import entries, then empties the table and zeroes current.
 *   - current = bytes requested from PyTorch's CPU allocator while installed
 *     and not freed yet. An allocation made before installation is not in the
 *     table, so its free is ignored: current never goes negative.
 *   - peak = highest current since installation or the last reset_peak().
 *   - A scope keeps its own start (current when opened) and peak (highest
 *     current while it was open); reset_peak() never touches scopes.
 *
 * Locking: the table is split in MT_NSTRIPES stripes, each with a spinlock; a
 * hook holds the lock of its pointer's stripe for the whole update (table,
 * current, peaks, event log). Rare operations (install, uninstall, opening and
 * closing scopes, reset_peak) take every stripe lock in order ("stop the
 * world"), so they never see a half-done update and a hook never sees a
 * half-opened scope. The hooks never call Python and never take the GIL.
 */

#define MT_NSTRIPES 64
#define MT_NSCOPES 64

typedef struct {
    uintptr_t key; /* 0: empty */
    size_t size;
    uint64_t serial; /* this allocation among all counted ones: stripe << 56 | its number there */
} mt_entry;

/* One stripe of the table: open addressing, linear probing, backward-shift
 * deletion, grown at half load. Memory from the real calloc/free of this
 * extension, which are not interposed. */
typedef struct {
    _Alignas(64) atomic_flag lock;
    mt_entry *slots;
    size_t cap; /* 0 or a power of two */
    size_t count;
    /* Statistics, per stripe so that the hooks need no shared atomic for
     * them: allocations with no room in the table (out of memory), counted
     * allocations and frees since installation. */
    int64_t lost, nallocs, nfrees;
    /* Frees of pointers not in the table that could be tensor storage
     * (allocated before counting began) and their usable sizes: what the
     * counters could not see leave. Frees that cannot be tensor storage
     * (through libc10's address-taken &free, or not aligned as
     * c10::alloc_cpu aligns) are only counted, as foreign. */
    int64_t unseen, unseen_bytes, foreign;
    uint64_t serials; /* allocations numbered in this stripe (never reset) */
} mt_stripe;

typedef struct {
    int64_t start;          /* current when opened */
    _Atomic int64_t peak;   /* highest current while open */
    int timeline;           /* 1 if it keeps the event log running */
    uint64_t generation;    /* tells a reused slot from the one a caller holds */
    pthread_t owner;        /* the thread that opened it */
    /* Allocations counted while open that another thread made. */
    _Atomic int64_t other_bytes, other_allocs;
    int hook_lost;          /* our hooks were found gone while it was open */
} mt_scope;

static mt_stripe mt_stripes[MT_NSTRIPES];
static pthread_once_t mt_once = PTHREAD_ONCE_INIT;

static _Atomic int mt_active;         /* 1 while counting */
static _Atomic int64_t mt_current;    /* bytes live, counted */
static _Atomic int64_t mt_peak;       /* global peak since install/reset */
static _Atomic uint64_t mt_scope_mask; /* bit i: scope i is open */
static mt_scope mt_scopes[MT_NSCOPES];
static uint64_t mt_scope_generation;  /* under all stripe locks */
static int mt_install_count;          /* under the GIL and all stripe locks */
/* Times our hooks were found gone from their slots (and patched again), and
 * what the first lost slot held then; under all stripe locks. */
static uint64_t mt_loss_count;
static uintptr_t mt_loss_found;
/* When the table was first started afresh after a loss since counting began
 * (CLOCK_MONOTONIC ns; 0: never): from then on the counters hold only what was
 * allocated since, so absolute figures have an unknown baseline until counting
 * restarts (the install that patches zeroes it). Under all stripe locks. */
static int64_t mt_restart_ns;

/* The last tensor allocation that failed while counting (the out-of-memory
 * post-mortem reads it after the error reached Python): how many failed, the
 * size asked for, the counted bytes then, the event log's head (the events
 * before it happened before the failure), the failing thread's owner tag, and
 * its CLOCK_MONOTONIC time. Written by the failing thread with relaxed stores
 * (a second failure racing a reader can mix two failures' fields: the count
 * read before and after tells). */
static _Atomic uint64_t mt_fail_count;
static _Atomic int64_t mt_fail_size, mt_fail_bytes, mt_fail_ns;
static _Atomic uint64_t mt_fail_head;
static _Atomic uint32_t mt_fail_tag;

/* Re-entrancy guard: set while this thread is inside a hook, so that
 * anything the hook itself allocates is never counted (memray's recursion
 * guard is the model). */
static _Thread_local int mt_in_hook;

/* A stripe lock: a test-and-set spinlock that yields the CPU after a few
 * turns (a holder may be preempted on a busy machine). Critical sections
 * are a few dozen instructions and never block. */
static inline void
mt_stripe_lock(mt_stripe *s)
{
    int turns = 0;
    while (atomic_flag_test_and_set_explicit(&s->lock, memory_order_acquire)) {
        if (++turns >= 64) {
            sched_yield();
            turns = 0;
        }
    }
}

static inline void
mt_stripe_unlock(mt_stripe *s)
{
    atomic_flag_clear_explicit(&s->lock, memory_order_release);
}

static void
mt_take_all(void)
{
    for (int i = 0; i < MT_NSTRIPES; i++) {
        mt_stripe_lock(&mt_stripes[i]);
    }
}

static void
mt_unlock_all(void)
{
    for (int i = MT_NSTRIPES - 1; i >= 0; i--) {
        mt_stripe_unlock(&mt_stripes[i]);
    }
}

static void
mt_init_locks(void)
{
    for (int i = 0; i < MT_NSTRIPES; i++) {
        atomic_flag_clear(&mt_stripes[i].lock);
    }
    /* fork() (DataLoader workers) while another thread holds a stripe lock
     * would leave the child's copy locked forever: hold them all across it. */
    pthread_atfork(mt_take_all, mt_unlock_all, mt_unlock_all);
}

static void
mt_lock_all(void)
{
    pthread_once(&mt_once, mt_init_locks);
    mt_take_all();
}

/* Mix the address (murmur3's finalizer): the low bits of aligned pointers
 * are all zero. */
static inline uint64_t
mt_hash(uintptr_t p)
{
    uint64_t h = (uint64_t)p;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline size_t
mt_home(const mt_stripe *s, uint64_t h)
{
    return (size_t)(h >> 6) & (s->cap - 1);
}

/* Grow the stripe to twice its size; 0 or -1 on out-of-memory. */
static int
mt_stripe_grow(mt_stripe *s)
{
    size_t ncap = s->cap ? s->cap * 2 : 256;
    mt_entry *nslots = calloc(ncap, sizeof(mt_entry));
    if (nslots == NULL) {
        return -1;
    }
    mt_entry *old = s->slots;
    size_t ocap = s->cap;
    s->slots = nslots;
    s->cap = ncap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].key != 0) {
            size_t j = mt_home(s, mt_hash(old[i].key));
            while (nslots[j].key != 0) {
                j = (j + 1) & (ncap - 1);
            }
            nslots[j] = old[i];
        }
    }
    free(old);
    return 0;
}

/* Insert or replace; returns the size it replaced (0 if new), or -1 when
 * there was no room. */
static int64_t
mt_stripe_put(mt_stripe *s, uintptr_t key, size_t size, uint64_t h)
{
    if ((s->count + 1) * 2 > s->cap && mt_stripe_grow(s) < 0) {
        return -1;
    }
    size_t j = mt_home(s, h);
    while (s->slots[j].key != 0) {
        if (s->slots[j].key == key) {
            /* Cannot happen while every free is seen; kept exact anyway. */
            int64_t old = (int64_t)s->slots[j].size;
            s->slots[j].size = size;
            s->slots[j].serial = ((uint64_t)(s - mt_stripes) << 56) | ++s->serials;
            return old;
        }
        j = (j + 1) & (s->cap - 1);
    }
    s->slots[j].key = key;
    s->slots[j].size = size;
    s->slots[j].serial = ((uint64_t)(s - mt_stripes) << 56) | ++s->serials;
    s->count++;
    return 0;
}

/* Remove key; returns its size, or -1 if it was not there. */
static int64_t
mt_stripe_take(mt_stripe *s, uintptr_t key, uint64_t h)
{
    if (s->count == 0) {
        return -1;
    }
    size_t mask = s->cap - 1;
    size_t i = mt_home(s, h);
    while (s->slots[i].key != key) {
        if (s->slots[i].key == 0) {
            return -1;
        }
        i = (i + 1) & mask;
    }
    int64_t size = (int64_t)s->slots[i].size;
    /* Backward-shift deletion: move later entries of the probe run into the
     * hole when the hole lies cyclically between their home and them. */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (s->slots[j].key == 0) {
            break;
        }
        size_t k = mt_home(s, mt_hash(s->slots[j].key));
        int between = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!between) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i].key = 0;
    s->slots[i].size = 0;
    s->count--;
    return size;
}

static void
mt_table_clear(void)
{
    for (int i = 0; i < MT_NSTRIPES; i++) {
        free(mt_stripes[i].slots);
        mt_stripes[i].slots = NULL;
        mt_stripes[i].cap = 0;
        mt_stripes[i].count = 0;
        mt_stripes[i].lost = mt_stripes[i].nallocs = mt_stripes[i].nfrees = 0;
        mt_stripes[i].unseen = mt_stripes[i].unseen_bytes = mt_stripes[i].foreign = 0;
    }
}

/* Forget every pointer but keep the statistics (after our hooks were gone
 * for a while: the frees missed meanwhile left entries that are no longer
 * true). Caller holds all locks. */
static void
mt_table_drop(void)
{
    for (int i = 0; i < MT_NSTRIPES; i++) {
        free(mt_stripes[i].slots);
        mt_stripes[i].slots = NULL;
        mt_stripes[i].cap = 0;
        mt_stripes[i].count = 0;
    }
}

static inline void
mt_raise_to(_Atomic int64_t *peak, int64_t now)
{
    int64_t seen = atomic_load_explicit(peak, memory_order_relaxed);
    while (now > seen &&
           !atomic_compare_exchange_weak_explicit(
               peak, &seen, now, memory_order_relaxed, memory_order_relaxed)) {
    }
}

/* The new value of current after a counted change: raise the global peak
 * and the peak of every open scope, log the event; returns what
 * mt_eventlog_record returned. Caller holds a stripe lock, so the scope set
 * cannot change under it. */
static inline uint64_t
mt_after_change(int64_t now, int grew, const void *ptr, int64_t delta)
{
    if (grew) {
        mt_raise_to(&mt_peak, now);
        uint64_t mask = atomic_load_explicit(&mt_scope_mask, memory_order_relaxed);
        while (mask) {
            int i = __builtin_ctzll(mask);
            mt_raise_to(&mt_scopes[i].peak, now);
            mask &= mask - 1;
        }
    }
    return mt_eventlog_record(now, ptr, delta);
}

void
mt_counters_on_alloc(void *ptr, size_t size)
{
    if (mt_in_hook || !atomic_load_explicit(&mt_active, memory_order_relaxed)) {
        return;
    }
    mt_in_hook = 1;
    uint64_t h = mt_hash((uintptr_t)ptr);
    uint64_t site = 0;
    mt_stripe *s = &mt_stripes[h & (MT_NSTRIPES - 1)];
    mt_stripe_lock(s);
    /* Checked again under the lock: uninstall clears with every lock held. */
    if (atomic_load_explicit(&mt_active, memory_order_relaxed)) {
        int64_t old = mt_stripe_put(s, (uintptr_t)ptr, size, h);
        if (old < 0) {
            s->lost++;
        }
        else {
            int64_t delta = (int64_t)size - old;
            int64_t now = atomic_fetch_add_explicit(
                              &mt_current, delta, memory_order_relaxed) + delta;
            s->nallocs++;
            site = mt_after_change(now, delta > 0, ptr, delta);
            /* The counters are process-wide: note, per open scope, what
             * other threads than its owner allocated (one compare each).
             * torch's intra-op workers are not other threads: they allocate
             * inside an operator a Python thread called, for it. */
            uint64_t mask = atomic_load_explicit(&mt_scope_mask, memory_order_relaxed);
            if (mask) {
                pthread_t me = pthread_self();
                int worker = -1; /* unknown until a scope asks */
                while (mask) {
                    int i = __builtin_ctzll(mask);
                    if (!pthread_equal(mt_scopes[i].owner, me)) {
                        if (worker < 0) {
                            worker = !mt_thread_runs_python();
                        }
                        if (!worker) {
                            atomic_fetch_add_explicit(&mt_scopes[i].other_bytes, (int64_t)size,
                                                      memory_order_relaxed);
                            atomic_fetch_add_explicit(&mt_scopes[i].other_allocs, 1,
                                                      memory_order_relaxed);
                        }
                    }
                    mask &= mask - 1;
                }
            }
        }
    }
    mt_stripe_unlock(s);
    if (__builtin_expect(site != 0, 0)) {
        /* Its source line, outside the lock (it may read a Python frame);
         * the guard stays set, so nothing it allocates is counted. */
        mt_sites_capture(site - 1, (int64_t)size);
    }
    mt_in_hook = 0;
}

void
mt_counters_on_fail(size_t size)
{
    if (!atomic_load_explicit(&mt_active, memory_order_relaxed)) {
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    atomic_store_explicit(&mt_fail_size, (int64_t)size, memory_order_relaxed);
    atomic_store_explicit(&mt_fail_bytes, atomic_load_explicit(&mt_current, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&mt_fail_head, mt_eventlog_head(), memory_order_relaxed);
    atomic_store_explicit(&mt_fail_tag, mt_eventlog_tag_now(), memory_order_relaxed);
    atomic_store_explicit(&mt_fail_ns, (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec,
                          memory_order_relaxed);
    atomic_fetch_add_explicit(&mt_fail_count, 1, memory_order_release);
}

int
mt_thread_runs_python(void)
{
    return PyGILState_GetThisThreadState() != NULL;
}

void
mt_counters_on_free(void *ptr, int kind)
{
    if (mt_in_hook || !atomic_load_explicit(&mt_active, memory_order_relaxed)) {
        return;
    }
    mt_in_hook = 1;
    uint64_t h = mt_hash((uintptr_t)ptr);
    mt_stripe *s = &mt_stripes[h & (MT_NSTRIPES - 1)];
    mt_stripe_lock(s);
    if (atomic_load_explicit(&mt_active, memory_order_relaxed)) {
        /* Unknown pointers (made before installation, or by libc10 for other
         * reasons than tensors) are not in the table: ignored. */
        int64_t size = mt_stripe_take(s, (uintptr_t)ptr, h);
        if (size >= 0) {
            int64_t now = atomic_fetch_sub_explicit(
                              &mt_current, size, memory_order_relaxed) - size;
            s->nfrees++;
            (void)mt_after_change(now, 0, ptr, -size);
        }
        else if (ptr != NULL) {
            /* Could it be tensor storage? c10::free_cpu frees through
             * libc10's direct call of free, and c10::alloc_cpu's blocks are
             * aligned to 64 bytes at least. libc10's other frees (demangled
             * names through its &free, C strings, ...) are not. */
            if (kind != MT_FREE_REF && ((uintptr_t)ptr & (MT_C10_ALIGNMENT - 1)) == 0) {
                /* malloc_usable_size() is libc's (or ASan's) and allocates
                 * nothing; it may exceed the size once requested. Only a
                 * real pointer (not a test's fake one) may be asked. */
                s->unseen++;
                s->unseen_bytes += kind == MT_FREE_DIRECT ? (int64_t)malloc_usable_size(ptr) : 0;
            }
            else {
                s->foreign++;
            }
        }
    }
    mt_stripe_unlock(s);
    mt_in_hook = 0;
}

/* Integrity check, with all locks held: if our hooks are gone from any
 * slot (another tool wrote its own or libc's functions there), patch them
 * back on top of what is there, mark every open scope, and start the table
 * afresh: frees missed meanwhile left entries that are no longer true.
 * Open scopes' figures are shifted with current so that they stay
 * consistent (they are not exact any more, and say so). Returns the number
 * of lost slots found. */
static int
mt_check_locked(void)
{
    uintptr_t found = 0;
    int lost;
    if (mt_install_count == 0) {
        return 0;
    }
    lost = mt_interpose_check(&found);
    if (lost == 0) {
        return 0;
    }
    (void)mt_interpose_repair();
    mt_loss_count++;
    mt_loss_found = found;
    if (mt_restart_ns == 0) {
        mt_restart_ns = mt_monotonic_ns();
    }
    int64_t old = atomic_load(&mt_current);
    mt_table_drop();
    atomic_store(&mt_current, 0);
    atomic_store(&mt_peak, 0);
    uint64_t mask = atomic_load(&mt_scope_mask);
    while (mask) {
        int i = __builtin_ctzll(mask);
        mt_scopes[i].hook_lost = 1;
        mt_scopes[i].start -= old;
        atomic_store(&mt_scopes[i].peak, atomic_load(&mt_scopes[i].peak) - old);
        mask &= mask - 1;
    }
    return lost;
}

int64_t
mt_counters_current(void)
{
    return atomic_load_explicit(&mt_current, memory_order_relaxed);
}

/* The counted size of the live allocation at ptr, or -1 if the table does
 * not hold it (for the event log's replay: which storages made before a
 * block are counted). Takes the pointer's stripe lock. */
int64_t
mt_counters_size_of(const void *ptr)
{
    int64_t serial;
    return mt_counters_lookup(ptr, &serial);
}

/* The counted size of the live allocation at ptr (-1: none), and in *serial
 * the number that tells this allocation from any other made at the same
 * address before or after it (-1: none). Takes the pointer's stripe lock. */
int64_t
mt_counters_lookup(const void *ptr, int64_t *serial)
{
    int64_t size = -1;
    *serial = -1;
    uint64_t h = mt_hash((uintptr_t)ptr);
    mt_stripe *s = &mt_stripes[h & (MT_NSTRIPES - 1)];
    mt_stripe_lock(s);
    if (s->count > 0) {
        size_t j = mt_home(s, h);
        while (s->slots[j].key != 0) {
            if (s->slots[j].key == (uintptr_t)ptr) {
                size = (int64_t)s->slots[j].size;
                *serial = (int64_t)(s->slots[j].serial & INT64_MAX);
                break;
            }
            j = (j + 1) & (s->cap - 1);
        }
    }
    mt_stripe_unlock(s);
    return size;
}

/* mt_counters_lookup() of n addresses at once (0: none): sizes[i] and serials[i]
 * (-1 where the table holds none). The addresses a block names (its model's
 * parameters, gradients and optimizer state) sit in parts of the table a
 * training step seldom touches, so each probe waits on memory (about 100 ns):
 * under every stripe lock, held once, every probe's first slot is prefetched
 * before any is read, so that the waits overlap. Never allocates. */
void
mt_counters_lookup_many(const uintptr_t *ptrs, size_t n, int64_t *sizes, int64_t *serials)
{
    mt_lock_all();
    for (size_t i = 0; i < n; i++) {
        const mt_stripe *s = &mt_stripes[mt_hash(ptrs[i]) & (MT_NSTRIPES - 1)];
        if (ptrs[i] != 0 && s->count > 0) {
            __builtin_prefetch(&s->slots[mt_home(s, mt_hash(ptrs[i]))]);
        }
    }
    for (size_t i = 0; i < n; i++) {
        sizes[i] = serials[i] = -1;
        uint64_t h = mt_hash(ptrs[i]);
        const mt_stripe *s = &mt_stripes[h & (MT_NSTRIPES - 1)];
        if (ptrs[i] == 0 || s->count == 0) {
            continue;
        }
        for (size_t j = mt_home(s, h); s->slots[j].key != 0; j = (j + 1) & (s->cap - 1)) {
            if (s->slots[j].key == ptrs[i]) {
                sizes[i] = (int64_t)s->slots[j].size;
                serials[i] = (int64_t)(s->slots[j].serial & INT64_MAX);
                break;
            }
        }
    }
    mt_unlock_all();
}

/* ------------------------------------------------------------------------ */
/* Python entry points (called with the GIL held).                           */

static void
mt_reset_counts(void)
{
    mt_restart_ns = 0;
    mt_table_clear();
    atomic_store(&mt_current, 0);
    atomic_store(&mt_peak, 0);
}

PyDoc_STRVAR(install_doc,
"counters_install($module, /)\n--\n\n"
"Start counting (refcounted). The first call patches the allocator's imports\n"
"and zeroes the counters; raises OSError where that is impossible.");

static PyObject *
counters_install(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    char err[256] = "";
    int rc = 0;
    /* Locating takes the dynamic linker's lock: before the table locks. */
    if (mt_interpose_prepare(err, sizeof(err)) < 0) {
        PyErr_Format(PyExc_OSError, "cannot install the CPU allocation counters: %s", err);
        return NULL;
    }
    mt_lock_all();
    if (mt_install_count == 0) {
        mt_reset_counts();
        atomic_store(&mt_active, 1);
        rc = mt_interpose_patch(err, sizeof(err));
        if (rc < 0) {
            atomic_store(&mt_active, 0);
        }
    }
    else {
        (void)mt_check_locked();
    }
    if (rc == 0) {
        mt_install_count++;
    }
    mt_unlock_all();
    if (rc < 0) {
        PyErr_Format(PyExc_OSError, "cannot install the CPU allocation counters: %s", err);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uninstall_doc,
"counters_uninstall($module, /)\n--\n\n"
"Undo one counters_install(); the last one restores the original imports\n"
"and zeroes the counters. Raises RuntimeError if not installed, or if\n"
"scopes are still open at the last one.");

/* Undo one installation; caller holds all locks. NULL, or why it was refused. */
static const char *
mt_uninstall_locked(void)
{
    if (mt_install_count == 0) {
        return "the CPU allocation counters are not installed";
    }
    if (mt_install_count == 1 && atomic_load(&mt_scope_mask) != 0) {
        return "cannot uninstall the CPU allocation counters while scopes are open";
    }
    if (--mt_install_count == 0) {
        mt_interpose_unpatch();
        atomic_store(&mt_active, 0);
        mt_reset_counts();
    }
    return NULL;
}

static PyObject *
counters_uninstall(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const char *problem;
    mt_lock_all();
    problem = mt_uninstall_locked();
    mt_unlock_all();
    if (problem != NULL) {
        PyErr_SetString(PyExc_RuntimeError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(installed_doc,
"counters_installed($module, /)\n--\n\n"
"The installation refcount (0: not counting).");

static PyObject *
counters_installed(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    int n;
    mt_lock_all();
    n = mt_install_count;
    mt_unlock_all();
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(probe_doc,
"counters_probe($module, /)\n--\n\n"
"None if the exact mechanism can be installed now, else the reason (str).");

static PyObject *
counters_probe(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    char err[256] = "";
    if (mt_interpose_probe(err, sizeof(err)) == 0) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromString(err);
}

PyDoc_STRVAR(mechanism_doc,
"counters_mechanism($module, /)\n--\n\n"
"Name of the exact mechanism patched now, or found usable by the last\n"
"install or probe (e.g. 'libc10-got'); None where there is none.");

static PyObject *
counters_mechanism(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const char *name = mt_interpose_mechanism();
    if (name == NULL) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromString(name);
}

PyDoc_STRVAR(current_doc,
"counters_current($module, /)\n--\n\n"
"Bytes counted live now (0 when not installed).");

static PyObject *
counters_current(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(atomic_load(&mt_current));
}

PyDoc_STRVAR(last_failure_doc,
"counters_last_failure($module, /)\n--\n\n"
"The last tensor allocation that failed while counting: (count, size, bytes,\n"
"head, tag, time_ns): failures so far, the bytes asked for, the counted bytes\n"
"then, the event log's head then, the failing thread's owner tag, and its\n"
"CLOCK_MONOTONIC time (all 0 before any failure).");

static PyObject *
counters_last_failure(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    uint64_t count = atomic_load_explicit(&mt_fail_count, memory_order_acquire);
    return Py_BuildValue(
        "(KLLKkL)", (unsigned long long)count,
        (long long)atomic_load_explicit(&mt_fail_size, memory_order_relaxed),
        (long long)atomic_load_explicit(&mt_fail_bytes, memory_order_relaxed),
        (unsigned long long)atomic_load_explicit(&mt_fail_head, memory_order_relaxed),
        (unsigned long)atomic_load_explicit(&mt_fail_tag, memory_order_relaxed),
        (long long)atomic_load_explicit(&mt_fail_ns, memory_order_relaxed));
}

PyDoc_STRVAR(peak_doc,
"counters_peak($module, /)\n--\n\n"
"Highest current since installation or the last counters_reset_peak().");

static PyObject *
counters_peak(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(atomic_load(&mt_peak));
}

PyDoc_STRVAR(reset_peak_doc,
"counters_reset_peak($module, /)\n--\n\n"
"Set the global peak to current; open scopes keep their own peaks.");

static PyObject *
counters_reset_peak(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    mt_lock_all();
    atomic_store(&mt_peak, atomic_load(&mt_current));
    mt_unlock_all();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stats_doc,
"counters_stats($module, /)\n--\n\n"
"(live_entries, lost, allocations, frees, unseen_frees, unseen_bytes,\n"
"foreign_frees, hook_losses) since installation: entries in the table,\n"
"allocations that could not be recorded (out of memory), counted allocations\n"
"and frees, frees of pointers the table does not hold that could be tensor\n"
"storage and their usable bytes, frees that cannot be tensor storage, and\n"
"the times the hooks were found gone and patched again (process lifetime).");

/* The table's statistics summed over the stripes; caller holds all locks. */
typedef struct {
    long long live, lost, nallocs, nfrees, unseen, unseen_bytes, foreign;
} mt_totals;

static void
mt_totals_locked(mt_totals *t)
{
    memset(t, 0, sizeof(*t));
    for (int i = 0; i < MT_NSTRIPES; i++) {
        t->live += (long long)mt_stripes[i].count;
        t->lost += (long long)mt_stripes[i].lost;
        t->nallocs += (long long)mt_stripes[i].nallocs;
        t->nfrees += (long long)mt_stripes[i].nfrees;
        t->unseen += (long long)mt_stripes[i].unseen;
        t->unseen_bytes += (long long)mt_stripes[i].unseen_bytes;
        t->foreign += (long long)mt_stripes[i].foreign;
    }
}

static PyObject *
counters_stats(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    mt_totals t;
    unsigned long long losses;
    mt_lock_all();
    mt_totals_locked(&t);
    losses = (unsigned long long)mt_loss_count;
    mt_unlock_all();
    return Py_BuildValue("(LLLLLLLK)", t.live, t.lost, t.nallocs, t.nfrees, t.unseen, t.unseen_bytes,
                         t.foreign, losses);
}

PyDoc_STRVAR(check_doc,
"counters_check($module, /)\n--\n\n"
"Check that the hooks are still in their import slots; where another tool\n"
"replaced them, patch them again on top of it (the table starts afresh and\n"
"open scopes are marked). Returns the number of lost slots found (0: all\n"
"well, or not installed).");

static PyObject *
counters_check(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    int lost;
    mt_lock_all();
    lost = mt_check_locked();
    mt_unlock_all();
    return PyLong_FromLong(lost);
}

PyDoc_STRVAR(restarted_doc,
"counters_restarted($module, /)\n--\n\n"
"CLOCK_MONOTONIC ns at which the table was first started afresh after another\n"
"tool took the hooks since counting began (absolute figures count only what\n"
"was allocated since), or 0 if it never was.");

static PyObject *
counters_restarted(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    long long ns;
    mt_lock_all();
    ns = (long long)mt_restart_ns;
    mt_unlock_all();
    return PyLong_FromLongLong(ns);
}

PyDoc_STRVAR(loss_info_doc,
"counters_loss_info($module, /)\n--\n\n"
"(times the hooks were found gone, path of the object whose function sat in\n"
"the first lost slot the last time, its symbol name); the strings are None\n"
"when unknown or when it never happened.");

static PyObject *
counters_loss_info(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    char path[512], sym[256];
    unsigned long long n;
    uintptr_t found;
    PyObject *py_path = NULL, *py_sym = NULL, *result = NULL;
    mt_lock_all();
    n = (unsigned long long)mt_loss_count;
    found = mt_loss_found;
    mt_unlock_all();
    /* dladdr takes the dynamic linker's lock: after the table locks. */
    if (found == 0 || mt_interpose_describe(found, path, sizeof(path), sym, sizeof(sym)) < 0) {
        path[0] = sym[0] = '\0';
    }
    py_path = path[0] ? PyUnicode_DecodeFSDefault(path) : Py_NewRef(Py_None);
    if (py_path == NULL) {
        goto error;
    }
    py_sym = sym[0] ? PyUnicode_DecodeFSDefault(sym) : Py_NewRef(Py_None);
    if (py_sym == NULL) {
        goto error;
    }
    result = Py_BuildValue("(KOO)", n, py_path, py_sym);
error:
    Py_XDECREF(py_path);
    Py_XDECREF(py_sym);
    return result;
}

/* Open a scope; caller holds all locks. Its id, or -1 with *problem set. */
static int
mt_scope_open_locked(int timeline, int64_t *start, uint64_t *gen, const char **problem)
{
    /* Cheap integrity check first (a few loads): a scope opened after
     * another tool took the slots starts on our hooks again. */
    (void)mt_check_locked();
    uint64_t mask = atomic_load(&mt_scope_mask);
    if (mt_install_count == 0) {
        *problem = "the CPU allocation counters are not installed";
        return -1;
    }
    if (mask == UINT64_MAX) {
        *problem = "too many open CPU counter scopes (64)";
        return -1;
    }
    int id = __builtin_ctzll(~mask);
    *start = atomic_load(&mt_current);
    *gen = ++mt_scope_generation;
    mt_scopes[id].start = *start;
    atomic_store(&mt_scopes[id].peak, *start);
    mt_scopes[id].timeline = timeline;
    mt_scopes[id].generation = *gen;
    mt_scopes[id].owner = pthread_self();
    atomic_store(&mt_scopes[id].other_bytes, 0);
    atomic_store(&mt_scopes[id].other_allocs, 0);
    mt_scopes[id].hook_lost = 0;
    atomic_store(&mt_scope_mask, mask | (1ULL << id));
    return id;
}

/* The open and close of scope_open/scope_begin (begin: also take one
 * installation, and read the statistics a Scope starts from, in the same
 * stop-the-world). NULL with an exception set on failure. */
static PyObject *
mt_scope_start(PyObject *arg, int begin)
{
    int timeline = PyObject_IsTrue(arg);
    const char *problem = NULL;
    int id = -1;
    int64_t start = 0;
    uint64_t gen = 0;
    mt_totals t = {0};
    if (timeline < 0) {
        goto error;
    }
    /* Started before taking the locks: it may allocate the ring buffer. */
    if (timeline && mt_eventlog_start() < 0) {
        PyErr_NoMemory();
        goto error;
    }
    mt_lock_all();
    id = mt_scope_open_locked(timeline, &start, &gen, &problem);
    if (id >= 0 && begin) {
        mt_install_count++; /* installed already (checked above): no patching */
        mt_totals_locked(&t);
    }
    uint64_t head = mt_eventlog_head();
    mt_unlock_all();
    if (problem != NULL) {
        if (timeline) {
            mt_eventlog_stop();
        }
        PyErr_SetString(PyExc_RuntimeError, problem);
        goto error;
    }
    if (begin) {
        return Py_BuildValue("(iKLLKLLL)", id, (unsigned long long)gen, (long long)start,
                             (long long)mt_monotonic_ns(), (unsigned long long)head, t.lost,
                             t.unseen, t.unseen_bytes);
    }
    return Py_BuildValue("(iKLLK)", id, (unsigned long long)gen, (long long)start,
                         (long long)mt_monotonic_ns(), (unsigned long long)head);
error:
    return NULL;
}

PyDoc_STRVAR(scope_open_doc,
"scope_open($module, timeline, /)\n--\n\n"
"Open a scope; returns (id, generation, start, time_ns, event_index).\n"
"Needs the counters installed. timeline: also run the event log.");

static PyObject *
scope_open(PyObject *module, PyObject *arg)
{
    return mt_scope_start(arg, 0);
}

PyDoc_STRVAR(scope_begin_doc,
"scope_begin($module, timeline, /)\n--\n\n"
"counters_install() and scope_open() in one, for counters installed already\n"
"(raises RuntimeError if not: it never patches). Returns (id, generation,\n"
"start, time_ns, event_index, lost, unseen_frees, unseen_bytes), the last\n"
"three as counters_stats() reads them. Close it with scope_end().");

static PyObject *
scope_begin(PyObject *module, PyObject *arg)
{
    return mt_scope_start(arg, 1);
}

/* Parse (id, generation); 0 or -1 with an exception set. */
static int
mt_parse_scope(PyObject *const *args, Py_ssize_t nargs, const char *fname,
               int *id, uint64_t *gen)
{
    long v = -1;
    unsigned long long g = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", fname, nargs);
        goto error;
    }
    v = PyLong_AsLong(args[0]);
    if (v == -1 && PyErr_Occurred()) {
        goto error;
    }
    g = PyLong_AsUnsignedLongLong(args[1]);
    if (g == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    if (v < 0 || v >= MT_NSCOPES) {
        PyErr_Format(PyExc_ValueError, "%s(): no scope %ld", fname, v);
        goto error;
    }
    *id = (int)v;
    *gen = (uint64_t)g;
    return 0;
error:
    return -1;
}

/* 1 if scope id of generation gen is open; caller holds all locks. */
static int
mt_scope_is_open(int id, uint64_t gen)
{
    return (atomic_load(&mt_scope_mask) & (1ULL << id)) &&
           mt_scopes[id].generation == gen;
}

PyDoc_STRVAR(scope_read_doc,
"scope_read($module, id, generation, /)\n--\n\n"
"(start, current, peak, hook_lost, other_thread_bytes, other_thread_allocs)\n"
"of an open scope.");

static PyObject *
scope_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int id;
    uint64_t gen;
    long long start = 0, current = 0, peak = 0, ob = 0, oa = 0;
    int open, lost = 0;
    if (mt_parse_scope(args, nargs, "scope_read", &id, &gen) < 0) {
        goto error;
    }
    mt_lock_all();
    open = mt_scope_is_open(id, gen);
    if (open) {
        start = mt_scopes[id].start;
        current = atomic_load(&mt_current);
        peak = atomic_load(&mt_scopes[id].peak);
        lost = mt_scopes[id].hook_lost;
        ob = atomic_load(&mt_scopes[id].other_bytes);
        oa = atomic_load(&mt_scopes[id].other_allocs);
    }
    mt_unlock_all();
    if (!open) {
        PyErr_SetString(PyExc_RuntimeError, "scope_read(): this scope is closed");
        goto error;
    }
    return Py_BuildValue("(LLLiLL)", start, current, peak, lost, ob, oa);
error:
    return NULL;
}

/* What a scope's close reads (scope_close, scope_end). */
typedef struct {
    long long start, end, peak, other_bytes, other_allocs;
    int hook_lost, timeline;
} mt_closing;

/* Close scope id of generation gen if open, after checking the hooks; caller
 * holds all locks. 1 if it was open (c filled), else 0. */
static int
mt_scope_close_locked(int id, uint64_t gen, mt_closing *c)
{
    if (!mt_scope_is_open(id, gen)) {
        return 0;
    }
    (void)mt_check_locked();
    c->start = mt_scopes[id].start;
    c->end = atomic_load(&mt_current);
    c->peak = atomic_load(&mt_scopes[id].peak);
    c->hook_lost = mt_scopes[id].hook_lost;
    c->other_bytes = atomic_load(&mt_scopes[id].other_bytes);
    c->other_allocs = atomic_load(&mt_scopes[id].other_allocs);
    c->timeline = mt_scopes[id].timeline;
    mt_scopes[id].timeline = 0;
    atomic_fetch_and(&mt_scope_mask, ~(1ULL << id));
    return 1;
}

/* scope_close (end = 0) and scope_end (end = 1: also read the statistics and
 * give back the installation scope_begin took). */
static PyObject *
mt_scope_finish(PyObject *const *args, Py_ssize_t nargs, int end)
{
    const char *fname = end ? "scope_end" : "scope_close";
    int id;
    uint64_t gen;
    mt_closing c = {0};
    mt_totals t = {0};
    const char *problem = NULL;
    uint64_t head;
    int open;
    if (mt_parse_scope(args, nargs, fname, &id, &gen) < 0) {
        goto error;
    }
    mt_lock_all();
    open = mt_scope_close_locked(id, gen, &c);
    if (open && end) {
        mt_totals_locked(&t);
        problem = mt_uninstall_locked(); /* the scope is closed: never refused for it */
    }
    head = mt_eventlog_head();
    mt_unlock_all();
    if (!open) {
        PyErr_Format(PyExc_RuntimeError, "%s(): this scope is already closed", fname);
        goto error;
    }
    if (c.timeline) {
        mt_eventlog_stop();
    }
    if (problem != NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s(): %s", fname, problem);
        goto error;
    }
    if (end) {
        return Py_BuildValue("(LLLLKiLLLLL)", c.start, c.end, c.peak, (long long)mt_monotonic_ns(),
                             (unsigned long long)head, c.hook_lost, c.other_bytes, c.other_allocs,
                             t.lost, t.unseen, t.unseen_bytes);
    }
    return Py_BuildValue("(LLLLKiLL)", c.start, c.end, c.peak, (long long)mt_monotonic_ns(),
                         (unsigned long long)head, c.hook_lost, c.other_bytes, c.other_allocs);
error:
    return NULL;
}

PyDoc_STRVAR(scope_close_doc,
"scope_close($module, id, generation, /)\n--\n\n"
"Close a scope after checking that the hooks are still in place; returns\n"
"(start, end, peak, time_ns, event_index, hook_lost, other_thread_bytes,\n"
"other_thread_allocs). hook_lost: another tool took the hooks' slots while\n"
"it was open (the figures are not exact).");

static PyObject *
scope_close(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return mt_scope_finish(args, nargs, 0);
}

PyDoc_STRVAR(scope_end_doc,
"scope_end($module, id, generation, /)\n--\n\n"
"scope_close() and counters_uninstall() in one, for a scope_begin() scope:\n"
"scope_close()'s tuple followed by (lost, unseen_frees, unseen_bytes) as\n"
"counters_stats() reads them after the close.");

static PyObject *
scope_end(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return mt_scope_finish(args, nargs, 1);
}

PyDoc_STRVAR(open_scopes_doc,
"counters_open_scopes($module, /)\n--\n\n"
"Number of scopes open now.");

static PyObject *
counters_open_scopes(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(__builtin_popcountll(atomic_load(&mt_scope_mask)));
}

PyDoc_STRVAR(rss_doc,
"counters_rss($module, /)\n--\n\n"
"(resident set size, its high-water mark) of the process in bytes; -1 where\n"
"unknown. The approximate fallback mechanism.");

static PyObject *
counters_rss(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    int64_t cur = -1, hwm = -1;
    mt_platform_rss(&cur, &hwm);
    return Py_BuildValue("(LL)", (long long)cur, (long long)hwm);
}

PyDoc_STRVAR(slot_info_doc,
"_counters_slot_info($module, name, /)\n--\n\n"
"Test helper: (slot value now, saved original, real function, hook) as ints\n"
"for libc10's import of `name` ('posix_memalign' or 'free').");

static PyObject *
counters_slot_info(PyObject *module, PyObject *arg)
{
    uintptr_t vals[4] = {0, 0, 0, 0};
    const char *name = PyUnicode_AsUTF8(arg); /* borrowed buffer */
    char err[256];
    if (name == NULL) {
        goto error;
    }
    (void)mt_interpose_prepare(err, sizeof(err)); /* locate (loader lock): no table locks */
    if (mt_interpose_slot_info(name, vals) < 0) {
        PyErr_Format(PyExc_ValueError, "_counters_slot_info(): no import slot for %R", arg);
        goto error;
    }
    return Py_BuildValue("(KKKK)", (unsigned long long)vals[0], (unsigned long long)vals[1],
                         (unsigned long long)vals[2], (unsigned long long)vals[3]);
error:
    return NULL;
}

PyDoc_STRVAR(adopt_doc,
"counters_adopt($module, ptrs, sizes, /)\n--\n\n"
"Enter storages that PyTorch's CPU allocator made before counting began (the\n"
"caller checked that their memory goes back through libc10's free) into the\n"
"table, as if their allocations had been counted: their frees are then seen,\n"
"and current and the peak rise by their bytes (they lived all along). Addresses\n"
"the table holds already are skipped. Refused while counting is off or a scope\n"
"is open (its start and peak would mix bytes counted from two baselines).\n"
"Returns the bytes entered (0 when refused).");

static PyObject *
counters_adopt(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_ptrs = NULL, *py_sizes = NULL;
    uintptr_t *keys = NULL;
    size_t *sizes = NULL;
    int64_t total = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "counters_adopt() takes 2 arguments (%zd given)", nargs);
        goto error;
    }
    py_ptrs = PySequence_Fast(args[0], "counters_adopt() expects two sequences of ints"); /* new reference */
    py_sizes = py_ptrs == NULL ? NULL : PySequence_Fast(args[1], "counters_adopt() expects two sequences of ints");
    if (py_sizes == NULL) { /* new reference, or NULL with py_ptrs's error */
        goto error;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(py_ptrs);
    if (PySequence_Fast_GET_SIZE(py_sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "counters_adopt(): ptrs and sizes differ in length");
        goto error;
    }
    /* read into C arrays first: no Python (nor an allocation of ours that the hooks could see) under the locks */
    keys = PyMem_Calloc((size_t)n + 1, sizeof(uintptr_t));
    sizes = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    if (keys == NULL || sizes == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* borrowed from the sequences, which live through the loop */
        unsigned long long p = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(py_ptrs, i));
        if (p == (unsigned long long)-1 && PyErr_Occurred()) {
            goto error;
        }
        long long size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(py_sizes, i));
        if (size == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (p == 0 || size < 0) {
            PyErr_SetString(PyExc_ValueError, "counters_adopt(): an address is 0 or a size negative");
            goto error;
        }
        keys[i] = (uintptr_t)p;
        sizes[i] = (size_t)size;
    }
    mt_lock_all();
    if (atomic_load(&mt_active) && atomic_load(&mt_scope_mask) == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t h = mt_hash(keys[i]);
            mt_stripe *st = &mt_stripes[h & (MT_NSTRIPES - 1)];
            int held = 0;
            if (st->count > 0) {
                for (size_t j = mt_home(st, h); st->slots[j].key != 0; j = (j + 1) & (st->cap - 1)) {
                    if (st->slots[j].key == keys[i]) {
                        held = 1;
                        break;
                    }
                }
            }
            if (!held && sizes[i] > 0 && mt_stripe_put(st, keys[i], sizes[i], h) == 0) {
                total += (int64_t)sizes[i];
            }
        }
        /* no scope is open, so none has a start or peak to move; the global peak counts them too */
        int64_t now = atomic_fetch_add(&mt_current, total) + total;
        atomic_fetch_add(&mt_peak, total);
        mt_raise_to(&mt_peak, now);
    }
    mt_unlock_all();
    PyMem_Free(keys);
    PyMem_Free(sizes);
    Py_DECREF(py_ptrs);
    Py_DECREF(py_sizes);
    return PyLong_FromLongLong((long long)total);
error:
    PyMem_Free(keys);
    PyMem_Free(sizes);
    Py_XDECREF(py_ptrs);
    Py_XDECREF(py_sizes);
    return NULL;
}

PyDoc_STRVAR(inject_doc,
"_counters_inject($module, address, size, /)\n--\n\n"
"Test helper: feed one allocation (size >= 0) or free of `address` through\n"
"the hook path, as the interposer would: size -1 a free through libc10's\n"
"direct call of free, -2 through its address-taken &free.");

static PyObject *
counters_inject(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long addr = 0;
    long long size = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_counters_inject() takes 2 arguments (%zd given)", nargs);
        goto error;
    }
    addr = PyLong_AsUnsignedLongLong(args[0]);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    size = PyLong_AsLongLong(args[1]);
    if (size == -1 && PyErr_Occurred()) {
        goto error;
    }
    if (addr == 0) {
        PyErr_SetString(PyExc_ValueError, "_counters_inject(): address must not be 0");
        goto error;
    }
    if (size >= 0) {
        mt_counters_on_alloc((void *)(uintptr_t)addr, (size_t)size);
    }
    else if (size == -1 || size == -2) {
        /* MT_FREE_FAKE stands for a direct free of a fake pointer. */
        mt_counters_on_free((void *)(uintptr_t)addr, size == -1 ? MT_FREE_FAKE : MT_FREE_REF);
    }
    else {
        PyErr_SetString(PyExc_ValueError, "_counters_inject(): size must be >= 0, -1 or -2");
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

PyDoc_STRVAR(bench_doc,
"_counters_bench($module, n, size, /)\n--\n\n"
"Benchmark helper: (direct_ns, hooked_ns), the mean time of one\n"
"posix_memalign(64, size) + free called directly and through the hooks.\n"
"Needs the counters installed (the hooks then count, as they would).");

static PyObject *
counters_bench(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long n = 0;
    Py_ssize_t size = 0;
    double direct = 0.0, hooked = 0.0;
    int installed;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_counters_bench() takes 2 arguments (%zd given)", nargs);
        goto error;
    }
    n = PyLong_AsLong(args[0]);
    if (n == -1 && PyErr_Occurred()) {
        goto error;
    }
    size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred()) {
        goto error;
    }
    if (n <= 0 || size <= 0) {
        PyErr_SetString(PyExc_ValueError, "_counters_bench(): n and size must be positive");
        goto error;
    }
    mt_lock_all();
    installed = mt_install_count > 0;
    mt_unlock_all();
    if (!installed) {
        PyErr_SetString(PyExc_RuntimeError, "the CPU allocation counters are not installed");
        goto error;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mt_interpose_bench(n, (size_t)size, &direct, &hooked);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetString(PyExc_RuntimeError, "_counters_bench(): no hooks on this platform");
        goto error;
    }
    return Py_BuildValue("(dd)", direct, hooked);
error:
    return NULL;
}

PyDoc_STRVAR(set_target_doc,
"_counters_set_target($module, name, /)\n--\n\n"
"Test helper: interpose the library whose basename is `name` (a stand-in\n"
"for 'libc10.so', loaded by the test) from the next installation on.\n"
"Refused while installed.");

static PyObject *
counters_set_target(PyObject *module, PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg); /* borrowed buffer */
    int rc;
    if (name == NULL) {
        goto error;
    }
    mt_lock_all();
    rc = mt_install_count == 0 ? mt_interpose_set_target(name) : -1;
    mt_unlock_all();
    if (rc < 0) {
        PyErr_Format(PyExc_ValueError,
                     "_counters_set_target(%R): refused (installed, empty or too long)", arg);
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

PyDoc_STRVAR(tool_doc,
"_counters_tool($module, action, /)\n--\n\n"
"Test helper: another tool patching the same import slots. action:\n"
"'chain' (forwards to what it found, restores only its own slots),\n"
"'naive' (forwards to what it found, restores unconditionally), 'libc'\n"
"(forwards to libc, restores libc's functions, as memray does) or\n"
"'uninstall'; 'calls' does nothing. Returns the number of calls its hooks\n"
"have seen so far.");

static PyObject *
counters_tool(PyObject *module, PyObject *arg)
{
    static const char *const names[] = {"uninstall", "chain", "naive", "libc"};
    const char *name = PyUnicode_AsUTF8(arg); /* borrowed buffer */
    char err[256] = "";
    int action = -1, rc;
    if (name == NULL) {
        goto error;
    }
    if (strcmp(name, "calls") == 0) {
        return PyLong_FromLong(mt_interpose_tool_calls());
    }
    for (int i = 0; i < 4; i++) {
        if (strcmp(name, names[i]) == 0) {
            action = i;
        }
    }
    if (action < 0) {
        PyErr_Format(PyExc_ValueError, "_counters_tool(): unknown action %R", arg);
        goto error;
    }
    /* Not under the table locks: it locates the library (loader lock). */
    rc = mt_interpose_tool(action, err, sizeof(err));
    if (rc < 0) {
        PyErr_Format(PyExc_RuntimeError, "_counters_tool(%R): %s", arg, err);
        goto error;
    }
    return PyLong_FromLong(mt_interpose_tool_calls());
error:
    return NULL;
}

extern PyMethodDef mt_eventlog_methods[];

PyMethodDef mt_counters_methods[] = {
    {"counters_install", counters_install, METH_NOARGS, install_doc},
    {"counters_uninstall", counters_uninstall, METH_NOARGS, uninstall_doc},
    {"counters_installed", counters_installed, METH_NOARGS, installed_doc},
    {"counters_probe", counters_probe, METH_NOARGS, probe_doc},
    {"counters_mechanism", counters_mechanism, METH_NOARGS, mechanism_doc},
    {"counters_current", counters_current, METH_NOARGS, current_doc},
    {"counters_peak", counters_peak, METH_NOARGS, peak_doc},
    {"counters_last_failure", counters_last_failure, METH_NOARGS, last_failure_doc},
    {"counters_reset_peak", counters_reset_peak, METH_NOARGS, reset_peak_doc},
    {"counters_stats", counters_stats, METH_NOARGS, stats_doc},
    {"counters_open_scopes", counters_open_scopes, METH_NOARGS, open_scopes_doc},
    {"counters_rss", counters_rss, METH_NOARGS, rss_doc},
    {"scope_open", scope_open, METH_O, scope_open_doc},
    {"scope_read", (PyCFunction)(void (*)(void))scope_read, METH_FASTCALL, scope_read_doc},
    {"scope_close", (PyCFunction)(void (*)(void))scope_close, METH_FASTCALL, scope_close_doc},
    {"scope_begin", scope_begin, METH_O, scope_begin_doc},
    {"scope_end", (PyCFunction)(void (*)(void))scope_end, METH_FASTCALL, scope_end_doc},
    {"_counters_slot_info", counters_slot_info, METH_O, slot_info_doc},
    {"counters_adopt", (PyCFunction)(void (*)(void))counters_adopt, METH_FASTCALL, adopt_doc},
    {"_counters_inject", (PyCFunction)(void (*)(void))counters_inject, METH_FASTCALL,
     inject_doc},
    {"_counters_bench", (PyCFunction)(void (*)(void))counters_bench, METH_FASTCALL, bench_doc},
    {"counters_check", counters_check, METH_NOARGS, check_doc},
    {"counters_loss_info", counters_loss_info, METH_NOARGS, loss_info_doc},
    {"counters_restarted", counters_restarted, METH_NOARGS, restarted_doc},
    {"_counters_set_target", counters_set_target, METH_O, set_target_doc},
    {"_counters_tool", counters_tool, METH_O, tool_doc},
    {NULL, NULL, 0, NULL},
};

int
mt_counters_exec(PyObject *module)
{
    pthread_once(&mt_once, mt_init_locks);
    if (PyModule_AddFunctions(module, mt_eventlog_methods) < 0) {
        return -1;
    }
    return 0;
}
