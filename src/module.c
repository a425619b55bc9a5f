/* module.c: PyInit__C, the exec slot, module state and _set_types. */
#define MT_IMPORT_ARRAY_HERE
#include "mt.h"

PyDoc_STRVAR(set_types_doc,
"_set_types($module, tensor, parameter, module, optimizer, /)\n--\n\n"
"Hand the torch types to the extension (called once by memtorch._torch).");

static PyObject *
set_types(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mt_state *st = mt_get_state(module);
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "_set_types() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < 4; i++) {
        if (!PyType_Check(args[i])) {
            PyErr_Format(PyExc_TypeError,
                         "_set_types() argument %zd must be a type", i + 1);
            return NULL;
        }
    }
    Py_XSETREF(st->tensor_type, Py_NewRef(args[0]));
    Py_XSETREF(st->parameter_type, Py_NewRef(args[1]));
    Py_XSETREF(st->module_type, Py_NewRef(args[2]));
    Py_XSETREF(st->optimizer_type, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_set_types", (PyCFunction)(void (*)(void))set_types, METH_FASTCALL,
     set_types_doc},
    {NULL, NULL, 0, NULL},
};

static int
mt_exec(PyObject *module)
{
    mt_state *st = mt_get_state(module);
    if (PyArray_ImportNumPyAPI() < 0) {
        return -1;
    }
    if (PyModule_AddFunctions(module, mt_walker_methods) < 0 ||
        PyModule_AddFunctions(module, mt_counters_methods) < 0 ||
        PyModule_AddFunctions(module, mt_replay_methods) < 0 ||
        PyModule_AddFunctions(module, mt_allocmodel_methods) < 0 ||
        PyModule_AddFunctions(module, mt_names_methods) < 0 ||
        PyModule_AddFunctions(module, mt_sites_methods) < 0) {
        return -1;
    }
    if (mt_walker_exec(module, st) < 0 || mt_counters_exec(module) < 0 || mt_marks_exec(module) < 0) {
        return -1;
    }
    return 0;
}

static int
mt_traverse(PyObject *module, visitproc visit, void *arg)
{
    mt_state *st = mt_get_state(module);
    if (st == NULL) {
        return 0;
    }
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->parameter_type);
    Py_VISIT(st->module_type);
    Py_VISIT(st->optimizer_type);
    Py_VISIT(st->row_dtype);
    Py_VISIT(st->log_dtype);
    Py_VISIT(st->extra);
    return 0;
}

static int
mt_clear(PyObject *module)
{
    mt_state *st = mt_get_state(module);
    if (st == NULL) {
        return 0;
    }
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->parameter_type);
    Py_CLEAR(st->module_type);
    Py_CLEAR(st->optimizer_type);
    Py_CLEAR(st->row_dtype);
    Py_CLEAR(st->log_dtype);
    Py_CLEAR(st->extra);
    mt_names_strs_clear(&st->strs);
    return 0;
}

static void
mt_free(void *module)
{
    (void)mt_clear((PyObject *)module);
}

static PyModuleDef_Slot mt_slots[] = {
    {Py_mod_exec, mt_exec},
    {0, NULL},
};

static struct PyModuleDef mt_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "memtorch._C",
    .m_doc = "memtorch's C core: the walker and the allocation counters.",
    .m_size = sizeof(mt_state),
    .m_methods = module_methods,
    .m_slots = mt_slots,
    .m_traverse = mt_traverse,
    .m_clear = mt_clear,
    .m_free = mt_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&mt_module);
}
