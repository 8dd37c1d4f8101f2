/* What picklehooks/_frow.c, _fhook.c and _frecords.c, the sources of the _frow extension,
 * share. Nothing here is part of any API: the extension is built and used only by picklehooks. */
#ifndef PICKLEHOOKS_FROW_H
#define PICKLEHOOKS_FROW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* _frow.c: Log._add_tensor's common cases (a new reference to True or False, or NULL with an
 * error), Log._next_call (a new reference, or NULL), and whether x's exact type is handled. */
PyObject *frow_add_row(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *x, long flags);
PyObject *frow_next_call(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *expect);
int frow_handled_type(PyObject *x);

/* *slot = value, for the module state configure() and configure_hooks() set. */
static inline void set_ref(PyObject **slot, PyObject *value) {
    Py_XINCREF(value);
    Py_XSETREF(*slot, value);
}

/* _fhook.c: the hook lane's functions, and adding its GradRecorder type to the module. */
extern PyMethodDef fhook_methods[];
int fhook_add_types(PyObject *module);

/* _frecords.c: building Records from a log's rows. */
extern PyMethodDef frecords_methods[];

#endif
