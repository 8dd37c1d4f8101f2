/* picklehooks._speedups, part three (calls rows.c): the eager hook lane. What picklehooks._hookrt
 * does for the commonest recorded values, once a Python check has ruled out tracing:
 *
 *   forward_lane(module, output, flags) -> None, or NotImplemented
 *       _hookrt.forward's eager body for an output that needs no gradient hook: None when the
 *       hook is done (nothing records, or the value was recorded through the row lane or
 *       log._add_tensor; an output that requires grad with the none bit, since the lane hooks
 *       no gradient) and returns None; NotImplemented, having done nothing, for anything
 *       else (the output is not exactly a torch.Tensor, a guard, no value asked for, a gradient
 *       hook needed, a checkpoint's recomputation, no name on the module), and _hookrt.forward
 *       goes on in Python.
 *
 *   GradRecorder(name, kind, path, flags)
 *       _hookrt._GradRecorder: the tensor hook that records a gradient. Called with the
 *       gradient, it records it through the row lane (or log._add_tensor) when a log records in
 *       this context and the gradient is a plain tensor; a guard flag, no log in this context
 *       (autograd's device threads look for one elsewhere), or any other tensor type go to the
 *       Python fallback, fallback(name, kind, path, flags, grad), which is the whole of it.
 *
 * The Python side (picklehooks._native.hook_lane, called by _hookrt) passes every object and
 * constant to configure_hooks(), so none is spelled twice. Both record through rows.c's add_row,
 * called directly, so they record only once configure_rows() was called (before that, through
 * log._add_tensor). Why C: a recorded value's trip
 * through _hookrt's Python is most of what it costs above its native statistics (see
 * bench/bench_record_path.py). The checks that must stay Python are those torch.compile traces:
 * _hookrt.forward makes them before it calls forward_lane.
 */
#include "_speedups.h"

#include <stddef.h>
#include <structmember.h>

/* What configure_hooks() sets; NULL (or 0) until then. */
static PyObject *RECORDING;      /* the list of logs recording anywhere (picklehooks._state._ANYWHERE) */
static PyObject *ACTIVE;         /* the ContextVar of the log recording here (picklehooks._state._ACTIVE) */
static PyObject *GRAPH_TASK_ID;  /* torch._C._current_graph_task_id: -1 outside a backward pass */
static PyObject *TENSOR;         /* torch.Tensor: the one output type forward_lane takes */
static PyObject *NAME_ATTR;      /* "_picklehooks_name" */
static PyObject *FALLBACK;       /* fallback(name, kind, path, flags, grad): the Python recorder */
static long VALUE_BIT, GRAD_BIT, GUARD_BIT, NONE_BIT;

static PyObject *S_add_tensor, *S_requires_grad, *S_output, *S_empty;

static PyObject *configure_hooks(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *names[] = {"recording", "active", "graph_task_id", "tensor", "name_attr", "fallback",
                            "value_bit", "grad_bit", "guard_bit", "none_bit", NULL};
    PyObject *recording, *active, *graph_task_id, *tensor, *name_attr, *fallback;
    long value_bit, grad_bit, guard_bit, none_bit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!OOO!UOllll:configure_hooks", names, &PyList_Type, &recording,
                                     &active, &graph_task_id, &PyType_Type, &tensor, &name_attr, &fallback,
                                     &value_bit, &grad_bit, &guard_bit, &none_bit))
        return NULL;
    if (!PyContextVar_CheckExact(active) || !PyCallable_Check(graph_task_id) || !PyCallable_Check(fallback) ||
        value_bit <= 0 || grad_bit <= 0 || guard_bit <= 0 || none_bit <= 0) {
        PyErr_SetString(PyExc_TypeError, "configure_hooks: active must be a ContextVar, graph_task_id and fallback "
                                         "callable, the bits positive");
        return NULL;
    }
    set_ref(&RECORDING, recording);
    set_ref(&ACTIVE, active);
    set_ref(&GRAPH_TASK_ID, graph_task_id);
    set_ref(&TENSOR, tensor);
    set_ref(&NAME_ATTR, name_attr);
    set_ref(&FALLBACK, fallback);
    VALUE_BIT = value_bit;
    GRAD_BIT = grad_bit;
    GUARD_BIT = guard_bit;
    NONE_BIT = none_bit;
    Py_RETURN_NONE;
}

/* Record x in log: the row lane, or log._add_tensor where it declines (flags_obj: flags as an int
 * object, or NULL to make one for it). 0, or -1 with an error. */
static int record(PyObject *log, PyObject *name, PyObject *kind, PyObject *path, PyObject *x, long flags,
                  PyObject *flags_obj) {
    PyObject *took = rows_add_row(log, name, kind, path, x, flags);
    if (!took) return -1;
    int done = took == Py_True;
    Py_DECREF(took);
    if (done) return 0;
    PyObject *own = flags_obj ? Py_NewRef(flags_obj) : PyLong_FromLong(flags);
    if (!own) return -1;
    PyObject *args[6] = {log, name, kind, path, x, own};
    PyObject *result = PyObject_VectorcallMethod(S_add_tensor, args, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(own);
    Py_XDECREF(result);
    return result ? 0 : -1;
}

/* The log recording in this context: a new reference to it or to None, or NULL with an error. */
static PyObject *active_log(void) {
    PyObject *log = NULL;
    if (PyContextVar_Get(ACTIVE, Py_None, &log) < 0) return NULL;
    return log;
}

static PyObject *forward_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "forward_lane(module, output, flags) takes 3 arguments");
        return NULL;
    }
    PyObject *module = args[0], *output = args[1], *flags_obj = args[2];
    long flags = PyLong_AsLong(flags_obj);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    if (!RECORDING) Py_RETURN_NOTIMPLEMENTED;
    if (PyList_GET_SIZE(RECORDING) == 0 && !(flags & GUARD_BIT)) Py_RETURN_NONE; /* nothing records */
    if ((PyObject *)Py_TYPE(output) != TENSOR || (flags & (VALUE_BIT | GUARD_BIT)) != VALUE_BIT)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *requires_grad = PyObject_GetAttr(output, S_requires_grad);
    if (!requires_grad) return NULL;
    int grad_flows = requires_grad == Py_True;
    Py_DECREF(requires_grad);
    if (grad_flows && (flags & GRAD_BIT)) Py_RETURN_NOTIMPLEMENTED; /* its gradient needs a hook: Python */
    PyObject *log = active_log(), *name = NULL, *result = NULL;
    if (!log) return NULL;
    if (log == Py_None) { /* another thread records, this one doesn't */
        result = log;
        log = NULL;
        goto done;
    }
    PyObject *task = PyObject_CallNoArgs(GRAPH_TASK_ID);
    if (!task) goto done;
    long task_id = PyLong_AsLong(task);
    Py_DECREF(task);
    if (task_id == -1 && PyErr_Occurred()) goto done;
    if (task_id != -1) { /* inside backward: a checkpoint's recomputation */
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (!(name = PyObject_GetAttr(module, NAME_ATTR))) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto done;
        PyErr_Clear(); /* Python raises, saying why */
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* A gradient that flows here isn't hooked (the lane takes no value that needs a hook): none will
     * pair with this call. One that doesn't flow now may still come (reentrant checkpointing runs the
     * forward under no_grad and recomputes it for backward): add_row decides that as for any value. */
    if (record(log, name, S_output, S_empty, output, grad_flows ? flags | NONE_BIT : flags, NULL) == 0)
        result = Py_NewRef(Py_None);
done:
    Py_XDECREF(log);
    Py_XDECREF(name);
    return result;
}

/* -- GradRecorder --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *name, *kind, *path, *flags_obj;
    long flags;
    vectorcallfunc vectorcall;
} GradRecorder;

static PyObject *recorder_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    GradRecorder *self = (GradRecorder *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "GradRecorder takes one argument, the gradient");
        return NULL;
    }
    PyObject *grad = args[0];
    PyObject *log = NULL;
    if (!(self->flags & GUARD_BIT) && FALLBACK) {
        if (!(log = active_log())) return NULL;
        if (log != Py_None && !(self->flags & GRAD_BIT)) {
            Py_DECREF(log);
            Py_RETURN_NONE;
        }
        if (log != Py_None && rows_handled_type(grad)) {
            int failed = record(log, self->name, self->kind, self->path, grad, self->flags, self->flags_obj);
            Py_DECREF(log);
            if (failed) return NULL;
            Py_RETURN_NONE;
        }
        Py_DECREF(log);
    }
    if (!FALLBACK) {
        PyErr_SetString(PyExc_RuntimeError, "GradRecorder: configure_hooks() was not called");
        return NULL;
    }
    PyObject *fallback_args[5] = {self->name, self->kind, self->path, self->flags_obj, grad};
    return PyObject_Vectorcall(FALLBACK, fallback_args, 5, NULL);
}

static PyObject *recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"name", "kind", "path", "flags", NULL};
    PyObject *name, *kind, *path, *flags_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UUUO!:GradRecorder", names, &name, &kind, &path, &PyLong_Type,
                                     &flags_obj))
        return NULL;
    long flags = PyLong_AsLong(flags_obj);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    GradRecorder *self = (GradRecorder *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->name = Py_NewRef(name);
    self->kind = Py_NewRef(kind);
    self->path = Py_NewRef(path);
    self->flags_obj = Py_NewRef(flags_obj);
    self->flags = flags;
    self->vectorcall = recorder_call;
    return (PyObject *)self;
}

static void recorder_dealloc(GradRecorder *self) {
    Py_XDECREF(self->name);
    Py_XDECREF(self->kind);
    Py_XDECREF(self->path);
    Py_XDECREF(self->flags_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef recorder_members[] = {
    {"name", T_OBJECT, offsetof(GradRecorder, name), READONLY, "the module's name"},
    {"kind", T_OBJECT, offsetof(GradRecorder, kind), READONLY, "the record's kind (\"grad_output\"...)"},
    {"path", T_OBJECT, offsetof(GradRecorder, path), READONLY, "the record's path"},
    {"flags", T_OBJECT, offsetof(GradRecorder, flags_obj), READONLY, "the tap's flags"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject GradRecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "picklehooks._speedups.GradRecorder",
    .tp_doc = "GradRecorder(name, kind, path, flags)\n--\n\n"
              "A tensor hook recording a gradient (see _hookrt._GradRecorder).",
    .tp_basicsize = sizeof(GradRecorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = recorder_new,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GradRecorder, vectorcall),
    .tp_members = recorder_members,
};

static PyMethodDef hooks_functions[] = {
    {"configure_hooks", (PyCFunction)(void (*)(void))configure_hooks, METH_VARARGS | METH_KEYWORDS,
     "configure_hooks($module, /, *, recording, active, graph_task_id, tensor, name_attr, fallback, value_bit,\n"
     "                grad_bit, guard_bit, none_bit)\n--\n\n"
     "What forward_lane and GradRecorder check and call (see the top of csrc/hooks.c)."},
    {"forward_lane", (PyCFunction)(void (*)(void))forward_lane, METH_FASTCALL,
     "forward_lane($module, module, output, flags, /)\n--\n\n"
     "None when the eager forward hook is done, else NotImplemented."},
    {NULL, NULL, 0, NULL},
};

int hooks_init(PyObject *m) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    INTERN(S_add_tensor, "_add_tensor");
    INTERN(S_requires_grad, "requires_grad");
    INTERN(S_output, "output");
    INTERN(S_empty, "");
#undef INTERN
    if (PyModule_AddFunctions(m, hooks_functions) < 0 || PyType_Ready(&GradRecorderType) < 0) return -1;
    Py_INCREF(&GradRecorderType);
    if (PyModule_AddObject(m, "GradRecorder", (PyObject *)&GradRecorderType) < 0) {
        Py_DECREF(&GradRecorderType);
        return -1;
    }
    return 0;
}
