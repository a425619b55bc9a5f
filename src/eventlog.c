/* eventlog.c: lock-free ring buffer of allocation events (time, bytes, pointer, owner tag) and marks, read out as NumPy arrays. */
#include "mt.h"
#include "counters.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/*
 * PROCESS-WIDE STATE, like the counters it records: one ring buffer of
 * MT_EVENTS events, allocated the first time a timeline is asked for and
 * kept for the life of the process (a hook may still be writing when the
 * last timeline stops). Writers (the hooks, any thread, no GIL) claim an
 * index with one fetch_add and publish the event with a per-slot sequence
 * number (a seqlock): a reader keeps an event only if the sequence number
 * before and after reading it is the one its index expects, so a torn or
 * overwritten event is dropped, never misread.
 */

#define MT_EVENTS_LOG2 17
#define MT_EVENTS (1u << MT_EVENTS_LOG2) /* 131072 events, 6 MiB */

typedef struct {
    _Atomic uint64_t seq; /* index + 1 once written; 0 while being written */
    _Atomic int64_t time_ns;
    _Atomic int64_t bytes;  /* counted bytes after the event (-1 for marks) */
    _Atomic uint64_t ptr;   /* the allocation's address, or a mark's number */
    _Atomic int64_t delta;  /* bytes allocated (> 0) or freed (< 0) */
    _Atomic uint64_t info;  /* kind << 32 | owner tag */
} mt_event;

static mt_event *_Atomic mt_events;   /* NULL until first used */
static _Atomic uint64_t mt_events_head; /* next index to claim */
static _Atomic int mt_eventlog_users;   /* open timelines */
/* The owner tag: a small integer set by Python's module and optimizer hooks
 * (through eventlog_mark, GIL held) and stamped on every event. It is the
 * setting thread's own (thread-local): an allocation by another thread
 * carries that thread's tag (0 where no block runs), never the module or
 * phase running in a block's thread, so the replay can file it apart. */
static _Thread_local uint32_t mt_event_tag;
/* The tag last set by any thread (GIL held): what a native worker of torch's
 * intra-op pool stamps, since it allocates inside the operator that the Python
 * thread setting tags called (a thread running Python stamps its own). */
static _Atomic uint32_t mt_event_tag_python;

/* Claim one slot and publish an event in it (any thread, no GIL); returns
 * its index + 1, or 0 when there is no ring. */
static uint64_t
mt_eventlog_put(int64_t bytes, uint64_t ptr, int64_t delta, uint64_t info)
{
    mt_event *events = atomic_load_explicit(&mt_events, memory_order_acquire);
    if (events == NULL) {
        return 0;
    }
    int64_t t = mt_monotonic_ns();
    uint64_t i = atomic_fetch_add_explicit(&mt_events_head, 1, memory_order_relaxed);
    mt_event *e = &events[i & (MT_EVENTS - 1)];
    atomic_store_explicit(&e->seq, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&e->time_ns, t, memory_order_relaxed);
    atomic_store_explicit(&e->bytes, bytes, memory_order_relaxed);
    atomic_store_explicit(&e->ptr, ptr, memory_order_relaxed);
    atomic_store_explicit(&e->delta, delta, memory_order_relaxed);
    atomic_store_explicit(&e->info, info, memory_order_relaxed);
    atomic_store_explicit(&e->seq, i + 1, memory_order_release);
    return i + 1;
}

uint32_t
mt_eventlog_tag_now(void)
{
    uint32_t tag = mt_event_tag;
    if (tag == 0 && !mt_thread_runs_python()) {
        tag = atomic_load_explicit(&mt_event_tag_python, memory_order_relaxed);
    }
    return tag;
}

uint64_t
mt_eventlog_record(int64_t bytes, const void *ptr, int64_t delta)
{
    if (atomic_load_explicit(&mt_eventlog_users, memory_order_relaxed) == 0) {
        return 0;
    }
    uint64_t tag = mt_eventlog_tag_now();
    uint64_t i1 = mt_eventlog_put(bytes, (uint64_t)(uintptr_t)ptr, delta,
                                  ((uint64_t)MT_EV_ALLOC << 32) | tag);
    /* sites.c: does this allocation want its source line? */
    int64_t min = atomic_load_explicit(&mt_sites_armed_min, memory_order_relaxed);
    return (min > 0 && delta >= min) ? i1 : 0;
}

int
mt_eventlog_recording(void)
{
    return atomic_load(&mt_eventlog_users) != 0;
}

int
mt_eventlog_start(void)
{
    if (atomic_load(&mt_events) == NULL) {
        mt_event *events = calloc(MT_EVENTS, sizeof(mt_event));
        mt_event *expected = NULL;
        if (events == NULL) {
            return -1;
        }
        if (!atomic_compare_exchange_strong(&mt_events, &expected, events)) {
            free(events);
        }
    }
    atomic_fetch_add(&mt_eventlog_users, 1);
    return 0;
}

void
mt_eventlog_stop(void)
{
    atomic_fetch_sub(&mt_eventlog_users, 1);
}

uint64_t
mt_eventlog_head(void)
{
    return atomic_load(&mt_events_head);
}

/* Read one event of index i into the out-parameters; 1 if it was intact
 * (written for index i and not overwritten while read), else 0. */
static int
mt_eventlog_get(mt_event *events, uint64_t i, int64_t *t, int64_t *b, uint64_t *p,
                int64_t *d, uint64_t *info)
{
    mt_event *e = &events[i & (MT_EVENTS - 1)];
    uint64_t s1 = atomic_load_explicit(&e->seq, memory_order_acquire);
    *t = atomic_load_explicit(&e->time_ns, memory_order_relaxed);
    *b = atomic_load_explicit(&e->bytes, memory_order_relaxed);
    *p = atomic_load_explicit(&e->ptr, memory_order_relaxed);
    *d = atomic_load_explicit(&e->delta, memory_order_relaxed);
    *info = atomic_load_explicit(&e->info, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    uint64_t s2 = atomic_load_explicit(&e->seq, memory_order_relaxed);
    return s1 == i + 1 && s2 == s1;
}

/* Parse (first, last) and clamp them to what was written: [*lo, *last) is
 * what the ring can still hold, n = last - first what was asked. 0, or -1
 * with an exception set. */
static int
mt_eventlog_range(PyObject *const *args, Py_ssize_t nargs, const char *fname,
                  uint64_t *lo, uint64_t *lastp, uint64_t *n)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", fname, nargs);
        goto error;
    }
    unsigned long long first = PyLong_AsUnsignedLongLong(args[0]);
    if (first == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    unsigned long long last = PyLong_AsUnsignedLongLong(args[1]);
    if (last == (unsigned long long)-1 && PyErr_Occurred()) {
        goto error;
    }
    uint64_t head = atomic_load(&mt_events_head);
    if (last > head) {
        last = head;
    }
    if (first > last) {
        first = last;
    }
    /* Only the latest MT_EVENTS indices can still be in the ring: the arrays
     * are sized by what is retained, never by the whole range asked for. */
    *lo = (head > MT_EVENTS && first < head - MT_EVENTS) ? head - MT_EVENTS : first;
    if (*lo > last) { /* a range that ended before the oldest event kept: nothing */
        *lo = last;
    }
    *lastp = last;
    *n = last - first;
    return 0;
error:
    return -1;
}

/* Shrink a 1-d array this function created (owns its data, no views) to
 * kept items; 0 or -1 with an exception set. */
static int
mt_shrink(PyObject *arr, npy_intp kept)
{
    npy_intp dims[1] = {kept};
    PyArray_Dims newshape = {dims, 1};
    PyObject *tmp = PyArray_Resize((PyArrayObject *)arr, &newshape, 0, NPY_CORDER);
    if (tmp == NULL) {
        return -1;
    }
    Py_DECREF(tmp);
    return 0;
}

PyDoc_STRVAR(read_doc,
"eventlog_read($module, first, last, /)\n--\n\n"
"Allocation events with index in [first, last) as (times_ns, bytes, dropped):\n"
"two int64 arrays and the number of events in that range that were\n"
"overwritten or torn (the ring holds the latest 131072 events). Marks\n"
"(eventlog_mark) are left out.");

static PyObject *
eventlog_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_times = NULL, *py_bytes = NULL, *py_result = NULL;
    uint64_t lo = 0, last = 0, n = 0;
    if (mt_eventlog_range(args, nargs, "eventlog_read", &lo, &last, &n) < 0) {
        goto error;
    }
    npy_intp dims[1] = {(npy_intp)(last - lo)};
    py_times = PyArray_SimpleNew(1, dims, NPY_INT64);  /* new reference */
    if (py_times == NULL) {
        goto error;
    }
    py_bytes = PyArray_SimpleNew(1, dims, NPY_INT64);  /* new reference */
    if (py_bytes == NULL) {
        goto error;
    }
    int64_t *tp = (int64_t *)PyArray_DATA((PyArrayObject *)py_times);
    int64_t *bp = (int64_t *)PyArray_DATA((PyArrayObject *)py_bytes);
    npy_intp kept = 0, marks = 0;
    mt_event *events = atomic_load(&mt_events);
    for (uint64_t i = lo; events != NULL && i < last; i++) {
        int64_t t, b, d;
        uint64_t p, info;
        if (mt_eventlog_get(events, i, &t, &b, &p, &d, &info)) {
            if ((info >> 32) != MT_EV_ALLOC) {
                marks++;
                continue;
            }
            tp[kept] = t;
            bp[kept] = b;
            kept++;
        }
    }
    long long dropped = (long long)n - (long long)kept - (long long)marks;
    if (mt_shrink(py_times, kept) < 0 || mt_shrink(py_bytes, kept) < 0) {
        goto error;
    }
    py_result = Py_BuildValue("(OOL)", py_times, py_bytes, dropped);
error:
    Py_XDECREF(py_times);
    Py_XDECREF(py_bytes);
    return py_result;
}

PyDoc_STRVAR(read_all_doc,
"eventlog_read_all($module, first, last, raw=False, /)\n--\n\n"
"Every event with index in [first, last), marks included, as (array, dropped):\n"
"a structured array with fields index (uint64), time (int64, ns), bytes\n"
"(int64: counted bytes after the event, -1 for a mark), ptr (uint64: the\n"
"address, or a mark's number), delta (int64: bytes allocated, negative when\n"
"freed), kind (uint32: 0 allocation or free, 1 enter, 2 exit, 3 tag) and tag\n"
"(uint32: the owner tag), and the number of events of the range lost to the\n"
"ring's wrap-around or torn. raw true: the array's bytes instead (a bytes\n"
"object, for numpy.frombuffer with the array's dtype).");

/* The rows of [lo, last) into rows (room for last - lo); returns how many were intact. */
static npy_intp
mt_eventlog_rows(mt_log_row *rows, uint64_t lo, uint64_t last)
{
    npy_intp kept = 0;
    mt_event *events = atomic_load(&mt_events);
    for (uint64_t i = lo; events != NULL && i < last; i++) {
        int64_t t, b, d;
        uint64_t p, info;
        if (mt_eventlog_get(events, i, &t, &b, &p, &d, &info)) {
            mt_log_row *r = &rows[kept++];
            r->index = i;
            r->time = t;
            r->bytes = b;
            r->ptr = p;
            r->delta = d;
            r->kind = (uint32_t)(info >> 32);
            r->tag = (uint32_t)(info & 0xffffffffu);
        }
    }
    return kept;
}

/* The numpy dtype of an event row (borrowed from the module state), made once. */
static PyObject *
mt_log_dtype(mt_state *st)
{
    PyObject *py_spec = NULL;
    PyArray_Descr *descr = NULL;
    if (st->log_dtype == NULL) { /* the layout of mt_log_row (counters.h) */
        py_spec = Py_BuildValue(
            "[(ss)(ss)(ss)(ss)(ss)(ss)(ss)]", "index", "<u8", "time", "<i8", "bytes", "<i8",
            "ptr", "<u8", "delta", "<i8", "kind", "<u4", "tag", "<u4");  /* new reference */
        if (py_spec == NULL) {
            goto error;
        }
        if (!PyArray_DescrConverter(py_spec, &descr)) {  /* descr: new reference */
            goto error;
        }
        if (PyDataType_ELSIZE(descr) != (npy_intp)sizeof(mt_log_row)) {
            PyErr_SetString(PyExc_SystemError, "eventlog_read_all(): unexpected record layout");
            goto error;
        }
        st->log_dtype = (PyObject *)descr; /* the state takes descr's reference */
        descr = NULL;
    }
error:
    Py_XDECREF(py_spec);
    Py_XDECREF((PyObject *)descr);
    return st->log_dtype;
}

static PyObject *
eventlog_read_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_arr = NULL, *py_raw = NULL, *py_result = NULL;
    uint64_t lo = 0, last = 0, n = 0;
    mt_state *st = mt_get_state(module);
    int raw = 0;
    if (nargs == 3) {
        raw = PyObject_IsTrue(args[2]);
        if (raw < 0) {
            goto error;
        }
    }
    if (mt_eventlog_range(args, nargs == 3 ? 2 : nargs, "eventlog_read_all", &lo, &last, &n) < 0) {
        goto error;
    }
    npy_intp kept;
    if (raw) { /* the rows as bytes: one copy now, the array made when (if) the replay runs */
        py_raw = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((last - lo) * sizeof(mt_log_row))); /* new reference */
        if (py_raw == NULL) {
            goto error;
        }
        kept = mt_eventlog_rows((mt_log_row *)PyBytes_AS_STRING(py_raw), lo, last);
        if ((uint64_t)kept < last - lo) { /* torn events left out: the kept rows alone */
            PyObject *py_short = PyBytes_FromStringAndSize(PyBytes_AS_STRING(py_raw),
                                                           (Py_ssize_t)(kept * (npy_intp)sizeof(mt_log_row)));
            if (py_short == NULL) {
                goto error;
            }
            Py_SETREF(py_raw, py_short);
        }
        py_result = Py_BuildValue("(OL)", py_raw, (long long)n - (long long)kept);
        goto error;
    }
    PyObject *dtype = mt_log_dtype(st); /* borrowed from the state */
    if (dtype == NULL) {
        goto error;
    }
    npy_intp dims[1] = {(npy_intp)(last - lo)};
    /* PyArray_NewFromDescr steals the descr, even on failure. */
    py_arr = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)Py_NewRef(dtype), 1, dims, NULL, NULL, 0, NULL);
    if (py_arr == NULL) {
        goto error;
    }
    kept = mt_eventlog_rows((mt_log_row *)PyArray_DATA((PyArrayObject *)py_arr), lo, last);
    if (kept < dims[0] && mt_shrink(py_arr, kept) < 0) {
        goto error;
    }
    py_result = Py_BuildValue("(OL)", py_arr, (long long)n - (long long)kept);
error:
    Py_XDECREF(py_arr);
    Py_XDECREF(py_raw);
    return py_result;
}

void
mt_eventlog_mark(int kind, uint64_t number, uint32_t tag)
{
    mt_event_tag = tag;
    atomic_store_explicit(&mt_event_tag_python, tag, memory_order_relaxed);
    mt_sites_on_tag(tag);
    if (atomic_load_explicit(&mt_eventlog_users, memory_order_relaxed) != 0) {
        mt_eventlog_put(-1, number, 0, ((uint64_t)kind << 32) | (uint64_t)tag);
    }
}

PyDoc_STRVAR(mark_doc,
"eventlog_mark($module, kind, number, tag, /)\n--\n\n"
"Set the owner tag stamped on later events to `tag` (0 <= tag < 2**32) and,\n"
"while a timeline is recorded, log a mark: kind 1 (a module's forward began),\n"
"2 (it ended) or 3 (the tag changed), with `number` (< 2**63) the caller's\n"
"name for what began or ended.");

static PyObject *
eventlog_mark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "eventlog_mark() takes 3 arguments (%zd given)", nargs);
        goto error;
    }
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred()) {
        goto error;
    }
    long long number = PyLong_AsLongLong(args[1]);
    if (number == -1 && PyErr_Occurred()) {
        goto error;
    }
    long long tag = PyLong_AsLongLong(args[2]);
    if (tag == -1 && PyErr_Occurred()) {
        goto error;
    }
    if (kind < MT_EV_ENTER || kind > MT_EV_TAG || number < 0 || tag < 0 || tag > 0xffffffffLL) {
        PyErr_Format(PyExc_ValueError,
                     "eventlog_mark(): kind must be 1, 2 or 3, number >= 0, 0 <= tag < 2**32 "
                     "(got %ld, %lld, %lld)", kind, number, tag);
        goto error;
    }
    mt_eventlog_mark((int)kind, (uint64_t)number, (uint32_t)tag);
    Py_RETURN_NONE;
error:
    return NULL;
}

/* counters_sizes() and counters_serials(): one int64 per address of arg, from
 * mt_counters_lookup(). Returns a new reference, or NULL with an exception. */
static PyObject *
mt_lookup_all(PyObject *arg, int want_serial, const char *msg)
{
    PyObject *py_seq = NULL, *py_out = NULL;
    uintptr_t *ptrs = NULL;
    int64_t *sizes = NULL, *serials = NULL;
    py_seq = PySequence_Fast(arg, msg); /* new reference */
    if (py_seq == NULL) {
        goto error;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(py_seq);
    /* the addresses read into C first: no Python under the table's locks */
    ptrs = PyMem_Malloc(((size_t)n + 1) * sizeof(uintptr_t));
    sizes = PyMem_Malloc(((size_t)n + 1) * sizeof(int64_t));
    serials = PyMem_Malloc(((size_t)n + 1) * sizeof(int64_t));
    if (ptrs == NULL || sizes == NULL || serials == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* borrowed from py_seq, which lives through the loop */
        unsigned long long p = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(py_seq, i));
        if (p == (unsigned long long)-1 && PyErr_Occurred()) {
            goto error;
        }
        ptrs[i] = (uintptr_t)p;
    }
    mt_counters_lookup_many(ptrs, (size_t)n, sizes, serials);
    /* a list, not an array: track() compares and zips it, and a small array costs more to make */
    py_out = PyList_New(n); /* new reference */
    if (py_out == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *py_v = PyLong_FromLongLong((long long)(want_serial ? serials[i] : sizes[i])); /* new reference */
        if (py_v == NULL) {
            goto error;
        }
        PyList_SET_ITEM(py_out, i, py_v); /* steals py_v */
    }
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    PyMem_Free(serials);
    Py_DECREF(py_seq);
    return py_out;
error:
    PyMem_Free(ptrs);
    PyMem_Free(sizes);
    PyMem_Free(serials);
    Py_XDECREF(py_seq);
    Py_XDECREF(py_out);
    return NULL;
}

PyDoc_STRVAR(sizes_doc,
"counters_sizes($module, ptrs, /)\n--\n\n"
"For each address of the sequence `ptrs` (ints), the counted size of the live\n"
"allocation there, or -1 where the counters hold none: a list of ints.");

static PyObject *
counters_sizes(PyObject *module, PyObject *arg)
{
    return mt_lookup_all(arg, 0, "counters_sizes() expects a sequence of ints");
}

PyDoc_STRVAR(serials_doc,
"counters_serials($module, ptrs, /)\n--\n\n"
"For each address of the sequence `ptrs` (ints), a number that tells the live\n"
"allocation there from any other made at that address before or after it, or\n"
"-1 where the counters hold none: a list of ints. Two reads that give the same\n"
"number saw the same allocation.");

static PyObject *
counters_serials(PyObject *module, PyObject *arg)
{
    return mt_lookup_all(arg, 1, "counters_serials() expects a sequence of ints");
}

PyDoc_STRVAR(head_doc,
"eventlog_head($module, /)\n--\n\n"
"Index of the next event to be written.");

static PyObject *
eventlog_head(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(mt_eventlog_head());
}

PyDoc_STRVAR(monotonic_doc,
"monotonic_ns($module, /)\n--\n\n"
"The event log's clock (CLOCK_MONOTONIC on Linux), in nanoseconds.");

static PyObject *
monotonic_ns(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong((long long)mt_monotonic_ns());
}

PyMethodDef mt_eventlog_methods[] = {
    {"eventlog_read", (PyCFunction)(void (*)(void))eventlog_read, METH_FASTCALL, read_doc},
    {"eventlog_read_all", (PyCFunction)(void (*)(void))eventlog_read_all, METH_FASTCALL,
     read_all_doc},
    {"eventlog_mark", (PyCFunction)(void (*)(void))eventlog_mark, METH_FASTCALL, mark_doc},
    {"counters_sizes", counters_sizes, METH_O, sizes_doc},
    {"counters_serials", counters_serials, METH_O, serials_doc},
    {"eventlog_head", eventlog_head, METH_NOARGS, head_doc},
    {"monotonic_ns", monotonic_ns, METH_NOARGS, monotonic_doc},
    {NULL, NULL, 0, NULL},
};
