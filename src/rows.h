/* rows.h: the walker's row record, growable row buffer and its NumPy conversion. */
#ifndef MT_ROWS_H
#define MT_ROWS_H

#include "mt.h"
#include <stdint.h>

/* Categories of a row; memtorch/report.py keeps the names in this order. */
enum {
    MT_CAT_PARAMETER = 0,
    MT_CAT_BUFFER = 1,
    MT_CAT_GRADIENT = 2,
    MT_CAT_OPTIMIZER_STATE = 3,
    MT_CAT_TENSOR = 4, /* a tensor met outside a module (sizeof) */
    MT_CAT_ARRAY = 5,  /* a NumPy array */
    MT_CAT_ATTRIBUTE = 6, /* a tensor held as a plain attribute of a module
                             (not a parameter or buffer), e.g. the weight
                             torch.nn.utils.prune computes */
};

/* nbytes of a row whose numel * element size does not fit in int64 (a
 * huge expanded or meta tensor): Python recomputes it in exact ints. */
#define MT_NBYTES_OVERFLOW (-1)

/* One tensor (or tensor component, or ndarray) occurrence. The NumPy dtype
 * built by mt_rows_dtype() mirrors this layout field by field (offsetof), so
 * a buffer of rows is copied into the array with one memcpy. */
typedef struct {
    int64_t numel;          /* elements */
    int64_t nbytes;         /* logical bytes: numel * element size, or
                               MT_NBYTES_OVERFLOW */
    uint64_t storage;       /* storage key: StorageImpl address or root ndarray */
    int64_t storage_nbytes; /* bytes of the whole storage the row keeps alive */
    uint64_t tensor;        /* id of the tensor met in the walk (for a sparse
                               or quantized component: of the whole tensor) */
    uint64_t data;          /* address of the first byte of the memory the
                               storage (or the array's owner) holds, 0 where
                               unknown or none (meta): memory shared by two
                               storages (torch.from_numpy, np.frombuffer) is
                               found by overlapping ranges */
    int32_t path;           /* index into the paths list */
    int32_t module;         /* index into the modules list, -1 for none */
    int32_t dtype;          /* index into the dtypes list */
    int16_t device;         /* index into the devices list */
    uint8_t category;       /* MT_CAT_* */
    uint8_t requires_grad;  /* 0 or 1 */
} mt_row;

typedef struct {
    mt_row *rows;
    Py_ssize_t n;
    Py_ssize_t cap;
} mt_rows;

/* Returns a pointer to a new zeroed row at the end of the buffer, or NULL
 * with MemoryError set. The pointer is valid until the next call. */
mt_row *mt_rows_push(mt_rows *r);

/* Frees the buffer (idempotent). */
void mt_rows_free(mt_rows *r);

/* Returns a new reference to a 1-d array of dtype `descr` (borrowed) holding
 * a copy of the rows, or NULL with an exception set. */
PyObject *mt_rows_to_array(mt_rows *r, PyObject *descr);

/* Returns a new reference to the NumPy dtype of a row, or NULL. */
PyObject *mt_rows_dtype(void);

#endif /* MT_ROWS_H */
