/* walker.c: iterative walk of modules, optimizers and containers into rows, one per tensor occurrence. */
#include "rows.h"

#include <stdint.h>
#include <string.h>

/* Facts about PyTorch relied on here:
 * - Every strided tensor (meta ones included) answers untyped_storage(); the
 *   storage object's `_cdata` is the address of its c10::StorageImpl, shared
 *   by every view of it and unique among live storages. It is the storage
 *   key: data pointers would not do (every meta and empty storage has 0).
 * - untyped_storage().nbytes() is the size of the whole storage, which a
 *   view keeps alive; numel() * itemsize is the tensor's logical size.
 * - Sparse tensors have no storage of their own: their index and value
 *   tensors do. Per-channel quantized tensors hold scale and zero-point
 *   tensors beside their data.
 * - A module keeps its tensors in the dicts `_parameters` and `_buffers` and
 *   its children in `_modules`, all in its instance __dict__; reading them
 *   there runs no user code (getattr could: __getattr__ overrides).
 * Methods of torch.Tensor are called (they are torch's, not user code); the
 * walker itself holds no state between calls. */

/* Side tables (dtypes, devices) are indexed by an int32 (dtype) or int16
 * (device) field of a row. */
#define MT_MAX_DTYPES INT32_MAX
#define MT_MAX_DEVICES INT16_MAX
#define MT_MAX_FLATTEN_DEPTH 32

enum { MT_ITEM_MODULE = 0, MT_ITEM_ANY = 1 };

/* Type classes returned by the Python classifier (memtorch.inspection). */
enum { MT_TYPE_PLAIN = 0, MT_TYPE_FLATTEN = 1, MT_TYPE_CHECK_DATA = 2 };

/* One pending piece of work on the explicit stack. */
typedef struct {
    PyObject *obj;  /* owned */
    PyObject *path; /* owned str */
    int32_t module; /* MODULE: parent module index; ANY: owning module */
    uint8_t category;
    uint8_t kind;
} mt_item;

/* Interned attribute names, created at the start of each walk. */
#define MT_NAMES(X)                                                          \
    X(untyped_storage) X(_cdata) X(nbytes) X(numel) X(dtype) X(device)       \
    X(requires_grad) X(grad) X(is_leaf) X(layout) X(_indices) X(_values)     \
    X(crow_indices) X(col_indices) X(ccol_indices) X(row_indices) X(values)  \
    X(qscheme) X(q_per_channel_scales) X(q_per_channel_zero_points)          \
    X(_parameters) X(_buffers) X(_modules) X(state) X(param_groups)         \
    X(params) X(__tensor_flatten__) X(__dataclass_fields__) X(_fields)      \
    X(data_ptr) X(retains_grad) X(shape) X(_mask)

typedef struct {
#define MT_DECL(n) PyObject *n;
    MT_NAMES(MT_DECL)
#undef MT_DECL
} mt_names;

typedef struct {
    mt_state *st;
    mt_names s;
    mt_rows rows;
    mt_item *stack;
    Py_ssize_t sn, scap;
    PyObject *paths;        /* list[str] */
    PyObject *dtypes;       /* list[str] */
    PyObject *dtype_index;  /* dict: torch.dtype / numpy dtype -> int */
    int64_t *itemsize;      /* per dtype slot: bytes per element (0: ndarray) */
    int64_t *perbyte;       /* per dtype slot: elements per byte along the
                               last dimension (packed quint4x2: 2), else 0 */
    uint8_t *quantized;     /* per dtype slot: a quantized dtype */
    Py_ssize_t dtcap;
    PyObject *devices;      /* list[str] */
    PyObject *device_index; /* dict: torch.device -> int */
    int meta_device;        /* slot of the meta device, -1 until met */
    PyObject *mod_paths;    /* list[str]: path of each module entry */
    PyObject *mod_types;    /* list[str]: type name of each module entry */
    PyObject *type_names;   /* dict: type -> its name (str), a cache */
    int32_t *links;         /* per module entry: parent index, alias-of index */
    Py_ssize_t nlinks, caplinks;
    PyObject *module_ids;   /* dict: id(module) -> index */
    PyObject *seen;         /* set: id of containers and optimizers walked;
                               each object is also in keepalive, so that no
                               address is reused by a fresh object during
                               the walk (a property returning a new list) */
    PyObject *params;       /* dict: id(parameter) -> index of its first row,
                               filled from the rows when an optimizer asks */
    Py_ssize_t params_scanned; /* rows already entered in params */
    PyObject *keepalive;    /* list: every object whose address is used as a
                               key (tensors of rows, arrays, containers in
                               seen, modules), kept for the whole walk so
                               that no address (id or StorageImpl) is reused */
    PyObject *empty;        /* "" */
    PyObject *cpu;          /* "cpu" */
    /* From _walker_setup (owned here for the walk's duration). */
    PyObject *dtype_info;   /* dict: torch.dtype -> (name, itemsize, quantized) */
    PyObject *layouts;      /* tuple: strided, coo, csr, csc, bsr, bsc */
    PyObject *per_channel;  /* tuple of per-channel qschemes */
    PyObject *classify;     /* callable(type) -> MT_TYPE_* */
    PyObject *type_cache;   /* dict: type -> int class */
    PyObject *dc_fields;    /* callable(type) -> tuple of dataclass field names */
    PyObject *dc_cache;     /* dict: type -> tuple of names (this walk) */
    PyObject *script_tables; /* callable(module) -> (params, buffers, modules)
                                dicts, for TorchScript modules */
    PyObject *iterables;    /* tuple of types iterated by their C tp_iter (deque) */
    PyObject *namespaces;   /* tuple of types whose instance __dict__ is
                               walked as a dict (SimpleNamespace, UserDict) */
    PyObject *masked_type;  /* numpy.ma.MaskedArray */
    PyObject *module_skip;  /* frozenset: nn.Module's own __dict__ keys */
} mt_walk;

static int walk_tensor(mt_walk *w, PyObject *t, PyObject *owner, PyObject *path,
                       int32_t module, uint8_t category, int depth);
static int is_atom(PyObject *obj);

/* ---------------------------------------------------------------- helpers */

/* Returns a new reference: prefix + "." + name, or name when prefix is "". */
static PyObject *
join_name(PyObject *prefix, PyObject *name)
{
    Py_ssize_t n1 = PyUnicode_GET_LENGTH(prefix), n2 = PyUnicode_GET_LENGTH(name);
    Py_UCS4 maxc = PyUnicode_MAX_CHAR_VALUE(prefix);
    PyObject *r;

    if (n1 == 0) {
        return Py_NewRef(name);
    }
    /* Built by hand: PyUnicode_FromFormat parses its format on every call
     * and this runs once per tensor. */
    if (PyUnicode_MAX_CHAR_VALUE(name) > maxc) {
        maxc = PyUnicode_MAX_CHAR_VALUE(name);
    }
    r = PyUnicode_New(n1 + 1 + n2, maxc);
    if (r == NULL) {
        return NULL;
    }
    if (PyUnicode_CopyCharacters(r, 0, prefix, 0, n1) < 0 ||
        PyUnicode_WriteChar(r, n1, '.') < 0 ||
        PyUnicode_CopyCharacters(r, n1 + 1, name, 0, n2) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    return r;
}

/* Returns a new reference: prefix + "." + suffix (a C string). */
static PyObject *
join_cstr(PyObject *prefix, const char *suffix)
{
    if (PyUnicode_GET_LENGTH(prefix) == 0) {
        return PyUnicode_FromString(suffix);
    }
    return PyUnicode_FromFormat("%U.%s", prefix, suffix);
}

/* Returns a new reference: prefix + "[i]". */
static PyObject *
join_index(PyObject *prefix, Py_ssize_t i)
{
    return PyUnicode_FromFormat("%U[%zd]", prefix, i);
}

/* Returns a new reference to id(obj) as an int. */
static PyObject *
id_of(PyObject *obj)
{
    return PyLong_FromVoidPtr(obj);
}

/* Adds id(obj) to w->seen and keeps obj (borrowed) alive for the walk, so
 * that its address is not reused. Returns 1 if it was there already, 0 if
 * newly added, -1 on error. */
static int
mark_seen(mt_walk *w, PyObject *obj)
{
    PyObject *py_id = NULL;
    int rc = -1;

    py_id = id_of(obj);
    if (py_id == NULL) {
        goto error;
    }
    rc = PySet_Contains(w->seen, py_id);
    if (rc == 0 && (PySet_Add(w->seen, py_id) < 0 ||
                    PyList_Append(w->keepalive, obj) < 0)) {
        rc = -1;
    }
error:
    Py_XDECREF(py_id);
    return rc;
}

/* Pushes a work item; obj and path are borrowed (the stack takes its own
 * references). Returns 0 or -1. */
static int
push_item(mt_walk *w, int kind, PyObject *obj, PyObject *path, int32_t module,
          uint8_t category)
{
    if (w->sn == w->scap) {
        Py_ssize_t cap = w->scap ? w->scap * 2 : 64;
        mt_item *grown = PyMem_Realloc(w->stack, (size_t)cap * sizeof(mt_item));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        w->stack = grown;
        w->scap = cap;
    }
    mt_item *it = &w->stack[w->sn++];
    it->obj = Py_NewRef(obj);
    it->path = Py_NewRef(path);
    it->module = module;
    it->category = category;
    it->kind = (uint8_t)kind;
    return 0;
}

/* Reverses the items pushed since `base`, so that items pushed in their
 * natural order are popped in it. */
static void
reverse_from(mt_walk *w, Py_ssize_t base)
{
    for (Py_ssize_t i = base, j = w->sn - 1; i < j; i++, j--) {
        mt_item tmp = w->stack[i];
        w->stack[i] = w->stack[j];
        w->stack[j] = tmp;
    }
}

/* Appends path (borrowed) to the paths table; returns its index or -1. */
static int32_t
path_slot(mt_walk *w, PyObject *path)
{
    Py_ssize_t n = PyList_GET_SIZE(w->paths);
    if (n >= INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "too many tensors to walk");
        return -1;
    }
    if (PyList_Append(w->paths, path) < 0) {
        return -1;
    }
    return (int32_t)n;
}

/* Index of `key` (borrowed) in a side-table index dict: >= 0 if found, -1
 * if absent, -2 with an exception set. */
static int
lookup_slot(PyObject *index, PyObject *key)
{
    PyObject *found = PyDict_GetItemWithError(index, key); /* borrowed */
    if (found == NULL) {
        return PyErr_Occurred() ? -2 : -1;
    }
    return (int)PyLong_AsLong(found);
}

/* Registers a new slot for key with the given name (both borrowed), at most
 * `limit` slots. Returns the index or -1. */
static int
new_slot(PyObject *index, PyObject *table, PyObject *key, PyObject *name,
         Py_ssize_t limit)
{
    PyObject *py_i = NULL;
    Py_ssize_t n = PyList_GET_SIZE(table);
    int rc = -1;

    if (n >= limit) {
        PyErr_Format(PyExc_OverflowError,
                     "memtorch can tell apart at most %zd dtypes or devices in one walk",
                     limit);
        goto error;
    }
    py_i = PyLong_FromSsize_t(n);
    if (py_i == NULL || PyDict_SetItem(index, key, py_i) < 0 ||
        PyList_Append(table, name) < 0) {
        goto error;
    }
    rc = (int)n;
error:
    Py_XDECREF(py_i);
    return rc;
}

/* Makes room for dtype slot i in the per-dtype arrays. Returns 0 or -1. */
static int
dtype_room(mt_walk *w, Py_ssize_t i)
{
    if (i < w->dtcap) {
        return 0;
    }
    Py_ssize_t cap = w->dtcap ? w->dtcap * 2 : 32;
    int64_t *a = PyMem_Realloc(w->itemsize, (size_t)cap * sizeof(int64_t));
    if (a == NULL) {
        goto nomem;
    }
    w->itemsize = a;
    a = PyMem_Realloc(w->perbyte, (size_t)cap * sizeof(int64_t));
    if (a == NULL) {
        goto nomem;
    }
    w->perbyte = a;
    uint8_t *q = PyMem_Realloc(w->quantized, (size_t)cap);
    if (q == NULL) {
        goto nomem;
    }
    w->quantized = q;
    w->dtcap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Checks one value of the dtype table handed to _walker_setup: a tuple
 * (name: str, itemsize: int >= 0, quantized: bool, per_byte: int >= 0).
 * Returns 0, or -1 with TypeError set. */
static int
check_dtype_info(PyObject *dtype, PyObject *info)
{
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 4 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(info, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(info, 1)) ||
        !PyBool_Check(PyTuple_GET_ITEM(info, 2)) ||
        !PyLong_Check(PyTuple_GET_ITEM(info, 3))) {
        PyErr_Format(PyExc_TypeError,
                     "memtorch._C: the dtype table entry for %R must be a tuple "
                     "(name: str, itemsize: int, quantized: bool, per_byte: int), not %R",
                     dtype, info);
        return -1;
    }
    long long isz = PyLong_AsLongLong(PyTuple_GET_ITEM(info, 1));
    long long pb = PyLong_AsLongLong(PyTuple_GET_ITEM(info, 3));
    if (PyErr_Occurred()) {
        return -1;
    }
    if (isz < 0 || isz > 1024 || pb < 0 || pb > 64) {
        PyErr_Format(PyExc_TypeError,
                     "memtorch._C: the dtype table entry for %R has itemsize %lld "
                     "and per_byte %lld (expected 0..1024 and 0..64)",
                     dtype, isz, pb);
        return -1;
    }
    return 0;
}

/* Index of a torch.dtype (borrowed) in the dtypes table; fills itemsize and
 * quantized for a new one. Returns the index or -1. */
static int
torch_dtype_slot(mt_walk *w, PyObject *dtype)
{
    PyObject *info = NULL;
    int i = lookup_slot(w->dtype_index, dtype);
    if (i >= 0 || i == -2) {
        return i == -2 ? -1 : i;
    }
    info = PyDict_GetItemWithError(w->dtype_info, dtype); /* borrowed */
    if (info == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "memtorch does not know the dtype %R",
                         dtype);
        }
        return -1;
    }
    /* Checked again here: the table is a dict the caller could change. */
    if (check_dtype_info(dtype, info) < 0 ||
        dtype_room(w, PyList_GET_SIZE(w->dtypes)) < 0) {
        return -1;
    }
    i = new_slot(w->dtype_index, w->dtypes, dtype, PyTuple_GET_ITEM(info, 0),
                 MT_MAX_DTYPES);
    if (i < 0) {
        return -1;
    }
    w->itemsize[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(info, 1));
    w->quantized[i] = PyTuple_GET_ITEM(info, 2) == Py_True;
    w->perbyte[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(info, 3));
    return i;
}

/* Index of a numpy dtype (borrowed) in the dtypes table, or -1. */
static int
numpy_dtype_slot(mt_walk *w, PyObject *descr)
{
    PyObject *name = NULL;
    int i = lookup_slot(w->dtype_index, descr);
    if (i >= 0 || i == -2) {
        return i == -2 ? -1 : i;
    }
    name = PyObject_Str(descr); /* numpy's own str of a dtype */
    if (name == NULL) {
        return -1;
    }
    if (dtype_room(w, PyList_GET_SIZE(w->dtypes)) < 0) {
        Py_DECREF(name);
        return -1;
    }
    i = new_slot(w->dtype_index, w->dtypes, descr, name, MT_MAX_DTYPES);
    Py_DECREF(name);
    if (i >= 0) {
        w->itemsize[i] = 0;
        w->quantized[i] = 0;
        w->perbyte[i] = 0;
    }
    return i;
}

/* Index of a torch.device (borrowed) in the devices table, or -1. */
static int
device_slot(mt_walk *w, PyObject *device)
{
    PyObject *name = NULL;
    int i = lookup_slot(w->device_index, device);
    if (i >= 0 || i == -2) {
        return i == -2 ? -1 : i;
    }
    name = PyObject_Str(device); /* torch.device's own str, e.g. "cuda:0" */
    if (name == NULL) {
        return -1;
    }
    i = new_slot(w->device_index, w->devices, device, name, MT_MAX_DEVICES);
    if (i >= 0 && PyUnicode_Check(name) &&
        PyUnicode_CompareWithASCIIString(name, "meta") == 0) {
        w->meta_device = i;
    }
    Py_DECREF(name);
    return i;
}

/* ---------------------------------------------------------------- tensors */

/* Logical bytes of a tensor t (borrowed) of a packed dtype with `perbyte`
 * elements per byte: outer * ceil(last / perbyte), last the size of the last
 * dimension (numel for a 0-d tensor). Stores it in *out (MT_NBYTES_OVERFLOW
 * never: it is at most numel). Returns 0 or -1. */
static int
packed_nbytes(mt_walk *w, PyObject *t, int64_t numel, int64_t perbyte, int64_t *out)
{
    PyObject *py_shape = NULL;
    int64_t last = numel;
    Py_ssize_t nd;

    py_shape = PyObject_GetAttr(t, w->s.shape);
    if (py_shape == NULL) {
        return -1;
    }
    if (!PyTuple_Check(py_shape)) {
        PyErr_Format(PyExc_TypeError, "tensor.shape is a %s, not a tuple",
                     Py_TYPE(py_shape)->tp_name);
        Py_DECREF(py_shape);
        return -1;
    }
    nd = PyTuple_GET_SIZE(py_shape);
    if (nd > 0) {
        last = PyLong_AsLongLong(PyTuple_GET_ITEM(py_shape, nd - 1));
        if (last == -1 && PyErr_Occurred()) {
            Py_DECREF(py_shape);
            return -1;
        }
    }
    Py_DECREF(py_shape);
    *out = last <= 0 ? 0 : (numel / last) * ((last + perbyte - 1) / perbyte);
    return 0;
}

/* Modes of walk_dense. */
enum { MT_DENSE_PLAIN = 0, MT_DENSE_CHECK_DATA = 1, MT_DENSE_TRY = 2 };

/* Emits one row for a strided tensor t (borrowed), and the rows of a
 * per-channel quantized tensor's scales and zero points. Returns 0, or -1
 * with an exception set; in mode MT_DENSE_TRY, 1 (no exception) when t has
 * no storage. */
static int
walk_dense(mt_walk *w, PyObject *t, PyObject *owner, PyObject *path,
           int32_t module, uint8_t category, int check_data)
{
    PyObject *py_storage = NULL, *py_o = NULL, *py_q = NULL, *py_path = NULL;
    mt_row row = {0};
    int dt, dev, rg, pc;
    int32_t p;

    py_storage = PyObject_CallMethodNoArgs(t, w->s.untyped_storage);
    if (py_storage == NULL) {
        if (check_data == MT_DENSE_TRY &&
            (PyErr_ExceptionMatches(PyExc_NotImplementedError) ||
             PyErr_ExceptionMatches(PyExc_RuntimeError))) {
            /* No storage: a sparse or other non-strided tensor. The caller
             * checks the layout (and reproduces the error if strided). */
            PyErr_Clear();
            return 1;
        }
        goto error;
    }
    py_o = PyObject_GetAttr(py_storage, w->s._cdata);
    if (py_o == NULL) {
        goto error;
    }
    row.storage = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(py_o);
    Py_CLEAR(py_o);
    if (PyErr_Occurred()) {
        goto error;
    }
    py_o = PyObject_CallMethodNoArgs(py_storage, w->s.nbytes);
    if (py_o == NULL) {
        goto error;
    }
    row.storage_nbytes = PyLong_AsLongLong(py_o);
    Py_CLEAR(py_o);
    if (row.storage_nbytes == -1 && PyErr_Occurred()) {
        goto error;
    }
    py_o = PyObject_CallMethodNoArgs(t, w->s.numel);
    if (py_o == NULL) {
        goto error;
    }
    row.numel = PyLong_AsLongLong(py_o);
    Py_CLEAR(py_o);
    if (row.numel == -1 && PyErr_Occurred()) {
        goto error;
    }
    py_o = PyObject_GetAttr(t, w->s.dtype);
    if (py_o == NULL || (dt = torch_dtype_slot(w, py_o)) < 0) {
        goto error;
    }
    Py_CLEAR(py_o);
    py_o = PyObject_GetAttr(t, w->s.device);
    if (py_o == NULL || (dev = device_slot(w, py_o)) < 0) {
        goto error;
    }
    Py_CLEAR(py_o);
    /* Meta storages and empty ones hold no memory to share: data stays 0
     * and the call is saved (a wrapper subclass is checked in any case). */
    if (check_data == MT_DENSE_CHECK_DATA ||
        (row.storage_nbytes > 0 && dev != w->meta_device)) {
        /* The address of the storage's memory: two storages over one buffer
         * (torch.from_numpy, torch.frombuffer) are told apart by their
         * StorageImpl but share memory. A wrapper subclass has a storage object
         * with a size but no data: data_ptr() raises on it, and its bytes live
         * in tensors it holds. */
        py_o = PyObject_CallMethodNoArgs(py_storage, w->s.data_ptr);
        if (py_o == NULL && check_data != MT_DENSE_CHECK_DATA &&
            PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            /* A storage whose memory cannot be reached (data 0: unknown);
             * it is still counted by its StorageImpl. */
            PyErr_Clear();
            py_o = PyLong_FromLong(0);
        }
        if (py_o == NULL) {
            if (check_data == MT_DENSE_CHECK_DATA &&
                PyErr_ExceptionMatches(PyExc_RuntimeError)) {
                /* Replaced by the error that says what is wrong and why. */
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError,
                             "memtorch cannot measure the tensor subclass %s at "
                             "'%U': its storage holds no data (a wrapper subclass) "
                             "and it does not implement __tensor_flatten__ to say "
                             "which tensors hold its data",
                             Py_TYPE(t)->tp_name, path);
            }
            goto error;
        }
        row.data = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(py_o);
        Py_CLEAR(py_o);
        if (PyErr_Occurred()) {
            goto error;
        }
    }
    py_o = PyObject_GetAttr(t, w->s.requires_grad);
    if (py_o == NULL || (rg = PyObject_IsTrue(py_o)) < 0) {
        goto error;
    }
    Py_CLEAR(py_o);
    if ((p = path_slot(w, path)) < 0) {
        goto error;
    }
    if (w->perbyte[dt] > 0) {
        /* Packed sub-byte dtypes (quint4x2, quint2x4) pack `perbyte`
         * elements per byte along the last dimension, each row of it
         * rounded up to whole bytes. */
        if (packed_nbytes(w, t, row.numel, w->perbyte[dt], &row.nbytes) < 0) {
            goto error;
        }
    }
    else if (__builtin_mul_overflow(row.numel, w->itemsize[dt], &row.nbytes)) {
        /* Explicit: CPython builds with -fwrapv, so a wrap is silent. */
        row.nbytes = MT_NBYTES_OVERFLOW;
    }
    row.tensor = (uint64_t)(uintptr_t)owner;
    row.path = p;
    row.module = module;
    row.dtype = (int32_t)dt;
    row.device = (int16_t)dev;
    row.category = category;
    row.requires_grad = (uint8_t)rg;
    mt_row *slot = mt_rows_push(&w->rows);
    if (slot == NULL) {
        goto error;
    }
    *slot = row;

    if (w->quantized[dt]) {
        py_q = PyObject_CallMethodNoArgs(t, w->s.qscheme);
        if (py_q == NULL &&
            (PyErr_ExceptionMatches(PyExc_RuntimeError) ||
             PyErr_ExceptionMatches(PyExc_NotImplementedError))) {
            /* No quantizer torch can name (torch.empty(n, dtype=quint8) has
             * an UnknownQuantizer; meta quantized tensors have none): then
             * there are no scale or zero-point tensors to count. */
            PyErr_Clear();
            pc = 0;
        }
        else if (py_q == NULL ||
                 (pc = PySequence_Contains(w->per_channel, py_q)) < 0) {
            goto error;
        }
        if (pc) {
            /* Scales and zero points are tensors the quantizer holds. */
            static const char *aux[2] = {"q_per_channel_scales",
                                         "q_per_channel_zero_points"};
            PyObject *meth[2] = {w->s.q_per_channel_scales,
                                 w->s.q_per_channel_zero_points};
            for (int k = 0; k < 2; k++) {
                py_o = PyObject_CallMethodNoArgs(t, meth[k]);
                if (py_o == NULL || PyList_Append(w->keepalive, py_o) < 0) {
                    goto error;
                }
                py_path = join_cstr(path, aux[k]);
                if (py_path == NULL ||
                    walk_dense(w, py_o, owner, py_path, module, category,
                                   MT_DENSE_PLAIN) < 0) {
                    goto error;
                }
                Py_CLEAR(py_o);
                Py_CLEAR(py_path);
            }
        }
    }
    Py_DECREF(py_storage);
    Py_XDECREF(py_q);
    return 0;
error:
    Py_XDECREF(py_storage);
    Py_XDECREF(py_o);
    Py_XDECREF(py_q);
    Py_XDECREF(py_path);
    return -1;
}

/* Emits the rows of the component tensors named by `methods` (borrowed
 * names), e.g. a sparse tensor's indices and values. Returns 0 or -1. */
static int
walk_components(mt_walk *w, PyObject *t, PyObject *owner, PyObject *path,
                int32_t module, uint8_t category, PyObject **methods, int n,
                int depth)
{
    PyObject *py_part = NULL, *py_path = NULL;

    for (int k = 0; k < n; k++) {
        py_part = PyObject_CallMethodNoArgs(t, methods[k]);
        if (py_part == NULL || PyList_Append(w->keepalive, py_part) < 0) {
            goto error;
        }
        py_path = join_name(path, methods[k]);
        if (py_path == NULL ||
            walk_tensor(w, py_part, owner, py_path, module, category, depth + 1) < 0) {
            goto error;
        }
        Py_CLEAR(py_part);
        Py_CLEAR(py_path);
    }
    return 0;
error:
    Py_XDECREF(py_part);
    Py_XDECREF(py_path);
    return -1;
}

/* Class of a tensor's type (cached): MT_TYPE_*, or -1 on error. */
static int
tensor_type_class(mt_walk *w, PyObject *t)
{
    PyObject *tp = (PyObject *)Py_TYPE(t);
    PyObject *py_c = NULL;
    long c;

    if (tp == w->st->tensor_type || tp == w->st->parameter_type) {
        return MT_TYPE_PLAIN;
    }
    py_c = PyDict_GetItemWithError(w->type_cache, tp); /* borrowed */
    if (py_c != NULL) {
        return (int)PyLong_AsLong(py_c); /* checked when cached */
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    py_c = PyObject_CallOneArg(w->classify, tp);
    if (py_c == NULL) {
        return -1;
    }
    /* Checked at the boundary: a result outside MT_TYPE_* would otherwise
     * read as an error with no exception set. */
    c = PyLong_Check(py_c) ? PyLong_AsLong(py_c) : -1;
    if (c == -1 && PyErr_Occurred()) {
        Py_DECREF(py_c);
        return -1;
    }
    if (c < MT_TYPE_PLAIN || c > MT_TYPE_CHECK_DATA) {
        PyErr_Format(PyExc_TypeError,
                     "memtorch._C: the walker's classify(%s) returned %R, "
                     "expected 0, 1 or 2",
                     ((PyTypeObject *)tp)->tp_name, py_c);
        Py_DECREF(py_c);
        return -1;
    }
    if (PyDict_SetItem(w->type_cache, tp, py_c) < 0) {
        Py_DECREF(py_c);
        return -1;
    }
    Py_DECREF(py_c);
    return (int)c;
}

/* Emits the rows of tensor t (borrowed) at path. Returns 0 or -1. */
static int
walk_tensor(mt_walk *w, PyObject *t, PyObject *owner, PyObject *path,
            int32_t module, uint8_t category, int depth)
{
    PyObject *py_layout = NULL, *py_flat = NULL, *py_inner = NULL, *py_path = NULL;
    int cls;

    if (owner == NULL) {
        owner = t; /* rows of components are keyed to the whole tensor */
        /* Its address (and its storage's) are keys: keep it alive for the
         * walk (a tensor read through getattr may be fresh). */
        if (PyList_Append(w->keepalive, t) < 0) {
            goto error;
        }
    }
    if (depth > MT_MAX_FLATTEN_DEPTH) {
        PyErr_Format(PyExc_RecursionError,
                     "tensor subclasses nested more than %d deep at '%U'",
                     MT_MAX_FLATTEN_DEPTH, path);
        goto error;
    }
    if ((cls = tensor_type_class(w, t)) < 0) {
        goto error;
    }
    if (cls == MT_TYPE_FLATTEN) {
        /* Traceable wrapper subclass: its data is in the tensors named by
         * the first item of __tensor_flatten__(). */
        PyObject *attrs;
        py_flat = PyObject_CallMethodNoArgs(t, w->s.__tensor_flatten__);
        if (py_flat == NULL) {
            goto error;
        }
        if (!PyTuple_Check(py_flat) || PyTuple_GET_SIZE(py_flat) < 1 ||
            !PyList_Check(PyTuple_GET_ITEM(py_flat, 0))) {
            PyErr_Format(PyExc_TypeError,
                         "%s.__tensor_flatten__() at '%U' did not return "
                         "(list of attribute names, context)",
                         Py_TYPE(t)->tp_name, path);
            goto error;
        }
        /* A copy of the list of names: getattr below runs user code (a
         * property) that could change the list and free its items. */
        attrs = PySequence_List(PyTuple_GET_ITEM(py_flat, 0)); /* new */
        Py_CLEAR(py_flat);
        if (attrs == NULL) {
            goto error;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(attrs); i++) {
            PyObject *name = PyList_GET_ITEM(attrs, i); /* held by attrs */
            if (!PyUnicode_Check(name)) {
                PyErr_Format(PyExc_TypeError,
                             "%s.__tensor_flatten__() at '%U' named a non-string",
                             Py_TYPE(t)->tp_name, path);
                Py_DECREF(attrs);
                goto error;
            }
            py_inner = PyObject_GetAttr(t, name);
            if (py_inner == NULL) {
                Py_DECREF(attrs);
                goto error;
            }
            if (PyObject_TypeCheck(py_inner, (PyTypeObject *)w->st->tensor_type)) {
                /* Kept: a property may return a fresh tensor each time. */
                if (PyList_Append(w->keepalive, py_inner) < 0) {
                    Py_DECREF(attrs);
                    goto error;
                }
                py_path = join_name(path, name);
                if (py_path == NULL || walk_tensor(w, py_inner, owner, py_path,
                                                   module, category, depth + 1) < 0) {
                    Py_DECREF(attrs);
                    goto error;
                }
                Py_CLEAR(py_path);
            }
            Py_CLEAR(py_inner);
        }
        Py_DECREF(attrs);
        return 0;
    }
    if (cls == MT_TYPE_PLAIN) {
        /* Most tensors are strided: try that first and save a layout read. */
        int rc = walk_dense(w, t, owner, path, module, category, MT_DENSE_TRY);
        if (rc <= 0) {
            return rc;
        }
    }
    py_layout = PyObject_GetAttr(t, w->s.layout);
    if (py_layout == NULL) {
        goto error;
    }
    if (py_layout == PyTuple_GET_ITEM(w->layouts, 0)) {
        if (walk_dense(w, t, owner, path, module, category,
                       cls == MT_TYPE_CHECK_DATA ? MT_DENSE_CHECK_DATA
                                                 : MT_DENSE_PLAIN) < 0) {
            goto error;
        }
    }
    else if (py_layout == PyTuple_GET_ITEM(w->layouts, 1)) {
        PyObject *m[2] = {w->s._indices, w->s._values};
        if (walk_components(w, t, owner, path, module, category, m, 2, depth) < 0) {
            goto error;
        }
    }
    else if (py_layout == PyTuple_GET_ITEM(w->layouts, 2) ||
             py_layout == PyTuple_GET_ITEM(w->layouts, 4)) {
        PyObject *m[3] = {w->s.crow_indices, w->s.col_indices, w->s.values};
        if (walk_components(w, t, owner, path, module, category, m, 3, depth) < 0) {
            goto error;
        }
    }
    else if (py_layout == PyTuple_GET_ITEM(w->layouts, 3) ||
             py_layout == PyTuple_GET_ITEM(w->layouts, 5)) {
        PyObject *m[3] = {w->s.ccol_indices, w->s.row_indices, w->s.values};
        if (walk_components(w, t, owner, path, module, category, m, 3, depth) < 0) {
            goto error;
        }
    }
    else {
        PyErr_Format(PyExc_TypeError,
                     "memtorch cannot measure the tensor at '%U': layout %R is "
                     "not supported (strided, sparse COO/CSR/CSC/BSR/BSC are)",
                     path, py_layout);
        goto error;
    }
    Py_DECREF(py_layout);
    return 0;
error:
    Py_XDECREF(py_layout);
    Py_XDECREF(py_flat);
    Py_XDECREF(py_inner);
    Py_XDECREF(py_path);
    return -1;
}

/* Emits the rows of a parameter-like tensor p (borrowed) and of its .grad.
 * Returns 0 or -1. */
static int
walk_param(mt_walk *w, PyObject *p, PyObject *path, int32_t module,
           uint8_t category)
{
    PyObject *py_grad = NULL, *py_path = NULL, *py_o = NULL;
    int r;

    if (walk_tensor(w, p, NULL, path, module, category, 0) < 0) {
        goto error;
    }
    if (Py_TYPE(p) != (PyTypeObject *)w->st->parameter_type) {
        /* Reading .grad of a non-leaf warns: look only where one can be. */
        py_o = PyObject_GetAttr(p, w->s.requires_grad);
        if (py_o == NULL || (r = PyObject_IsTrue(py_o)) < 0) {
            goto error;
        }
        Py_CLEAR(py_o);
        if (r) {
            py_o = PyObject_GetAttr(p, w->s.is_leaf);
            if (py_o == NULL || (r = PyObject_IsTrue(py_o)) < 0) {
                goto error;
            }
            Py_CLEAR(py_o);
        }
        if (!r) {
            /* A non-leaf keeps a .grad only after retain_grad(). */
            py_o = PyObject_GetAttr(p, w->s.retains_grad);
            if (py_o == NULL || (r = PyObject_IsTrue(py_o)) < 0) {
                goto error;
            }
            Py_CLEAR(py_o);
        }
        if (!r) {
            goto done;
        }
    }
    py_grad = PyObject_GetAttr(p, w->s.grad);
    if (py_grad == NULL) {
        goto error;
    }
    if (PyObject_TypeCheck(py_grad, (PyTypeObject *)w->st->tensor_type)) {
        py_path = join_cstr(path, "grad");
        if (py_path == NULL ||
            walk_tensor(w, py_grad, NULL, py_path, module, MT_CAT_GRADIENT, 0) < 0) {
            goto error;
        }
    }
done:
    Py_XDECREF(py_grad);
    Py_XDECREF(py_path);
    return 0;
error:
    Py_XDECREF(py_grad);
    Py_XDECREF(py_path);
    Py_XDECREF(py_o);
    return -1;
}

/* Pushes the elements of an object array (borrowed) as items named
 * path[i] (flat C-order index). Returns 0 or -1. */
static int
push_object_elements(mt_walk *w, PyObject *arr, PyObject *path, int32_t module,
                     uint8_t category)
{
    PyObject *py_flat = NULL, *py_path = NULL;
    Py_ssize_t base = w->sn, n;
    PyObject **items;

    /* A C-contiguous copy holds its own references to the elements. */
    py_flat = PyArray_NewCopy((PyArrayObject *)arr, NPY_CORDER);
    if (py_flat == NULL) {
        goto error;
    }
    n = (Py_ssize_t)PyArray_SIZE((PyArrayObject *)py_flat);
    items = (PyObject **)PyArray_DATA((PyArrayObject *)py_flat);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL || is_atom(items[i])) {
            continue;
        }
        py_path = join_index(path, i);
        if (py_path == NULL ||
            push_item(w, MT_ITEM_ANY, items[i], py_path, module, category) < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
    }
    reverse_from(w, base);
    Py_DECREF(py_flat);
    return 0;
error:
    Py_XDECREF(py_flat);
    Py_XDECREF(py_path);
    return -1;
}

/* Emits the row of a NumPy array (borrowed). Views of one base share the key
 * of the base that owns the memory; an array over a tensor's memory shares
 * that tensor's storage key; an array over another buffer (bytes, mmap) is
 * keyed by that object, with the whole buffer's size. The row's `data` is
 * the owner's first byte, so that memory shared with a tensor
 * (torch.from_numpy) is found by overlap. Then the elements of an object
 * array and the mask of a masked array are pushed as items. Returns 0 or -1. */
static int
walk_array(mt_walk *w, PyObject *arr, PyObject *path, int32_t module,
           uint8_t category)
{
    PyArrayObject *root = (PyArrayObject *)arr;
    PyObject *base, *py_storage = NULL, *py_o = NULL, *py_d = NULL, *py_path = NULL;
    mt_row row = {0};
    int dt, dev;
    int32_t p;

    /* Its address and its base's are keys: keep it for the walk. */
    if (PyList_Append(w->keepalive, arr) < 0) {
        goto error;
    }
    while ((base = PyArray_BASE(root)) != NULL && PyArray_Check(base)) {
        root = (PyArrayObject *)base;
    }
    row.storage_nbytes = (int64_t)PyArray_NBYTES(root);
    if (base == NULL) {
        row.storage = (uint64_t)(uintptr_t)root;
        row.data = (uint64_t)(uintptr_t)PyArray_DATA(root);
    }
    else if (PyObject_TypeCheck(base, (PyTypeObject *)w->st->tensor_type)) {
        /* tensor.numpy(): the array views the tensor's storage. */
        py_storage = PyObject_CallMethodNoArgs(base, w->s.untyped_storage);
        if (py_storage == NULL) {
            goto error;
        }
        py_o = PyObject_GetAttr(py_storage, w->s._cdata);
        if (py_o == NULL) {
            goto error;
        }
        row.storage = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(py_o);
        Py_CLEAR(py_o);
        py_o = PyObject_CallMethodNoArgs(py_storage, w->s.nbytes);
        if (py_o == NULL) {
            goto error;
        }
        row.storage_nbytes = PyLong_AsLongLong(py_o);
        Py_CLEAR(py_o);
        py_o = PyObject_CallMethodNoArgs(py_storage, w->s.data_ptr);
        if (py_o == NULL) {
            goto error;
        }
        row.data = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(py_o);
        Py_CLEAR(py_o);
        if (PyErr_Occurred()) {
            goto error;
        }
    }
    else {
        /* Another owner (bytes, bytearray, mmap, a memoryview): keyed by it,
         * sized by the whole buffer it exports (kept alive whole). */
        row.storage = (uint64_t)(uintptr_t)base;
        if (PyBytes_CheckExact(base)) {
            row.storage_nbytes = (int64_t)PyBytes_GET_SIZE(base);
            row.data = row.storage_nbytes ? (uint64_t)(uintptr_t)PyBytes_AS_STRING(base) : 0;
        }
        else if (PyObject_CheckBuffer(base)) {
            Py_buffer view;
            if (PyObject_GetBuffer(base, &view, PyBUF_SIMPLE) < 0) {
                /* Not a simple buffer: keep the extent the array shows. */
                PyErr_Clear();
            }
            else {
                row.storage_nbytes = (int64_t)view.len;
                row.data = view.len ? (uint64_t)(uintptr_t)view.buf : 0;
                PyBuffer_Release(&view);
            }
        }
    }
    if ((dt = numpy_dtype_slot(w, (PyObject *)PyArray_DESCR((PyArrayObject *)arr))) < 0 ||
        (dev = device_slot(w, w->cpu)) < 0 || (p = path_slot(w, path)) < 0) {
        goto error;
    }
    row.numel = (int64_t)PyArray_SIZE((PyArrayObject *)arr);
    row.nbytes = (int64_t)PyArray_NBYTES((PyArrayObject *)arr);
    row.tensor = (uint64_t)(uintptr_t)arr;
    row.path = p;
    row.module = module;
    row.dtype = (int32_t)dt;
    row.device = (int16_t)dev;
    row.category = MT_CAT_ARRAY;
    mt_row *slot = mt_rows_push(&w->rows);
    if (slot == NULL) {
        goto error;
    }
    *slot = row;
    if (w->masked_type != NULL &&
        PyObject_TypeCheck(arr, (PyTypeObject *)w->masked_type)) {
        /* numpy.ma keeps the mask, an array of its own, in the instance
         * __dict__ (read there: no property runs). */
        py_d = PyObject_GenericGetDict(arr, NULL);
        if (py_d == NULL || PyDict_GetItemRef(py_d, w->s._mask, &py_o) < 0) {
            goto error;
        }
        if (py_o != NULL && PyArray_Check(py_o) && PyArray_NDIM((PyArrayObject *)py_o) > 0) {
            py_path = join_cstr(path, "mask");
            if (py_path == NULL ||
                push_item(w, MT_ITEM_ANY, py_o, py_path, module, category) < 0) {
                goto error;
            }
        }
        Py_CLEAR(py_o);
    }
    if (PyArray_DESCR((PyArrayObject *)arr)->type_num == NPY_OBJECT &&
        push_object_elements(w, arr, path, module, category) < 0) {
        goto error;
    }
    Py_XDECREF(py_storage);
    Py_XDECREF(py_d);
    Py_XDECREF(py_path);
    return 0;
error:
    Py_XDECREF(py_storage);
    Py_XDECREF(py_o);
    Py_XDECREF(py_d);
    Py_XDECREF(py_path);
    return -1;
}

/* ---------------------------------------------------------------- modules */

/* Appends a module entry: path (borrowed), the name of mod's type, parent
 * and alias-of indices. Returns 0 or -1. */
static int
add_module_entry(mt_walk *w, PyObject *mod, PyObject *path, int32_t parent,
                 int32_t alias)
{
    PyObject *tp = (PyObject *)Py_TYPE(mod);
    PyObject *name = PyDict_GetItemWithError(w->type_names, tp); /* borrowed */

    if (name == NULL) {
        if (PyErr_Occurred()) {
            return -1;
        }
        name = PyUnicode_FromString(Py_TYPE(mod)->tp_name);
        if (name == NULL) {
            return -1;
        }
        int rc = PyDict_SetItem(w->type_names, tp, name);
        Py_DECREF(name); /* the cache holds it */
        if (rc < 0) {
            return -1;
        }
    }
    if (w->nlinks == w->caplinks) {
        Py_ssize_t cap = w->caplinks ? w->caplinks * 2 : 64;
        int32_t *grown = PyMem_Realloc(w->links, (size_t)cap * 2 * sizeof(int32_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        w->links = grown;
        w->caplinks = cap;
    }
    if (w->nlinks >= INT32_MAX || PyList_Append(w->mod_paths, path) < 0 ||
        PyList_Append(w->mod_types, name) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_OverflowError, "too many modules to walk");
        }
        return -1;
    }
    w->links[2 * w->nlinks] = parent;
    w->links[2 * w->nlinks + 1] = alias;
    w->nlinks++;
    return 0;
}

/* Borrowed reference to the dict d[name] of a module, or NULL with an error
 * naming the module and what is wrong. */
static PyObject *
module_dict_entry(PyObject *d, PyObject *name, PyObject *module, PyObject *path)
{
    PyObject *v = PyDict_GetItemWithError(d, name); /* borrowed */
    if (v == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (v == NULL || !PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError,
                     "module %s at '%U' has no dict %U in its __dict__ "
                     "(was nn.Module.__init__ called?)",
                     Py_TYPE(module)->tp_name, path, name);
        return NULL;
    }
    return v;
}

/* The three tables of a module's __dict__, in the order they are walked. */
enum { MT_TAB_PARAMETERS, MT_TAB_BUFFERS, MT_TAB_MODULES };

/* Walks one table of the module item it (whose entry index is idx), read
 * from the module's __dict__ d (borrowed): parameters with their grads and
 * buffers are walked now, children pushed on the stack to be popped in
 * their order. Returns 0 or -1. Inline: each call passes a constant kind,
 * so the compiler folds the switches and the loop costs what three written
 * out did (not inlined, it cost ~0.8% more instructions per walk). */
static inline int
walk_table(mt_walk *w, mt_item *it, int32_t idx, PyObject *d, PyObject *tables,
           int kind)
{
    PyObject *name, *tab, *key, *value, *py_tab = NULL, *py_path = NULL;
    PyTypeObject *tp;
    const char *allowed;
    Py_ssize_t pos = 0, base = w->sn;
    int r;

    switch (kind) {
    case MT_TAB_PARAMETERS:
        name = w->s._parameters;
        break;
    case MT_TAB_BUFFERS:
        name = w->s._buffers;
        break;
    default:
        name = w->s._modules;
        break;
    }
    tp = (PyTypeObject *)(kind == MT_TAB_MODULES ? w->st->module_type
                                                 : w->st->tensor_type);
    allowed = kind == MT_TAB_MODULES ? "modules" : "tensors";
    if (tables != NULL) {
        tab = PyTuple_GET_ITEM(tables, kind); /* a dict, checked by the caller */
    }
    else if ((tab = module_dict_entry(d, name, it->obj, it->path)) == NULL) {
        goto error;
    }
    py_tab = Py_NewRef(tab); /* held while user code may run */
    while (PyDict_Next(py_tab, &pos, &key, &value)) {
        if (value == Py_None) {
            continue; /* declared but unset, e.g. a parameter with bias=False */
        }
        if (!PyUnicode_Check(key) || !PyObject_TypeCheck(value, tp)) {
            PyErr_Format(PyExc_TypeError,
                         "module %s at '%U' holds a %s in %U[%R]: "
                         "only %s and None are allowed there",
                         Py_TYPE(it->obj)->tp_name, it->path,
                         Py_TYPE(value)->tp_name, name, key, allowed);
            goto error;
        }
        py_path = join_name(it->path, key);
        if (py_path == NULL) {
            goto error;
        }
        /* Strong reference while user code may run (a wrapper subclass's
         * __tensor_flatten__ could change the module). */
        Py_INCREF(value);
        switch (kind) {
        case MT_TAB_PARAMETERS:
            r = walk_param(w, value, py_path, idx, MT_CAT_PARAMETER);
            break;
        case MT_TAB_BUFFERS:
            r = walk_tensor(w, value, NULL, py_path, idx, MT_CAT_BUFFER, 0);
            break;
        default:
            r = push_item(w, MT_ITEM_MODULE, value, py_path, idx, MT_CAT_PARAMETER);
            break;
        }
        Py_DECREF(value);
        if (r < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
    }
    if (kind == MT_TAB_MODULES) {
        reverse_from(w, base);
    }
    Py_DECREF(py_tab);
    return 0;
error:
    Py_XDECREF(py_tab);
    Py_XDECREF(py_path);
    return -1;
}

/* Returns a new reference to (parameters, buffers, modules) dicts of a
 * TorchScript module, whose __dict__ holds wrappers (or nothing, for a
 * traced module) instead of dicts: NULL with no exception if mod is not
 * one, NULL with an exception on error. */
static PyObject *
script_tables(mt_walk *w, PyObject *mod, PyObject *path)
{
    PyObject *r = PyObject_CallOneArg(w->script_tables, mod);
    if (r == NULL || r == Py_None) {
        Py_XDECREF(r);
        return NULL;
    }
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 ||
        !PyDict_Check(PyTuple_GET_ITEM(r, 0)) ||
        !PyDict_Check(PyTuple_GET_ITEM(r, 1)) ||
        !PyDict_Check(PyTuple_GET_ITEM(r, 2))) {
        PyErr_Format(PyExc_TypeError,
                     "memtorch._C: script_tables(%s at '%U') must return None "
                     "or a tuple of 3 dicts",
                     Py_TYPE(mod)->tp_name, path);
        Py_DECREF(r);
        return NULL;
    }
    return r;
}

/* Returns 1 if obj is an empty dict, set, list or tuple (of any subclass:
 * read from the C object, no __len__ runs), e.g. nn.Module's hook tables. */
static int
is_empty_container(PyObject *obj)
{
    return (PyDict_Check(obj) && PyDict_GET_SIZE(obj) == 0) ||
           (PyAnySet_Check(obj) && PySet_GET_SIZE(obj) == 0) ||
           (PyList_Check(obj) && PyList_GET_SIZE(obj) == 0) ||
           (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 0);
}

/* Walks the plain attributes of a module (its instance __dict__ d,
 * borrowed) other than nn.Module's own bookkeeping: tensors now (category
 * attribute), containers and arrays pushed. Modules and optimizers held as
 * plain attributes are not walked (usually back-references). Returns 0 or -1. */
static int
walk_attributes(mt_walk *w, mt_item *it, int32_t idx, PyObject *d)
{
    PyObject *py_tensors = NULL, *py_path = NULL, *key, *value;
    Py_ssize_t base = w->sn, pos = 0;
    int r;

    /* First pass, no user code runs (push_item only takes references):
     * containers pushed, tensors put aside with their names. */
    while (PyDict_Next(d, &pos, &key, &value)) {
        if (is_atom(value) || !PyUnicode_Check(key) || is_empty_container(value)) {
            continue;
        }
        if ((r = PySet_Contains(w->module_skip, key)) != 0) {
            if (r < 0) {
                goto error;
            }
            continue;
        }
        if (PyObject_TypeCheck(value, (PyTypeObject *)w->st->module_type) ||
            PyObject_TypeCheck(value, (PyTypeObject *)w->st->optimizer_type)) {
            continue;
        }
        if (PyObject_TypeCheck(value, (PyTypeObject *)w->st->tensor_type)) {
            if (py_tensors == NULL && (py_tensors = PyList_New(0)) == NULL) {
                goto error;
            }
            if (PyList_Append(py_tensors, key) < 0 ||
                PyList_Append(py_tensors, value) < 0) {
                goto error;
            }
            continue;
        }
        py_path = join_name(it->path, key);
        if (py_path == NULL ||
            push_item(w, MT_ITEM_ANY, value, py_path, idx, MT_CAT_ATTRIBUTE) < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
    }
    reverse_from(w, base);
    /* Second pass over the snapshot (py_tensors holds every item). */
    for (Py_ssize_t i = 0; py_tensors != NULL && i < PyList_GET_SIZE(py_tensors); i += 2) {
        py_path = join_name(it->path, PyList_GET_ITEM(py_tensors, i));
        if (py_path == NULL ||
            walk_tensor(w, PyList_GET_ITEM(py_tensors, i + 1), NULL, py_path, idx,
                        MT_CAT_ATTRIBUTE, 0) < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
    }
    Py_XDECREF(py_tensors);
    return 0;
error:
    Py_XDECREF(py_tensors);
    Py_XDECREF(py_path);
    return -1;
}

/* Walks one module item: its parameters, their grads, its buffers and its
 * plain tensor attributes now, its children pushed on the stack. A module
 * met again is recorded as an alias of its first path and not walked twice.
 * Returns 0 or -1. */
static int
walk_module(mt_walk *w, mt_item *it)
{
    PyObject *mod = it->obj, *py_id = NULL, *py_found, *py_d = NULL,
             *py_i = NULL, *py_tables = NULL, *tab;
    int32_t idx, alias = -1;

    py_id = id_of(mod);
    if (py_id == NULL) {
        goto error;
    }
    py_found = PyDict_GetItemWithError(w->module_ids, py_id); /* borrowed */
    if (py_found == NULL && PyErr_Occurred()) {
        goto error;
    }
    idx = (int32_t)w->nlinks;
    if (py_found != NULL) {
        alias = (int32_t)PyLong_AsLong(py_found);
    }
    if (add_module_entry(w, mod, it->path, it->module, alias) < 0) {
        goto error;
    }
    if (alias >= 0) {
        goto done;
    }
    py_i = PyLong_FromLong(idx);
    /* Kept for the walk: its id is a key of module_ids. */
    if (py_i == NULL || PyDict_SetItem(w->module_ids, py_id, py_i) < 0 ||
        PyList_Append(w->keepalive, mod) < 0) {
        goto error;
    }
    py_d = PyObject_GenericGetDict(mod, NULL);
    if (py_d == NULL) {
        goto error;
    }
    tab = PyDict_GetItemWithError(py_d, w->s._parameters); /* borrowed */
    if (tab == NULL && PyErr_Occurred()) {
        goto error;
    }
    if (tab == NULL || !PyDict_Check(tab)) {
        /* TorchScript keeps its tables in C++: ask torch for them. */
        py_tables = script_tables(w, mod, it->path);
        if (py_tables == NULL && PyErr_Occurred()) {
            goto error;
        }
    }
    if (walk_table(w, it, idx, py_d, py_tables, MT_TAB_PARAMETERS) < 0 ||
        walk_table(w, it, idx, py_d, py_tables, MT_TAB_BUFFERS) < 0 ||
        walk_attributes(w, it, idx, py_d) < 0 ||
        walk_table(w, it, idx, py_d, py_tables, MT_TAB_MODULES) < 0) {
        goto error;
    }
done:
    Py_XDECREF(py_id);
    Py_XDECREF(py_i);
    Py_XDECREF(py_d);
    Py_XDECREF(py_tables);
    return 0;
error:
    Py_XDECREF(py_id);
    Py_XDECREF(py_i);
    Py_XDECREF(py_d);
    Py_XDECREF(py_tables);
    return -1;
}

/* ------------------------------------------------------------- optimizers */

/* Enters the parameter-like rows (categories parameter and tensor: the rows
 * walk_param makes) emitted since the last call into w->params, keyed by the
 * tensor's id, first row kept. Done lazily: only an optimizer needs it.
 * Returns 0 or -1. */
static int
scan_params(mt_walk *w)
{
    PyObject *py_id = NULL, *py_i = NULL;

    for (; w->params_scanned < w->rows.n; w->params_scanned++) {
        mt_row *row = &w->rows.rows[w->params_scanned];
        if (row->category != MT_CAT_PARAMETER && row->category != MT_CAT_TENSOR) {
            continue;
        }
        py_id = PyLong_FromVoidPtr((void *)(uintptr_t)row->tensor);
        py_i = PyLong_FromSsize_t(w->params_scanned);
        if (py_id == NULL || py_i == NULL ||
            PyDict_SetDefault(w->params, py_id, py_i) == NULL) {
            goto error;
        }
        Py_CLEAR(py_id);
        Py_CLEAR(py_i);
    }
    return 0;
error:
    Py_XDECREF(py_id);
    Py_XDECREF(py_i);
    return -1;
}

/* Walks an optimizer (borrowed) at prefix: parameters of its groups that the
 * module walk did not meet (with their grads) now; other group entries and
 * the per-parameter state pushed on the stack, named after the parameter's
 * path. Returns 0 or -1. */
static int
walk_optimizer(mt_walk *w, PyObject *opt, PyObject *prefix)
{
    PyObject *py_d = NULL, *py_path = NULL, *py_id = NULL, *py_groups = NULL,
             *py_state = NULL, *py_group = NULL, *py_params = NULL, *key, *value;
    Py_ssize_t pos, base, i;
    int r;

    if ((r = mark_seen(w, opt)) != 0) {
        return r < 0 ? -1 : 0;
    }
    py_d = PyObject_GenericGetDict(opt, NULL);
    if (py_d == NULL) {
        goto error;
    }
    /* Strong references throughout: user code may run during the walk (a
     * wrapper subclass's __tensor_flatten__) and could change the optimizer. */
    if (PyDict_GetItemRef(py_d, w->s.param_groups, &py_groups) < 0 ||
        PyDict_GetItemRef(py_d, w->s.state, &py_state) < 0) {
        goto error;
    }
    if (py_groups == NULL || !PyList_Check(py_groups) || py_state == NULL ||
        !PyDict_Check(py_state)) {
        PyErr_Format(PyExc_TypeError,
                     "optimizer %s has no list param_groups and dict state in "
                     "its __dict__ (was Optimizer.__init__ called?)",
                     Py_TYPE(opt)->tp_name);
        goto error;
    }
    /* 1. Parameters the module walk did not meet, with their grads. */
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(py_groups); g++) {
        py_group = Py_NewRef(PyList_GET_ITEM(py_groups, g));
        if (!PyDict_Check(py_group)) {
            PyErr_Format(PyExc_TypeError,
                         "optimizer %s: param_groups[%zd] is a %s, not a dict",
                         Py_TYPE(opt)->tp_name, g, Py_TYPE(py_group)->tp_name);
            goto error;
        }
        if (PyDict_GetItemRef(py_group, w->s.params, &py_params) < 0) {
            goto error;
        }
        if (py_params != NULL && !PyList_Check(py_params) && !PyTuple_Check(py_params)) {
            PyErr_Format(PyExc_TypeError,
                         "optimizer %s: param_groups[%zd]['params'] is a %s, not a list",
                         Py_TYPE(opt)->tp_name, g, Py_TYPE(py_params)->tp_name);
            goto error;
        }
        for (Py_ssize_t j = 0; py_params != NULL && j < PySequence_Fast_GET_SIZE(py_params); j++) {
            PyObject *p = PySequence_Fast_GET_ITEM(py_params, j); /* borrowed */
            if (!PyObject_TypeCheck(p, (PyTypeObject *)w->st->tensor_type)) {
                PyErr_Format(PyExc_TypeError,
                             "optimizer %s: param_groups[%zd]['params'][%zd] is a %s, "
                             "not a tensor",
                             Py_TYPE(opt)->tp_name, g, j, Py_TYPE(p)->tp_name);
                goto error;
            }
            py_id = id_of(p);
            if (py_id == NULL || scan_params(w) < 0 ||
                (r = PyDict_Contains(w->params, py_id)) < 0) {
                goto error;
            }
            Py_CLEAR(py_id);
            if (!r) {
                py_path = PyUnicode_FromFormat("%U.param_groups[%zd].params[%zd]",
                                               prefix, g, j);
                Py_INCREF(p);
                r = py_path == NULL ? -1 : walk_param(w, p, py_path, -1, MT_CAT_PARAMETER);
                Py_DECREF(p);
                if (r < 0) {
                    goto error;
                }
                Py_CLEAR(py_path);
            }
        }
        Py_CLEAR(py_params);
        Py_CLEAR(py_group);
    }
    /* 2. State {param: {name: tensor or number}}: named after the parameter
     * and owned by its module. */
    if (scan_params(w) < 0) {
        goto error;
    }
    base = w->sn;
    pos = 0;
    i = 0;
    while (PyDict_Next(py_state, &pos, &key, &value)) {
        PyObject *rec; /* borrowed: index of the parameter's first row */
        int32_t module = -1;
        py_id = id_of(key);
        if (py_id == NULL) {
            goto error;
        }
        rec = PyDict_GetItemWithError(w->params, py_id);
        Py_CLEAR(py_id);
        if (rec == NULL && PyErr_Occurred()) {
            goto error;
        }
        if (rec != NULL) {
            mt_row *row = &w->rows.rows[PyLong_AsSsize_t(rec)];
            module = row->module;
            py_path = PyUnicode_FromFormat("%U.state[%U]", prefix,
                                           PyList_GET_ITEM(w->paths, row->path));
        }
        else {
            py_path = PyUnicode_FromFormat("%U.state[%zd]", prefix, i);
        }
        if (py_path == NULL || push_item(w, MT_ITEM_ANY, value, py_path, module,
                                         MT_CAT_OPTIMIZER_STATE) < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
        i++;
    }
    reverse_from(w, base);
    /* 3. Other group entries (e.g. a tensor lr): pushed last, walked first. */
    base = w->sn;
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(py_groups); g++) {
        /* No user code runs in this loop: push_item only takes references. */
        PyObject *group = PyList_GET_ITEM(py_groups, g); /* borrowed */
        if (!PyDict_Check(group)) {
            continue; /* replaced during the walk; checked above */
        }
        pos = 0;
        while (PyDict_Next(group, &pos, &key, &value)) {
            if (!PyUnicode_Check(key) || PyUnicode_Compare(key, w->s.params) == 0) {
                continue;
            }
            py_path = PyUnicode_FromFormat("%U.param_groups[%zd].%U", prefix, g, key);
            if (py_path == NULL || push_item(w, MT_ITEM_ANY, value, py_path, -1,
                                             MT_CAT_OPTIMIZER_STATE) < 0) {
                goto error;
            }
            Py_CLEAR(py_path);
        }
    }
    reverse_from(w, base);
    Py_DECREF(py_d);
    Py_DECREF(py_groups);
    Py_DECREF(py_state);
    return 0;
error:
    Py_XDECREF(py_d);
    Py_XDECREF(py_path);
    Py_XDECREF(py_id);
    Py_XDECREF(py_groups);
    Py_XDECREF(py_state);
    Py_XDECREF(py_group);
    Py_XDECREF(py_params);
    return -1;
}

/* ------------------------------------------------------------- containers */

/* Returns 1 if obj is of a type that never holds tensors (fast path). */
static int
is_atom(PyObject *obj)
{
    return obj == Py_None || PyLong_CheckExact(obj) || PyFloat_CheckExact(obj) ||
           PyUnicode_CheckExact(obj) || PyBytes_CheckExact(obj) ||
           PyBool_Check(obj) || PyComplex_CheckExact(obj) || PyType_Check(obj);
}

/* Returns a new reference to the tuple of field names of the dataclass type
 * tp (cached for the walk), Py_None if tp is no dataclass, NULL on error.
 * Names come from dataclasses.fields() (through the dc_fields callable): it
 * leaves out ClassVar and InitVar pseudo-fields. */
static PyObject *
dataclass_names(mt_walk *w, PyObject *tp)
{
    PyObject *py_names = PyDict_GetItemWithError(w->dc_cache, tp); /* borrowed */
    if (py_names != NULL) {
        return Py_NewRef(py_names);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    py_names = PyObject_CallOneArg(w->dc_fields, tp);
    if (py_names == NULL) {
        return NULL;
    }
    if (py_names != Py_None && !PyTuple_Check(py_names)) {
        PyErr_Format(PyExc_TypeError,
                     "memtorch._C: dataclass_fields(%s) must return a tuple or None",
                     ((PyTypeObject *)tp)->tp_name);
        Py_DECREF(py_names);
        return NULL;
    }
    if (PyDict_SetItem(w->dc_cache, tp, py_names) < 0) {
        Py_DECREF(py_names);
        return NULL;
    }
    return py_names;
}

/* Index+1 of the first type in the tuple `types` that obj is an instance
 * of, 0 if none. */
static Py_ssize_t
type_in(PyObject *obj, PyObject *types)
{
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); k++) {
        PyObject *tp = PyTuple_GET_ITEM(types, k);
        if (PyType_Check(tp) && PyObject_TypeCheck(obj, (PyTypeObject *)tp)) {
            return k + 1;
        }
    }
    return 0;
}

/* Pushes the items of a dict d (borrowed) named after path; keys that are
 * neither str nor int are pushed too (a tensor can be a key), as
 * path[i].key. No user code runs. Returns 0 or -1. */
static int
push_dict(mt_walk *w, mt_item *it, PyObject *d)
{
    PyObject *py_path = NULL, *key, *value;
    Py_ssize_t pos = 0, i = 0;

    while (PyDict_Next(d, &pos, &key, &value)) {
        if (PyUnicode_Check(key)) {
            py_path = join_name(it->path, key);
        }
        else if (PyLong_CheckExact(key)) {
            py_path = PyUnicode_FromFormat("%U[%S]", it->path, key);
        }
        else {
            py_path = join_index(it->path, i);
            if (py_path != NULL && !is_atom(key)) {
                PyObject *py_kpath = PyUnicode_FromFormat("%U.key", py_path);
                int r = py_kpath == NULL ? -1
                        : push_item(w, MT_ITEM_ANY, key, py_kpath, it->module,
                                    it->category);
                Py_XDECREF(py_kpath);
                if (r < 0) {
                    goto error;
                }
            }
        }
        if (py_path == NULL ||
            push_item(w, MT_ITEM_ANY, value, py_path, it->module, it->category) < 0) {
            goto error;
        }
        Py_CLEAR(py_path);
        i++;
    }
    return 0;
error:
    Py_XDECREF(py_path);
    return -1;
}

/* Pushes the items the C iterator of type tp (borrowed) yields over obj,
 * named path{i}: sets (set's own tp_iter, so a subclass's __iter__ does not
 * run) and deques. Returns 0 or -1. */
static int
push_iterated(mt_walk *w, mt_item *it, PyObject *obj, PyTypeObject *tp)
{
    PyObject *py_iter = NULL, *py_v = NULL, *py_path = NULL;
    Py_ssize_t i = 0;

    if (tp->tp_iter == NULL) {
        return 0;
    }
    py_iter = tp->tp_iter(obj);
    if (py_iter == NULL) {
        goto error;
    }
    while ((py_v = PyIter_Next(py_iter)) != NULL) {
        py_path = PyUnicode_FromFormat("%U{%zd}", it->path, i);
        if (py_path == NULL ||
            push_item(w, MT_ITEM_ANY, py_v, py_path, it->module, it->category) < 0) {
            goto error;
        }
        Py_CLEAR(py_v);
        Py_CLEAR(py_path);
        i++;
    }
    if (PyErr_Occurred()) {
        goto error;
    }
    Py_DECREF(py_iter);
    return 0;
error:
    Py_XDECREF(py_iter);
    Py_XDECREF(py_v);
    Py_XDECREF(py_path);
    return -1;
}

/* Walks one generic item: a tensor, ndarray, module, optimizer, container
 * (dict, list, tuple, set, deque, SimpleNamespace/UserDict/UserList) or
 * dataclass; anything else holds no tensor memory memtorch can see and is
 * skipped. Returns 0 or -1. */
static int
walk_any(mt_walk *w, mt_item *it)
{
    PyObject *obj = it->obj, *py_path = NULL, *py_fields = NULL, *py_v = NULL,
             *py_ns = NULL, *value;
    Py_ssize_t i, base, iter_k = 0, ns_k = 0;
    int r;

    if (is_atom(obj)) {
        return 0;
    }
    if (PyObject_TypeCheck(obj, (PyTypeObject *)w->st->tensor_type)) {
        if (it->category == MT_CAT_TENSOR || it->category == MT_CAT_PARAMETER) {
            uint8_t cat = PyObject_TypeCheck(obj, (PyTypeObject *)w->st->parameter_type)
                              ? MT_CAT_PARAMETER : MT_CAT_TENSOR;
            return walk_param(w, obj, it->path, it->module, cat);
        }
        return walk_tensor(w, obj, NULL, it->path, it->module, it->category, 0);
    }
    if (PyArray_Check(obj)) {
        return walk_array(w, obj, it->path, it->module, it->category);
    }
    if (PyObject_TypeCheck(obj, (PyTypeObject *)w->st->module_type)) {
        if (it->category == MT_CAT_ATTRIBUTE) {
            return 0; /* a module held as a plain attribute: not walked */
        }
        return push_item(w, MT_ITEM_MODULE, obj, it->path, it->module,
                         MT_CAT_PARAMETER);
    }
    if (PyObject_TypeCheck(obj, (PyTypeObject *)w->st->optimizer_type)) {
        if (it->category == MT_CAT_ATTRIBUTE) {
            return 0;
        }
        if (PyUnicode_GET_LENGTH(it->path)) {
            return walk_optimizer(w, obj, it->path);
        }
        py_path = PyUnicode_FromString("optimizer");
        if (py_path == NULL) {
            goto error;
        }
        r = walk_optimizer(w, obj, py_path);
        Py_DECREF(py_path);
        return r;
    }
    int is_container = PyDict_Check(obj) || PyList_Check(obj) ||
                       PyTuple_Check(obj) || PyAnySet_Check(obj);
    if (!is_container) {
        iter_k = type_in(obj, w->iterables);
        ns_k = iter_k ? 0 : type_in(obj, w->namespaces);
    }
    if (!is_container && !iter_k && !ns_k) {
        /* A dataclass instance? Its class names its fields. */
        py_fields = dataclass_names(w, (PyObject *)Py_TYPE(obj));
        if (py_fields == NULL) {
            goto error;
        }
        if (py_fields == Py_None) {
            /* An object memtorch does not look into. */
            Py_DECREF(py_fields);
            return 0;
        }
    }
    if ((r = mark_seen(w, obj)) != 0) {
        /* Met before (shared or a cycle): its tensors are already rows. */
        Py_XDECREF(py_fields);
        return r < 0 ? -1 : 0;
    }
    base = w->sn;
    if (py_fields != NULL) {
        /* py_fields is a tuple we hold: getattr (a property, user code)
         * cannot free the names. */
        for (i = 0; i < PyTuple_GET_SIZE(py_fields); i++) {
            PyObject *name = PyTuple_GET_ITEM(py_fields, i);
            if (!PyUnicode_Check(name)) {
                continue;
            }
            py_v = PyObject_GetAttr(obj, name);
            if (py_v == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    goto error;
                }
                /* A field deleted from the instance: nothing to count. */
                PyErr_Clear();
                continue;
            }
            py_path = join_name(it->path, name);
            if (py_path == NULL || push_item(w, MT_ITEM_ANY, py_v, py_path, it->module,
                                             it->category) < 0) {
                goto error;
            }
            Py_CLEAR(py_v);
            Py_CLEAR(py_path);
        }
    }
    else if (PyDict_Check(obj)) {
        if (push_dict(w, it, obj) < 0) {
            goto error;
        }
    }
    else if (ns_k) {
        /* SimpleNamespace, UserDict, UserList: their state is in the
         * instance __dict__ (read there: no property runs). */
        py_ns = PyObject_GenericGetDict(obj, NULL);
        if (py_ns == NULL || push_dict(w, it, py_ns) < 0) {
            goto error;
        }
    }
    else if (PyList_Check(obj) || PyTuple_Check(obj)) {
        PyObject *fields = NULL;
        if (PyTuple_Check(obj) && !PyTuple_CheckExact(obj)) {
            /* A namedtuple names its items by the class's _fields. */
            fields = PyObject_GetAttr((PyObject *)Py_TYPE(obj), w->s._fields);
            if (fields == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    goto error;
                }
                PyErr_Clear(); /* a plain tuple subclass */
            }
            else if (!PyTuple_Check(fields)) {
                Py_CLEAR(fields);
            }
        }
        Py_ssize_t n = PyList_Check(obj) ? PyList_GET_SIZE(obj) : PyTuple_GET_SIZE(obj);
        for (i = 0; i < n; i++) {
            /* Bound checked each turn: nothing here runs user code, but a list
             * is re-read rather than trusted. */
            if (PyList_Check(obj) && i >= PyList_GET_SIZE(obj)) {
                break;
            }
            value = PyList_Check(obj) ? PyList_GET_ITEM(obj, i) : PyTuple_GET_ITEM(obj, i);
            if (fields != NULL && i < PyTuple_GET_SIZE(fields) &&
                PyUnicode_Check(PyTuple_GET_ITEM(fields, i))) {
                py_path = join_name(it->path, PyTuple_GET_ITEM(fields, i));
            }
            else {
                py_path = join_index(it->path, i);
            }
            if (py_path == NULL || push_item(w, MT_ITEM_ANY, value, py_path, it->module,
                                             it->category) < 0) {
                Py_XDECREF(fields);
                goto error;
            }
            Py_CLEAR(py_path);
        }
        Py_XDECREF(fields);
    }
    else if (iter_k) {
        PyTypeObject *tp = (PyTypeObject *)PyTuple_GET_ITEM(w->iterables, iter_k - 1);
        if (push_iterated(w, it, obj, tp) < 0) {
            goto error;
        }
    }
    else {
        /* set / frozenset: set's own iterator, no user code. */
        if (push_iterated(w, it, obj,
                          PyFrozenSet_Check(obj) ? &PyFrozenSet_Type : &PySet_Type) < 0) {
            goto error;
        }
    }
    reverse_from(w, base);
    Py_XDECREF(py_fields);
    Py_XDECREF(py_ns);
    return 0;
error:
    Py_XDECREF(py_fields);
    Py_XDECREF(py_ns);
    Py_XDECREF(py_path);
    Py_XDECREF(py_v);
    return -1;
}

/* ------------------------------------------------------------------ walk */

/* Pops and walks items until the stack is empty. Returns 0 or -1. */
static int
drain(mt_walk *w)
{
    while (w->sn > 0) {
        mt_item it = w->stack[--w->sn];
        int rc = it.kind == MT_ITEM_MODULE ? walk_module(w, &it) : walk_any(w, &it);
        Py_DECREF(it.obj);
        Py_DECREF(it.path);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Releases everything the walk holds (idempotent). */
static void
walk_clear(mt_walk *w)
{
    while (w->sn > 0) {
        w->sn--;
        Py_DECREF(w->stack[w->sn].obj);
        Py_DECREF(w->stack[w->sn].path);
    }
    PyMem_Free(w->stack);
    w->stack = NULL;
    mt_rows_free(&w->rows);
#define MT_CLR(n) Py_CLEAR(w->s.n);
    MT_NAMES(MT_CLR)
#undef MT_CLR
    Py_CLEAR(w->paths);
    Py_CLEAR(w->dtypes);
    Py_CLEAR(w->dtype_index);
    Py_CLEAR(w->devices);
    Py_CLEAR(w->device_index);
    Py_CLEAR(w->mod_paths);
    Py_CLEAR(w->mod_types);
    Py_CLEAR(w->type_names);
    PyMem_Free(w->links);
    w->links = NULL;
    Py_CLEAR(w->module_ids);
    Py_CLEAR(w->seen);
    Py_CLEAR(w->params);
    Py_CLEAR(w->keepalive);
    Py_CLEAR(w->empty);
    Py_CLEAR(w->cpu);
    Py_CLEAR(w->dtype_info);
    Py_CLEAR(w->layouts);
    Py_CLEAR(w->per_channel);
    Py_CLEAR(w->classify);
    Py_CLEAR(w->type_cache);
    Py_CLEAR(w->dc_fields);
    Py_CLEAR(w->dc_cache);
    Py_CLEAR(w->script_tables);
    Py_CLEAR(w->iterables);
    Py_CLEAR(w->namespaces);
    Py_CLEAR(w->masked_type);
    Py_CLEAR(w->module_skip);
    PyMem_Free(w->itemsize);
    PyMem_Free(w->perbyte);
    PyMem_Free(w->quantized);
    w->itemsize = w->perbyte = NULL;
    w->quantized = NULL;
    w->dtcap = 0;
}

/* Takes a new reference to extra[name] into *out, checking its type.
 * Returns 0 or -1. */
static int
setup_get(PyObject *extra, const char *name, PyObject **out,
          int (*check)(PyObject *))
{
    PyObject *v = PyDict_GetItemString(extra, name); /* borrowed */
    if (v == NULL || (check != NULL && !check(v))) {
        PyErr_Format(PyExc_RuntimeError,
                     "memtorch._C walker is not set up (%s missing): use "
                     "memtorch.inspect() / memtorch.sizeof()", name);
        return -1;
    }
    *out = Py_NewRef(v);
    return 0;
}

static int mt_dict_check(PyObject *o) { return PyDict_Check(o); }
static int mt_tuple_check(PyObject *o) { return PyTuple_Check(o); }
static int mt_callable_check(PyObject *o) { return PyCallable_Check(o); }
static int mt_frozenset_check(PyObject *o) { return PyFrozenSet_CheckExact(o); }
static int mt_type_or_none_check(PyObject *o) { return o == Py_None || PyType_Check(o); }

/* Returns 1 if every item of the tuple o is a type. */
static int
mt_types_check(PyObject *o)
{
    if (!PyTuple_Check(o)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(o, i))) {
            return 0;
        }
    }
    return 1;
}

static int
walk_init(mt_walk *w, PyObject *module)
{
    memset(w, 0, sizeof(*w));
    w->meta_device = -1;
    w->st = mt_get_state(module);
    if (w->st->tensor_type == NULL || w->st->extra == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "memtorch._C walker is not set up: use memtorch.inspect() "
                        "or memtorch.sizeof()");
        return -1;
    }
    if (setup_get(w->st->extra, "dtypes", &w->dtype_info, mt_dict_check) < 0 ||
        setup_get(w->st->extra, "layouts", &w->layouts, mt_tuple_check) < 0 ||
        setup_get(w->st->extra, "per_channel", &w->per_channel, mt_tuple_check) < 0 ||
        setup_get(w->st->extra, "classify", &w->classify, mt_callable_check) < 0 ||
        setup_get(w->st->extra, "type_cache", &w->type_cache, mt_dict_check) < 0 ||
        setup_get(w->st->extra, "dataclass_fields", &w->dc_fields, mt_callable_check) < 0 ||
        setup_get(w->st->extra, "script_tables", &w->script_tables, mt_callable_check) < 0 ||
        setup_get(w->st->extra, "iterables", &w->iterables, mt_types_check) < 0 ||
        setup_get(w->st->extra, "namespaces", &w->namespaces, mt_types_check) < 0 ||
        setup_get(w->st->extra, "masked_type", &w->masked_type, mt_type_or_none_check) < 0 ||
        setup_get(w->st->extra, "module_skip", &w->module_skip, mt_frozenset_check) < 0) {
        return -1;
    }
    if (w->masked_type == Py_None) {
        Py_CLEAR(w->masked_type);
    }
    if (PyTuple_GET_SIZE(w->layouts) != 6) {
        PyErr_SetString(PyExc_RuntimeError, "memtorch._C: layouts must have 6 items");
        return -1;
    }
#define MT_MK(n)                                   \
    if ((w->s.n = PyUnicode_InternFromString(#n)) == NULL) { \
        return -1;                                 \
    }
    MT_NAMES(MT_MK)
#undef MT_MK
    if ((w->paths = PyList_New(0)) == NULL || (w->dtypes = PyList_New(0)) == NULL ||
        (w->dtype_index = PyDict_New()) == NULL ||
        (w->devices = PyList_New(0)) == NULL ||
        (w->device_index = PyDict_New()) == NULL ||
        (w->mod_paths = PyList_New(0)) == NULL ||
        (w->mod_types = PyList_New(0)) == NULL ||
        (w->type_names = PyDict_New()) == NULL ||
        (w->module_ids = PyDict_New()) == NULL || (w->seen = PySet_New(NULL)) == NULL ||
        (w->params = PyDict_New()) == NULL || (w->keepalive = PyList_New(0)) == NULL ||
        (w->empty = PyUnicode_FromString("")) == NULL ||
        (w->cpu = PyUnicode_FromString("cpu")) == NULL ||
        (w->dc_cache = PyDict_New()) == NULL) {
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(walk_doc,
"_walk($module, obj, optimizer, /)\n--\n\n"
"Walk obj (a module or any nest of containers) and then optimizer (or None)\n"
"into rows. Returns (rows, paths, dtypes, devices, (module_paths,\n"
"module_types, links)): rows a NumPy structured array, one row per tensor\n"
"occurrence, whose path/dtype/device/module fields index the lists beside\n"
"it; links an int32 array (n, 2) of each module entry's parent index and\n"
"the index it was first met under (-1 for none), in walk (pre-)order.");

static PyObject *
walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mt_walk w;
    PyObject *py_rows = NULL, *py_prefix = NULL, *py_links = NULL, *result = NULL;
    npy_intp dims[2];
    int gc_was_enabled = 0;

    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_walk() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (walk_init(&w, module) < 0) {
        goto error;
    }
#if PY_VERSION_HEX >= 0x030A0000
    /* The walk makes many small tracked objects (tuples, dicts) and no
     * cycles; collections triggered by them would traverse the whole heap
     * (the model's) again and again. Restored below. */
    gc_was_enabled = PyGC_Disable();
#endif
    if (push_item(&w, MT_ITEM_ANY, args[0], w.empty, -1, MT_CAT_TENSOR) < 0 ||
        drain(&w) < 0) {
        goto error;
    }
    if (args[1] != Py_None) {
        if (!PyObject_TypeCheck(args[1], (PyTypeObject *)w.st->optimizer_type)) {
            PyErr_Format(PyExc_TypeError,
                         "optimizer must be a torch.optim.Optimizer or None, not %s",
                         Py_TYPE(args[1])->tp_name);
            goto error;
        }
        py_prefix = PyUnicode_FromString("optimizer");
        if (py_prefix == NULL || walk_optimizer(&w, args[1], py_prefix) < 0 ||
            drain(&w) < 0) {
            goto error;
        }
    }
    dims[0] = (npy_intp)w.nlinks;
    dims[1] = 2;
    py_rows = mt_rows_to_array(&w.rows, w.st->row_dtype);
    if (py_rows == NULL) {
        goto error;
    }
    py_links = PyArray_SimpleNew(2, dims, NPY_INT32);
    if (py_links == NULL) {
        goto error;
    }
    if (w.nlinks > 0) {
        memcpy(PyArray_DATA((PyArrayObject *)py_links), w.links,
               (size_t)w.nlinks * 2 * sizeof(int32_t));
    }
    result = Py_BuildValue("(OOOO(OOO))", py_rows, w.paths, w.dtypes, w.devices,
                           w.mod_paths, w.mod_types, py_links);
error:
#if PY_VERSION_HEX >= 0x030A0000
    if (gc_was_enabled) {
        PyGC_Enable();
    }
#endif
    Py_XDECREF(py_rows);
    Py_XDECREF(py_links);
    Py_XDECREF(py_prefix);
    walk_clear(&w);
    return result;
}

PyDoc_STRVAR(walker_setup_doc,
"_walker_setup($module, info, /)\n--\n\n"
"Hand the walker what it needs to know about torch (called once by\n"
"memtorch.inspection): a dict with 'dtypes' {torch.dtype: (name, itemsize,\n"
"quantized, per_byte)}, 'layouts' (strided, sparse_coo, sparse_csr,\n"
"sparse_csc, sparse_bsr, sparse_bsc), 'per_channel' (tuple of qschemes),\n"
"'classify' (callable(type) -> 0 plain, 1 flatten, 2 check data),\n"
"'dataclass_fields' (callable(type) -> tuple of names or None),\n"
"'script_tables' (callable(module) -> 3 dicts or None), 'iterables' and\n"
"'namespaces' (tuples of types), 'masked_type' (type or None) and\n"
"'module_skip' (frozenset of nn.Module's own __dict__ keys).");

static PyObject *
walker_setup(PyObject *module, PyObject *info)
{
    mt_state *st = mt_get_state(module);
    PyObject *extra = NULL, *cache = NULL;

    if (!PyDict_Check(info)) {
        PyErr_Format(PyExc_TypeError, "_walker_setup() needs a dict, not %s",
                     Py_TYPE(info)->tp_name);
        goto error;
    }
    /* Checked here, at the boundary, so that a malformed table is an error
     * now and not a crash in the middle of a walk. */
    PyObject *dtypes = PyDict_GetItemString(info, "dtypes"); /* borrowed */
    if (dtypes == NULL || !PyDict_Check(dtypes)) {
        PyErr_SetString(PyExc_TypeError,
                        "_walker_setup(): info['dtypes'] must be a dict");
        goto error;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dtypes, &pos, &key, &value)) {
        if (check_dtype_info(key, value) < 0) {
            goto error;
        }
    }
    PyObject *layouts = PyDict_GetItemString(info, "layouts"); /* borrowed */
    if (layouts == NULL || !PyTuple_Check(layouts) || PyTuple_GET_SIZE(layouts) != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "_walker_setup(): info['layouts'] must be a tuple of 6 layouts");
        goto error;
    }
    extra = PyDict_Copy(info);
    cache = PyDict_New();
    if (extra == NULL || cache == NULL ||
        PyDict_SetItemString(extra, "type_cache", cache) < 0) {
        goto error;
    }
    Py_XSETREF(st->extra, extra);
    Py_DECREF(cache);
    Py_RETURN_NONE;
error:
    Py_XDECREF(extra);
    Py_XDECREF(cache);
    return NULL;
}

PyMethodDef mt_walker_methods[] = {
    {"_walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"_walker_setup", (PyCFunction)walker_setup, METH_O, walker_setup_doc},
    {NULL, NULL, 0, NULL},
};

int
mt_walker_exec(PyObject *module, mt_state *st)
{
    PyObject *descr = mt_rows_dtype();
    if (descr == NULL) {
        return -1;
    }
    Py_XSETREF(st->row_dtype, descr);
    /* PyModule_AddObject steals a reference on success only (3.9-compatible
     * spelling of PyModule_AddObjectRef). */
    Py_INCREF(descr);
    if (PyModule_AddObject(module, "row_dtype", descr) < 0) {
        Py_DECREF(descr);
        return -1;
    }
    return 0;
}
