/* marks.c: track()'s hooks in C (ModuleMarks): owner tags, module and phase marks of the event log, names of the batch and gradients. */
#include "mt.h"
#include "counters.h"

#include <stdint.h>
#include <string.h>

/*
 * A block in event-log mode puts a forward pre-hook and a forward hook (always
 * called) on each module of the watched model (install(): into each module's
 * own hook dicts, not torch's global ones, which make torch warn on every call
 * of a torch.compile'd module and send every other module of the process down
 * its slow path). They push or pop the module's owner tag and log an enter or
 * exit mark. What goes into the dicts are the Python wrappers tracking.py
 * makes around pre/post/opt_pre/opt_post: they return at once while dynamo
 * traces (torch.compiler.is_compiling()), which a C function cannot tell
 * dynamo, so that a compiled graph has no break and no trace of memtorch. Its root's forward begins the forward phase (and names the batch: the
 * tensors given to it), its end the backward phase when autograd is on. The
 * root is the first module of the model whose forward runs while none of the
 * model's does: the model itself, or the part a framework's step calls (a
 * LightningModule's training_step calling self.model(x), never the
 * LightningModule). A later such forward of another module (self.head(h)
 * after self.encoder(x)) is the same forward pass: the forward phase again,
 * no new call of it, and after it the backward phase, no new call either. The
 * optimizer's step pre- and post-hooks begin and end the optimizer phase and
 * name the gradients (which zero_grad() may free before the block ends) and
 * new optimizer state. Each phase change is a tag mark; names go into the
 * block's list of snapshots, (log index, {address: (name, kind, ...)}), which
 * the replay reads. Written in C because between a step's operators the hooks
 * run with cold caches, where every line of Python costs several times what it
 * costs in a loop.
 *
 * The modules are kept as addresses only (ids, as the Python hooks compared
 * id(module)): never dereferenced, so no reference is held. The phase codes
 * are peak.py's PHASE_CODES (1 forward, 2 backward, 3 optimizer).
 */

#define MT_MARKS_DEPTH 256 /* tags kept on the stack; deeper nesting reuses the last */
#define MT_MARKS_INPUTS 64 /* the root's first arguments looked at for the batch */
#define MT_MARKS_SNAPS 256 /* snapshots kept: the first 16 and the latest (a block's peak is often in its first step) */

static const char *const mt_phase_names[4] = {NULL, "forward", "backward", "optimizer"};

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
    unsigned int phase_code; /* the phase bits of the tags: the running phase's code, 0 between phases */
    Py_ssize_t depth;    /* tags pushed (may exceed MT_MARKS_DEPTH) */
    uint32_t tags[MT_MARKS_DEPTH];
    /* Per module call, beside the event log (whose ring may wrap in a long block and
     * lose old marks): the row and the counted bytes when its forward began, and per
     * row the calls, the bytes they left allocated (end - start, summed) and the ends
     * whose start was not on the stack (deeper than MT_MARKS_DEPTH, or hooks added
     * mid-forward). rows_n rows; PyMem arrays owned here, of 2 * rows_n entries: row
     * rows_n + r holds row r's recomputations (a forward autograd runs during backward:
     * torch.utils.checkpoint), which the event log marks as row rows_n + r too. */
    int64_t starts[MT_MARKS_DEPTH];
    int64_t srows[MT_MARKS_DEPTH];
    int64_t *row_calls, *row_act, *row_unmatched;
    Py_ssize_t rows_n;
    int64_t phase_b0;      /* counted bytes when the running phase began */
    int64_t phase_delta[4]; /* per phase, counted bytes at its end - at its start, summed */
    Py_ssize_t root_depth; /* the root's forwards running (recursion) */
    long long forwards;    /* the root's outermost forwards */
    uintptr_t top;         /* a module of the model other than the root whose forward runs
                            * while none of the model's did when it began (0: none) */
    long long phase_calls[4];
    int64_t phase_ns[4];   /* CLOCK_MONOTONIC time spent in each phase */
    int64_t phase_t0;      /* when the running phase began */
    Py_ssize_t state_n;    /* entries of the optimizer's state when its names were last read */
    int no_shape;          /* names without shape and dtype (16 in names_walk's want) */
    /* owned references: */
    PyObject *snapshots;   /* list of (log index, names) */
    PyObject *params;      /* list of (name, weakref to a parameter), or None until the first walk */
    PyObject *grad_enabled; /* torch.is_grad_enabled */
    PyObject *timeline;    /* list of (ns, "phase"|"end", name), or None */
    PyObject *last_inputs; /* list of the addresses of the last forward's tensor arguments (0: none) */
    PyObject *closure_hook; /* closure_hook(args, kwargs) for a step given arguments (a closure), or None */
    PyObject *installed;    /* install(): list of (hook dict, id) it put in; NULL: none */
    PyObject *pre_id;       /* install(): the id of the modules' pre-hooks; NULL: none installed */
    PyObject *in_backward;  /* torch._C._current_graph_task_id (-1: not in a backward), or None */
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
    Py_VISIT(m->snapshots);
    Py_VISIT(m->params);
    Py_VISIT(m->grad_enabled);
    Py_VISIT(m->timeline);
    Py_VISIT(m->last_inputs);
    Py_VISIT(m->closure_hook);
    Py_VISIT(m->installed);
    Py_VISIT(m->pre_id);
    Py_VISIT(m->in_backward);
    return 0;
}

static int
marks_clear(mt_marks *m)
{
    Py_CLEAR(m->snapshots);
    Py_CLEAR(m->params);
    Py_CLEAR(m->grad_enabled);
    Py_CLEAR(m->timeline);
    Py_CLEAR(m->last_inputs);
    Py_CLEAR(m->closure_hook);
    Py_CLEAR(m->installed);
    Py_CLEAR(m->pre_id);
    Py_CLEAR(m->in_backward);
    return 0;
}

/* Fill the hash of module addresses from py_ids ({id(module): row}, borrowed);
 * replaces the old one. 0, or -1 with an exception set (the old one kept). */
static int
mt_marks_set_ids(mt_marks *m, PyObject *py_ids)
{
    mt_mark_slot *slots = NULL;
    int64_t *calls = NULL, *act = NULL, *unmatched = NULL;
    Py_ssize_t nrows = 0;
    Py_ssize_t n = PyDict_GET_SIZE(py_ids);
    size_t cap = 8;
    while (cap < 2 * (size_t)n + 2) {
        cap *= 2;
    }
    slots = PyMem_Calloc(cap, sizeof(mt_mark_slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        goto error;
    }
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
        while (slots[j].key != 0 && slots[j].key != (uintptr_t)key) {
            j = (j + 1) & (cap - 1);
        }
        slots[j].key = (uintptr_t)key;
        slots[j].row = row;
        nrows = row + 1 > nrows ? (Py_ssize_t)row + 1 : nrows;
    }
    /* the per-row totals (forwards, then recomputations), the old rows' kept (a model given
     * to an open block starts at 0) */
    size_t alloc = (size_t)(nrows ? 2 * nrows : 1);
    calls = PyMem_Calloc(alloc, sizeof(int64_t));
    act = PyMem_Calloc(alloc, sizeof(int64_t));
    unmatched = PyMem_Calloc(alloc, sizeof(int64_t));
    if (calls == NULL || act == NULL || unmatched == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t r = 0; r < nrows && r < m->rows_n; r++) {
        for (Py_ssize_t half = 0; half < 2; half++) {
            calls[r + half * nrows] = m->row_calls[r + half * m->rows_n];
            act[r + half * nrows] = m->row_act[r + half * m->rows_n];
            unmatched[r + half * nrows] = m->row_unmatched[r + half * m->rows_n];
        }
    }
    PyMem_Free(m->slots);
    PyMem_Free(m->row_calls);
    PyMem_Free(m->row_act);
    PyMem_Free(m->row_unmatched);
    m->slots = slots;
    m->cap = cap;
    m->row_calls = calls;
    m->row_act = act;
    m->row_unmatched = unmatched;
    m->rows_n = nrows;
    return 0;
error:
    PyMem_Free(slots);
    PyMem_Free(calls);
    PyMem_Free(act);
    PyMem_Free(unmatched);
    return -1;
}

/* snapshots.append((log head, names)); beyond MT_MARKS_SNAPS, the 17th oldest goes. */
static int
mt_marks_snapshot(mt_marks *m, PyObject *names)
{
    PyObject *py_head = NULL, *py_pair = NULL;
    int rc = -1;
    if (m->snapshots == NULL) { /* cleared by the collector (marks_clear): nothing to add to */
        return 0;
    }
    py_head = PyLong_FromUnsignedLongLong((unsigned long long)mt_eventlog_head()); /* new reference */
    if (py_head == NULL) {
        goto error;
    }
    py_pair = PyTuple_Pack(2, py_head, names); /* new reference */
    if (py_pair == NULL || PyList_Append(m->snapshots, py_pair) < 0) {
        goto error;
    }
    if (PyList_GET_SIZE(m->snapshots) > MT_MARKS_SNAPS && PySequence_DelItem(m->snapshots, 16) < 0) {
        goto error;
    }
    rc = 0;
error:
    Py_XDECREF(py_head);
    Py_XDECREF(py_pair);
    return rc;
}

/* Append (now, kind, the phase's name) to the timeline's marks (if one is kept). */
static int
mt_marks_timeline(mt_marks *m, int64_t now, const char *kind, unsigned int code)
{
    if (m->timeline == NULL || m->timeline == Py_None) {
        return 0;
    }
    PyObject *py_mark = Py_BuildValue("(Lss)", (long long)now, kind, mt_phase_names[code]); /* new reference */
    if (py_mark == NULL) {
        return -1;
    }
    int rc = PyList_Append(m->timeline, py_mark);
    Py_DECREF(py_mark);
    return rc;
}

/* End the running phase (if any): its tag mark, time and timeline mark. */
static int
mt_marks_end_phase(mt_marks *m)
{
    unsigned int code = m->phase_code;
    if (code == 0) {
        return 0;
    }
    int64_t now = mt_monotonic_ns();
    mt_eventlog_mark(MT_EV_TAG, 0x200u | code, m->tagbase);
    m->phase_delta[code] += mt_counters_current() - m->phase_b0;
    m->phase_code = 0;
    m->phase_ns[code] += now - m->phase_t0;
    return mt_marks_timeline(m, now, "end", code);
}

/* Begin phase code (1..3), ending the running one first; counted: a new call of
 * the phase (0: the optimizer's update resumed after its closure, the same call). */
static int
mt_marks_begin_phase_as(mt_marks *m, unsigned int code, int counted)
{
    if (mt_marks_end_phase(m) < 0) {
        return -1;
    }
    m->phase_code = code;
    m->phase_calls[code] += counted != 0;
    m->phase_b0 = mt_counters_current();
    m->phase_t0 = mt_monotonic_ns();
    mt_eventlog_mark(MT_EV_TAG, 0x100u | code, mt_marks_top(m));
    return mt_marks_timeline(m, m->phase_t0, "phase", code);
}

static inline int
mt_marks_begin_phase(mt_marks *m, unsigned int code)
{
    return mt_marks_begin_phase_as(m, code, 1);
}

static void
marks_dealloc(mt_marks *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    PyObject_GC_UnTrack(m);
    (void)marks_clear(m);
    PyMem_Free(m->slots);
    m->slots = NULL;
    PyMem_Free(m->row_calls);
    PyMem_Free(m->row_act);
    PyMem_Free(m->row_unmatched);
    m->row_calls = m->row_act = m->row_unmatched = NULL;
    tp->tp_free((PyObject *)m);
    Py_DECREF(tp);
}

static PyObject *
marks_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ids", "root_id", "tagbase", "snapshots", "grad_enabled", "timeline", "shapes", NULL};
    PyObject *py_ids, *py_snaps, *py_grad, *py_timeline = Py_None;
    unsigned long long root = 0;
    unsigned long long tagbase = 0;
    int shapes = 0;
    mt_marks *m = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!KKO!O|Op:ModuleMarks", kwlist, &PyDict_Type, &py_ids, &root,
                                     &tagbase, &PyList_Type, &py_snaps, &py_grad, &py_timeline, &shapes)) {
        goto error;
    }
    if (!PyCallable_Check(py_grad)) {
        PyErr_SetString(PyExc_TypeError, "ModuleMarks(): grad_enabled must be callable (torch.is_grad_enabled)");
        goto error;
    }
    if (py_timeline != Py_None && !PyList_Check(py_timeline)) {
        PyErr_SetString(PyExc_TypeError, "ModuleMarks(): timeline must be a list or None");
        goto error;
    }
    if (tagbase > 0xffffffffULL || (tagbase & 0xffffffULL) != 0) {
        PyErr_SetString(PyExc_ValueError, "ModuleMarks(): tagbase must be < 2**32 with its low 24 bits 0");
        goto error;
    }
    m = (mt_marks *)type->tp_alloc(type, 0); /* new reference, zeroed */
    if (m == NULL) {
        goto error;
    }
    m->root = (uintptr_t)root;
    m->tagbase = (uint32_t)tagbase;
    m->no_shape = !shapes;
    m->snapshots = Py_NewRef(py_snaps);
    m->grad_enabled = Py_NewRef(py_grad);
    m->timeline = Py_NewRef(py_timeline);
    m->params = Py_NewRef(Py_None);
    m->closure_hook = Py_NewRef(Py_None);
    m->in_backward = Py_NewRef(Py_None);
    m->last_inputs = PyList_New(0); /* new reference */
    if (m->last_inputs == NULL || mt_marks_set_ids(m, py_ids) < 0) {
        goto error;
    }
    return (PyObject *)m;
error:
    Py_XDECREF(m);
    return NULL;
}

/* One tensor of the batch: py_t named py_name (kind "input") into py_names, its
 * address appended to py_inputs (all borrowed). 0, or -1 with an exception set. */
static int
mt_marks_input(PyObject *module, mt_marks *m, PyObject *py_names, PyObject *py_inputs, PyObject *py_t,
               PyObject *py_name)
{
    const mt_strs *s = mt_names_strs(module); /* borrowed from the state */
    if (s == NULL) {
        return -1;
    }
    void *addr = NULL;
    if (mt_names_put(module, py_names, py_t, py_name, s->input, m->no_shape, &addr) < 0) {
        return -1;
    }
    PyObject *py_addr = PyLong_FromVoidPtr(addr); /* new reference */
    if (py_addr == NULL) {
        return -1;
    }
    int rc = PyList_Append(py_inputs, py_addr);
    Py_DECREF(py_addr);
    return rc;
}

/* The root's forward began: the forward phase (if not running already, for a
 * recursive root) and the names of the tensors among its arguments (py_args,
 * borrowed: the module's args tuple; py_kwargs, borrowed: its kwargs dict, or
 * NULL when the hook was called without them). */
static int
mt_marks_root_pre(mt_marks *m, PyObject *py_args, PyObject *py_kwargs)
{
    PyObject *py_names = NULL, *py_inputs = NULL, *py_name = NULL;
    int rc = -1;
    PyObject *module = PyType_GetModule(Py_TYPE(m)); /* borrowed */
    if (module == NULL) {
        goto error;
    }
    PyObject *tensor_type = mt_get_state(module)->tensor_type; /* borrowed from the state */
    const mt_strs *s = mt_names_strs(module);                   /* borrowed from the state */
    if (s == NULL) {
        goto error;
    }
    if (tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ModuleMarks: the torch types were not handed over (_set_types)");
        goto error;
    }
    m->root_depth++;
    if (m->root_depth == 1) {
        m->forwards++;
        if (mt_marks_begin_phase(m, 1) < 0) {
            goto error;
        }
    }
    py_names = PyDict_New();    /* new reference */
    py_inputs = PyList_New(0); /* new reference */
    if (py_names == NULL || py_inputs == NULL) {
        goto error;
    }
    Py_ssize_t seen = 0; /* arguments looked at, positional and keyword together */
    if (PyTuple_Check(py_args)) {
        Py_ssize_t n = PyTuple_GET_SIZE(py_args);
        for (Py_ssize_t j = 0; j < n && seen < MT_MARKS_INPUTS; j++, seen++) {
            PyObject *py_a = PyTuple_GET_ITEM(py_args, j); /* borrowed from py_args */
            int is_tensor = PyObject_IsInstance(py_a, tensor_type);
            if (is_tensor < 0) {
                goto error;
            }
            if (!is_tensor) {
                continue;
            }
            py_name = n > 1 ? PyUnicode_FromFormat("input %zd", j) : Py_NewRef(s->input); /* new reference */
            if (py_name == NULL || mt_marks_input(module, m, py_names, py_inputs, py_a, py_name) < 0) {
                goto error;
            }
            Py_CLEAR(py_name);
        }
    }
    /* model(**batch): the tensors given by keyword, named by their keyword (the root's pre-hook
     * is called with the kwargs when its id is in the root's _forward_pre_hooks_with_kwargs) */
    if (py_kwargs != NULL && PyDict_Check(py_kwargs)) {
        PyObject *py_k, *py_a; /* borrowed from py_kwargs */
        Py_ssize_t pos = 0;
        while (seen < MT_MARKS_INPUTS && PyDict_Next(py_kwargs, &pos, &py_k, &py_a)) {
            seen++;
            int is_tensor = PyUnicode_Check(py_k) ? PyObject_IsInstance(py_a, tensor_type) : 0;
            if (is_tensor < 0) {
                goto error;
            }
            if (is_tensor && mt_marks_input(module, m, py_names, py_inputs, py_a, py_k) < 0) {
                goto error;
            }
        }
    }
    Py_SETREF(m->last_inputs, Py_NewRef(py_inputs));
    /* named at this point of the log: the batch may be freed before the block ends */
    if (PyDict_GET_SIZE(py_names) > 0 && mt_marks_snapshot(m, py_names) < 0) {
        goto error;
    }
    rc = 0;
error:
    Py_XDECREF(py_names);
    Py_XDECREF(py_inputs);
    Py_XDECREF(py_name);
    return rc;
}

/* A forward of the model ended: the forward phase ends and, when autograd
 * records (a training step), the backward phase begins (counted: a new call of
 * it, else the same backward phase again). */
static int
mt_marks_forward_ended(mt_marks *m, int counted)
{
    if (mt_marks_end_phase(m) < 0) {
        return -1;
    }
    if (m->grad_enabled == NULL) { /* cleared by the collector (marks_clear) */
        return 0;
    }
    PyObject *py_on = PyObject_CallNoArgs(m->grad_enabled); /* new reference */
    if (py_on == NULL) {
        return -1;
    }
    int on = PyObject_IsTrue(py_on);
    Py_DECREF(py_on);
    if (on < 0) {
        return -1;
    }
    return on ? mt_marks_begin_phase_as(m, 2, counted) : 0;
}

/* The root's forward ended: at the outermost, the phase change above. */
static int
mt_marks_root_post(mt_marks *m)
{
    if (m->root_depth == 0) { /* an end without its beginning (hooks added mid-forward) */
        return 0;
    }
    m->root_depth--;
    return m->root_depth > 0 ? 0 : mt_marks_forward_ended(m, 1);
}

/* 1 when a module's forward runs inside autograd's backward (a recomputation:
 * torch.utils.checkpoint), 0 when not (or when rows_n + row would not fit the
 * tag: then it counts as a forward), -1 with an exception set. */
static int
mt_marks_recomputing(mt_marks *m)
{
    if (m->in_backward == NULL || m->in_backward == Py_None || 2 * m->rows_n > (1LL << 22) - 1) {
        return 0;
    }
    PyObject *py_id = PyObject_CallNoArgs(m->in_backward); /* new reference */
    if (py_id == NULL) {
        return -1;
    }
    long long id = PyLong_AsLongLong(py_id);
    Py_DECREF(py_id);
    if (id == -1 && PyErr_Occurred()) {
        return -1;
    }
    return id != -1;
}

/* pre(module, args[, kwargs]): the forward pre-hook (with kwargs: the root's, see mt_marks_root_pre). */
static PyObject *
marks_pre(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.pre() takes 2 arguments, or 3 with the kwargs (%zd given)", nargs);
        goto error;
    }
    uintptr_t key = (uintptr_t)args[0];
    int64_t row = mt_marks_row(m, key);
    int again = row >= 0 || key == m->root ? mt_marks_recomputing(m) : 0;
    if (again < 0) {
        goto error;
    }
    /* a forward of the model's begins while none of its modules runs: before the root ever
     * ran, this module is the root from now on; after, the same forward pass goes on */
    if (row >= 0 && !again && m->root != 0 && key != m->root && m->depth == 0 && m->root_depth == 0 && m->top == 0) {
        if (m->forwards == 0) {
            m->root = key;
        }
        else {
            m->top = key;
            if (m->phase_code != 1 && mt_marks_begin_phase_as(m, 1, 0) < 0) {
                goto error;
            }
        }
    }
    /* a recomputation is no forward of the model: no phase, no batch named */
    if (key == m->root && !again && mt_marks_root_pre(m, args[1], nargs == 3 ? args[2] : NULL) < 0) {
        goto error;
    }
    if (row >= 0) {
        row += again ? m->rows_n : 0;
        uint32_t tag = m->tagbase | ((uint32_t)(row + 1) << 2) | m->phase_code;
        if (m->depth < MT_MARKS_DEPTH) {
            m->tags[m->depth] = tag;
            m->srows[m->depth] = row;
            m->starts[m->depth] = mt_counters_current();
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
    int again = row >= 0 || key == m->root ? mt_marks_recomputing(m) : 0;
    if (again < 0) {
        goto error;
    }
    if (row >= 0) {
        row += again ? m->rows_n : 0;
        int matched = 0;
        if (m->depth > 0) {
            m->depth--;
            matched = m->depth < MT_MARKS_DEPTH && m->srows[m->depth] == row;
        }
        if (row < 2 * m->rows_n) {
            m->row_calls[row]++;
            if (matched) {
                m->row_act[row] += mt_counters_current() - m->starts[m->depth];
            }
            else {
                m->row_unmatched[row]++;
            }
        }
        mt_eventlog_mark(MT_EV_EXIT, (uint64_t)row, mt_marks_top(m));
        if (key == m->top && !again && m->depth == 0) {
            m->top = 0;
            if (mt_marks_forward_ended(m, 0) < 0) {
                goto error;
            }
        }
    }
    if (key == m->root && !again && mt_marks_root_post(m) < 0) {
        goto error;
    }
    Py_RETURN_NONE;
error:
    return NULL;
}

/* Names from a walk of the parameters (want: names_walk's) as a snapshot now;
 * state: the optimizer's state dict or NULL. Nothing before the first walk. */
static int
mt_marks_walk(mt_marks *m, PyObject *state, long want)
{
    if (m->params == NULL || m->params == Py_None) {
        return 0;
    }
    PyObject *module = PyType_GetModule(Py_TYPE(m)); /* borrowed */
    if (module == NULL) {
        return -1;
    }
    PyObject *py_names = PyDict_New(); /* new reference */
    if (py_names == NULL) {
        return -1;
    }
    int rc = mt_names_walk(module, py_names, m->params, state, want | (m->no_shape ? 16 : 0));
    if (rc == 0 && PyDict_GET_SIZE(py_names) > 0) {
        rc = mt_marks_snapshot(m, py_names);
    }
    Py_DECREF(py_names);
    return rc;
}

/* opt_pre(optimizer, args, kwargs): the optimizer's step pre-hook. */
static PyObject *
marks_opt_pre(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.opt_pre() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    /* the gradients, named while they live: zero_grad() may free them before the block ends */
    if (mt_marks_begin_phase(m, 3) < 0 || mt_marks_walk(m, NULL, 2) < 0) {
        return NULL;
    }
    /* step(closure): the closure's forward and backward are their own phases, the update
     * after it the optimizer's again; closure_hook answers the step's arguments with the
     * closure wrapped to say when it returns (Python only when the step has arguments) */
    /* (torch's step wrapper passes the optimizer itself as args[0]) */
    int has_args = (PyTuple_Check(args[1]) && PyTuple_GET_SIZE(args[1]) > 1) ||
                   (PyDict_Check(args[2]) && PyDict_GET_SIZE(args[2]) > 0);
    if (has_args && m->closure_hook != NULL && m->closure_hook != Py_None) {
        return PyObject_CallFunctionObjArgs(m->closure_hook, args[1], args[2], NULL); /* new reference */
    }
    Py_RETURN_NONE;
}

/* resume_optimizer(): the step's closure returned: the optimizer phase again (the
 * same call), the gradients the closure made named while they live. */
static PyObject *
marks_resume_optimizer(mt_marks *m, PyObject *Py_UNUSED(ignored))
{
    if (mt_marks_begin_phase_as(m, 3, 0) < 0 || mt_marks_walk(m, NULL, 2) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* opt_post(optimizer, args, kwargs): the optimizer's step post-hook. */
static PyObject *
marks_opt_post(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_state = NULL, *py_dict = NULL, *py_result = NULL;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.opt_post() takes 3 arguments (%zd given)", nargs);
        goto error;
    }
    if (mt_marks_end_phase(m) < 0) {
        goto error;
    }
    PyObject *module = PyType_GetModule(Py_TYPE(m)); /* borrowed */
    const mt_strs *s = module == NULL ? NULL : mt_names_strs(module); /* borrowed from the state */
    if (s == NULL) {
        goto error;
    }
    py_state = PyObject_GetAttr(args[0], s->state_attr); /* new reference: optimizer.state */
    if (py_state == NULL) {
        goto error;
    }
    Py_ssize_t n = PyObject_Length(py_state);
    if (n < 0) {
        goto error;
    }
    if (n != m->state_n) { /* new state (the first step's): named while it lives */
        m->state_n = n;
        /* an optimizer of its own kind may keep state in a mapping that is not a dict: read as one */
        py_dict = PyDict_Check(py_state) ? Py_NewRef(py_state) : PyDict_New(); /* new reference */
        if (py_dict == NULL || (py_dict != py_state && PyDict_Merge(py_dict, py_state, 1) < 0)) {
            goto error;
        }
        if (mt_marks_walk(m, py_dict, 4) < 0) {
            goto error;
        }
    }
    py_result = Py_NewRef(Py_None);
error:
    Py_XDECREF(py_state);
    Py_XDECREF(py_dict);
    return py_result;
}

/* Take out every hook install() put in (a missing entry is skipped), the last
 * first. 0, or -1 with an exception set (after trying every entry). */
static int
mt_marks_uninstall(mt_marks *m)
{
    PyObject *first = NULL;            /* the first error (new reference), raised again at the end */
    PyObject *py_list = m->installed;  /* owned, taken over */
    m->installed = NULL;
    Py_CLEAR(m->pre_id);
    if (py_list == NULL) {
        return 0;
    }
    for (Py_ssize_t j = PyList_GET_SIZE(py_list) - 1; j >= 0; j--) {
        PyObject *py_pair = PyList_GET_ITEM(py_list, j); /* borrowed: a (dict, id) tuple */
        PyObject *py_d = PyTuple_GET_ITEM(py_pair, 0), *py_id = PyTuple_GET_ITEM(py_pair, 1); /* borrowed */
        /* the abstract API: torch's hook dicts are OrderedDicts, whose order a PyDict_DelItem would break */
        int failed = PyObject_DelItem(py_d, py_id) < 0;
        if (failed && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear(); /* the entry is gone already (taken out by other code, or never put in: mt_marks_put) */
            failed = 0;
        }
        if (failed) { /* keep the first error; the other entries are still taken out */
            PyObject *exc = PyErr_GetRaisedException(); /* new reference */
            if (first == NULL) {
                first = exc;
            }
            else {
                Py_XDECREF(exc);
            }
        }
    }
    Py_DECREF(py_list);
    if (first != NULL) {
        PyErr_SetRaisedException(first); /* steals first */
        return -1;
    }
    return 0;
}

/* py_d[py_id] = py_value, recorded first in m->installed as (py_d, py_id) for uninstall
 * (which skips an id the dict does not hold); with front, moved to the front of py_d (an
 * OrderedDict holding other hooks: ours run first, as torch's global hooks run before a
 * module's own). All borrowed. 0, or -1 with an exception set. */
static int
mt_marks_put(mt_marks *m, const mt_strs *s, PyObject *py_d, PyObject *py_id, PyObject *py_value, int front)
{
    Py_ssize_t before = PyDict_GET_SIZE(py_d); /* the caller checked: a dict (torch's: OrderedDicts) */
    PyObject *py_pair = PyTuple_Pack(2, py_d, py_id); /* new reference */
    int rc = py_pair == NULL ? -1 : PyList_Append(m->installed, py_pair);
    Py_XDECREF(py_pair);
    if (rc < 0 || PyObject_SetItem(py_d, py_id, py_value) < 0) {
        return -1;
    }
    if (front && before > 0 && !PyDict_CheckExact(py_d)) {
        PyObject *py_args[3] = {py_d, py_id, Py_False};                       /* borrowed; py_d is self */
        PyObject *py_r = PyObject_VectorcallMethod(s->move_to_end, py_args, 3, NULL); /* new reference */
        if (py_r == NULL) {
            return -1;
        }
        Py_DECREF(py_r);
    }
    return 0;
}

/* The module's own hook dicts (borrowed from its __dict__, held by py_dict, a new
 * reference the caller releases): _forward_pre_hooks, _forward_hooks and
 * _forward_hooks_always_called. 0, 1 when the module has no such dicts, or -1
 * with an exception set. */
static int
mt_marks_module_dicts(PyObject *py_mod, const mt_strs *s, PyObject **py_dict, PyObject *out[3])
{
    *py_dict = PyObject_GenericGetDict(py_mod, NULL); /* new reference: the instance __dict__ */
    if (*py_dict == NULL) {
        return -1;
    }
    for (size_t j = 0; j < 3; j++) {
        out[j] = PyDict_GetItemWithError(*py_dict, s->hook_keys[j]); /* borrowed */
        if (out[j] == NULL && PyErr_Occurred()) {
            return -1;
        }
        if (out[j] == NULL || !PyDict_Check(out[j])) {
            return 1;
        }
    }
    return 0;
}

static PyObject *
marks_install(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_seq = NULL, *py_mod = NULL, *py_dict = NULL, *py_ids[4] = {NULL, NULL, NULL, NULL};
    PyObject *py_next = NULL;
    /* refused before anything goes in (the error path below takes out what this call put in) */
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "ModuleMarks.install() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    if (m->installed != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ModuleMarks.install(): the hooks are installed already");
        return NULL;
    }
    PyObject *py_mods = args[0], *py_opt_pre = args[1], *py_opt_post = args[2]; /* borrowed */
    PyObject *py_hooks = args[3], *handle = args[4];                              /* borrowed */
    if ((py_opt_pre != Py_None && !PyDict_Check(py_opt_pre)) || (py_opt_post != Py_None && !PyDict_Check(py_opt_post)) ||
        (py_opt_pre == Py_None) != (py_opt_post == Py_None) || !PyTuple_Check(py_hooks) ||
        PyTuple_GET_SIZE(py_hooks) != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "ModuleMarks.install(modules, opt_pre_hooks, opt_post_hooks, (pre, post, opt_pre, opt_post), "
                        "handle_class): the optimizer's hook dicts (or None, None) and a tuple of 4 hooks");
        return NULL;
    }
    if (py_mods != Py_None) {
        py_seq = PySequence_Fast(py_mods, "ModuleMarks.install() expects a list of modules (or weakrefs)");
        if (py_seq == NULL) { /* new reference */
            return NULL;
        }
    }
    PyObject *module = PyType_GetModule(Py_TYPE(m)); /* borrowed */
    const mt_strs *s = module == NULL ? NULL : mt_names_strs(module); /* borrowed from the state */
    if (s == NULL) {
        goto error;
    }
    /* the ids: from the handles' own counter, as RemovableHandle() takes one, read and moved on once.
     * One id per kind of hook: each module's dicts are its own, so the same id serves every module. */
    PyObject *py_first = PyObject_GetAttr(handle, s->next_id); /* new reference */
    if (py_first == NULL) {
        goto error;
    }
    long long first = PyLong_CheckExact(py_first) ? PyLong_AsLongLong(py_first) : -1;
    Py_DECREF(py_first);
    if (first < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "ModuleMarks.install(): the handle class's next_id is not an int >= 0");
        }
        goto error;
    }
    py_next = PyLong_FromLongLong(first + 4); /* new reference */
    if (py_next == NULL || PyObject_SetAttr(handle, s->next_id, py_next) < 0) {
        goto error;
    }
    for (int j = 0; j < 4; j++) {
        py_ids[j] = PyLong_FromLongLong(first + j); /* new reference */
        if (py_ids[j] == NULL) {
            goto error;
        }
    }
    m->installed = PyList_New(0); /* new reference */
    if (m->installed == NULL) {
        goto error;
    }
    PyObject *pre = PyTuple_GET_ITEM(py_hooks, 0), *post = PyTuple_GET_ITEM(py_hooks, 1); /* borrowed */
    Py_ssize_t n = py_seq == NULL ? 0 : PySequence_Fast_GET_SIZE(py_seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mt_module_at(py_seq, i, &py_mod) < 0) { /* py_mod: new reference, NULL if dead */
            goto error;
        }
        if (py_mod != NULL && py_mod != Py_None) {
            PyObject *dicts[3]; /* borrowed from py_dict */
            int r = mt_marks_module_dicts(py_mod, s, &py_dict, dicts);
            if (r < 0) {
                goto error;
            }
            if (r == 0 && (mt_marks_put(m, s, dicts[0], py_ids[0], pre, 1) < 0 ||
                           mt_marks_put(m, s, dicts[1], py_ids[1], post, 1) < 0 ||
                           mt_marks_put(m, s, dicts[2], py_ids[1], Py_True, 0) < 0)) {
                goto error;
            }
            Py_CLEAR(py_dict);
        }
        Py_CLEAR(py_mod);
    }
    if (py_opt_pre != Py_None &&
        (mt_marks_put(m, s, py_opt_pre, py_ids[2], PyTuple_GET_ITEM(py_hooks, 2), 0) < 0 ||
         mt_marks_put(m, s, py_opt_post, py_ids[3], PyTuple_GET_ITEM(py_hooks, 3), 0) < 0)) {
        goto error;
    }
    if (py_seq != NULL) {
        m->pre_id = Py_NewRef(py_ids[0]);
    }
    Py_XDECREF(py_seq);
    Py_DECREF(py_next);
    for (int j = 0; j < 4; j++) {
        Py_DECREF(py_ids[j]);
    }
    Py_RETURN_NONE;
error:
    Py_XDECREF(py_seq);
    Py_XDECREF(py_mod);
    Py_XDECREF(py_dict);
    Py_XDECREF(py_next);
    for (int j = 0; j < 4; j++) {
        Py_XDECREF(py_ids[j]);
    }
    { /* what this call put in before the error comes out again */
        PyObject *exc = PyErr_GetRaisedException(); /* new reference */
        if (mt_marks_uninstall(m) < 0) {
            PyErr_Clear(); /* the install's own error is the one to raise */
        }
        PyErr_SetRaisedException(exc); /* steals exc */
    }
    return NULL;
}

static PyObject *
marks_uninstall(mt_marks *m, PyObject *Py_UNUSED(ignored))
{
    if (mt_marks_uninstall(m) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
marks_snapshot(mt_marks *m, PyObject *py_names)
{
    if (!PyDict_Check(py_names)) {
        PyErr_SetString(PyExc_TypeError, "ModuleMarks.snapshot() expects a dict {address: (name, kind, ...)}");
        return NULL;
    }
    if (mt_marks_snapshot(m, py_names) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
marks_begin_phase(mt_marks *m, PyObject *py_code)
{
    long code = PyLong_AsLong(py_code);
    if (code == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (code < 1 || code > 3) {
        PyErr_SetString(PyExc_ValueError, "ModuleMarks.begin_phase(): the phase code is 1, 2 or 3");
        return NULL;
    }
    if (mt_marks_begin_phase(m, (unsigned int)code) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
marks_end_phase(mt_marks *m, PyObject *Py_UNUSED(ignored))
{
    if (mt_marks_end_phase(m) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
marks_set_model(mt_marks *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "ModuleMarks.set_model() takes a dict {id(module): row} and the root's id");
        return NULL;
    }
    unsigned long long root = PyLong_AsUnsignedLongLong(args[1]);
    if (root == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (mt_marks_set_ids(m, args[0]) < 0) {
        return NULL;
    }
    m->root = (uintptr_t)root;
    m->top = 0;
    Py_RETURN_NONE;
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

static PyObject *
marks_get_depth(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(m->depth);
}

static PyObject *
marks_get_root(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong((unsigned long long)m->root);
}

static PyObject *
marks_get_forwards(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(m->forwards);
}

static PyObject *
marks_get_phases(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_BuildValue("((Ld)(Ld)(Ld))", m->phase_calls[1], (double)m->phase_ns[1] / 1e9, m->phase_calls[2],
                         (double)m->phase_ns[2] / 1e9, m->phase_calls[3], (double)m->phase_ns[3] / 1e9);
}

/* [(calls, act, unmatched)] of the rows' forwards (half 0) or recomputations (half 1) */
static PyObject *
mt_marks_totals(mt_marks *m, Py_ssize_t half)
{
    PyObject *py_list = PyList_New(m->rows_n); /* new reference */
    if (py_list == NULL) {
        return NULL;
    }
    for (Py_ssize_t r = 0; r < m->rows_n; r++) {
        Py_ssize_t j = r + half * m->rows_n;
        PyObject *py_t = Py_BuildValue("(LLL)", (long long)m->row_calls[j], (long long)m->row_act[j],
                                       (long long)m->row_unmatched[j]); /* new reference */
        if (py_t == NULL) {
            Py_DECREF(py_list);
            return NULL;
        }
        PyList_SET_ITEM(py_list, r, py_t); /* steals py_t */
    }
    return py_list;
}

static PyObject *
marks_get_module_totals(mt_marks *m, void *Py_UNUSED(closure))
{
    return mt_marks_totals(m, 0);
}

static PyObject *
marks_get_recompute_totals(mt_marks *m, void *Py_UNUSED(closure))
{
    return mt_marks_totals(m, 1);
}

static PyObject *
marks_get_phase_deltas(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_BuildValue("(LLL)", (long long)m->phase_delta[1], (long long)m->phase_delta[2],
                         (long long)m->phase_delta[3]);
}

static PyObject *
marks_get_state_n(mt_marks *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(m->state_n);
}

static int
marks_set_state_n(mt_marks *m, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "state_n cannot be deleted");
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(value);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    m->state_n = n;
    return 0;
}

/* The getters below answer None for a reference the collector cleared (marks_clear). */
static PyObject *
marks_get_params(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_NewRef(m->params != NULL ? m->params : Py_None);
}

static int
marks_set_params(mt_marks *m, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL || (value != Py_None && !PyList_Check(value))) {
        PyErr_SetString(PyExc_TypeError, "params is a list of (name, weakref[, grad name]) or None");
        return -1;
    }
    Py_SETREF(m->params, Py_NewRef(value));
    return 0;
}

static PyObject *
marks_get_last_inputs(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_NewRef(m->last_inputs != NULL ? m->last_inputs : Py_None);
}

static PyObject *
marks_get_closure_hook(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_NewRef(m->closure_hook != NULL ? m->closure_hook : Py_None);
}

/* Stores value (a callable or None) in *slot; else TypeError(what) and -1. Shared by the setters below. */
static int
set_callable_or_none(PyObject **slot, PyObject *value, const char *what)
{
    if (value == NULL || (value != Py_None && !PyCallable_Check(value))) {
        PyErr_SetString(PyExc_TypeError, what);
        return -1;
    }
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

static int
marks_set_closure_hook(mt_marks *m, PyObject *value, void *Py_UNUSED(closure))
{
    return set_callable_or_none(&m->closure_hook, value, "closure_hook is a callable (args, kwargs) or None");
}

static PyObject *
marks_get_in_backward(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_NewRef(m->in_backward != NULL ? m->in_backward : Py_None);
}

static int
marks_set_in_backward(mt_marks *m, PyObject *value, void *Py_UNUSED(closure))
{
    return set_callable_or_none(&m->in_backward, value,
                                "in_backward is a callable returning autograd's graph task id, or None");
}

static PyObject *
marks_get_pre_id(mt_marks *m, void *Py_UNUSED(closure))
{
    return Py_NewRef(m->pre_id != NULL ? m->pre_id : Py_None);
}

static PyMethodDef marks_methods[] = {
    {"pre", (PyCFunction)(void (*)(void))marks_pre, METH_FASTCALL,
     "pre(module, args): the forward pre-hook (for the root, the forward phase and the batch's names first)."},
    {"post", (PyCFunction)(void (*)(void))marks_post, METH_FASTCALL,
     "post(module, args, output): the forward hook (for the root, the phase change last)."},
    {"opt_pre", (PyCFunction)(void (*)(void))marks_opt_pre, METH_FASTCALL,
     "opt_pre(optimizer, args, kwargs): the step pre-hook: the optimizer phase, the gradients' names."},
    {"opt_post", (PyCFunction)(void (*)(void))marks_opt_post, METH_FASTCALL,
     "opt_post(optimizer, args, kwargs): the step post-hook: the phase ends, new state is named."},
    {"resume_optimizer", (PyCFunction)marks_resume_optimizer, METH_NOARGS,
     "resume_optimizer(): the step's closure returned: the optimizer phase again (not a new call)."},
    {"snapshot", (PyCFunction)marks_snapshot, METH_O,
     "snapshot(names): add (log head now, names) to the block's snapshots, as the hooks' walks do."},
    {"begin_phase", (PyCFunction)marks_begin_phase, METH_O,
     "begin_phase(code): end the running phase, begin phase code (1 forward, 2 backward, 3 optimizer)."},
    {"end_phase", (PyCFunction)marks_end_phase, METH_NOARGS, "end_phase(): end the running phase, if any."},
    {"install", (PyCFunction)(void (*)(void))marks_install, METH_FASTCALL,
     "install(modules, opt_pre_hooks, opt_post_hooks, hooks, handle_class): put hooks' pre and post (wrappers of "
     "this object's) into each module's forward hook dicts (modules: list of modules or weakrefs, or None) and "
     "opt_pre, opt_post into the optimizer's step hook dicts (or None, None), under ids from handle_class.next_id."},
    {"uninstall", (PyCFunction)marks_uninstall, METH_NOARGS,
     "uninstall(): take out what install() put in (safe to call again)."},
    {"set_model", (PyCFunction)(void (*)(void))marks_set_model, METH_FASTCALL,
     "set_model(ids, root_id): the model's modules ({id(module): row}) and its root, replacing the old."},
    {"top", (PyCFunction)marks_top, METH_NOARGS,
     "top(): the owner tag now: the innermost running module's, else tagbase | phase_code."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef marks_getset[] = {
    {"phase_code", (getter)marks_get_phase_code, NULL, "the running phase's code (0: none)", NULL},
    {"depth", (getter)marks_get_depth, NULL, "module forwards running (tags pushed)", NULL},
    {"forwards", (getter)marks_get_forwards, NULL, "the root's outermost forwards so far", NULL},
    {"root", (getter)marks_get_root, NULL, "the root's address: id() of the model, or of the first module of it whose forward ran (0: none)", NULL},
    {"phases", (getter)marks_get_phases, NULL,
     "((calls, seconds) of the forward, backward and optimizer phases)", NULL},
    {"module_totals", (getter)marks_get_module_totals, NULL,
     "[(calls, bytes left allocated summed, calls without their start)] per row, counted in the hooks "
     "(exact however long the block: the event log's ring may lose old marks)", NULL},
    {"recompute_totals", (getter)marks_get_recompute_totals, NULL,
     "module_totals of the rows' recomputations (forwards run during autograd's backward, see in_backward); "
     "the event log marks them as row len(module_totals) + row", NULL},
    {"phase_deltas", (getter)marks_get_phase_deltas, NULL,
     "(forward, backward, optimizer): counted bytes at each phase's end - at its start, summed", NULL},
    {"state_n", (getter)marks_get_state_n, (setter)marks_set_state_n,
     "entries of the optimizer's state when its names were last read", NULL},
    {"params", (getter)marks_get_params, (setter)marks_set_params,
     "[(name, weakref[, grad name])] the walks read, or None (no walk in the optimizer's hooks)", NULL},
    {"closure_hook", (getter)marks_get_closure_hook, (setter)marks_set_closure_hook,
     "closure_hook(args, kwargs): called by opt_pre for a step given arguments; its answer is the "
     "pre-hook's (None, or (args, kwargs) with the closure wrapped); None: not called", NULL},
    {"in_backward", (getter)marks_get_in_backward, (setter)marks_set_in_backward,
     "in_backward(): autograd's graph task id (-1: none), read at each module call; a call inside a backward "
     "is a recomputation (torch.utils.checkpoint), marked as its own row; None: every call is a forward", NULL},
    {"pre_id", (getter)marks_get_pre_id, NULL, "the id install() gave the module pre-hook (None: not installed)", NULL},
    {"last_inputs", (getter)marks_get_last_inputs, NULL,
     "the addresses of the last root forward's tensor arguments (0: no storage)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot marks_slots[] = {
    {Py_tp_doc, (void *)"ModuleMarks(ids, root_id, tagbase, snapshots, grad_enabled, timeline=None, shapes=False): "
                        "track()'s module and optimizer hooks in event-log mode (ids: {id(module): row}; "
                        "snapshots: the block's list of (log index, names))."},
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
