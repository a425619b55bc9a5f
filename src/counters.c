/* counters.c: process-wide CPU allocation counters and scopes (stub). */
#include "mt.h"

PyMethodDef mt_counters_methods[] = {
    {NULL, NULL, 0, NULL},
};

int
mt_counters_exec(PyObject *module)
{
    return 0;
}
