/* mt.h: shared declarations of memtorch._C (module state, method tables, macros). */
#ifndef MT_H
#define MT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* One NumPy C-API table for the whole extension: module.c imports it, every
 * other file includes this header after defining NO_IMPORT_ARRAY. */
#define PY_ARRAY_UNIQUE_SYMBOL MT_ARRAY_API
#ifndef MT_IMPORT_ARRAY_HERE
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "compat.h"

/* The attribute names and owner kinds the names walk and the marks use (names.c), made once
 * per module on first use (mt_names_strs). All new references. */
typedef struct {
    PyObject *untyped_storage, *data_ptr, *grad, *shape, *dtype, *state_attr;
    PyObject *dict_keys[3]; /* "_modules", "_parameters", "_buffers" */
    PyObject *next_id;      /* RemovableHandle.next_id (marks.c's install) */
    PyObject *compiled_call_impl; /* nn.Module._compiled_call_impl (set by module.compile()) */
    PyObject *hook_keys[3];       /* "_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called" */
    PyObject *move_to_end;        /* OrderedDict.move_to_end (marks.c's install) */
    PyObject *parameter, *gradient, *state, *buffer, *input;
} mt_strs;

/* Per-module state (PEP 489). The torch types are handed over once by
 * memtorch/_torch.py through _C._set_types(); until then they are NULL and
 * the walker refuses to run. All references here are strong (owned). */
typedef struct {
    PyObject *tensor_type;     /* torch.Tensor */
    PyObject *parameter_type;  /* torch.nn.Parameter */
    PyObject *module_type;     /* torch.nn.Module */
    PyObject *optimizer_type;  /* torch.optim.Optimizer */
    PyObject *row_dtype;       /* numpy dtype of a walker row (PyArray_Descr) */
    PyObject *log_dtype;       /* numpy dtype of an event log row (eventlog_read_all), made once */
    PyObject *extra;           /* dict: further objects the walker needs */
    mt_strs strs;              /* names.c's strings; strs.input NULL until made */
} mt_state;

/* Borrowed pointer to the state of memtorch._C, from the module object. */
static inline mt_state *
mt_get_state(PyObject *module)
{
    return (mt_state *)PyModule_GetState(module);
}

/* Method tables, one per mechanism file; module.c adds each to the module. */
extern PyMethodDef mt_walker_methods[];
extern PyMethodDef mt_counters_methods[];
extern PyMethodDef mt_replay_methods[];
extern PyMethodDef mt_allocmodel_methods[];
extern PyMethodDef mt_names_methods[];
extern PyMethodDef mt_sites_methods[];

/* names.c, for marks.c: fill names (a dict) as names_walk() does (params: a
 * list of (name, weakref); state: the optimizer's state dict or NULL). 0, or -1
 * with an exception set. */
int mt_names_walk(PyObject *module, PyObject *names, PyObject *params, PyObject *state, long want);
/* names.c, for marks.c: names[address of t's storage] = (name, kind, None, shape,
 * dtype) unless named already (no_shape: shape and dtype None); *addr is that
 * address (0: t has no storage with data). t, name and kind are borrowed. 0, or -1
 * with an exception set. */
int mt_names_put(PyObject *module, PyObject *names, PyObject *t, PyObject *name, PyObject *kind,
                 int no_shape, void **addr);
/* names.c: the module's strings (borrowed from its state), made on first use; NULL with an exception set. */
const mt_strs *mt_names_strs(PyObject *module);
void mt_names_strs_clear(mt_strs *s);
int mt_module_at(PyObject *py_seq, Py_ssize_t i, PyObject **out);

/* Per-file hooks called from module.c's exec slot, traverse and clear.
 * Each returns 0 on success, -1 with an exception set. */
int mt_walker_exec(PyObject *module, mt_state *st);
int mt_counters_exec(PyObject *module);
int mt_marks_exec(PyObject *module);

#ifdef MT_DEBUG
#include <stdio.h>
#define MT_DPRINT(...) fprintf(stderr, "memtorch: " __VA_ARGS__)
#else
#define MT_DPRINT(...) ((void)0)
#endif

#endif /* MT_H */
