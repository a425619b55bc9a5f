/* counters.h: internal interface between the counters, the platform interposer and the event log. */
#ifndef MT_COUNTERS_H
#define MT_COUNTERS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* ---- counters.c: called by the interposer's hooks (no GIL, no Python) ---- */

/* An allocation of `size` bytes at `ptr` was made by PyTorch's CPU allocator
 * (after the real allocation succeeded). */
void mt_counters_on_alloc(void *ptr, size_t size);
/* A tensor allocation that failed (posix_memalign returned an error): its size,
 * the counted bytes, the event log's head and this thread's owner tag are kept
 * for counters_last_failure() (the out-of-memory post-mortem). Any thread. */
void mt_counters_on_fail(size_t size);
/* How a free reached the counters: a test's fake pointer (never handed to
 * malloc_usable_size), libc10's direct call of free (c10::free_cpu is one),
 * or libc10's address-taken &free (c10::demangle's deleter: never tensor
 * storage). */
#define MT_FREE_FAKE 0
#define MT_FREE_DIRECT 1
#define MT_FREE_REF 2
/* Smallest alignment c10::alloc_cpu asks of posix_memalign (gAlignment). */
#define MT_C10_ALIGNMENT 64

/* `ptr` is about to be freed (called before the real free, so that the
 * address cannot be handed out again while it is still in the table). */
void mt_counters_on_free(void *ptr, int kind);

/* The counted bytes live now (process-wide; 0 when not installed): a relaxed
 * atomic load, for marks.c's hooks (any thread, no lock). */
int64_t mt_counters_current(void);

/* The counted size of the live allocation at ptr, or -1 if not counted. */
int64_t mt_counters_size_of(const void *ptr);
int64_t mt_counters_lookup(const void *ptr, int64_t *serial);
/* The same for n addresses under one hold of the table (see counters.c). */
void mt_counters_lookup_many(const uintptr_t *ptrs, size_t n, int64_t *sizes, int64_t *serials);

/* ---- eventlog.c and replay.c: the log's kinds and its records as read ---- */

/* What an event is (the `info` field's high 32 bits); the low 32 bits hold
 * the owner tag current when it was recorded. */
#define MT_EV_ALLOC 0 /* an allocation (delta >= 0) or a free (delta < 0) */
#define MT_EV_ENTER 1 /* a module's forward began: ptr = the caller's number for it */
#define MT_EV_EXIT 2  /* a module's forward ended: ptr = the caller's number for it */
#define MT_EV_TAG 3   /* the owner tag changed (a phase began or ended) */

/* One record of eventlog_read_all()'s array (its NumPy dtype has this layout;
 * eventlog_replay() reads the array as these). */
typedef struct {
    uint64_t index;
    int64_t time, bytes;
    uint64_t ptr;
    int64_t delta;
    uint32_t kind, tag;
} mt_log_row;

/* ---- interpose_linux.c / interpose_other.c: the platform mechanism ---- */

/* Name of the exact mechanism patched now, or found usable by the last
 * prepare/probe ("libc10-got"); NULL where there is none (other systems, a
 * libc10 that imports no posix_memalign). */
const char *mt_interpose_mechanism(void);
/* Locate the allocator's import slots (takes the dynamic linker's lock:
 * call without the table locks). 0, or -1 with a reason in err. */
int mt_interpose_prepare(char *err, size_t errlen);
/* 0 if the allocator can be interposed now, else -1 with a reason in err. */
int mt_interpose_probe(char *err, size_t errlen);
/* Patch the allocator's imports, chaining to what each slot holds; 0 on
 * success, -1 with a reason in err (then nothing is left patched). After a
 * successful prepare, with all table locks held. */
int mt_interpose_patch(char *err, size_t errlen);
/* Put the saved entries back where the slot still holds our hook; leave a
 * tool that patched on top of us in place. */
void mt_interpose_unpatch(void);
/* Integrity: how many of our slots no longer lead to our hooks (0 when
 * intact, or when not patched); *found gets what the first lost slot holds.
 * With all table locks held. */
int mt_interpose_check(uintptr_t *found);
/* Patch the lost slots again, on top of what they hold; 0 or -1. With all
 * table locks held. */
int mt_interpose_repair(void);
/* dladdr() of a code address: the object's path and the symbol; 0 or -1.
 * Takes the dynamic linker's lock: call without the table locks. */
int mt_interpose_describe(uintptr_t v, char *path, size_t pathlen, char *sym, size_t symlen);
/* Test helper: patch the imports of the library named `name` (a basename,
 * e.g. a stand-in for libc10) instead of libc10.so; -1 while patched. */
int mt_interpose_set_target(const char *name);
/* Test helper: another tool patching the same slots. */
#define MT_TOOL_UNINSTALL 0
#define MT_TOOL_CHAIN 1 /* forwards to what it found; restores only its own slots */
#define MT_TOOL_NAIVE 2 /* forwards to what it found; restores unconditionally */
#define MT_TOOL_LIBC 3  /* forwards to libc; restores libc's functions (memray) */
int mt_interpose_tool(int action, char *err, size_t errlen);
long mt_interpose_tool_calls(void);
/* Test helper: fill vals with (slot now, saved original, real function, hook)
 * for the first import slot of `name`; 0 on success, -1 if unknown. */
int mt_interpose_slot_info(const char *name, uintptr_t vals[4]);
/* Benchmark helper: mean ns of posix_memalign(64, size) + free called
 * directly and through the hooks, n times each; 0 or -1 where there are no
 * hooks. */
int mt_interpose_bench(long n, size_t size, double *direct_ns, double *hooked_ns);
/* Resident set size now and its high-water mark, in bytes (-1 if unknown). */
void mt_platform_rss(int64_t *current, int64_t *hwm);

/* 1 when this thread runs Python (a thread state is bound to it: the thread that
 * opened a block, a DataLoader pin-memory thread, a user's threading.Thread), 0
 * for a native worker (torch's intra-op pool: OpenMP or its own threads), which
 * allocates only inside an operator that a Python thread called. Any thread, no
 * GIL (it reads the interpreter's thread-specific slot). */
int mt_thread_runs_python(void);

/* ---- eventlog.c: (time, bytes) ring buffer ---- */

/* Record one allocation (delta > 0) or free (delta < 0) of ptr, bytes being
 * the counted bytes after it; cheap no-op unless a timeline is recorded.
 * Returns the event's log index + 1 when sites.c wants the allocation's
 * source line (mt_sites_capture), else 0. */
uint64_t mt_eventlog_record(int64_t bytes, const void *ptr, int64_t delta);
/* Set the owner tag stamped on later events (GIL held) and, while a timeline
 * is recorded, log a mark of `kind` (MT_EV_ENTER, MT_EV_EXIT, MT_EV_TAG) with
 * the caller's `number` for what began or ended: eventlog_mark()'s work. */
void mt_eventlog_mark(int kind, uint64_t number, uint32_t tag);
/* 1 while a timeline is recorded (a block or a timeline scope is open). */
int mt_eventlog_recording(void);
/* The owner tag this thread stamps on its events now (its own, or the Python
 * thread's for a native worker: see mt_eventlog_record). */
uint32_t mt_eventlog_tag_now(void);
/* Start/stop recording (refcounted); start returns -1 on out-of-memory. */
int mt_eventlog_start(void);
void mt_eventlog_stop(void);
/* Index of the next event to be written. */
uint64_t mt_eventlog_head(void);
/* Monotonic clock in nanoseconds (same clock as Python's time.monotonic_ns
 * on Linux: CLOCK_MONOTONIC). */
int64_t mt_monotonic_ns(void);

/* ---- sites.c: the Python source line of large allocations outside phases ---- */

/* The size threshold while the current owner tag asks for sites, else 0
 * (any thread, no GIL: a relaxed load). */
extern _Atomic int64_t mt_sites_armed_min;
/* The owner tag changed (eventlog_mark, GIL held): arm or disarm. */
void mt_sites_on_tag(uint32_t tag);
/* Ask for the source line of the allocation logged at `index` (any thread,
 * no GIL, from the hook after the stripe lock is released): queued for a
 * pending call of the main thread, which reads it; no Python state is read
 * here. */
void mt_sites_capture(uint64_t index, int64_t size) __attribute__((cold));

#endif /* MT_COUNTERS_H */
