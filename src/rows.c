/* rows.c: growable buffer of walker rows and its conversion to a NumPy structured array. */
#include "rows.h"

#include <stddef.h>
#include <string.h>

mt_row *
mt_rows_push(mt_rows *r)
{
    if (r->n == r->cap) {
        Py_ssize_t cap = r->cap ? r->cap * 2 : 256;
        if ((size_t)cap > PY_SSIZE_T_MAX / sizeof(mt_row)) {
            PyErr_NoMemory();
            return NULL;
        }
        mt_row *grown = PyMem_Realloc(r->rows, (size_t)cap * sizeof(mt_row));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        r->rows = grown;
        r->cap = cap;
    }
    mt_row *row = &r->rows[r->n++];
    memset(row, 0, sizeof(*row));
    return row;
}

void
mt_rows_free(mt_rows *r)
{
    PyMem_Free(r->rows);
    r->rows = NULL;
    r->n = r->cap = 0;
}

PyObject *
mt_rows_to_array(mt_rows *r, PyObject *descr)
{
    npy_intp dims[1] = {(npy_intp)r->n};
    /* PyArray_NewFromDescr steals a reference to the descr. */
    Py_INCREF(descr);
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)descr,
                                         1, dims, NULL, NULL, 0, NULL);
    if (arr == NULL) {
        return NULL;
    }
    if (r->n > 0) {
        memcpy(PyArray_DATA((PyArrayObject *)arr), r->rows,
               (size_t)r->n * sizeof(mt_row));
    }
    return arr;
}

PyObject *
mt_rows_dtype(void)
{
    PyObject *spec = NULL;
    PyArray_Descr *descr = NULL;

    /* {"names": [...], "formats": [...], "offsets": [...], "itemsize": n}
     * with the offsets of the C struct, so that the layouts agree. */
    spec = Py_BuildValue(
        "{s:[ssssssssssss],s:[ssssssssssss],s:[nnnnnnnnnnnn],s:n}",
        "names", "numel", "nbytes", "storage", "storage_nbytes", "tensor", "data",
        "path", "module", "dtype", "device", "category", "requires_grad",
        "formats", "i8", "i8", "u8", "i8", "u8", "u8", "i4", "i4", "i4", "i2",
        "u1", "?",
        "offsets", (Py_ssize_t)offsetof(mt_row, numel),
        (Py_ssize_t)offsetof(mt_row, nbytes),
        (Py_ssize_t)offsetof(mt_row, storage),
        (Py_ssize_t)offsetof(mt_row, storage_nbytes),
        (Py_ssize_t)offsetof(mt_row, tensor),
        (Py_ssize_t)offsetof(mt_row, data),
        (Py_ssize_t)offsetof(mt_row, path),
        (Py_ssize_t)offsetof(mt_row, module),
        (Py_ssize_t)offsetof(mt_row, dtype),
        (Py_ssize_t)offsetof(mt_row, device),
        (Py_ssize_t)offsetof(mt_row, category),
        (Py_ssize_t)offsetof(mt_row, requires_grad),
        "itemsize", (Py_ssize_t)sizeof(mt_row));
    if (spec == NULL) {
        goto error;
    }
    if (!PyArray_DescrConverter(spec, &descr)) {
        goto error;
    }
    Py_DECREF(spec);
    return (PyObject *)descr;
error:
    Py_XDECREF(spec);
    Py_XDECREF(descr);
    return NULL;
}
