/* compat.h: backports of newer C-API functions for Python 3.9-3.12. */
#ifndef MT_COMPAT_H
#define MT_COMPAT_H

#include <Python.h>

#if PY_VERSION_HEX < 0x030D0000
/* PyDict_GetItemRef (3.13): *result is a new reference or NULL.
 * Returns 1 if found, 0 if not, -1 on error. */
static inline int
mt_PyDict_GetItemRef(PyObject *d, PyObject *key, PyObject **result)
{
    PyObject *item = PyDict_GetItemWithError(d, key); /* borrowed */
    if (item != NULL) {
        Py_INCREF(item);
        *result = item;
        return 1;
    }
    *result = NULL;
    return PyErr_Occurred() ? -1 : 0;
}
#define PyDict_GetItemRef mt_PyDict_GetItemRef

/* PyWeakref_GetRef (3.13): *pobj is a new reference to the referent, or NULL
 * when it is dead. Returns 1 if alive, 0 if dead, -1 on error. */
static inline int
mt_PyWeakref_GetRef(PyObject *ref, PyObject **pobj)
{
    PyObject *obj = PyWeakref_GetObject(ref); /* borrowed, or NULL with an exception */
    *pobj = NULL;
    if (obj == NULL) {
        return -1;
    }
    if (obj == Py_None) {
        return 0;
    }
    *pobj = Py_NewRef(obj);
    return 1;
}
#define PyWeakref_GetRef mt_PyWeakref_GetRef
#endif

#if PY_VERSION_HEX < 0x030C0000
/* PyErr_GetRaisedException (3.12): the raised exception (a new reference, or
 * NULL), taken off the indicator; PyErr_SetRaisedException raises it again
 * (stealing the reference). */
static inline PyObject *
mt_PyErr_GetRaisedException(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static inline void
mt_PyErr_SetRaisedException(PyObject *exc)
{
    if (exc == NULL) {
        return;
    }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#define PyErr_GetRaisedException mt_PyErr_GetRaisedException
#define PyErr_SetRaisedException mt_PyErr_SetRaisedException
#endif

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *
Py_NewRef(PyObject *o)
{
    Py_INCREF(o);
    return o;
}
static inline PyObject *
Py_XNewRef(PyObject *o)
{
    Py_XINCREF(o);
    return o;
}
#endif

#endif /* MT_COMPAT_H */
