/* replay.c: one pass over a block's event log: per-module and per-phase bytes, the live set at the peak. */
#include "mt.h"
#include "counters.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MT_TAG_BITS 24 /* memtorch/peak.py TAG_BITS: tag = token << 24 | ... */

/* Expected (name, offset) of each field; a record of another layout is refused. */
static const struct {
    const char *name;
    Py_ssize_t offset;
} mt_fields[] = {
    {"index", offsetof(mt_log_row, index)}, {"time", offsetof(mt_log_row, time)},
    {"bytes", offsetof(mt_log_row, bytes)}, {"ptr", offsetof(mt_log_row, ptr)},
    {"delta", offsetof(mt_log_row, delta)}, {"kind", offsetof(mt_log_row, kind)},
    {"tag", offsetof(mt_log_row, tag)},
};

/* 0 if py_arr is a contiguous 1-d array of eventlog_read_all's records; -1 with
 * an exception set otherwise. py_arr is borrowed. */
static int
mt_check_log(PyObject *py_arr)
{
    if (!PyArray_Check(py_arr)) {
        PyErr_Format(PyExc_TypeError, "eventlog_replay() expects eventlog_read_all()'s array, not %.80s",
                     Py_TYPE(py_arr)->tp_name);
        return -1;
    }
    PyArrayObject *arr = (PyArrayObject *)py_arr;
    PyArray_Descr *descr = PyArray_DESCR(arr); /* borrowed */
    if (PyArray_NDIM(arr) != 1 || !PyArray_IS_C_CONTIGUOUS(arr) || !PyArray_ISALIGNED(arr) ||
        PyDataType_ELSIZE(descr) != (npy_intp)sizeof(mt_log_row) || !PyDataType_HASFIELDS(descr)) {
        PyErr_SetString(PyExc_TypeError, "eventlog_replay() expects a contiguous 1-d array of eventlog_read_all() records");
        return -1;
    }
    PyObject *fields = PyDataType_FIELDS(descr); /* borrowed: {name: (dtype, offset)} */
    for (size_t i = 0; i < sizeof(mt_fields) / sizeof(mt_fields[0]); i++) {
        PyObject *py_f = PyDict_GetItemString(fields, mt_fields[i].name); /* borrowed */
        if (py_f == NULL || !PyTuple_Check(py_f) || PyTuple_GET_SIZE(py_f) < 2 ||
            PyLong_AsSsize_t(PyTuple_GET_ITEM(py_f, 1)) != mt_fields[i].offset) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "eventlog_replay(): the records' field %s is missing or moved",
                             mt_fields[i].name);
            }
            return -1;
        }
    }
    return 0;
}

/* A max segment tree over b[0..n): tree[n + i] = b[i], tree[i] = max of its children. */
static void
mt_tree_build(int64_t *tree, const int64_t *b, Py_ssize_t n)
{
    memcpy(tree + n, b, (size_t)n * sizeof(int64_t));
    for (Py_ssize_t i = n - 1; i > 0; i--) {
        tree[i] = tree[2 * i] > tree[2 * i + 1] ? tree[2 * i] : tree[2 * i + 1];
    }
}

/* max of b[lo..hi] (both inclusive, lo <= hi < n). */
static int64_t
mt_tree_max(const int64_t *tree, Py_ssize_t n, Py_ssize_t lo, Py_ssize_t hi)
{
    int64_t best = INT64_MIN;
    for (lo += n, hi += n + 1; lo < hi; lo /= 2, hi /= 2) {
        if (lo & 1) {
            best = tree[lo] > best ? tree[lo] : best;
            lo++;
        }
        if (hi & 1) {
            hi--;
            best = tree[hi] > best ? tree[hi] : best;
        }
    }
    return best;
}

/* Open addressing, keyed by address: the first event of the address in the log,
 * the last one at or before the peak, and the log index of the first one after it. */
typedef struct {
    uint64_t ptr;
    Py_ssize_t first, last; /* positions in the log; -1: none */
    int64_t next_index;     /* INT64_MAX: none */
    int used;
} mt_slot;

static mt_slot *
mt_slot_of(mt_slot *table, size_t mask, uint64_t ptr)
{
    size_t h = (size_t)((ptr >> 4) * UINT64_C(0x9E3779B97F4A7C15)) & mask;
    while (table[h].used && table[h].ptr != ptr) {
        h = (h + 1) & mask;
    }
    if (!table[h].used) {
        table[h].used = 1;
        table[h].ptr = ptr;
        table[h].first = table[h].last = -1;
        table[h].next_index = INT64_MAX;
    }
    return &table[h];
}

PyDoc_STRVAR(replay_doc,
"eventlog_replay($module, events, start, dropped, peak, token, nrows, queries, /)\n--\n\n"
"One pass over eventlog_read_all()'s array of a block. start: the counted bytes\n"
"when the block opened; dropped: events of the block lost before the oldest one\n"
"kept; peak: the block's peak (< 0: the live set at the log's last event);\n"
"token: the block's tag token (marks of other blocks are ignored); nrows:\n"
"module rows; queries: addresses.\n"
"Returns (base, k, at, reached, live, freed_before, firsts, modules, phases):\n"
"base, the bytes before the first event; k, the position of the first\n"
"allocation event that reached peak (-1: none needed); at, the bytes there;\n"
"reached, False when no event reached peak (k is then the highest one); live,\n"
"int64 array (m, 5) of ptr, delta, tag, index and the index of the address's\n"
"next event (INT64_MAX: none) of the allocations live at k; freed_before, the\n"
"bytes freed up to k of addresses whose first event is a free; firsts, int64\n"
"array (len(queries), 3): position, delta and index of each address's first\n"
"event (position -1: none); modules, int64 array (nrows, 5): calls, measured\n"
"calls, activation bytes summed, highest peak above start, unmatched ends;\n"
"phases, list of (code, start, end, peak) of each completed phase.");

static PyObject *
eventlog_replay(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_live = NULL, *py_firsts = NULL, *py_mods = NULL, *py_phases = NULL;
    PyObject *py_item = NULL, *py_result = NULL;
    int64_t *b = NULL, *tree = NULL;
    Py_ssize_t *top = NULL, *below = NULL;
    mt_slot *table = NULL;
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "eventlog_replay() takes 7 arguments (%zd given)", nargs);
        goto error;
    }
    if (mt_check_log(args[0]) < 0) {
        goto error;
    }
    long long start = PyLong_AsLongLong(args[1]);
    long long dropped = PyLong_AsLongLong(args[2]);
    long long peak = PyLong_AsLongLong(args[3]);
    long token = PyLong_AsLong(args[4]);
    Py_ssize_t nrows = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) {
        goto error;
    }
    if (nrows < 0 || token < 0) {
        PyErr_SetString(PyExc_ValueError, "eventlog_replay(): nrows and token must be >= 0");
        goto error;
    }
    if (!PyList_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "eventlog_replay(): queries must be a list of addresses");
        goto error;
    }
    PyArrayObject *arr = (PyArrayObject *)args[0];
    const mt_log_row *ev = (const mt_log_row *)PyArray_DATA(arr);
    Py_ssize_t n = (Py_ssize_t)PyArray_DIM(arr, 0);
    Py_ssize_t nq = PyList_GET_SIZE(args[6]);

    /* bytes after each event; a mark takes the bytes of the allocation event before it */
    int64_t base = start;
    Py_ssize_t first_alloc = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ev[i].kind == MT_EV_ALLOC) {
            first_alloc = i;
            break;
        }
    }
    if (dropped && first_alloc >= 0) {
        base = ev[first_alloc].bytes - ev[first_alloc].delta;
    }
    b = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    tree = PyMem_Malloc((size_t)(n ? 2 * n : 1) * sizeof(int64_t));
    top = PyMem_Malloc((size_t)(nrows ? nrows : 1) * sizeof(Py_ssize_t));
    below = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (b == NULL || tree == NULL || top == NULL || below == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    int64_t cur = base;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ev[i].kind == MT_EV_ALLOC) {
            cur = ev[i].bytes;
        }
        b[i] = cur;
    }
    if (n) {
        mt_tree_build(tree, b, n);
    }

    /* modules: a stack of open forwards per row, linked through `below` */
    npy_intp mdims[2] = {nrows, 5};
    py_mods = PyArray_ZEROS(2, mdims, NPY_INT64, 0); /* new reference */
    py_phases = PyList_New(0);                      /* new reference */
    if (py_mods == NULL || py_phases == NULL) {
        goto error;
    }
    int64_t *mods = (int64_t *)PyArray_DATA((PyArrayObject *)py_mods);
    for (Py_ssize_t r = 0; r < nrows; r++) {
        top[r] = -1;
    }
    Py_ssize_t phase_open[256];
    for (int c = 0; c < 256; c++) {
        phase_open[c] = -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t kind = ev[j].kind;
        if (kind == MT_EV_ALLOC || (long)(ev[j].tag >> MT_TAG_BITS) != token) {
            continue;
        }
        uint64_t num = ev[j].ptr;
        if (kind == MT_EV_TAG) {
            if (num < 0x100) {
                continue;
            }
            int code = (int)(num & 0xFF);
            if (num & 0x100) {
                phase_open[code] = j;
            }
            else if (phase_open[code] >= 0) {
                Py_ssize_t p = phase_open[code];
                phase_open[code] = -1;
                py_item = Py_BuildValue("(iLLL)", code, (long long)b[p], (long long)b[j],
                                        (long long)mt_tree_max(tree, n, p, j)); /* new reference */
                if (py_item == NULL || PyList_Append(py_phases, py_item) < 0) {
                    goto error;
                }
                Py_CLEAR(py_item);
            }
            continue;
        }
        if (num >= (uint64_t)nrows) {
            continue; /* not a row of this block's table */
        }
        Py_ssize_t r = (Py_ssize_t)num;
        int64_t *row = mods + 5 * r;
        if (kind == MT_EV_ENTER) {
            below[j] = top[r];
            top[r] = j;
        }
        else if (top[r] >= 0) {
            Py_ssize_t p = top[r];
            top[r] = below[p];
            int64_t above = mt_tree_max(tree, n, p, j) - b[p];
            row[0] += 1;
            row[1] += 1;
            row[2] += b[j] - b[p];
            row[3] = above > row[3] ? above : row[3];
        }
        else {
            row[0] += 1; /* began before the oldest event kept */
            row[4] += 1;
        }
    }
    for (Py_ssize_t r = 0; r < nrows; r++) { /* interrupted forwards end with the log */
        int64_t *row = mods + 5 * r;
        for (Py_ssize_t p = top[r]; p >= 0; p = below[p]) {
            int64_t above = mt_tree_max(tree, n, p, n - 1) - b[p];
            row[0] += 1;
            row[1] += 1;
            row[2] += b[n - 1] - b[p];
            row[3] = above > row[3] ? above : row[3];
        }
    }

    /* the allocation event that reached the peak: the first one, in log order
     * (peak < 0: the last event of the log, the live set at its end: the
     * out-of-memory post-mortem passes the events before the failure) */
    Py_ssize_t k = -1;
    int reached = 1;
    int64_t at = peak;
    if (peak < 0) {
        at = base;
        for (Py_ssize_t i = n - 1; i >= 0; i--) {
            if (ev[i].kind == MT_EV_ALLOC) {
                k = i;
                at = ev[i].bytes;
                break;
            }
        }
    }
    else if (peak > base && first_alloc >= 0) {
        Py_ssize_t best = -1;
        for (Py_ssize_t i = first_alloc; i < n; i++) {
            if (ev[i].kind != MT_EV_ALLOC) {
                continue;
            }
            if (ev[i].bytes == peak) {
                k = i;
                break;
            }
            if (best < 0 || ev[i].bytes > ev[best].bytes) {
                best = i;
            }
        }
        if (k < 0) {
            k = best;
            reached = 0;
        }
        at = ev[k].bytes;
    }

    /* per address: first event, last one up to k, index of the next one after it */
    size_t cap = 16;
    while (cap < (size_t)n * 2 + (size_t)nq * 2 + 16) {
        cap *= 2;
    }
    table = PyMem_Calloc(cap, sizeof(mt_slot));
    if (table == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    size_t mask = cap - 1;
    int64_t freed_before = 0;
    Py_ssize_t nlive = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ev[i].kind != MT_EV_ALLOC) {
            continue;
        }
        mt_slot *s = mt_slot_of(table, mask, ev[i].ptr);
        if (s->first < 0) {
            s->first = i;
            if (i <= k && ev[i].delta < 0) {
                freed_before -= ev[i].delta;
            }
        }
        if (i <= k) {
            if (s->last >= 0 && ev[s->last].delta >= 0) {
                nlive--;
            }
            s->last = i;
            if (ev[i].delta >= 0) {
                nlive++;
            }
        }
        else if (s->last >= 0 && s->next_index == INT64_MAX) {
            s->next_index = (int64_t)ev[i].index;
        }
    }
    npy_intp ldims[2] = {nlive, 5};
    py_live = PyArray_ZEROS(2, ldims, NPY_INT64, 0); /* new reference */
    if (py_live == NULL) {
        goto error;
    }
    int64_t *live = (int64_t *)PyArray_DATA((PyArrayObject *)py_live);
    Py_ssize_t m = 0;
    /* in log order: walk the events up to k and keep each address's last one */
    for (Py_ssize_t i = 0; i <= k && m < nlive; i++) {
        if (ev[i].kind != MT_EV_ALLOC || ev[i].delta < 0) {
            continue;
        }
        mt_slot *s = mt_slot_of(table, mask, ev[i].ptr);
        if (s->last != i) {
            continue;
        }
        int64_t *o = live + 5 * m++;
        o[0] = (int64_t)ev[i].ptr;
        o[1] = ev[i].delta;
        o[2] = (int64_t)ev[i].tag;
        o[3] = (int64_t)ev[i].index;
        o[4] = s->next_index;
    }
    npy_intp fdims[2] = {nq, 3};
    py_firsts = PyArray_ZEROS(2, fdims, NPY_INT64, 0); /* new reference */
    if (py_firsts == NULL) {
        goto error;
    }
    int64_t *firsts = (int64_t *)PyArray_DATA((PyArrayObject *)py_firsts);
    for (Py_ssize_t q = 0; q < nq; q++) {
        unsigned long long a = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(args[6], q)); /* borrowed item */
        if (a == (unsigned long long)-1 && PyErr_Occurred()) {
            goto error;
        }
        mt_slot *s = mt_slot_of(table, mask, (uint64_t)a); /* may add an unused slot: harmless */
        int64_t *o = firsts + 3 * q;
        o[0] = s->first;
        o[1] = s->first >= 0 ? ev[s->first].delta : 0;
        o[2] = s->first >= 0 ? (int64_t)ev[s->first].index : 0;
    }
    py_result = Py_BuildValue("(LnLOOLOOO)", (long long)base, k, (long long)at, reached ? Py_True : Py_False,
                              py_live, (long long)freed_before, py_firsts, py_mods, py_phases);
error:
    Py_XDECREF(py_item);
    Py_XDECREF(py_live);
    Py_XDECREF(py_firsts);
    Py_XDECREF(py_mods);
    Py_XDECREF(py_phases);
    PyMem_Free(b);
    PyMem_Free(tree);
    PyMem_Free(top);
    PyMem_Free(below);
    PyMem_Free(table);
    return py_result;
}

/* snapshots[i] as (head, names): head into *head, names (borrowed from the
 * snapshot) into *names. 0, or -1 with an exception set. */
static int
mt_snapshot(PyObject *py_snaps, Py_ssize_t i, long long *head, PyObject **names)
{
    PyObject *py_snap = PyList_GET_ITEM(py_snaps, i); /* borrowed from py_snaps */
    if (!PyTuple_Check(py_snap) || PyTuple_GET_SIZE(py_snap) != 2 || !PyDict_Check(PyTuple_GET_ITEM(py_snap, 1))) {
        PyErr_SetString(PyExc_TypeError, "eventlog_names(): snapshots must be (head, dict) pairs");
        return -1;
    }
    *head = PyLong_AsLongLong(PyTuple_GET_ITEM(py_snap, 0));
    *names = PyTuple_GET_ITEM(py_snap, 1);
    return *head == -1 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(names_doc,
"eventlog_names($module, live, snapshots, queries, firsts, k, sizes, /)\n--\n\n"
"The names of the storages live at a block's peak, from eventlog_replay()'s\n"
"live and firsts (k: its peak position) and the walks snapshots, a list of\n"
"(log index, {address: name tuple}): a walk names an allocation that lived\n"
"when it was taken. Returns (named, before): named, one name tuple or None per\n"
"live row; before, [(name tuple, bytes)] of the storages made before the log\n"
"that a walk saw, live at the peak: those freed after it (their size from the\n"
"log) and those with no event in the log whose size sizes (a dict address ->\n"
"counted size now, -1: none) knows. Each address once, from the first walk\n"
"that names it.");

static PyObject *
eventlog_names(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_named = NULL, *py_before = NULL, *py_done = NULL, *py_item = NULL, *py_row_of = NULL;
    PyObject *py_q = NULL, *py_result = NULL;
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "eventlog_names() takes 6 arguments (%zd given)", nargs);
        goto error;
    }
    PyObject *py_snaps = args[1], *py_queries = args[2], *py_sizes = args[5]; /* borrowed arguments */
    if (!PyArray_Check(args[0]) || !PyArray_Check(args[3]) || !PyList_Check(py_snaps) ||
        !PyList_Check(py_queries) || !PyDict_Check(py_sizes)) {
        PyErr_SetString(PyExc_TypeError, "eventlog_names() expects eventlog_replay()'s live and firsts, lists and a dict");
        goto error;
    }
    PyArrayObject *live = (PyArrayObject *)args[0], *firsts = (PyArrayObject *)args[3];
    Py_ssize_t nq = PyList_GET_SIZE(py_queries), ns = PyList_GET_SIZE(py_snaps);
    if (PyArray_TYPE(live) != NPY_INT64 || PyArray_NDIM(live) != 2 || PyArray_DIM(live, 1) != 5 ||
        !PyArray_IS_C_CONTIGUOUS(live) || PyArray_TYPE(firsts) != NPY_INT64 || PyArray_NDIM(firsts) != 2 ||
        PyArray_DIM(firsts, 0) != nq || PyArray_DIM(firsts, 1) != 3 || !PyArray_IS_C_CONTIGUOUS(firsts)) {
        PyErr_SetString(PyExc_ValueError, "eventlog_names(): live or firsts is not what eventlog_replay() returned");
        goto error;
    }
    long long k = PyLong_AsLongLong(args[4]);
    if (k == -1 && PyErr_Occurred()) {
        goto error;
    }
    const int64_t *lv = (const int64_t *)PyArray_DATA(live);
    const int64_t *fs = (const int64_t *)PyArray_DATA(firsts);
    Py_ssize_t m = (Py_ssize_t)PyArray_DIM(live, 0);

    /* the live rows: the first walk (in list order) taken while the allocation lived */
    py_named = PyList_New(m); /* new reference */
    if (py_named == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t *row = lv + 5 * i; /* ptr, delta, tag, index, next index */
        PyObject *py_found = Py_None;      /* borrowed */
        for (Py_ssize_t j = 0; j < ns; j++) {
            long long head;
            PyObject *names;
            if (mt_snapshot(py_snaps, j, &head, &names) < 0) {
                goto error;
            }
            if (!(row[3] < head && head <= row[4])) {
                continue;
            }
            py_item = PyLong_FromUnsignedLongLong((unsigned long long)row[0]); /* new reference */
            if (py_item == NULL) {
                goto error;
            }
            PyObject *py_n = PyDict_GetItemWithError(names, py_item); /* borrowed from names */
            Py_CLEAR(py_item);
            if (py_n == NULL && PyErr_Occurred()) {
                goto error;
            }
            if (py_n != NULL) {
                py_found = py_n;
                break;
            }
        }
        PyList_SET_ITEM(py_named, i, Py_NewRef(py_found));
    }

    /* storages made before the log: the first event of each address, by query */
    py_row_of = PyDict_New(); /* new reference: address -> row of firsts */
    if (py_row_of == NULL) {
        goto error;
    }
    for (Py_ssize_t q = 0; q < nq; q++) {
        py_q = PyLong_FromSsize_t(q); /* new reference */
        if (py_q == NULL || PyDict_SetItem(py_row_of, PyList_GET_ITEM(py_queries, q), py_q) < 0) {
            goto error;
        }
        Py_CLEAR(py_q);
    }
    py_before = PyList_New(0); /* new reference */
    py_done = PySet_New(NULL); /* new reference */
    if (py_before == NULL || py_done == NULL) {
        goto error;
    }
    for (Py_ssize_t j = 0; j < ns; j++) {
        long long head;
        PyObject *names, *py_a, *py_n; /* borrowed */
        Py_ssize_t pos = 0;
        if (mt_snapshot(py_snaps, j, &head, &names) < 0) {
            goto error;
        }
        while (PyDict_Next(names, &pos, &py_a, &py_n)) {
            int done = PySet_Contains(py_done, py_a);
            PyObject *py_row = done ? NULL : PyDict_GetItemWithError(py_row_of, py_a); /* borrowed */
            if (done < 0 || (!done && py_row == NULL)) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_KeyError, "eventlog_names(): a snapshot's address is not among the queries");
                }
                goto error;
            }
            if (done) {
                continue;
            }
            const int64_t *f = fs + 3 * PyLong_AsSsize_t(py_row); /* position, delta, index */
            long long size = -1;
            if (f[0] < 0) { /* no event in the log: its size now, if counted */
                PyObject *py_s = PyDict_GetItemWithError(py_sizes, py_a); /* borrowed */
                if (py_s == NULL && PyErr_Occurred()) {
                    goto error;
                }
                size = py_s == NULL ? -1 : PyLong_AsLongLong(py_s);
                if (size == -1 && PyErr_Occurred()) {
                    goto error;
                }
            }
            else if (f[0] > k && f[1] < 0 && f[2] >= head) { /* freed after the peak */
                size = -f[1];
            }
            else {
                continue; /* a later walk may still name it */
            }
            if (PySet_Add(py_done, py_a) < 0) {
                goto error;
            }
            if (size < 0) {
                continue;
            }
            py_item = Py_BuildValue("(OL)", py_n, size); /* new reference */
            if (py_item == NULL || PyList_Append(py_before, py_item) < 0) {
                goto error;
            }
            Py_CLEAR(py_item);
        }
    }
    py_result = PyTuple_Pack(2, py_named, py_before);
error:
    Py_XDECREF(py_row_of);
    Py_XDECREF(py_q);
    Py_XDECREF(py_named);
    Py_XDECREF(py_before);
    Py_XDECREF(py_done);
    Py_XDECREF(py_item);
    return py_result;
}

PyMethodDef mt_replay_methods[] = {
    {"eventlog_names", (PyCFunction)(void (*)(void))eventlog_names, METH_FASTCALL, names_doc},
    {"eventlog_replay", (PyCFunction)(void (*)(void))eventlog_replay, METH_FASTCALL, replay_doc},
    {NULL, NULL, 0, NULL},
};
