/* picklehooks._speedups, part three (calls rows.c): the eager hook lane. What picklehooks._hookrt
 * does for the commonest recorded values, once a Python check has ruled out tracing:
 *
 *   forward_lane(module, output, flags, inputs=None) -> None, or NotImplemented
 *       _hookrt.forward's eager body for an output that is exactly a torch.Tensor: None when the
 *       hook is done (nothing records, or the value was recorded through the row lane or
 *       log._add_tensor), having hooked its gradient where one flows and GRAD asks for it, as
 *       _taps._eager_tap(direct=True) does for torch.nn's own leaf modules (see hookable());
 *       NotImplemented, having done nothing, for anything else (another output type, a guard,
 *       no value asked for, a gradient hook only Python puts, a checkpoint's recomputation, no
 *       name on the module), and _hookrt.forward goes on in Python. inputs: the hook's
 *       positional inputs (None from hooks generated before they were passed: no gradient
 *       hook then).
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
static PyObject *BACKWARD_HOOKS; /* torch.nn.modules.module._global_backward_hooks (mutated, never replaced) */
static PyObject *HOOK_KEY;       /* the key of the hook in a tensor's hook dict (_taps._HOOK_KEY) */
static PyObject *HAS_TORCH_FUNCTION; /* torch._C._has_torch_function_unary */
static PyObject *FUNCTORCH_ACTIVE;   /* torch._C._are_functorch_transforms_active */
static long VALUE_BIT, GRAD_BIT, GUARD_BIT, NONE_BIT, SURE_BIT;

static PyObject *S_add_tensor, *S_output, *S_empty, *S_grad_output, *S_backward_hooks, *S_modules, *S_module_name,
    *S_nn_prefix, *S_grad_fn, *S_is_view, *S_register_hook_dict;

static PyObject *configure_hooks(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *names[] = {"recording", "active", "graph_task_id", "tensor", "name_attr", "fallback",
                            "backward_hooks", "hook_key", "has_torch_function", "functorch_active",
                            "value_bit", "grad_bit", "guard_bit", "none_bit", "sure_bit", NULL};
    PyObject *recording, *active, *graph_task_id, *tensor, *name_attr, *fallback, *backward_hooks, *hook_key,
        *has_torch_function, *functorch_active;
    long value_bit, grad_bit, guard_bit, none_bit, sure_bit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!OOO!UOO!UOOlllll:configure_hooks", names, &PyList_Type,
                                     &recording, &active, &graph_task_id, &PyType_Type, &tensor, &name_attr,
                                     &fallback, &PyDict_Type, &backward_hooks, &hook_key, &has_torch_function,
                                     &functorch_active, &value_bit, &grad_bit, &guard_bit, &none_bit, &sure_bit))
        return NULL;
    if (!PyContextVar_CheckExact(active) || !PyCallable_Check(graph_task_id) || !PyCallable_Check(fallback) ||
        !PyCallable_Check(has_torch_function) || !PyCallable_Check(functorch_active) || value_bit <= 0 ||
        grad_bit <= 0 || guard_bit <= 0 || none_bit <= 0 || sure_bit <= 0) {
        PyErr_SetString(PyExc_TypeError, "configure_hooks: active must be a ContextVar, graph_task_id, fallback, "
                                         "has_torch_function and functorch_active callable, the bits positive");
        return NULL;
    }
    set_ref(&RECORDING, recording);
    set_ref(&ACTIVE, active);
    set_ref(&GRAPH_TASK_ID, graph_task_id);
    set_ref(&TENSOR, tensor);
    set_ref(&NAME_ATTR, name_attr);
    set_ref(&FALLBACK, fallback);
    set_ref(&BACKWARD_HOOKS, backward_hooks);
    set_ref(&HOOK_KEY, hook_key);
    set_ref(&HAS_TORCH_FUNCTION, has_torch_function);
    set_ref(&FUNCTORCH_ACTIVE, functorch_active);
    VALUE_BIT = value_bit;
    GRAD_BIT = grad_bit;
    GUARD_BIT = guard_bit;
    NONE_BIT = none_bit;
    SURE_BIT = sure_bit;
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

/* An attribute of a module's instance dict that is a dict: whether it is empty (1), not (0), or
 * neither can be told here (-1, no error: the caller declines); -2 with an error. */
static int empty_dict_attr(PyObject *module, PyObject *name) {
    PyObject *value = PyObject_GetAttr(module, name);
    if (!value) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -2;
        PyErr_Clear();
        return -1;
    }
    int empty = PyDict_Check(value) ? PyDict_GET_SIZE(value) == 0 : -1;
    Py_DECREF(value);
    return empty;
}

/* Whether the forward lane can hook output's gradient itself, as _taps._eager_tap does with
 * direct=True and _taps._hook_grad's fast branch, changing nothing yet: 1 (with *grad_fn set to a
 * new reference), 0 for anything that path or another one of _eager_tap's decides otherwise
 * (the caller declines), -1 with an error. The conditions, in _hookrt.forward's and _eager_tap's
 * order: no legacy backward hooks on the module or anywhere (register_backward_hook's hooks
 * attach to the output's grad_fn, which must stay the module's own); the module is one of
 * torch.nn's own without submodules (_hookrt._keeps_no_output: it computes its output last and
 * never uses it, so the output itself is hooked, no alias); inputs given; the output is not a
 * leaf, not a view and not one of the inputs (those are hooked through a view); it has no tensor
 * hooks yet, no __torch_function__, and no functorch transform is active. */
static int hookable(PyObject *module, PyObject *output, PyObject *inputs, PyObject **grad_fn) {
    *grad_fn = NULL;
    if (!BACKWARD_HOOKS || !PyTuple_Check(inputs) || PyDict_GET_SIZE(BACKWARD_HOOKS) != 0) return 0;
    int empty = empty_dict_attr(module, S_backward_hooks);
    if (empty != 1) return empty == -2 ? -1 : 0;
    PyObject *where = PyObject_GetAttr((PyObject *)Py_TYPE(module), S_module_name);
    if (!where) return -1;
    int torch_nn = PyUnicode_Check(where) && PyUnicode_Tailmatch(where, S_nn_prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
    Py_DECREF(where);
    if (!torch_nn) return 0;
    if ((empty = empty_dict_attr(module, S_modules)) != 1) return empty == -2 ? -1 : 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) {
        if (PyTuple_GET_ITEM(inputs, i) == output) return 0;
    }
    PyObject *fn = PyObject_GetAttr(output, S_grad_fn);
    if (!fn) return -1;
    if (fn == Py_None) { /* a leaf */
        Py_DECREF(fn);
        return 0;
    }
    PyObject *answers[4] = {NULL, NULL, NULL, NULL};
    int ok = (answers[0] = PyObject_CallMethodNoArgs(output, S_is_view)) &&
             (answers[1] = PyObject_GetAttr(output, S_backward_hooks)) &&
             (answers[2] = PyObject_CallOneArg(HAS_TORCH_FUNCTION, output)) &&
             (answers[3] = PyObject_CallNoArgs(FUNCTORCH_ACTIVE));
    int fast = ok && answers[0] == Py_False && answers[1] == Py_None && answers[2] == Py_False &&
               answers[3] == Py_False;
    for (int i = 0; i < 4; i++) Py_XDECREF(answers[i]);
    if (!ok || !fast) {
        Py_DECREF(fn);
        return ok ? 0 : -1;
    }
    *grad_fn = fn;
    return 1;
}

static int hook_gradient(PyObject *output, PyObject *grad_fn, PyObject *name, PyObject *flags_obj, long flags);

static PyObject *forward_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "forward_lane(module, output, flags, inputs=None) takes 3 or 4 arguments");
        return NULL;
    }
    PyObject *module = args[0], *output = args[1], *flags_obj = args[2], *inputs = nargs == 4 ? args[3] : Py_None;
    long flags = PyLong_AsLong(flags_obj);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    if (!RECORDING) Py_RETURN_NOTIMPLEMENTED;
    if (PyList_GET_SIZE(RECORDING) == 0 && !(flags & GUARD_BIT)) Py_RETURN_NONE; /* nothing records */
    if ((PyObject *)Py_TYPE(output) != TENSOR || (flags & (VALUE_BIT | GUARD_BIT)) != VALUE_BIT)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *requires_grad = rows_requires_grad(output); /* output is exactly a torch.Tensor */
    if (!requires_grad) return NULL;
    int grad_flows = requires_grad == Py_True;
    Py_DECREF(requires_grad);
    PyObject *grad_fn = NULL; /* set where this lane hooks the gradient itself */
    if (grad_flows && (flags & GRAD_BIT)) {
        int can = hookable(module, output, inputs, &grad_fn);
        if (can < 0) return NULL;
        if (!can) Py_RETURN_NOTIMPLEMENTED; /* its gradient needs a hook only Python puts */
    }
    PyObject *log = active_log(), *name = NULL, *result = NULL;
    if (!log) {
        Py_XDECREF(grad_fn);
        return NULL;
    }
    if (log == Py_None) { /* another thread records, this one doesn't (and _eager_tap hooks nothing) */
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
    /* A gradient this lane hooks pairs with this call for sure; one that flows here unhooked (GRAD
     * not asked for) never will. One that doesn't flow now may still come (reentrant checkpointing
     * runs the forward under no_grad and recomputes it for backward): add_row decides that as for
     * any value. Recorded first, then hooked, as _eager_tap does. */
    long known = grad_fn ? flags | SURE_BIT : grad_flows ? flags | NONE_BIT : flags;
    if (record(log, name, S_output, S_empty, output, known, NULL) == 0 &&
        (!grad_fn || hook_gradient(output, grad_fn, name, flags_obj, flags) == 0))
        result = Py_NewRef(Py_None);
done:
    Py_XDECREF(log);
    Py_XDECREF(name);
    Py_XDECREF(grad_fn);
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

/* A new GradRecorder of type (or a subtype) from checked arguments, or NULL with an error. */
static PyObject *make_recorder(PyTypeObject *type, PyObject *name, PyObject *kind, PyObject *path,
                               PyObject *flags_obj, long flags) {
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

static PyObject *recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"name", "kind", "path", "flags", NULL};
    PyObject *name, *kind, *path, *flags_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UUUO!:GradRecorder", names, &name, &kind, &path, &PyLong_Type,
                                     &flags_obj))
        return NULL;
    long flags = PyLong_AsLong(flags_obj);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    return make_recorder(type, name, kind, path, flags_obj, flags);
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

/* _taps._hook_grad's fast branch, with a new GradRecorder(name, "grad_output", "", flags): the
 * recorder in a new OrderedDict as the tensor's hook dict, registered with its grad_fn (what
 * Tensor.register_hook does, without the RemovableHandle nobody would keep). 0, or -1 with an error. */
static int hook_gradient(PyObject *output, PyObject *grad_fn, PyObject *name, PyObject *flags_obj, long flags) {
    PyObject *recorder = make_recorder(&GradRecorderType, name, S_grad_output, S_empty, flags_obj, flags);
    if (!recorder) return -1;
    PyObject *hooks = PyODict_New(), *done = NULL;
    if (hooks && PyODict_SetItem(hooks, HOOK_KEY, recorder) == 0 &&
        PyObject_SetAttr(output, S_backward_hooks, hooks) == 0)
        done = PyObject_CallMethodOneArg(grad_fn, S_register_hook_dict, output);
    Py_XDECREF(hooks);
    Py_DECREF(recorder);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

static PyMethodDef hooks_functions[] = {
    {"configure_hooks", (PyCFunction)(void (*)(void))configure_hooks, METH_VARARGS | METH_KEYWORDS,
     "configure_hooks($module, /, *, recording, active, graph_task_id, tensor, name_attr, fallback,\n"
     "                backward_hooks, hook_key, has_torch_function, functorch_active, value_bit, grad_bit,\n"
     "                guard_bit, none_bit, sure_bit)\n--\n\n"
     "What forward_lane and GradRecorder check and call (see the top of csrc/hooks.c)."},
    {"forward_lane", (PyCFunction)(void (*)(void))forward_lane, METH_FASTCALL,
     "forward_lane($module, module, output, flags, inputs=None, /)\n--\n\n"
     "None when the eager forward hook is done, else NotImplemented."},
    {NULL, NULL, 0, NULL},
};

int hooks_init(PyObject *m) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    INTERN(S_add_tensor, "_add_tensor");
    INTERN(S_output, "output");
    INTERN(S_empty, "");
    INTERN(S_grad_output, "grad_output");
    INTERN(S_backward_hooks, "_backward_hooks");
    INTERN(S_modules, "_modules");
    INTERN(S_module_name, "__module__");
    INTERN(S_nn_prefix, "torch.nn.modules.");
    INTERN(S_grad_fn, "grad_fn");
    INTERN(S_is_view, "_is_view");
    INTERN(S_register_hook_dict, "_register_hook_dict");
#undef INTERN
    if (PyModule_AddFunctions(m, hooks_functions) < 0 || PyType_Ready(&GradRecorderType) < 0) return -1;
    Py_INCREF(&GradRecorderType);
    if (PyModule_AddObject(m, "GradRecorder", (PyObject *)&GradRecorderType) < 0) {
        Py_DECREF(&GradRecorderType);
        return -1;
    }
    return 0;
}
