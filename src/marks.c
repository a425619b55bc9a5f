/* marks.c: track()'s module hooks in C (ModuleMarks): the owner tags and enter/exit marks of the event log. */
#include "mt.h"
#include "counters.h"

#include <stdint.h>
#include <string.h>

/*
 * A block in event-log mode registers two global module hooks; every module
 * call in the process goes through them (torch.nn.modules.module's
 * register_module_forward_pre_hook / _hook). For the modules of the watched
 * model they push or pop the module's owner tag and log an enter or exit
 * mark; for its root they first (pre) or last (post) call back into Python
 * (the phases, the batch's names). Written in C because between a step's
 * operators the hooks run with cold caches, where every line of Python costs
 * several times what it costs in a loop.
 *
 * The modules are kept as addresses only (ids, as the Python hooks compared
 * id(module)): never dereferenced, so no reference is held.
 */

#define MT_MARKS_DEPTH 256 /* tags kept on the stack; deeper nesting reuses the last */

typedef struct {
    uintptr_t key; /* module address; 0: empty */
    int64_t row;
} mt_mark_slot;

typedef struct {
    PyObject_HEAD
    mt_mark_slot *slots; /* open addressing, power-of-two capacity, half full at most */
    size_t cap;
    uintptr_t root;      /* the root module's address (0: none) */
    uint32_t tagbase;
    unsigned int phase_code; /* the phase bits of the tags, set by the Python hooks */
    Py_ssize_t depth;    /* tags pushed (may exceed MT_MARKS_DEPTH) */
    uint32_t tags[MT_MARKS_DEPTH];
    PyObject *on_pre, *on_post; /* Python callables for the root (owned) */
} mt_marks;

static inline size_t
mt_marks_home(uintptr_t key, size_t cap)
{
    uint64_t h = (uint64_t)key * UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(h >> 32) & (cap - 1);
}

/* The row of the module at key, or -1. */
static int64_t
mt_marks_row(const mt_marks *m, uintptr_t key)
{
    if (m->cap == 0 || key == 0) {
        return -1;
    }
    for (size_t j = mt_marks_home(key, m->cap);; j = (j + 1) & (m->cap - 1)) {
        if (m->slots[j].key == key) {
            return m->slots[j].row;
        }
        if (m->slots[j].key == 0) {
            return -1;
        }
    }
}

/* The tag on top: the innermost running module's, else the block's with its phase. */
static inline uint32_t
mt_marks_top(const mt_marks *m)
{
    if (m->depth > 0) {
        return m->tags[(m->depth <= MT_MARKS_DEPTH ? m->depth : MT_MARKS_DEPTH) - 1];
    }
    return m->tagbase | m->phase_code;
}

static int
marks_traverse(mt_marks *m, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(m));
    Py_VISIT(m->on_pre);
    Py_VISIT(m->on_post);
    return 0;
}

static int
marks_clear(mt_marks *m)
{
    Py_CLEAR(m->on_pre);
    Py_CLEAR(m->on_post);
    return 0;
}

static void
marks_dealloc(mt_marks *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    PyObject_GC_UnTrack(m);
    (void)marks_clear(m);
    PyMem_Free(m->slots);
    m->slots = NULL;
    tp->tp_free((PyObject *)m);
    Py_DECREF(tp);
}

static PyObject *
marks_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ids", "root_id", "tagbase", "on_root_pre", "on_root_post", NULL};
    PyObject *py_ids, *py_pre, *py_post;
    unsigned long long root = 0;
    unsigned long long tagbase = 0;
    mt_marks *m = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!KKOO:ModuleMarks", kwlist, &PyDict_Type, &py_ids,
                                     &root, &tagbase, &py_pre, &py_post)) {
        goto error;
    }
    if (!PyCallable_Check(py_pre) || !PyCallable_Check(py_post)) {
        PyErr_SetString(PyExc_TypeError, "ModuleMarks(): on_root_pre and on_root_post must be callable");
        goto error;
    }
    if (tagbase > 0xffffffffULL) {
        PyErr_SetString(PyExc_ValueError, "ModuleMarks(): tagbase must be < 2**32");
        goto error;
    }
    m = (mt_marks *)type->tp_alloc(type, 0); /* new reference, zeroed */
    if (m == NULL) {
        goto error;
    }
    m->root = (uintptr_t)root;
    m->tagbase = (uint32_t)tagbase;
    m->on_pre = Py_NewRef(py_pre);
    m->on_post = Py_NewRef(py_post);
    Py_ssize_t n = PyDict_GET_SIZE(py_ids);
    size_t cap = 8;
    while (cap < 2 * (size_t)n + 2) {
        cap *= 2;
    }
    m->slots = PyMem_Calloc(cap, sizeof(mt_mark_slot));
    if (m->slots == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    m->cap = cap;
    PyObject *py_k, *py_v; /* borrowed from py_ids */
    Py_ssize_t pos = 0;
    while (PyDict_Next(py_ids, &pos, &py_k, &py_v)) {
        unsigned long long key = PyLong_AsUnsignedLongLong(py_k);
        if (key == (unsigned long long)-1 && PyErr_Occurred()) {
            goto error;
        }
        long long row = PyLong_AsLongLong(py_v);
        if (row == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (key == 0 || row < 0 || row > (1LL << 22) - 2) { /* (row + 1) << 2 fits the tag's 24 bits */
            PyErr_SetString(PyExc_ValueError,
                            "ModuleMarks(): ids maps module ids (> 0) to rows (0 <= row < 2**22 - 1)");
            goto error;
        }
        size_t j = mt_marks_home((uintptr_t)key, cap);
        while (m->slots[j].key != 0 && m->slots[j].key != (uintptr_t)key) {
            j = (j + 1) & (cap - 1);
        }
        m->slots[j].key = (uintptr_t)key;
        m->slots[j].row = row;
    }
    return (PyObject *)m;
error:
    Py_XDECREF(m);
    return NULL;
}

/* pre(module, args): the forward pre-hook. */
static PyObject *
marks_pre(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.pre() takes 2 arguments (%zd given)", nargs);
        goto error;
    }
    uintptr_t key = (uintptr_t)args[0];
    if (key == m->root) {
        PyObject *py_r = PyObject_Vectorcall(m->on_pre, args, 2, NULL); /* new reference */
        if (py_r == NULL) {
            goto error;
        }
        Py_DECREF(py_r);
    }
    int64_t row = mt_marks_row(m, key);
    if (row >= 0) {
        uint32_t tag = m->tagbase | ((uint32_t)(row + 1) << 2) | m->phase_code;
        if (m->depth < MT_MARKS_DEPTH) {
            m->tags[m->depth] = tag;
        }
        m->depth++;
        mt_eventlog_mark(MT_EV_ENTER, (uint64_t)row, tag);
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

/* post(module, args, output): the forward hook (always called); never keeps output. */
static PyObject *
marks_post(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.post() takes 3 arguments (%zd given)", nargs);
        goto error;
    }
    uintptr_t key = (uintptr_t)args[0];
    int64_t row = mt_marks_row(m, key);
    if (row >= 0) {
        if (m->depth > 0) {
            m->depth--;
        }
        mt_eventlog_mark(MT_EV_EXIT, (uint64_t)row, mt_marks_top(m));
    }
    if (key == m->root) {
        PyObject *py_r = PyObject_Vectorcall(m->on_post, args, 3, NULL); /* new reference */
        if (py_r == NULL) {
            goto error;
        }
        Py_DECREF(py_r);
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

static PyObject *
marks_top(mt_marks *m, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLong(mt_marks_top(m));
}

static PyObject *
marks_get_phase_code(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(m->phase_code);
}

static int
marks_set_phase_code(mt_marks *m, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "phase_code cannot be deleted");
        return -1;
    }
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (v > 3) {
        PyErr_SetString(PyExc_ValueError, "phase_code must be 0..3 (the tag's two phase bits)");
        return -1;
    }
    m->phase_code = (unsigned int)v;
    return 0;
}

static PyObject *
marks_get_depth(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(m->depth);
}

static PyMethodDef marks_methods[] = {
    {"pre", (PyCFunction)(void (*)(void))marks_pre, METH_FASTCALL,
     "pre(module, args): the forward pre-hook (the root's Python callback first)."},
    {"post", (PyCFunction)(void (*)(void))marks_post, METH_FASTCALL,
     "post(module, args, output): the forward hook (the root's Python callback last)."},
    {"top", (PyCFunction)marks_top, METH_NOARGS,
     "top(): the owner tag now: the innermost running module's, else tagbase | phase_code."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef marks_getset[] = {
    {"phase_code", (getter)marks_get_phase_code, (setter)marks_set_phase_code,
     "the phase bits of the tags (0..3)", NULL},
    {"depth", (getter)marks_get_depth, NULL, "module forwards running (tags pushed)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot marks_slots[] = {
    {Py_tp_doc, (void *)"ModuleMarks(ids, root_id, tagbase, on_root_pre, on_root_post): track()'s module "
                        "hooks in event-log mode (ids: {id(module): row})."},
    {Py_tp_new, marks_new},
    {Py_tp_dealloc, marks_dealloc},
    {Py_tp_traverse, marks_traverse},
    {Py_tp_clear, marks_clear},
    {Py_tp_methods, marks_methods},
    {Py_tp_getset, marks_getset},
    {0, NULL},
};

static PyType_Spec marks_spec = {
    .name = "memtorch._C.ModuleMarks",
    .basicsize = sizeof(mt_marks),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = marks_slots,
};

int
mt_marks_exec(PyObject *module)
{
    PyObject *py_type = PyType_FromModuleAndSpec(module, &marks_spec, NULL); /* new reference */
    if (py_type == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(module, "ModuleMarks", py_type);
    Py_DECREF(py_type);
    return rc;
}
