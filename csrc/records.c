/* picklehooks._speedups, part four (depends on no other part): reading. What Log._records_now
 * (picklehooks/capture/rows.py) does with the rows the hooks appended, in one C call:
 *
 *   configure_records(record, fields, dtype_name)
 *       record is picklehooks.capture.record.Record, fields the names of its 14 fields in the order below,
 *       dtype_name the function naming a torch.dtype as records do ("float32").
 *   build_records(rows, n, rank) -> list
 *       a Record for each of rows[:n], each row the 11-tuple Log._add_tensor appends,
 *           (module, kind, path, call, step, shape, dtype, stats, src, tensor, live),
 *       built as the Python loop builds it:
 *           Record(module, kind, path, call, step, tuple(shape), dtype_name(dtype), tensor, None,
 *                  live, rank, None, src if stats is None else stats, None)
 *       (tests/test_record_builder.py checks the two give equal records).
 *
 * Why C: reading a log builds one Record per row, and a dataclass's __init__ (14 assignments) is
 * most of what reading costs; this fills the slots of a fresh instance directly. It can do that
 * because Record is a dataclass with slots and nothing but assignments in __init__ (no
 * __post_init__, no validation): configure_records() checks that every field is a plain writable
 * object slot of the type, and picklehooks._native.record_builder that the fields are exactly the
 * dataclass's, in order, and that it has no __post_init__; anything else leaves reading to Python.
 */
#include "_speedups.h"

#include <structmember.h>

#define NFIELDS 14

static PyTypeObject *RECORD;          /* picklehooks.capture.record.Record */
static Py_ssize_t OFFSETS[NFIELDS];   /* of each field's slot in a Record, in the order above */
static PyObject *DTYPE_NAME;          /* picklehooks.capture.logfile.dtype_name */
static PyObject *DTYPE_NAMES;         /* dict: torch.dtype -> its name, filled by DTYPE_NAME */

static PyObject *configure_records(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *names[] = {"record", "fields", "dtype_name", NULL};
    PyObject *record, *fields, *dtype_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!O!O:configure_records", names, &PyType_Type, &record,
                                     &PyTuple_Type, &fields, &dtype_name))
        return NULL;
    PyTypeObject *type = (PyTypeObject *)record;
    if (PyTuple_GET_SIZE(fields) != NFIELDS || !PyCallable_Check(dtype_name) || type->tp_dictoffset != 0 ||
        !type->tp_alloc) {
        PyErr_Format(PyExc_TypeError, "configure_records: need a type with slots and no __dict__, %d field "
                                      "names, and a callable dtype_name", NFIELDS);
        return NULL;
    }
    Py_ssize_t offsets[NFIELDS];
    for (Py_ssize_t i = 0; i < NFIELDS; i++) {
        PyObject *field = PyTuple_GET_ITEM(fields, i);
        PyObject *descr = PyUnicode_Check(field) ? PyDict_GetItemWithError(type->tp_dict, field) : NULL;
        if (!descr && PyErr_Occurred()) return NULL;
        /* A slot of this very type (not inherited, not a property), holding any object, writable. */
        PyMemberDef *member = descr && Py_IS_TYPE(descr, &PyMemberDescr_Type)
                                  ? ((PyMemberDescrObject *)descr)->d_member : NULL;
        if (!member || member->type != T_OBJECT_EX || (member->flags & READONLY) ||
            member->offset < (Py_ssize_t)sizeof(PyObject) ||
            member->offset + (Py_ssize_t)sizeof(PyObject *) > type->tp_basicsize) {
            PyErr_Format(PyExc_TypeError, "configure_records: %R is not a writable object slot of %s", field,
                         type->tp_name);
            return NULL;
        }
        offsets[i] = member->offset;
    }
    PyObject *cache = PyDict_New();
    if (!cache) return NULL;
    Py_XSETREF(DTYPE_NAMES, cache);
    set_ref((PyObject **)&RECORD, record);
    set_ref(&DTYPE_NAME, dtype_name);
    memcpy(OFFSETS, offsets, sizeof OFFSETS);
    Py_RETURN_NONE;
}

/* dtype_name(dtype), cached: a borrowed reference, or NULL with an error set. */
static PyObject *name_of(PyObject *dtype) {
    PyObject *name = PyDict_GetItemWithError(DTYPE_NAMES, dtype);
    if (name || PyErr_Occurred()) return name;
    if (!(name = PyObject_CallOneArg(DTYPE_NAME, dtype))) return NULL;
    int failed = PyDict_SetItem(DTYPE_NAMES, dtype, name);
    Py_DECREF(name); /* the dict keeps it */
    return failed ? NULL : name;
}

/* A new Record from one row (see the top of this file): a new reference, or NULL with an error. */
static PyObject *record_of(PyObject *row, PyObject *rank) {
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 11) {
        PyErr_SetString(PyExc_TypeError, "build_records: a log's row is not an 11-tuple");
        return NULL;
    }
    PyObject *const *item = &PyTuple_GET_ITEM(row, 0);
    PyObject *name = name_of(item[6]); /* borrowed */
    if (!name) return NULL;
    PyObject *shape = PySequence_Tuple(item[5]);
    if (!shape) return NULL;
    PyObject *record = RECORD->tp_alloc(RECORD, 0); /* every slot NULL */
    if (!record) {
        Py_DECREF(shape);
        return NULL;
    }
    PyObject *stats = item[7] == Py_None ? item[8] : item[7];
    PyObject *values[NFIELDS] = {item[0], item[1], item[2], item[3], item[4], shape, name,
                                 item[9], Py_None, item[10], rank, Py_None, stats, Py_None};
    for (int i = 0; i < NFIELDS; i++) *(PyObject **)((char *)record + OFFSETS[i]) = Py_NewRef(values[i]);
    Py_DECREF(shape);
    return record;
}

static PyObject *build_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "build_records(rows, n, rank) takes 3 arguments");
        return NULL;
    }
    if (!RECORD) {
        PyErr_SetString(PyExc_RuntimeError, "build_records: configure_records() was not called");
        return NULL;
    }
    PyObject *rows = args[0], *rank = args[2];
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(rows) || n < 0 || n > PyList_GET_SIZE(rows)) {
        PyErr_SetString(PyExc_ValueError, "build_records: rows must be a list of at least n rows");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Python code can run meanwhile (dtype_name, a finalizer when an allocation collects): hold
         * the row, and check the list still has it. */
        PyObject *row = i < PyList_GET_SIZE(rows) ? Py_NewRef(PyList_GET_ITEM(rows, i)) : NULL;
        PyObject *record = row ? record_of(row, rank) : NULL;
        Py_XDECREF(row);
        if (!record) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "build_records: the rows changed");
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, record);
    }
    return out;
}

static PyMethodDef records_functions[] = {
    {"configure_records", (PyCFunction)(void (*)(void))configure_records, METH_VARARGS | METH_KEYWORDS,
     "configure_records($module, /, *, record, fields, dtype_name)\n--\n\n"
     "The Record type, its fields, how dtypes are named."},
    {"build_records", (PyCFunction)(void (*)(void))build_records, METH_FASTCALL,
     "build_records($module, rows, n, rank, /)\n--\n\n"
     "A Record for each of rows[:n] (Log._records_now's loop), as a list."},
    {NULL, NULL, 0, NULL},
};

int records_init(PyObject *m) { return PyModule_AddFunctions(m, records_functions); }
