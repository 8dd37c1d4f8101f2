/* What the sources of picklehooks._speedups share. Nothing here is part of any API: the extension
 * is built and used only by picklehooks, through picklehooks/_native.py (which holds its Python twin).
 *
 * The parts, each one .c file, in dependency order (a part calls only the parts above it, in C):
 *
 *   stats.c    the statistics of a tensor's memory in one pass            (depends on nothing)
 *   rows.c     the record lane: Log._add_tensor's common cases, numbering (calls stats.c)
 *   hooks.c    the hook lane: _hookrt's eager forward body, GradRecorder   (calls rows.c)
 *   records.c  Records built from a log's rows when it is read            (depends on nothing)
 *   kernels.c  the active op's kernel, which PyTorch's dispatcher calls   (depends on nothing)
 *   tree.c     whether a model's module tree changed since instrument()   (depends on nothing)
 *   _speedups.c  PyInit__speedups: the module, made of every part's init (calls each part's *_init)
 *
 * Each part's *_init adds its functions, types and constants to the module.
 */
#ifndef PICKLEHOOKS_SPEEDUPS_H
#define PICKLEHOOKS_SPEEDUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* *slot = value, for the settings a configure_*() call stores (a part's static state). */
static inline void set_ref(PyObject **slot, PyObject *value) {
    Py_XINCREF(value);
    Py_XSETREF(*slot, value);
}

/* stats.c: stats(ptr, dtype_code, sizes, strides), the function itself (a new reference to a
 * Stats or to None, or NULL with an error), for rows.c to call without going through Python. */
PyObject *stats_of_memory(PyObject *ptr, PyObject *dtype_code, PyObject *sizes, PyObject *strides);
int stats_init(PyObject *module);

/* rows.c: add_row (a new reference to True or False, or NULL with an error), next_call (a new
 * reference, or NULL), and whether x's exact type is one the lane handles; for hooks.c. */
PyObject *rows_add_row(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *x, long flags);
PyObject *rows_next_call(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *expect);
int rows_handled_type(PyObject *x);
/* x.requires_grad for x of a type rows_handled_type() takes (read as add_row reads it): a new
 * reference, or NULL with an error. */
PyObject *rows_requires_grad(PyObject *x);
int rows_init(PyObject *module);

int hooks_init(PyObject *module);
int records_init(PyObject *module);
int kernels_init(PyObject *module);
int tree_init(PyObject *module);

#endif
