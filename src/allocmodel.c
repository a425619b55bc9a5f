/* allocmodel.c: an estimate's allocation sequence replayed, as a sum or through the CUDA caching allocator's model. */
#include "mt.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The caching allocator's constants (c10/cuda/CUDACachingAllocator.cpp, default settings); the same as
 * memtorch/estimator/allocator.py's, which is the reference this file is tested against. */
#define MT_MIN_BLOCK 512
#define MT_SMALL_SIZE ((int64_t)1 << 20)
#define MT_SMALL_BUFFER ((int64_t)2 << 20)
#define MT_LARGE_BUFFER ((int64_t)20 << 20)
#define MT_MIN_LARGE_ALLOC ((int64_t)10 << 20)
#define MT_ROUND_LARGE ((int64_t)2 << 20)

typedef struct {
    int64_t size;
    int64_t addr;
    Py_ssize_t prev, next; /* neighbours in the segment, -1 at its ends */
    int free;
    int small;
} mt_block;

/* Free blocks of one pool, ordered by (size, address) as BlockComparatorSize orders them. */
typedef struct {
    Py_ssize_t *at; /* block indices */
    Py_ssize_t n, cap;
} mt_pool;

typedef struct {
    mt_block *blocks;
    Py_ssize_t nblocks, cap;
    mt_pool pools[2]; /* [0]: large, [1]: small */
    int64_t allocated, reserved;
} mt_alloc;

static int64_t
mt_round_size(int64_t n)
{
    if (n <= 0) {
        return 0;
    }
    if (n < MT_MIN_BLOCK) {
        return MT_MIN_BLOCK;
    }
    return MT_MIN_BLOCK * ((n + MT_MIN_BLOCK - 1) / MT_MIN_BLOCK);
}

static int64_t
mt_segment_size(int64_t n)
{
    if (n <= MT_SMALL_SIZE) {
        return MT_SMALL_BUFFER;
    }
    if (n < MT_MIN_LARGE_ALLOC) {
        return MT_LARGE_BUFFER;
    }
    return MT_ROUND_LARGE * ((n + MT_ROUND_LARGE - 1) / MT_ROUND_LARGE);
}

/* Index of a new free block, or -1 with MemoryError set. */
static Py_ssize_t
mt_new_block(mt_alloc *a, int64_t size, int small, int64_t addr)
{
    if (a->nblocks == a->cap) {
        Py_ssize_t cap = a->cap ? 2 * a->cap : 64;
        mt_block *b = PyMem_Realloc(a->blocks, (size_t)cap * sizeof(mt_block));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a->blocks = b;
        a->cap = cap;
    }
    mt_block *b = &a->blocks[a->nblocks];
    b->size = size;
    b->addr = addr;
    b->prev = b->next = -1;
    b->free = 1;
    b->small = small;
    return a->nblocks++;
}

/* First position in the pool whose block is not below (size, addr). */
static Py_ssize_t
mt_pool_lower(const mt_alloc *a, const mt_pool *p, int64_t size, int64_t addr)
{
    Py_ssize_t lo = 0, hi = p->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        const mt_block *b = &a->blocks[p->at[mid]];
        if (b->size < size || (b->size == size && b->addr < addr)) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return lo;
}

static int
mt_pool_insert(mt_alloc *a, Py_ssize_t bi)
{
    mt_pool *p = &a->pools[a->blocks[bi].small];
    if (p->n == p->cap) {
        Py_ssize_t cap = p->cap ? 2 * p->cap : 64;
        Py_ssize_t *at = PyMem_Realloc(p->at, (size_t)cap * sizeof(Py_ssize_t));
        if (at == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->at = at;
        p->cap = cap;
    }
    Py_ssize_t i = mt_pool_lower(a, p, a->blocks[bi].size, a->blocks[bi].addr);
    memmove(p->at + i + 1, p->at + i, (size_t)(p->n - i) * sizeof(Py_ssize_t));
    p->at[i] = bi;
    p->n++;
    return 0;
}

/* Addresses are unique, so (size, addr) finds the block itself. */
static void
mt_pool_remove(mt_alloc *a, Py_ssize_t bi)
{
    mt_pool *p = &a->pools[a->blocks[bi].small];
    Py_ssize_t i = mt_pool_lower(a, p, a->blocks[bi].size, a->blocks[bi].addr);
    assert(i < p->n && p->at[i] == bi);
    memmove(p->at + i, p->at + i + 1, (size_t)(p->n - i - 1) * sizeof(Py_ssize_t));
    p->n--;
}

/* The block handed out for a request of nbytes (-1: none, a request of 0 bytes; -2: MemoryError set);
 * *unsplit is its bytes beyond the rounded request. */
static Py_ssize_t
mt_malloc(mt_alloc *a, int64_t nbytes, int64_t *unsplit)
{
    int64_t size = mt_round_size(nbytes);
    *unsplit = 0;
    if (size == 0) {
        return -1;
    }
    int small = size <= MT_SMALL_SIZE;
    mt_pool *p = &a->pools[small];
    Py_ssize_t i = mt_pool_lower(a, p, size, INT64_MIN);
    Py_ssize_t bi;
    if (i < p->n) {
        bi = p->at[i];
        memmove(p->at + i, p->at + i + 1, (size_t)(p->n - i - 1) * sizeof(Py_ssize_t));
        p->n--;
    }
    else {
        int64_t seg = mt_segment_size(size);
        bi = mt_new_block(a, seg, small, a->reserved);
        if (bi < 0) {
            return -2;
        }
        a->reserved += seg;
    }
    int64_t remaining = a->blocks[bi].size - size;
    if ((small && remaining >= MT_MIN_BLOCK) || (!small && remaining > MT_SMALL_SIZE)) {
        Py_ssize_t ri = mt_new_block(a, remaining, small, a->blocks[bi].addr + size);
        if (ri < 0) {
            return -2;
        }
        mt_block *b = &a->blocks[bi], *rest = &a->blocks[ri]; /* after the realloc in mt_new_block */
        rest->prev = bi;
        rest->next = b->next;
        if (b->next >= 0) {
            a->blocks[b->next].prev = ri;
        }
        b->next = ri;
        b->size = size;
        if (mt_pool_insert(a, ri) < 0) {
            return -2;
        }
    }
    mt_block *b = &a->blocks[bi];
    b->free = 0;
    a->allocated += b->size;
    *unsplit = b->size - size;
    return bi;
}

/* 0, or -1 with MemoryError set. */
static int
mt_free(mt_alloc *a, Py_ssize_t bi)
{
    mt_block *b = &a->blocks[bi];
    a->allocated -= b->size;
    b->free = 1;
    Py_ssize_t prev = b->prev, next = b->next;
    if (prev >= 0 && a->blocks[prev].free) {
        mt_block *nb = &a->blocks[prev];
        mt_pool_remove(a, prev);
        b->size += nb->size;
        b->addr = nb->addr;
        b->prev = nb->prev;
        if (nb->prev >= 0) {
            a->blocks[nb->prev].next = bi;
        }
    }
    if (next >= 0 && a->blocks[next].free) {
        mt_block *nb = &a->blocks[next];
        mt_pool_remove(a, next);
        b->size += nb->size;
        b->next = nb->next;
        if (nb->next >= 0) {
            a->blocks[nb->next].prev = bi;
        }
    }
    return mt_pool_insert(a, bi);
}

/* A contiguous 1-d int64 array (a new reference) of py_obj, or NULL with TypeError set. */
static PyArrayObject *
mt_int64_array(PyObject *py_obj, const char *what)
{
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(py_obj, NPY_INT64, 1, 1, NPY_ARRAY_IN_ARRAY);
    if (arr == NULL) {
        PyErr_Format(PyExc_TypeError, "alloc_replay(): %s must be a 1-d sequence of integers", what);
    }
    return arr;
}

PyDoc_STRVAR(alloc_replay_doc,
"alloc_replay($module, events, sizes, cuda, /)\n--\n\n"
"Replay an allocation sequence. events: int64, k for an allocation of key k, ~k for its free;\n"
"sizes[k]: the bytes key k requests. cuda false: allocated bytes are the sum of the live requests;\n"
"true: they are the blocks the CUDA caching allocator's model hands out (rounded to 512 B, split from\n"
"cached segments, a block too little larger than the request handed out whole), and reserved bytes are\n"
"its segments'. Returns (curve, peak, at, reserved, live, unsplit): allocated bytes after each event\n"
"(int64 array), its highest, the first event reaching it (-1: none above 0), the segments' bytes at the\n"
"end (None without cuda), the keys live at that event (int64 array, ascending) and their blocks' bytes\n"
"beyond their rounded requests.");

static PyObject *
alloc_replay(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyArrayObject *ev_arr = NULL, *size_arr = NULL, *curve_arr = NULL, *live_arr = NULL;
    PyObject *result = NULL;
    Py_ssize_t *block_of = NULL;
    int64_t *unsplit = NULL;
    char *live = NULL;
    mt_alloc a = {0};
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "alloc_replay() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    int cuda = PyObject_IsTrue(args[2]);
    if (cuda < 0) {
        return NULL;
    }
    ev_arr = mt_int64_array(args[0], "events");
    if (ev_arr == NULL) {
        goto error;
    }
    size_arr = mt_int64_array(args[1], "sizes");
    if (size_arr == NULL) {
        goto error;
    }
    const int64_t *ev = PyArray_DATA(ev_arr);
    const int64_t *sizes = PyArray_DATA(size_arr);
    Py_ssize_t n = PyArray_DIM(ev_arr, 0), nkeys = PyArray_DIM(size_arr, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = ev[i] >= 0 ? ev[i] : ~ev[i];
        if (k >= nkeys) {
            PyErr_Format(PyExc_ValueError, "alloc_replay(): event %zd names key %lld, beyond the %zd sizes", i,
                         (long long)k, nkeys);
            goto error;
        }
    }
    npy_intp dim = n;
    curve_arr = (PyArrayObject *)PyArray_SimpleNew(1, &dim, NPY_INT64);
    if (curve_arr == NULL) {
        goto error;
    }
    int64_t *curve = PyArray_DATA(curve_arr);
    /* calloc'd (at least one element): every key starts with no block and live nowhere */
    live = PyMem_Calloc((size_t)nkeys + 1, 1);
    if (live == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    if (cuda) {
        block_of = PyMem_Malloc(((size_t)nkeys + 1) * sizeof(Py_ssize_t));
        unsplit = PyMem_Calloc((size_t)nkeys + 1, sizeof(int64_t));
        if (block_of == NULL || unsplit == NULL) {
            PyErr_NoMemory();
            goto error;
        }
        for (Py_ssize_t k = 0; k < nkeys; k++) {
            block_of[k] = -1;
        }
    }
    int64_t cur = 0, best = 0;
    Py_ssize_t best_at = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cuda) {
            if (ev[i] >= 0) {
                /* a key allocated twice keeps its first block allocated, as the Python model does */
                Py_ssize_t bi = mt_malloc(&a, sizes[ev[i]], &unsplit[ev[i]]);
                if (bi == -2) {
                    goto error;
                }
                block_of[ev[i]] = bi;
            }
            else if (block_of[~ev[i]] >= 0) {
                if (mt_free(&a, block_of[~ev[i]]) < 0) {
                    goto error;
                }
                block_of[~ev[i]] = -1;
            }
            cur = a.allocated;
        }
        else {
            cur += ev[i] >= 0 ? sizes[ev[i]] : -sizes[~ev[i]];
        }
        curve[i] = cur;
        if (cur > best) {
            best = cur;
            best_at = i;
        }
    }
    Py_ssize_t nlive = 0;
    for (Py_ssize_t i = 0; i <= best_at; i++) {
        if (ev[i] >= 0) {
            nlive += !live[ev[i]];
            live[ev[i]] = 1;
        }
        else {
            nlive -= live[~ev[i]];
            live[~ev[i]] = 0;
        }
    }
    dim = nlive;
    live_arr = (PyArrayObject *)PyArray_SimpleNew(1, &dim, NPY_INT64);
    if (live_arr == NULL) {
        goto error;
    }
    int64_t *out = PyArray_DATA(live_arr), extra = 0;
    for (Py_ssize_t k = 0, j = 0; k < nkeys; k++) {
        if (live[k]) {
            out[j++] = k;
            extra += cuda ? unsplit[k] : 0;
        }
    }
    if (cuda) {
        result = Py_BuildValue("(OLnLOL)", curve_arr, (long long)best, best_at, (long long)a.reserved, live_arr,
                               (long long)extra);
    }
    else {
        result = Py_BuildValue("(OLnOOL)", curve_arr, (long long)best, best_at, Py_None, live_arr, (long long)0);
    }
error:
    Py_XDECREF(ev_arr);
    Py_XDECREF(size_arr);
    Py_XDECREF(curve_arr);
    Py_XDECREF(live_arr);
    PyMem_Free(block_of);
    PyMem_Free(unsplit);
    PyMem_Free(live);
    PyMem_Free(a.blocks);
    PyMem_Free(a.pools[0].at);
    PyMem_Free(a.pools[1].at);
    return result;
}

PyMethodDef mt_allocmodel_methods[] = {
    {"alloc_replay", (PyCFunction)(void (*)(void))alloc_replay, METH_FASTCALL, alloc_replay_doc},
    {NULL, NULL, 0, NULL},
};
