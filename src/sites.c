/* sites.c: the Python source line (file, line, function) of large allocations made in a track() block outside its phases. */
#include "mt.h"
#include "counters.h"

#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/*
 * PROCESS-WIDE STATE, beside the event log it annotates. While a track()
 * block's owner tag names no phase and no module (its bits in the owner
 * mask are 0, and the tag is not 0: a block is open), an allocation of at
 * least mt_sites_min bytes gets a site: the code object and line of the
 * innermost Python frame outside torch's own Python files (mt_sites_skip),
 * keyed by the event's log index.
 *
 * The hook never reads Python state, never takes the GIL (an allocator that
 * waits for the GIL deadlocks against a thread that holds the GIL and waits
 * for a lock the allocating thread holds) and holds no reference. PyTorch's
 * Python bindings release the GIL around most operators (torch.empty,
 * randn, stack, clone, x * 2 ... measured), so a frame can rarely be read
 * there anyway. Instead: a thread's Python frames cannot move while it runs
 * the operator, so the hook queues (index, bytes, thread) and schedules one
 * pending call (Py_AddPendingCall: callable without the GIL), which CPython
 * runs in the main thread at its next eval-breaker check, right after the
 * call instruction that allocated returns: the frame is still at the line
 * of that call. Sites of other threads are only counted then. CPython
 * checks only at calls, loop jumps and function starts: an operator that
 * is not a call (x * 2, x[idx]) is named at the next call its code makes
 * (mt_sites_take steps out of a function just entered to its caller's
 * line). A Python callback run inside the operator itself (a tensor hook,
 * a Python __float__) could be named instead of the caller.
 *
 * Cost: the hook pays one relaxed load (mt_sites_armed_min) and a compare
 * while the event log runs; the queue and the pending call only for armed
 * tags and allocations at or above the threshold.
 *
 * The table (mt_sites, mt_site_codes, mt_sites_skip) is read and written by
 * the pending call and the functions below, GIL held: the GIL is its lock.
 * The table keeps a strong reference to each code object (at most
 * MT_SITE_CODES), released by eventlog_sites() once no block records any
 * more; the ring of sites overwrites its oldest entries, which hold none.
 */

#define MT_SITES 4096      /* sites kept (the latest), 24 bytes each */
#define MT_SITE_CODES 256  /* distinct code objects held */
#define MT_SITE_NOFRAME -1 /* no Python frame was running */
#define MT_SITE_FULL -2    /* the table of code objects was full */
#define MT_PENDING 64      /* sites waiting for the main thread */
#define MT_SITE_DEPTH 64   /* frames looked at to step out of torch's own code */

/* Defaults: allocations of 4 KiB and more (a float32 tensor of 1024
 * elements), and memtorch/peak.py's tag layout (TAG_BITS = 24: the low 24
 * bits of a tag name the phase and module). */
#define MT_SITE_MIN_BYTES 4096
#define MT_SITE_OWNER_MASK 0x00FFFFFFu

typedef struct {
    uint64_t index1; /* the event's log index + 1; 0: empty */
    int64_t bytes;
    int32_t line;
    int32_t code;    /* slot in mt_site_codes, or MT_SITE_NOFRAME / MT_SITE_FULL */
} mt_site;

/* The threshold while the current tag asks for sites, else 0: set by
 * eventlog_mark (GIL held), loaded by the hooks (any thread, no GIL). */
_Atomic int64_t mt_sites_armed_min;
/* Armed allocations whose site could not be read: made by another thread
 * than the main one or by one with no Python state, or more waiting than
 * MT_PENDING. */
static _Atomic int64_t mt_sites_missed;

/* Under the GIL. */
static int64_t mt_sites_min = MT_SITE_MIN_BYTES;
static uint32_t mt_sites_mask = MT_SITE_OWNER_MASK;
static mt_site mt_sites[MT_SITES];
static uint64_t mt_sites_head;                   /* sites written so far */
static PyObject *mt_site_codes[MT_SITE_CODES];   /* strong references */
static int mt_site_ncodes;
/* Open addressing over the code objects' addresses: slot + 1, 0 empty. */
static int16_t mt_site_index[2 * MT_SITE_CODES];
/* str: frames of files under this directory (torch's) are stepped out of;
 * NULL: none. A strong reference. */
static PyObject *mt_sites_skip;

void
mt_sites_on_tag(uint32_t tag)
{
    int armed = tag != 0 && (tag & mt_sites_mask) == 0 && mt_sites_min > 0;
    atomic_store_explicit(&mt_sites_armed_min, armed ? mt_sites_min : 0, memory_order_relaxed);
}

/* The slot of `code` in the table (borrowed; the table takes its own
 * reference when it adds it), or MT_SITE_FULL. GIL held. */
static int32_t
mt_site_code_slot(PyObject *code)
{
    uint64_t h = (uint64_t)(uintptr_t)code;
    h = (h >> 4) * 0x9E3779B97F4A7C15ULL;
    size_t mask = 2 * MT_SITE_CODES - 1;
    size_t j = (size_t)(h >> 40) & mask;
    while (mt_site_index[j] != 0) {
        int32_t slot = mt_site_index[j] - 1;
        if (mt_site_codes[slot] == code) {
            return slot;
        }
        j = (j + 1) & mask;
    }
    if (mt_site_ncodes == MT_SITE_CODES) {
        return MT_SITE_FULL;
    }
    int32_t slot = mt_site_ncodes++;
    mt_site_codes[slot] = Py_NewRef(code);
    mt_site_index[j] = (int16_t)(slot + 1);
    return slot;
}

/* 1 if code's file lies under mt_sites_skip (torch's own Python code), 0 if
 * not, -1 with an exception set. code: borrowed. */
static int
mt_site_skipped(PyObject *code)
{
    PyObject *py_file = NULL;
    int rc = 0;
    if (mt_sites_skip == NULL) {
        return 0;
    }
    py_file = PyObject_GetAttrString(code, "co_filename"); /* new reference */
    if (py_file == NULL) {
        return -1;
    }
    if (PyUnicode_Check(py_file)) {
        Py_ssize_t n = PyUnicode_Tailmatch(py_file, mt_sites_skip, 0, PY_SSIZE_T_MAX, -1);
        rc = n < 0 ? -1 : (int)n;
    }
    Py_DECREF(py_file);
    return rc;
}

/* code.co_firstlineno (>= 0), or -1 with an exception set. code: borrowed. */
static int
mt_code_firstlineno(PyObject *code)
{
    PyObject *py_first = PyObject_GetAttrString(code, "co_firstlineno"); /* new reference */
    long first = -1;
    if (py_first == NULL) {
        return -1;
    }
    first = PyLong_AsLong(py_first);
    Py_DECREF(py_first);
    if (first < 0 && !PyErr_Occurred()) {
        first = 0;
    }
    return first > INT_MAX ? INT_MAX : (int)first;
}

/* Record the site of the allocation logged at `index` from the current
 * Python frame of this thread, stepping out of torch's own files. GIL
 * held, in the pending call; 0, or -1 with an exception set. */
static int
mt_sites_take(uint64_t index, int64_t size)
{
    PyObject *py_frame = NULL, *py_code = NULL, *py_first = NULL, *py_next = NULL;
    int32_t code = MT_SITE_NOFRAME, line = 0;
    int rc = -1;
    /* No collection while frame objects are created (3.11+ makes them
     * lazily): finalizers could run inside the walk. */
#if PY_VERSION_HEX >= 0x030A0000
    int gc = PyGC_Disable();
#endif
    int found = 0;
    py_frame = (PyObject *)PyThreadState_GetFrame(PyThreadState_Get()); /* new ref or NULL */
    for (int depth = 0; py_frame != NULL && depth < MT_SITE_DEPTH; depth++) {
        py_code = (PyObject *)PyFrame_GetCode((PyFrameObject *)py_frame); /* new reference */
        int skip = mt_site_skipped(py_code);
        Py_CLEAR(py_code);
        if (skip < 0) {
            goto error;
        }
        if (!skip) {
            found = 1;
            break;
        }
        if (py_first == NULL) {
            py_first = Py_NewRef(py_frame); /* the innermost, if every frame is torch's */
        }
        py_next = (PyObject *)PyFrame_GetBack((PyFrameObject *)py_frame); /* new ref or NULL */
        Py_SETREF(py_frame, py_next);
        py_next = NULL;
    }
    if (!found) {
        Py_XSETREF(py_frame, Py_XNewRef(py_first));
    }
    if (py_frame != NULL) {
        py_code = (PyObject *)PyFrame_GetCode((PyFrameObject *)py_frame); /* new reference */
        line = PyFrame_GetLineNumber((PyFrameObject *)py_frame);
        /* A frame still at its first line (its RESUME: the def or first
         * decorator line) has run nothing yet: the allocation was made by
         * its caller, before this call (an operator that is not a call,
         * x * 2, is only followed by a check at the next call). Name the
         * caller's line. A one-line function's own allocations are named at
         * its caller too. */
        int first = mt_code_firstlineno(py_code);
        if (first < 0) {
            goto error;
        }
        py_next = first == line ? (PyObject *)PyFrame_GetBack((PyFrameObject *)py_frame) : NULL;
        if (py_next != NULL) {
            Py_SETREF(py_frame, py_next);
            py_next = NULL;
            Py_SETREF(py_code, (PyObject *)PyFrame_GetCode((PyFrameObject *)py_frame));
            line = PyFrame_GetLineNumber((PyFrameObject *)py_frame);
        }
        code = mt_site_code_slot(py_code);
    }
    mt_site *s = &mt_sites[mt_sites_head++ & (MT_SITES - 1)];
    s->index1 = index + 1;
    s->bytes = size;
    s->line = line;
    s->code = code;
    rc = 0;
error:
#if PY_VERSION_HEX >= 0x030A0000
    if (gc) {
        PyGC_Enable();
    }
#endif
    Py_XDECREF(py_code);
    Py_XDECREF(py_frame);
    Py_XDECREF(py_first);
    return rc;
}

/* Sites asked for without the GIL, waiting for the main thread (below). */
typedef struct {
    uint64_t index;
    int64_t bytes;
    unsigned long ident; /* PyThread_get_thread_ident() of the allocating thread */
} mt_pending_site;

static atomic_flag mt_pending_lock = ATOMIC_FLAG_INIT; /* a spinlock: a few stores under it */
static mt_pending_site mt_pending[MT_PENDING];
static int mt_pending_n;      /* under mt_pending_lock */
static int mt_pending_queued; /* under mt_pending_lock: the pending call is on its way */

static inline void
mt_pending_take_lock(void)
{
    int turns = 0;
    while (atomic_flag_test_and_set_explicit(&mt_pending_lock, memory_order_acquire)) {
        if (++turns >= 64) {
            sched_yield(); /* the holder may be preempted on a busy machine */
            turns = 0;
        }
    }
}

static inline void
mt_pending_release_lock(void)
{
    atomic_flag_clear_explicit(&mt_pending_lock, memory_order_release);
}

/* The pending call (Py_AddPendingCall): run by the main thread with the GIL
 * at its next eval-breaker check, which CPython makes right after the call
 * instruction that allocated returns: its frame is then still at the line
 * of that call. A site asked for by another thread cannot be read here: it
 * is only counted. */
static int
mt_sites_pending_call(void *arg)
{
    mt_pending_site batch[MT_PENDING];
    int n;
    mt_pending_take_lock();
    n = mt_pending_n;
    memcpy(batch, mt_pending, (size_t)n * sizeof(mt_pending_site));
    mt_pending_n = 0;
    mt_pending_queued = 0;
    mt_pending_release_lock();
    unsigned long me = PyThread_get_thread_ident();
    for (int i = 0; i < n; i++) {
        if (batch[i].ident != me || !mt_eventlog_recording()) {
            atomic_fetch_add_explicit(&mt_sites_missed, 1, memory_order_relaxed);
        }
        else if (mt_sites_take(batch[i].index, batch[i].bytes) < 0) {
            /* A line that cannot be read must never raise in the user's code. */
            PyErr_Clear();
            atomic_fetch_add_explicit(&mt_sites_missed, 1, memory_order_relaxed);
        }
    }
    return 0;
}

void
mt_sites_capture(uint64_t index, int64_t size)
{
    /* A thread with no Python state (a C++ worker) has no line to give. */
    if (PyGILState_GetThisThreadState() == NULL || !Py_IsInitialized()) {
        atomic_fetch_add_explicit(&mt_sites_missed, 1, memory_order_relaxed);
        return;
    }
    int kept = 0, queue = 0;
    mt_pending_take_lock();
    if (mt_pending_n < MT_PENDING) {
        mt_pending_site *p = &mt_pending[mt_pending_n++];
        p->index = index;
        p->bytes = size;
        p->ident = PyThread_get_thread_ident();
        kept = 1;
        if (!mt_pending_queued) {
            mt_pending_queued = queue = 1;
        }
    }
    mt_pending_release_lock();
    if (!kept) {
        atomic_fetch_add_explicit(&mt_sites_missed, 1, memory_order_relaxed);
    }
    else if (queue && Py_AddPendingCall(mt_sites_pending_call, NULL) < 0) {
        /* CPython's queue is full: drop what waits rather than read a frame
         * that has moved on later. */
        mt_pending_take_lock();
        atomic_fetch_add_explicit(&mt_sites_missed, mt_pending_n, memory_order_relaxed);
        mt_pending_n = 0;
        mt_pending_queued = 0;
        mt_pending_release_lock();
    }
}

/* Release the table: every code object and site. GIL held, outside the
 * hooks. */
static void
mt_sites_clear(void)
{
    int n = mt_site_ncodes;
    mt_site_ncodes = 0;
    if (n > 0) {
        memset(mt_site_index, 0, sizeof(mt_site_index));
    }
    /* Readers look only at the latest min(head, MT_SITES) entries: the ring
     * itself needs no wiping. */
    mt_sites_head = 0;
    atomic_store(&mt_sites_missed, 0);
    for (int i = 0; i < n; i++) {
        Py_CLEAR(mt_site_codes[i]);
    }
}

/* A new reference to getattr(code, name), or to None when it has no such
 * attribute (co_qualname is 3.11+); NULL with an exception set. */
static PyObject *
mt_code_attr(PyObject *code, const char *name)
{
    PyObject *py_value = PyObject_GetAttrString(code, name);
    if (py_value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear(); /* an older Python: no such attribute, said as None */
        py_value = Py_NewRef(Py_None);
    }
    return py_value;
}

PyDoc_STRVAR(sites_doc,
"eventlog_sites($module, first, last, /)\n--\n\n"
"The Python source lines of the allocations with log index in [first, last)\n"
"that a track() block made outside its phases and modules, of min_bytes or\n"
"more, as (sites, oldest, min_bytes, missed): sites a list of (index, file,\n"
"line, function, bytes), file and function None where the allocating thread\n"
"ran no Python frame or the table of code objects was full (line 0 then);\n"
"oldest the lowest log index whose site can still be held (older ones were\n"
"overwritten: the table keeps the latest 4096 sites); missed the allocations\n"
"whose site could not be read (another thread than the main one without\n"
"the GIL, or too many waiting) since the table was last emptied. Once no\n"
"timeline is recorded any more (every block has closed), the table is\n"
"emptied after reading and the code objects it held are released.");

static PyObject *
eventlog_sites(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_list = NULL, *py_row = NULL, *py_file = NULL, *py_func = NULL;
    PyObject *py_result = NULL;
    unsigned long long first = 0, last = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "eventlog_sites() takes 2 arguments (%zd given)", nargs);
        goto error;
    }
    first = PyLong_AsUnsignedLongLong(args[0]);
    if (first == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    last = PyLong_AsUnsignedLongLong(args[1]);
    if (last == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    py_list = PyList_New(0); /* new reference */
    if (py_list == NULL) {
        goto error;
    }
    uint64_t n = mt_sites_head < MT_SITES ? mt_sites_head : MT_SITES;
    uint64_t oldest = 0;
    for (uint64_t k = mt_sites_head - n; k < mt_sites_head; k++) {
        mt_site *s = &mt_sites[k & (MT_SITES - 1)];
        uint64_t index = s->index1 - 1;
        if (k == mt_sites_head - n && mt_sites_head > MT_SITES) {
            /* the ring wrapped: indices below the oldest site kept may have lost theirs */
            oldest = index;
        }
        if (s->index1 == 0 || index < first || index >= last) {
            continue;
        }
        if (s->code >= 0) {
            PyObject *code = mt_site_codes[s->code]; /* borrowed from the table */
            py_file = mt_code_attr(code, "co_filename");
            if (py_file == NULL) {
                goto error;
            }
            py_func = mt_code_attr(code, "co_qualname");
            if (py_func == Py_None) {
                Py_SETREF(py_func, mt_code_attr(code, "co_name"));
            }
            if (py_func == NULL) {
                goto error;
            }
        }
        else {
            py_file = Py_NewRef(Py_None);
            py_func = Py_NewRef(Py_None);
        }
        py_row = Py_BuildValue("(KOiOL)", (unsigned long long)index, py_file, (int)s->line,
                               py_func, (long long)s->bytes); /* new reference */
        Py_CLEAR(py_file);
        Py_CLEAR(py_func);
        if (py_row == NULL || PyList_Append(py_list, py_row) < 0) {
            goto error;
        }
        Py_CLEAR(py_row);
    }
    py_result = Py_BuildValue("(OKLL)", py_list, (unsigned long long)oldest, (long long)mt_sites_min,
                              (long long)atomic_load(&mt_sites_missed));
    if (py_result != NULL && !mt_eventlog_recording()) {
        mt_sites_clear();
    }
error:
    Py_XDECREF(py_file);
    Py_XDECREF(py_func);
    Py_XDECREF(py_row);
    Py_XDECREF(py_list);
    return py_result;
}

PyDoc_STRVAR(sites_config_doc,
"eventlog_sites_config($module, min_bytes, owner_mask, /)\n--\n\n"
"Take sites (eventlog_sites) of allocations of at least `min_bytes`\n"
"(0: none) made while the owner tag is not 0 and its bits in `owner_mask`\n"
"are 0; returns the previous (min_bytes, owner_mask). Takes effect at the\n"
"next eventlog_mark.");

static PyObject *
eventlog_sites_config(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long min_bytes = 0;
    unsigned long long mask = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "eventlog_sites_config() takes 2 arguments (%zd given)",
                     nargs);
        goto error;
    }
    min_bytes = PyLong_AsLongLong(args[0]);
    if (min_bytes == -1 && PyErr_Occurred()) {
        goto error;
    }
    mask = PyLong_AsUnsignedLongLong(args[1]);
    if (mask == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    if (min_bytes < 0 || mask > 0xffffffffULL) {
        PyErr_Format(PyExc_ValueError,
                     "eventlog_sites_config(): min_bytes must be >= 0 and owner_mask < 2**32 "
                     "(got %lld, %llu)", min_bytes, mask);
        goto error;
    }
    PyObject *py_prev = Py_BuildValue("(Lk)", (long long)mt_sites_min,
                                      (unsigned long)mt_sites_mask); /* new reference */
    if (py_prev == NULL) {
        goto error;
    }
    mt_sites_min = min_bytes;
    mt_sites_mask = (uint32_t)mask;
    return py_prev;
error:
    return NULL;
}

PyDoc_STRVAR(sites_skip_doc,
"eventlog_sites_skip($module, prefix, /)\n--\n\n"
"Name, as a site, the innermost Python frame whose file does not start with\n"
"`prefix` (a str: torch's own directory), or the innermost frame if all do;\n"
"None: always the innermost. Returns the previous prefix.");

static PyObject *
eventlog_sites_skip(PyObject *module, PyObject *arg)
{
    PyObject *py_prev = NULL;
    if (arg != Py_None && !PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "eventlog_sites_skip() expects a str or None, not %.100s",
                     Py_TYPE(arg)->tp_name);
        goto error;
    }
    py_prev = mt_sites_skip != NULL ? mt_sites_skip : Py_NewRef(Py_None); /* owned */
    mt_sites_skip = arg == Py_None ? NULL : Py_NewRef(arg);
    return py_prev;
error:
    return NULL;
}

PyMethodDef mt_sites_methods[] = {
    {"eventlog_sites_skip", eventlog_sites_skip, METH_O, sites_skip_doc},
    {"eventlog_sites", (PyCFunction)(void (*)(void))eventlog_sites, METH_FASTCALL, sites_doc},
    {"eventlog_sites_config", (PyCFunction)(void (*)(void))eventlog_sites_config, METH_FASTCALL,
     sites_config_doc},
    {NULL, NULL, 0, NULL},
};
