/* walker.c: iterative walk of modules/optimizers/containers into rows (stub). */
#include "mt.h"

PyMethodDef mt_walker_methods[] = {
    {NULL, NULL, 0, NULL},
};

int
mt_walker_exec(PyObject *module, mt_state *st)
{
    return 0;
}
