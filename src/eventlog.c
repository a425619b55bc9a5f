/* eventlog.c: lock-free ring buffer of (time_ns, bytes) events for timelines, read out as NumPy arrays. */
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
#define MT_EVENTS (1u << MT_EVENTS_LOG2) /* 131072 events, 3 MiB */

typedef struct {
    _Atomic uint64_t seq; /* index + 1 once written; 0 while being written */
    _Atomic int64_t time_ns;
    _Atomic int64_t bytes;
} mt_event;

static mt_event *_Atomic mt_events;   /* NULL until first used */
static _Atomic uint64_t mt_events_head; /* next index to claim */
static _Atomic int mt_eventlog_users;   /* open timelines */

void
mt_eventlog_record(int64_t bytes)
{
    if (atomic_load_explicit(&mt_eventlog_users, memory_order_relaxed) == 0) {
        return;
    }
    mt_event *events = atomic_load_explicit(&mt_events, memory_order_acquire);
    if (events == NULL) {
        return;
    }
    int64_t t = mt_monotonic_ns();
    uint64_t i = atomic_fetch_add_explicit(&mt_events_head, 1, memory_order_relaxed);
    mt_event *e = &events[i & (MT_EVENTS - 1)];
    atomic_store_explicit(&e->seq, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&e->time_ns, t, memory_order_relaxed);
    atomic_store_explicit(&e->bytes, bytes, memory_order_relaxed);
    atomic_store_explicit(&e->seq, i + 1, memory_order_release);
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

PyDoc_STRVAR(read_doc,
"eventlog_read($module, first, last, /)\n--\n\n"
"Events with index in [first, last) as (times_ns, bytes, dropped): two int64\n"
"arrays and the number of events in that range that were overwritten or\n"
"torn (the ring holds the latest 131072 events).");

static PyObject *
eventlog_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_times = NULL, *py_bytes = NULL, *py_result = NULL;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "eventlog_read() takes 2 arguments (%zd given)", nargs);
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
    /* Only the latest MT_EVENTS indices can still be in the ring. */
    uint64_t lo = (head > MT_EVENTS && first < head - MT_EVENTS) ? head - MT_EVENTS : first;
    npy_intp n = (npy_intp)(last - first);
    npy_intp dims[1] = {n};
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
    npy_intp kept = 0;
    mt_event *events = atomic_load(&mt_events);
    for (uint64_t i = lo; events != NULL && i < last; i++) {
        mt_event *e = &events[i & (MT_EVENTS - 1)];
        uint64_t s1 = atomic_load_explicit(&e->seq, memory_order_acquire);
        int64_t t = atomic_load_explicit(&e->time_ns, memory_order_relaxed);
        int64_t b = atomic_load_explicit(&e->bytes, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        uint64_t s2 = atomic_load_explicit(&e->seq, memory_order_relaxed);
        if (s1 == i + 1 && s2 == s1) {
            tp[kept] = t;
            bp[kept] = b;
            kept++;
        }
    }
    long long dropped = (long long)(n - kept);
    /* Shrink to what was kept (the arrays own their data, no views yet). */
    PyArray_Dims newshape = {dims, 1};
    dims[0] = kept;
    PyObject *tmp = PyArray_Resize((PyArrayObject *)py_times, &newshape, 0, NPY_CORDER);
    if (tmp == NULL) {
        goto error;
    }
    Py_DECREF(tmp);
    tmp = PyArray_Resize((PyArrayObject *)py_bytes, &newshape, 0, NPY_CORDER);
    if (tmp == NULL) {
        goto error;
    }
    Py_DECREF(tmp);
    py_result = Py_BuildValue("(OOL)", py_times, py_bytes, dropped);
error:
    Py_XDECREF(py_times);
    Py_XDECREF(py_bytes);
    return py_result;
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
    {"eventlog_head", eventlog_head, METH_NOARGS, head_doc},
    {"monotonic_ns", monotonic_ns, METH_NOARGS, monotonic_doc},
    {NULL, NULL, 0, NULL},
};
