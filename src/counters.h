/* counters.h: internal interface between the counters, the platform interposer and the event log. */
#ifndef MT_COUNTERS_H
#define MT_COUNTERS_H

#include <stddef.h>
#include <stdint.h>

/* ---- counters.c: called by the interposer's hooks (no GIL, no Python) ---- */

/* An allocation of `size` bytes at `ptr` was made by PyTorch's CPU allocator
 * (after the real allocation succeeded). */
void mt_counters_on_alloc(void *ptr, size_t size);
/* `ptr` is about to be freed (called before the real free, so that the
 * address cannot be handed out again while it is still in the table). */
void mt_counters_on_free(void *ptr, int real);

/* The counted size of the live allocation at ptr, or -1 if not counted. */
int64_t mt_counters_size_of(const void *ptr);

/* ---- interpose_linux.c / interpose_other.c: the platform mechanism ---- */

/* Name of the exact mechanism of this platform ("libc10-got"), or NULL where
 * there is none. */
const char *mt_interpose_mechanism(void);
/* 0 if the allocator can be interposed now, else -1 with a reason in err. */
int mt_interpose_probe(char *err, size_t errlen);
/* Patch the allocator's imports; 0 on success, -1 with a reason in err (then
 * nothing is left patched). Called with all table locks held. */
int mt_interpose_patch(char *err, size_t errlen);
/* Put the original entries back. */
void mt_interpose_unpatch(void);
/* Test helper: fill vals with (slot now, saved original, real function, hook)
 * for the first import slot of `name`; 0 on success, -1 if unknown. */
int mt_interpose_slot_info(const char *name, uintptr_t vals[4]);
/* Benchmark helper: mean ns of posix_memalign(64, size) + free called
 * directly and through the hooks, n times each; 0 or -1 where there are no
 * hooks. */
int mt_interpose_bench(long n, size_t size, double *direct_ns, double *hooked_ns);
/* Resident set size now and its high-water mark, in bytes (-1 if unknown). */
void mt_platform_rss(int64_t *current, int64_t *hwm);

/* ---- eventlog.c: (time, bytes) ring buffer ---- */

/* Record one allocation (delta > 0) or free (delta < 0) of ptr, bytes being
 * the counted bytes after it; cheap no-op unless a timeline is recorded. */
void mt_eventlog_record(int64_t bytes, const void *ptr, int64_t delta);
/* Start/stop recording (refcounted); start returns -1 on out-of-memory. */
int mt_eventlog_start(void);
void mt_eventlog_stop(void);
/* Index of the next event to be written. */
uint64_t mt_eventlog_head(void);
/* Monotonic clock in nanoseconds (same clock as Python's time.monotonic_ns
 * on Linux: CLOCK_MONOTONIC). */
int64_t mt_monotonic_ns(void);

#endif /* MT_COUNTERS_H */
