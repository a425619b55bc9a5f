/* interpose_other.c: no exact mechanism off Linux; the resident-set-size fallback that memtorch.cpu labels approximate. */
#include "counters.h"

#include <stdint.h>
#include <stdio.h>
#include <time.h>

/*
 * Off Linux memtorch does not interpose PyTorch's allocator (macOS would need
 * Mach-O symbol rebinding, Windows IAT patching of c10.dll: not written yet).
 * memtorch.cpu then reports the process's resident set size, labelled
 * approximate everywhere (exact() is False, mechanism() "rss-fallback").
 */

#if defined(_WIN32)
#include <windows.h>
#include <psapi.h>
#elif defined(__APPLE__)
#include <mach/mach.h>
#include <sys/resource.h>
#else
#include <sys/resource.h>
#include <unistd.h>
#endif

const char *
mt_interpose_mechanism(void)
{
    return NULL;
}

int
mt_interpose_probe(char *err, size_t errlen)
{
    snprintf(err, errlen, "no exact CPU allocation counting on this platform");
    return -1;
}

int
mt_interpose_prepare(char *err, size_t errlen)
{
    return mt_interpose_probe(err, errlen);
}

int
mt_interpose_patch(char *err, size_t errlen)
{
    return mt_interpose_probe(err, errlen);
}

void
mt_interpose_unpatch(void)
{
}

int
mt_interpose_check(uintptr_t *found)
{
    return 0;
}

int
mt_interpose_repair(void)
{
    return 0;
}

int
mt_interpose_describe(uintptr_t v, char *path, size_t pathlen, char *sym, size_t symlen)
{
    path[0] = sym[0] = '\0';
    return -1;
}

int
mt_interpose_set_target(const char *name)
{
    return -1;
}

int
mt_interpose_tool(int action, char *err, size_t errlen)
{
    snprintf(err, errlen, "no import slots to patch on this platform");
    return -1;
}

long
mt_interpose_tool_calls(void)
{
    return 0;
}

int
mt_interpose_slot_info(const char *name, uintptr_t vals[4])
{
    return -1;
}

int
mt_interpose_bench(long n, size_t size, double *direct_ns, double *hooked_ns)
{
    return -1;
}

void
mt_platform_rss(int64_t *current, int64_t *hwm)
{
    *current = -1;
    *hwm = -1;
#if defined(_WIN32)
    PROCESS_MEMORY_COUNTERS pmc;
    if (GetProcessMemoryInfo(GetCurrentProcess(), &pmc, sizeof(pmc))) {
        *current = (int64_t)pmc.WorkingSetSize;
        *hwm = (int64_t)pmc.PeakWorkingSetSize;
    }
#elif defined(__APPLE__)
    struct mach_task_basic_info info;
    mach_msg_type_number_t count = MACH_TASK_BASIC_INFO_COUNT;
    struct rusage ru;
    if (task_info(mach_task_self(), MACH_TASK_BASIC_INFO, (task_info_t)&info, &count) ==
        KERN_SUCCESS) {
        *current = (int64_t)info.resident_size;
    }
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        *hwm = (int64_t)ru.ru_maxrss;  /* macOS: bytes */
    }
#else
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        *hwm = (int64_t)ru.ru_maxrss * 1024;  /* BSDs: KiB */
        *current = *hwm;  /* no portable "current": the high-water mark */
    }
#endif
}

int64_t
mt_monotonic_ns(void)
{
#if defined(_WIN32)
    LARGE_INTEGER freq, now;
    QueryPerformanceFrequency(&freq);
    QueryPerformanceCounter(&now);
    return (int64_t)((double)now.QuadPart * 1e9 / (double)freq.QuadPart);
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
}
