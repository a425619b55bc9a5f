/* names.c: the storage addresses of parameters, gradients and optimizer state, by name (track()'s at_peak). */
#include "mt.h"
#include "counters.h"

#include <stdint.h>

void
mt_names_strs_clear(mt_strs *s)
{
    Py_CLEAR(s->untyped_storage);
    Py_CLEAR(s->data_ptr);
    Py_CLEAR(s->grad);
    Py_CLEAR(s->shape);
    Py_CLEAR(s->dtype);
    Py_CLEAR(s->state_attr);
    for (size_t j = 0; j < 3; j++) {
        Py_CLEAR(s->dict_keys[j]);
    }
    Py_CLEAR(s->next_id);
    Py_CLEAR(s->compiled_call_impl);
    for (size_t j = 0; j < 3; j++) {
        Py_CLEAR(s->hook_keys[j]);
    }
    Py_CLEAR(s->move_to_end);
    Py_CLEAR(s->parameter);
    Py_CLEAR(s->gradient);
    Py_CLEAR(s->state);
    Py_CLEAR(s->buffer);
    Py_CLEAR(s->input);
}

/* Made once per module: a names walk runs several times per track() block, and
 * between a training step's operators making its strings costs more than the
 * walk's own work. s->input is made last: set means all are. */
const mt_strs *
mt_names_strs(PyObject *module)
{
    mt_strs *s = &mt_get_state(module)->strs;
    if (s->input != NULL) {
        return s;
    }
    mt_names_strs_clear(s);
    s->untyped_storage = PyUnicode_InternFromString("untyped_storage");
    s->data_ptr = PyUnicode_InternFromString("data_ptr");
    s->grad = PyUnicode_InternFromString("grad");
    s->shape = PyUnicode_InternFromString("shape");
    s->dtype = PyUnicode_InternFromString("dtype");
    s->state_attr = PyUnicode_InternFromString("state");
    s->dict_keys[0] = PyUnicode_InternFromString("_modules");
    s->dict_keys[1] = PyUnicode_InternFromString("_parameters");
    s->dict_keys[2] = PyUnicode_InternFromString("_buffers");
    s->next_id = PyUnicode_InternFromString("next_id");
    s->compiled_call_impl = PyUnicode_InternFromString("_compiled_call_impl");
    s->hook_keys[0] = PyUnicode_InternFromString("_forward_pre_hooks");
    s->hook_keys[1] = PyUnicode_InternFromString("_forward_hooks");
    s->hook_keys[2] = PyUnicode_InternFromString("_forward_hooks_always_called");
    s->move_to_end = PyUnicode_InternFromString("move_to_end");
    s->parameter = PyUnicode_FromString("parameter");
    s->gradient = PyUnicode_FromString("gradient");
    s->state = PyUnicode_FromString("optimizer state");
    s->buffer = PyUnicode_FromString("buffer");
    if (!s->untyped_storage || !s->data_ptr || !s->grad || !s->shape || !s->dtype || !s->state_attr ||
        !s->dict_keys[0] || !s->dict_keys[1] || !s->dict_keys[2] || !s->next_id || !s->compiled_call_impl ||
        !s->hook_keys[0] || !s->hook_keys[1] || !s->hook_keys[2] || !s->move_to_end || !s->parameter ||
        !s->gradient || !s->state || !s->buffer) {
        mt_names_strs_clear(s);
        return NULL;
    }
    s->input = PyUnicode_FromString("input");
    if (s->input == NULL) {
        mt_names_strs_clear(s);
        return NULL;
    }
    return s;
}

/* names[address of t's storage] = (name, kind, None, t.shape, t.dtype) unless the
 * address is named already (no_shape: shape and dtype None); *addr (if addr) is the
 * address, 0 for none. t, py_name and py_kind are borrowed. 0, or -1 with an
 * exception set. A tensor without a single storage with data is left unnamed. */
static int
mt_put(PyObject *names, PyObject *t, PyObject *py_name, PyObject *py_kind, const mt_strs *s, int no_shape,
       void **addr)
{
    PyObject *py_storage = NULL, *py_addr = NULL, *py_shape = NULL, *py_dtype = NULL, *py_val = NULL;
    int rc = -1;
    if (addr != NULL) {
        *addr = NULL;
    }
    /* t.data_ptr() is its storage's address when it is the start of an allocation the
     * counters hold: live allocations never overlap, so a view into the middle of another
     * storage cannot start there. Else t.untyped_storage().data_ptr() (one call more). */
    py_addr = PyObject_CallMethodNoArgs(t, s->data_ptr); /* new reference */
    if (py_addr != NULL) {
        void *p = PyLong_AsVoidPtr(py_addr);
        if (p == NULL && PyErr_Occurred()) {
            goto error;
        }
        if (p == NULL || mt_counters_size_of(p) < 0) {
            Py_CLEAR(py_addr);
        }
    }
    else if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear(); /* no data_ptr (nested, sparse): the storage's below, as in Python */
    }
    else {
        goto error;
    }
    if (py_addr == NULL) {
        py_storage = PyObject_CallMethodNoArgs(t, s->untyped_storage); /* new reference */
        if (py_storage != NULL) {
            py_addr = PyObject_CallMethodNoArgs(py_storage, s->data_ptr); /* new reference */
        }
    }
    if (py_addr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            goto error;
        }
        PyErr_Clear(); /* nested, sparse and wrapper tensors have no single storage: unnamed, as in Python */
        rc = 0;
        goto error;
    }
    void *p = PyLong_AsVoidPtr(py_addr);
    if (p == NULL) { /* a storage without data, or an error */
        rc = PyErr_Occurred() ? -1 : 0;
        goto error;
    }
    if (addr != NULL) {
        *addr = p;
    }
    int has = PyDict_Contains(names, py_addr);
    if (has != 0) {
        rc = has > 0 ? 0 : -1;
        goto error;
    }
    if (no_shape) {
        py_val = PyTuple_Pack(5, py_name, py_kind, Py_None, Py_None, Py_None); /* new reference */
        if (py_val == NULL || PyDict_SetItem(names, py_addr, py_val) < 0) {
            goto error;
        }
        rc = 0;
        goto error;
    }
    py_shape = PyObject_GetAttr(t, s->shape); /* new reference */
    if (py_shape == NULL) {
        goto error;
    }
    py_dtype = PyObject_GetAttr(t, s->dtype); /* new reference */
    if (py_dtype == NULL) {
        goto error;
    }
    py_val = PyTuple_Pack(5, py_name, py_kind, Py_None, py_shape, py_dtype); /* new reference */
    if (py_val == NULL || PyDict_SetItem(names, py_addr, py_val) < 0) {
        goto error;
    }
    rc = 0;
error:
    Py_XDECREF(py_storage);
    Py_XDECREF(py_addr);
    Py_XDECREF(py_shape);
    Py_XDECREF(py_dtype);
    Py_XDECREF(py_val);
    return rc;
}

/* The optimizer state of one parameter: each tensor value of py_st (a dict,
 * borrowed) named "<name>.<key>". 0, or -1 with an exception set. */
static int
mt_put_state(PyObject *names, PyObject *py_st, PyObject *py_name, PyObject *tensor_type, const mt_strs *s,
             int no_shape)
{
    PyObject *py_items = NULL, *py_sname = NULL;
    int rc = -1;
    py_items = PyDict_Items(py_st); /* new reference: a snapshot, user code may run below */
    if (py_items == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(py_items); i++) {
        PyObject *py_kv = PyList_GET_ITEM(py_items, i); /* borrowed from py_items */
        PyObject *py_v = PyTuple_GET_ITEM(py_kv, 1);     /* borrowed from py_kv */
        int is_tensor = PyObject_IsInstance(py_v, tensor_type);
        if (is_tensor < 0) {
            goto error;
        }
        if (!is_tensor) {
            continue;
        }
        py_sname = PyUnicode_FromFormat("%U.%S", py_name, PyTuple_GET_ITEM(py_kv, 0)); /* new reference */
        if (py_sname == NULL || mt_put(names, py_v, py_sname, s->state, s, no_shape, NULL) < 0) {
            goto error;
        }
        Py_CLEAR(py_sname);
    }
    rc = 0;
error:
    Py_XDECREF(py_items);
    Py_XDECREF(py_sname);
    return rc;
}

PyDoc_STRVAR(names_walk_doc,
"names_walk($module, names, params, state, want, /)\n--\n\n"
"Fill the dict names with {storage address: (name, kind, None, shape, dtype)}\n"
"for params, a list of (name, weakref to a parameter[, name of its gradient]):\n"
"with want & 1 each parameter (& 8: named as a buffer instead), & 2 its .grad (the\n"
"name given, else \"<name>.grad\"), & 4 the tensors of state[param]\n"
"(\"<name>.<key>\"; state: the optimizer's state dict or None); & 16: shape\n"
"and dtype left None. An address already in names keeps its name. Returns None.");

int
mt_names_walk(PyObject *module, PyObject *names, PyObject *params, PyObject *state, long want)
{
    PyObject *py_params = NULL, *py_p = NULL, *py_g = NULL, *py_gname = NULL, *py_st = NULL;
    int rc = -1;
    mt_state *st = mt_get_state(module);
    if (st->tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "names_walk(): the torch types were not handed over (_set_types)");
        goto error;
    }
    const mt_strs *s = mt_names_strs(module); /* borrowed from the module state */
    if (s == NULL) {
        goto error;
    }
    int no_shape = (want & 16) != 0;
    py_params = PySequence_Tuple(params); /* new reference: a snapshot of the list */
    if (py_params == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(py_params); i++) {
        PyObject *py_pair = PyTuple_GET_ITEM(py_params, i); /* borrowed from py_params */
        Py_ssize_t size = PyTuple_Check(py_pair) ? PyTuple_GET_SIZE(py_pair) : 0;
        if ((size != 2 && size != 3) || !PyUnicode_Check(PyTuple_GET_ITEM(py_pair, 0)) ||
            (size == 3 && !PyUnicode_Check(PyTuple_GET_ITEM(py_pair, 2)))) {
            PyErr_SetString(PyExc_TypeError, "names_walk(): params must hold (name, weakref[, grad name]) tuples");
            goto error;
        }
        PyObject *py_name = PyTuple_GET_ITEM(py_pair, 0); /* borrowed from py_pair */
        py_p = PyObject_CallNoArgs(PyTuple_GET_ITEM(py_pair, 1)); /* new reference: the parameter or None */
        if (py_p == NULL) {
            goto error;
        }
        if (py_p == Py_None) {
            Py_CLEAR(py_p);
            continue;
        }
        if ((want & 1) && mt_put(names, py_p, py_name, (want & 8) ? s->buffer : s->parameter, s, no_shape, NULL) < 0) {
            goto error;
        }
        if (want & 2) {
            py_g = PyObject_GetAttr(py_p, s->grad); /* new reference */
            if (py_g == NULL) {
                goto error;
            }
            if (py_g != Py_None) {
                /* the gradient's name made once by the caller (a walk per step), else here */
                py_gname = size == 3 ? Py_NewRef(PyTuple_GET_ITEM(py_pair, 2))
                                     : PyUnicode_FromFormat("%U.grad", py_name); /* new reference */
                if (py_gname == NULL || mt_put(names, py_g, py_gname, s->gradient, s, no_shape, NULL) < 0) {
                    goto error;
                }
                Py_CLEAR(py_gname);
            }
            Py_CLEAR(py_g);
        }
        if ((want & 4) && state != NULL) {
            if (PyDict_GetItemRef(state, py_p, &py_st) < 0) { /* py_st: new reference or NULL */
                goto error;
            }
            if (py_st != NULL && PyDict_Check(py_st) &&
                mt_put_state(names, py_st, py_name, st->tensor_type, s, no_shape) < 0) {
                goto error;
            }
            Py_CLEAR(py_st);
        }
        Py_CLEAR(py_p);
    }
    rc = 0;
error:
    Py_XDECREF(py_params);
    Py_XDECREF(py_p);
    Py_XDECREF(py_g);
    Py_XDECREF(py_gname);
    Py_XDECREF(py_st);
    return rc;
}

int
mt_names_put(PyObject *module, PyObject *names, PyObject *t, PyObject *name, PyObject *kind, int no_shape,
             void **addr)
{
    const mt_strs *s = mt_names_strs(module); /* borrowed from the module state */
    if (s == NULL) {
        return -1;
    }
    return mt_put(names, t, name, kind, s, no_shape, addr);
}

static PyObject *
names_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "names_walk() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *names = args[0], *state = args[2]; /* borrowed arguments */
    if (!PyDict_Check(names) || !PyList_Check(args[1]) || (state != Py_None && !PyDict_Check(state))) {
        PyErr_SetString(PyExc_TypeError, "names_walk() expects a dict, a list of (name, weakref) and a dict or None");
        return NULL;
    }
    long want = PyLong_AsLong(args[3]);
    if (want == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (mt_names_walk(module, names, args[1], state == Py_None ? NULL : state, want) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* *out: a new reference to item i of the fast sequence py_seq (borrowed), or to its referent when it
 * is a weak reference (what track()'s plan keeps of a module), NULL when that one is dead. 0, or -1
 * with an exception set (*out NULL). */
int
mt_module_at(PyObject *py_seq, Py_ssize_t i, PyObject **out)
{
    PyObject *py_item = PySequence_Fast_GET_ITEM(py_seq, i); /* borrowed from py_seq */
    if (PyWeakref_CheckRef(py_item)) {
        return PyWeakref_GetRef(py_item, out) < 0 ? -1 : 0; /* *out: new reference or NULL */
    }
    *out = Py_NewRef(py_item);
    return 0;
}

/* Mix every (key, value) identity of the dict py_d (borrowed) into *h. Reads the
 * dict directly: no user code runs. */
static void
mt_mix_dict(uint64_t *h, PyObject *py_d)
{
    PyObject *py_k, *py_v; /* borrowed from py_d */
    Py_ssize_t pos = 0;
    *h = (*h ^ (uint64_t)PyDict_GET_SIZE(py_d)) * UINT64_C(0x100000001B3);
    while (PyDict_Next(py_d, &pos, &py_k, &py_v)) {
        *h = (*h ^ (uint64_t)(uintptr_t)py_k) * UINT64_C(0x100000001B3);
        *h = (*h ^ (uint64_t)(uintptr_t)py_v) * UINT64_C(0x100000001B3);
    }
}

PyDoc_STRVAR(modules_fingerprint_doc,
"modules_fingerprint($module, modules, /)\n--\n\n"
"A hash of the identities of every module's children, parameters and buffers\n"
"(the _modules, _parameters and _buffers dicts of each module of the list, read\n"
"directly): it changes when any of them is added, removed or replaced. The list\n"
"may hold weak references to the modules instead: None if one of them is dead.");

static PyObject *
modules_fingerprint(PyObject *module, PyObject *py_mods)
{
    PyObject *py_seq = NULL, *py_m = NULL, *py_dict = NULL, *py_result = NULL;
    uint64_t h = UINT64_C(0xCBF29CE484222325);
    const mt_strs *s = mt_names_strs(module); /* borrowed from the module state */
    if (s == NULL) {
        goto error;
    }
    py_seq = PySequence_Fast(py_mods, "modules_fingerprint() expects a list of modules"); /* new reference */
    if (py_seq == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(py_seq); i++) {
        if (mt_module_at(py_seq, i, &py_m) < 0) { /* py_m: new reference, NULL if dead */
            goto error;
        }
        if (py_m == NULL) {
            py_result = Py_NewRef(Py_None);
            goto error;
        }
        py_dict = PyObject_GenericGetDict(py_m, NULL); /* new reference: the instance __dict__ */
        if (py_dict == NULL) {
            goto error;
        }
        for (size_t j = 0; j < 3; j++) {
            PyObject *py_d = PyDict_GetItemWithError(py_dict, s->dict_keys[j]); /* borrowed */
            if (py_d == NULL && PyErr_Occurred()) {
                goto error;
            }
            if (py_d != NULL && PyDict_Check(py_d)) {
                mt_mix_dict(&h, py_d);
            }
            else {
                h = (h ^ (uint64_t)(j + 1)) * UINT64_C(0x100000001B3);
            }
        }
        Py_CLEAR(py_dict);
        Py_CLEAR(py_m);
    }
    py_result = PyLong_FromUnsignedLongLong((unsigned long long)h);
error:
    Py_XDECREF(py_seq);
    Py_XDECREF(py_m);
    Py_XDECREF(py_dict);
    return py_result;
}

PyDoc_STRVAR(modules_compiled_doc,
"modules_compiled($module, modules, wrapper, /)\n--\n\n"
"Whether a module of the list (or of a list of weak references to modules: dead\n"
"ones are skipped) is a torch.compile'd region: an instance of `wrapper` (the class\n"
"torch.compile wraps a module in, or None) or one whose `_compiled_call_impl` is not\n"
"None (module.compile() was called). One call for a track() block's end, in place of\n"
"a getattr per module.");

static PyObject *
modules_compiled(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *py_seq = NULL, *py_m = NULL, *py_impl = NULL, *py_result = NULL;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "modules_compiled() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *py_wrapper = args[1]; /* borrowed */
    if (py_wrapper != Py_None && !PyType_Check(py_wrapper)) {
        PyErr_SetString(PyExc_TypeError, "modules_compiled(): the wrapper must be a class or None");
        return NULL;
    }
    const mt_strs *s = mt_names_strs(module); /* borrowed from the module state */
    if (s == NULL) {
        goto error;
    }
    py_seq = PySequence_Fast(args[0], "modules_compiled() expects a list of modules"); /* new reference */
    if (py_seq == NULL) {
        goto error;
    }
    int found = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(py_seq) && !found; i++) {
        if (mt_module_at(py_seq, i, &py_m) < 0) { /* py_m: new reference, NULL if dead */
            goto error;
        }
        if (py_m == NULL) {
            continue;
        }
        if (py_wrapper != Py_None) {
            found = PyObject_IsInstance(py_m, py_wrapper);
            if (found < 0) {
                goto error;
            }
        }
        if (!found) { /* getattr(module, "_compiled_call_impl", None) is not None */
            py_impl = PyObject_GetAttr(py_m, s->compiled_call_impl); /* new reference */
            if (py_impl == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    goto error;
                }
                PyErr_Clear(); /* no such attribute: not compiled, as getattr(..., None) answers */
            }
            found = py_impl != NULL && py_impl != Py_None;
            Py_CLEAR(py_impl);
        }
        Py_CLEAR(py_m);
    }
    py_result = Py_NewRef(found ? Py_True : Py_False);
error:
    Py_XDECREF(py_seq);
    Py_XDECREF(py_m);
    Py_XDECREF(py_impl);
    return py_result;
}

PyMethodDef mt_names_methods[] = {
    {"modules_compiled", (PyCFunction)(void (*)(void))modules_compiled, METH_FASTCALL, modules_compiled_doc},
    {"modules_fingerprint", (PyCFunction)modules_fingerprint, METH_O, modules_fingerprint_doc},
    {"names_walk", (PyCFunction)(void (*)(void))names_walk, METH_FASTCALL, names_walk_doc},
    {NULL, NULL, 0, NULL},
};
