/* picklehooks._speedups, part two (calls stats.c): the eager record lane. One call does what
 * Log._add_tensor (picklehooks/capture/rows.py) does for most records: either a plain CPU
 * tensor's statistics, computed now in one native pass (stats.c's stats_of_memory, called
 * directly), or a copy of a plain strided tensor (mode="tensor"); and the log's row.
 *
 *   add_row(log, module, kind, path, x, flags) -> True, or False when not
 *                                                handled here
 *   next_call(log, module, kind, path, expect) -> the record's call number:
 *       Log._next_call, step for step, but for the pairing of an input or
 *       output with its invocation, which it asks log._invocation for
 *       (tests/test_record_lane.py checks both number any sequence alike)
 *
 * False means nothing was done (no call numbered, no copy counted, no row),
 * and the caller goes on to Log._add_tensor's Python path: statistics and a
 * copy both (mode="both"), a log keeping live
 * values, a tensor that isn't exactly torch.Tensor or nn.Parameter, a tensor
 * without a shape (nested); for statistics, another dtype or device, a
 * negative-bit view, storage data_ptr() can't give, an empty tensor, and
 * whatever else stats.c declines (the checks of
 * picklehooks._native.stats, in its order, with the same soft errors turned
 * into "not handled"); for a copy, a layout other than strided (sparse and
 * mkldnn values are densified there); also before configure_rows() was called.
 *
 * When handled, the order is: the statistics or the copy (detached if x
 * requires grad; clone() if contiguous, else contiguous()), then the call
 * number from next_call(log, module, kind, path, expect), then, for a copy,
 * log._tensor_bytes += x.nbytes, then the row
 *   (module, kind, path, call, log.step, x.shape, x.dtype, stats or None,
 *    None, copy or None, None)
 * appended to log._rows: exactly the tuple Log._add_tensor appends.
 * expect is picklehooks.capture.pairing._expects_grad: for a kind a gradient
 * pairs with (forward_of's values: an input, an output), SURE where flags has
 * the sure bit, 0 where it has the none bit (set by tracing, and by the eager
 * hooks, which know whether they hook x's gradient), else SURE if x requires
 * grad, 0 with grad mode on and MAYBE with it off; 0 for other kinds. The Python side (picklehooks/_native.py for the tensor, the caller of
 * _native.row_lane for the row) passes every name and constant to configure_rows(), so none is
 * spelled twice; the Python twin of every function here is in picklehooks/_native.py.
 *
 * Why C: the same steps in Python measured 1 to 5.5 us more per record inside
 * a model (fewer interpreted instructions, less cache traffic), though only
 * about 0.3 us in a tight loop; see bench/bench_record_path.py. hooks.c, the hook lane,
 * calls add_row.
 */
#include "_speedups.h"

/* What configure_rows() sets; NULL (or 0) until then. */
static PyObject *TYPES;         /* tuple of the exact tensor types handled */
static PyObject *CODES;         /* dict: torch.dtype -> stats.c's dtype code */
static PyObject *SOFT_ERRORS;   /* exception types meaning "not handled" */
static PyObject *GRAD_ENABLED;  /* torch.is_grad_enabled */
static PyObject *PAIRED;        /* kinds whose forward values await a gradient: FORWARD_OF's values */
static PyObject *SURE, *MAYBE;
static PyObject *STRIDED;       /* torch.strided */
static PyObject *ONE;           /* 1 */
static PyObject *NONE_EXPECTED; /* 0: the expect of a value no gradient will pair with */
static PyObject *FORWARD_OF;    /* dict: gradient kind -> the forward kind it pairs with */
static Py_ssize_t MAYBE_TRIM, MAYBE_KEPT; /* a MAYBE list longer than TRIM keeps its last KEPT calls */
/* The bits that ask for statistics and for a copy; those that say a gradient will come, or won't. */
static long STATS_BIT, TENSOR_BIT, SURE_BIT, NONE_BIT;

static PyObject *S_keep_graph, *S_dtype, *S_is_cpu, *S_is_neg, *S_data_ptr, *S_shape, *S_stride,
    *S_rows, *S_step, *S_requires_grad, *S_layout, *S_detach, *S_is_contiguous, *S_clone, *S_contiguous, *S_nbytes,
    *S_tensor_bytes, *S_calls, *S_open, *S_awaiting_grad, *S_maybe_grad, *S_invocation,
    *S_input, *S_output;

static int intern_names(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return -1
    INTERN(S_keep_graph, "keep_graph");
    INTERN(S_dtype, "dtype");
    INTERN(S_is_cpu, "is_cpu");
    INTERN(S_is_neg, "is_neg");
    INTERN(S_data_ptr, "data_ptr");
    INTERN(S_shape, "shape");
    INTERN(S_stride, "stride");
    INTERN(S_rows, "_rows");
    INTERN(S_step, "step");
    INTERN(S_requires_grad, "requires_grad");
    INTERN(S_layout, "layout");
    INTERN(S_detach, "detach");
    INTERN(S_is_contiguous, "is_contiguous");
    INTERN(S_clone, "clone");
    INTERN(S_contiguous, "contiguous");
    INTERN(S_nbytes, "nbytes");
    INTERN(S_tensor_bytes, "_tensor_bytes");
    INTERN(S_calls, "_calls");
    INTERN(S_open, "_open");
    INTERN(S_awaiting_grad, "_awaiting_grad");
    INTERN(S_maybe_grad, "_maybe_grad");
    INTERN(S_invocation, "_invocation");
    INTERN(S_input, "input");
    INTERN(S_output, "output");
#undef INTERN
    return 0;
}

/* The attributes and methods the lanes read off a tensor of the exact TYPES, each found once, by
 * configure_rows: the TensorBase descriptor every one of TYPES resolves the name to. Reading
 * through it skips the attribute lookup, which measured about 300 instructions a name inside a
 * model (the type's method cache misses there, and three classes' dicts are searched). Getset
 * descriptors are data descriptors, which a lookup finds before any instance attribute, so the
 * value is getattr's; a method is called as TensorBase's own, as torch's bindings call it (an
 * instance attribute of the same name, which getattr would find first, is not looked for). A name
 * whose types disagree, or whose descriptor is of another kind, keeps the lookup (NULL here). */
enum { A_DTYPE, A_REQUIRES_GRAD, A_SHAPE, A_IS_CPU, A_LAYOUT, A_NBYTES, M_IS_NEG, M_DATA_PTR, M_STRIDE, NDESCR };
enum { FIRST_METHOD = M_IS_NEG };
static PyObject *DESCR[NDESCR];
static PyObject **const DESCR_NAME[NDESCR] = {&S_dtype, &S_requires_grad, &S_shape, &S_is_cpu, &S_layout,
                                              &S_nbytes, &S_is_neg, &S_data_ptr, &S_stride};

/* DESCR[which], found in types: a new reference, or NULL (no error set): the lookup stays. */
static PyObject *find_descr(PyObject *types, int which) {
    PyObject *found = NULL;
    PyTypeObject *kind = which < FIRST_METHOD ? &PyGetSetDescr_Type : &PyMethodDescr_Type;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        /* On a type, a getset or method descriptor's __get__ gives the descriptor itself. */
        PyObject *d = PyObject_GetAttr(PyTuple_GET_ITEM(types, i), *DESCR_NAME[which]);
        if (!d) {
            PyErr_Clear();
            Py_CLEAR(found);
            return NULL;
        }
        if (!Py_IS_TYPE(d, kind) || (found && d != found)) {
            Py_DECREF(d);
            Py_CLEAR(found);
            return NULL;
        }
        Py_XSETREF(found, d);
    }
    return found;
}

/* x.<attribute> for x of one of TYPES: a new reference, or NULL with an error. */
static PyObject *tensor_attr(PyObject *x, int which) {
    PyObject *d = DESCR[which];
    return d ? Py_TYPE(d)->tp_descr_get(d, x, (PyObject *)Py_TYPE(x)) : PyObject_GetAttr(x, *DESCR_NAME[which]);
}

/* x.<method>() for x of one of TYPES. */
static PyObject *tensor_call(PyObject *x, int which) {
    PyObject *d = DESCR[which];
    return d ? PyObject_Vectorcall(d, &x, 1, NULL) : PyObject_CallMethodNoArgs(x, *DESCR_NAME[which]);
}

PyObject *rows_requires_grad(PyObject *x) { return tensor_attr(x, A_REQUIRES_GRAD); }

static PyObject *configure_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *names[] = {"types", "codes", "soft_errors", "grad_enabled", "strided", "forward_of", "sure", "maybe",
                            "stats_bit", "tensor_bit", "sure_bit", "none_bit", "maybe_trim", "maybe_kept", NULL};
    PyObject *types, *codes, *soft, *grad_enabled, *strided, *forward_of, *sure, *maybe;
    long stats_bit, tensor_bit, sure_bit, none_bit;
    Py_ssize_t maybe_trim, maybe_kept;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$O!O!OOOO!OOllllnn:configure_rows", names, &PyTuple_Type, &types,
                                     &PyDict_Type, &codes, &soft, &grad_enabled, &strided, &PyDict_Type, &forward_of,
                                     &sure, &maybe, &stats_bit, &tensor_bit, &sure_bit, &none_bit, &maybe_trim,
                                     &maybe_kept))
        return NULL;
    if (maybe_kept < 0 || maybe_trim < maybe_kept) {
        PyErr_SetString(PyExc_ValueError, "configure_rows: need 0 <= maybe_kept <= maybe_trim");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_SetString(PyExc_TypeError, "configure_rows: types must hold types");
            return NULL;
        }
    }
    if (!PyCallable_Check(grad_enabled) || stats_bit <= 0 || tensor_bit <= 0 || sure_bit <= 0 || none_bit <= 0) {
        PyErr_SetString(PyExc_TypeError, "configure_rows: grad_enabled must be callable, the bits positive");
        return NULL;
    }
    PyObject *kinds = PyDict_Values(forward_of);
    PyObject *paired = kinds ? PyFrozenSet_New(kinds) : NULL;
    Py_XDECREF(kinds);
    if (!paired) return NULL;
    Py_XSETREF(PAIRED, paired);
    set_ref(&TYPES, types);
    for (int i = 0; i < NDESCR; i++) Py_XSETREF(DESCR[i], find_descr(types, i));
    set_ref(&CODES, codes);
    set_ref(&SOFT_ERRORS, soft);
    set_ref(&GRAD_ENABLED, grad_enabled);
    set_ref(&SURE, sure);
    set_ref(&MAYBE, maybe);
    set_ref(&STRIDED, strided);
    set_ref(&FORWARD_OF, forward_of);
    MAYBE_TRIM = maybe_trim;
    MAYBE_KEPT = maybe_kept;
    STATS_BIT = stats_bit;
    TENSOR_BIT = tensor_bit;
    SURE_BIT = sure_bit;
    NONE_BIT = none_bit;
    Py_RETURN_NONE;
}

int rows_handled_type(PyObject *x) {
    if (!TYPES) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(TYPES); i++) {
        if ((PyObject *)Py_TYPE(x) == PyTuple_GET_ITEM(TYPES, i)) return 1;
    }
    return 0;
}

/* A call's result, with a soft error (one of SOFT_ERRORS) turned into NULL without an error set. */
static PyObject *soft(PyObject *result) {
    if (!result && PyErr_ExceptionMatches(SOFT_ERRORS)) PyErr_Clear();
    return result;
}

/* The statistics of x, from the checks of picklehooks._native.stats (in its order) and stats.c's
 * pass: a new reference; NULL without an error set when not handled here; NULL with one on failure.
 * The pass's own errors (a bad shape, say) are soft too, as they were when it was a Python call. */
static PyObject *stats_of(PyObject *x, PyObject *dtype, PyObject *shape) {
    PyObject *code = PyDict_GetItemWithError(CODES, dtype); /* borrowed */
    if (!code) return NULL;
    PyObject *flag = tensor_attr(x, A_IS_CPU);
    if (!flag) return NULL;
    int cpu = flag == Py_True;
    Py_DECREF(flag);
    if (!cpu) return NULL;
    if (!(flag = tensor_call(x, M_IS_NEG))) return NULL;
    int neg = flag != Py_False;
    Py_DECREF(flag);
    if (neg) return NULL;
    PyObject *ptr = soft(tensor_call(x, M_DATA_PTR));
    if (!ptr) return NULL;
    PyObject *stride = soft(tensor_call(x, M_STRIDE));
    if (!stride) {
        Py_DECREF(ptr);
        return NULL;
    }
    PyObject *stats = soft(stats_of_memory(ptr, code, shape, stride));
    Py_DECREF(ptr);
    Py_DECREF(stride);
    if (stats == Py_None) { /* empty, or data the kernel leaves to PyTorch */
        Py_DECREF(stats);
        return NULL;
    }
    return stats;
}

/* A dict attribute of the log (a borrowed reference is not enough: the attribute may be replaced). */
static PyObject *dict_attr(PyObject *log, PyObject *name) {
    PyObject *d = PyObject_GetAttr(log, name);
    if (d && !PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "next_call: log.%U is not a dict", name);
        Py_CLEAR(d);
    }
    return d;
}

/* The dict lookups of next_call: all of one key, so its hash is computed once (the key is a new
 * tuple each time, and a tuple doesn't cache its hash). CPython's *_KnownHash calls are not part
 * of its limited API (3.13 moved some out of the headers): from 3.13 on, the plain calls. */
#if PY_VERSION_HEX < 0x030D0000
#define GET_KNOWN(d, key, hash) _PyDict_GetItem_KnownHash(d, key, hash)
#define SET_KNOWN(d, key, value, hash) _PyDict_SetItem_KnownHash(d, key, value, hash)
#else
#define GET_KNOWN(d, key, hash) ((void)(hash), PyDict_GetItemWithError(d, key))
#define SET_KNOWN(d, key, value, hash) ((void)(hash), PyDict_SetItem(d, key, value))
#endif

/* kind == text for a kind string: identity first (kinds are interned constants). 1, 0, or -1. */
static int kind_is(PyObject *kind, PyObject *text) {
    if (kind == text) return 1;
    if (!PyUnicode_Check(kind)) return 0;
    int differs = PyUnicode_Compare(kind, text);
    return differs == -1 && PyErr_Occurred() ? -1 : differs == 0;
}

/* waiting.pop() for a non-empty list: a new reference. */
static PyObject *list_pop(PyObject *waiting) {
    Py_ssize_t n = PyList_GET_SIZE(waiting);
    PyObject *last = Py_NewRef(PyList_GET_ITEM(waiting, n - 1));
    if (PyList_SetSlice(waiting, n - 1, n, NULL) < 0) Py_CLEAR(last);
    return last;
}

/* Log._next_call(module, kind, path, expect), step for step (see picklehooks/capture/pairing.py): the call of a
 * new record. A new reference, or NULL with an error set. The one branch it doesn't spell out,
 * pairing an input or output with its invocation, it leaves to log._invocation. */
PyObject *rows_next_call(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *expect) {
    PyObject *key = NULL, *calls = NULL, *count = NULL, *call = NULL, *next = NULL, *table = NULL, *list = NULL,
             *open = NULL, *result = NULL;
    PyObject *forward = PyDict_GetItemWithError(FORWARD_OF, kind); /* borrowed */
    if (!forward && PyErr_Occurred()) return NULL;
    if (forward) { /* a gradient: the latest forward call awaiting one, the sure ones first */
        PyObject *fkey = PyTuple_Pack(3, module, forward, path);
        if (!fkey) return NULL;
        Py_hash_t fhash = PyObject_Hash(fkey);
        PyObject *names[2] = {S_awaiting_grad, S_maybe_grad};
        for (int i = 0; i < 2 && !result && fhash != -1; i++) {
            PyObject *waiting_table = dict_attr(log, names[i]);
            if (!waiting_table) break;
            PyObject *waiting = GET_KNOWN(waiting_table, fkey, fhash); /* borrowed */
            if (waiting && !PyList_Check(waiting)) {
                PyErr_SetString(PyExc_TypeError, "next_call: a log's waiting calls are not a list");
            } else if (waiting && PyList_GET_SIZE(waiting) > 0) {
                result = list_pop(waiting);
            }
            Py_DECREF(waiting_table);
            if (PyErr_Occurred()) break;
        }
        Py_DECREF(fkey);
        if (result || PyErr_Occurred()) return result;
    }
    if (!(key = PyTuple_Pack(3, module, kind, path)) || !(calls = dict_attr(log, S_calls))) goto done;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) goto done;
    count = GET_KNOWN(calls, key, hash);
    if (!count && PyErr_Occurred()) goto done;
    count = count ? Py_NewRef(count) : PyLong_FromLong(0);
    if (!count) goto done;
    int invocation = kind_is(kind, S_input);
    if (invocation == 0 && (invocation = kind_is(kind, S_output)) == 1) {
        if (!(open = PyObject_GetAttr(log, S_open))) goto done;
        invocation = PyObject_IsTrue(open);
    }
    if (invocation < 0) goto done;
    if (invocation) {
        PyObject *args[5] = {log, module, kind, path, count};
        if (!(call = PyObject_VectorcallMethod(S_invocation, args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)))
            goto done;
        int later = PyObject_RichCompareBool(call, count, Py_GE);
        if (later < 0) goto done;
        next = later ? PyNumber_Add(call, ONE) : Py_NewRef(count);
    } else {
        call = Py_NewRef(count);
        next = PyNumber_Add(count, ONE);
    }
    if (!next || SET_KNOWN(calls, key, next, hash) < 0) goto done;
    int expecting = PyObject_IsTrue(expect);
    if (expecting < 0) goto done;
    if (expecting) {
        int sure = expect == SURE ? 1 : PyObject_RichCompareBool(expect, SURE, Py_EQ);
        if (sure < 0 || !(table = dict_attr(log, sure ? S_awaiting_grad : S_maybe_grad))) goto done;
        PyObject *waiting = GET_KNOWN(table, key, hash); /* borrowed */
        if (!waiting) {
            if (PyErr_Occurred() || !(list = PyList_New(1))) goto done;
            PyList_SET_ITEM(list, 0, Py_NewRef(call));
            if (SET_KNOWN(table, key, list, hash) < 0) goto done;
        } else {
            if (!PyList_Check(waiting)) {
                PyErr_SetString(PyExc_TypeError, "next_call: a log's waiting calls are not a list");
                goto done;
            }
            if (PyList_Append(waiting, call) < 0) goto done;
            Py_ssize_t n = PyList_GET_SIZE(waiting);
            if (n > MAYBE_TRIM) { /* inference loops: no gradient ever comes */
                int maybe = PyObject_RichCompareBool(expect, MAYBE, Py_EQ);
                if (maybe < 0 || (maybe && PyList_SetSlice(waiting, 0, n - MAYBE_KEPT, NULL) < 0)) goto done;
            }
        }
    }
    result = Py_NewRef(call);
done:
    Py_XDECREF(key);
    Py_XDECREF(calls);
    Py_XDECREF(count);
    Py_XDECREF(call);
    Py_XDECREF(next);
    Py_XDECREF(table);
    Py_XDECREF(list);
    Py_XDECREF(open);
    return result;
}

static PyObject *next_call_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "next_call(log, module, kind, path, expect) takes 5 arguments");
        return NULL;
    }
    if (!FORWARD_OF) {
        PyErr_SetString(PyExc_RuntimeError, "next_call: configure_rows() was not called");
        return NULL;
    }
    return rows_next_call(args[0], args[1], args[2], args[3], args[4]);
}

/* A copy of x as Log._add_tensor keeps it (detached, contiguous): a new reference; NULL without an
 * error set when not handled here (not strided). */
static PyObject *copy_of(PyObject *x, int requires_grad) {
    PyObject *layout = tensor_attr(x, A_LAYOUT);
    if (!layout) return NULL;
    int strided = layout == STRIDED;
    Py_DECREF(layout);
    if (!strided) return NULL; /* sparse and mkldnn values are densified by the Python path */
    PyObject *value = requires_grad ? PyObject_CallMethodNoArgs(x, S_detach) : Py_NewRef(x);
    if (!value) return NULL;
    PyObject *contiguous = PyObject_CallMethodNoArgs(value, S_is_contiguous);
    PyObject *copy = NULL;
    if (contiguous) copy = PyObject_CallMethodNoArgs(value, contiguous == Py_True ? S_clone : S_contiguous);
    Py_XDECREF(contiguous);
    Py_DECREF(value);
    return copy;
}

PyObject *rows_add_row(PyObject *log, PyObject *module, PyObject *kind, PyObject *path, PyObject *x, long flags) {
    int want_stats = (flags & STATS_BIT) != 0, want_copy = (flags & TENSOR_BIT) != 0;
    /* Exactly one of statistics and a copy; both (mode="both") take the Python path. */
    if (!TYPES || want_stats == want_copy || !rows_handled_type(x)) Py_RETURN_FALSE;

    PyObject *dtype = NULL, *shape = NULL, *flag = NULL, *stats = NULL, *copy = NULL, *call = NULL, *step = NULL,
             *rows = NULL, *row = NULL, *nbytes = NULL, *result = NULL;
    if (!(flag = PyObject_GetAttr(log, S_keep_graph))) goto done;
    int keep = PyObject_IsTrue(flag);
    Py_CLEAR(flag);
    if (keep) {
        if (keep > 0) result = Py_NewRef(Py_False);
        goto done;
    }
    if (!(dtype = tensor_attr(x, A_DTYPE)) || !(flag = tensor_attr(x, A_REQUIRES_GRAD)))
        goto done;
    if (!(shape = soft(tensor_attr(x, A_SHAPE)))) { /* nested tensors have none */
        if (!PyErr_Occurred()) result = Py_NewRef(Py_False);
        goto done;
    }
    int requires_grad = flag == Py_True;
    Py_CLEAR(flag);
    PyObject *kept = want_stats ? (stats = stats_of(x, dtype, shape)) : (copy = copy_of(x, requires_grad));
    if (!kept) {
        if (!PyErr_Occurred()) result = Py_NewRef(Py_False);
        goto done;
    }

    /* Handled from here on: number the call, count a copy's bytes, append the row. */
    PyObject *expect = NONE_EXPECTED; /* borrowed */
    int paired = PySet_Contains(PAIRED, kind);
    if (paired < 0) goto done;
    if (paired && (flags & (SURE_BIT | NONE_BIT))) {
        expect = flags & SURE_BIT ? SURE : NONE_EXPECTED;
    } else if (paired && requires_grad) {
        expect = SURE;
    } else if (paired) {
        if (!(flag = PyObject_CallNoArgs(GRAD_ENABLED))) goto done;
        expect = flag == Py_True ? NONE_EXPECTED : MAYBE;
    }
    if (!(call = rows_next_call(log, module, kind, path, expect)) ||
        !(step = PyObject_GetAttr(log, S_step)) || !(rows = PyObject_GetAttr(log, S_rows)))
        goto done;
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "add_row: log._rows is not a list");
        goto done;
    }
    if (copy) { /* log._tensor_bytes += x.nbytes */
        PyObject *bytes = tensor_attr(x, A_NBYTES);
        PyObject *total = bytes ? PyObject_GetAttr(log, S_tensor_bytes) : NULL;
        nbytes = total ? PyNumber_Add(total, bytes) : NULL;
        Py_XDECREF(bytes);
        Py_XDECREF(total);
        if (!nbytes || PyObject_SetAttr(log, S_tensor_bytes, nbytes) < 0) goto done;
    }
    if (!(row = PyTuple_Pack(11, module, kind, path, call, step, shape, dtype, stats ? stats : Py_None, Py_None,
                             copy ? copy : Py_None, Py_None)) ||
        PyList_Append(rows, row) < 0)
        goto done;
    result = Py_NewRef(Py_True);
done:
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(flag);
    Py_XDECREF(stats);
    Py_XDECREF(copy);
    Py_XDECREF(call);
    Py_XDECREF(step);
    Py_XDECREF(rows);
    Py_XDECREF(row);
    Py_XDECREF(nbytes);
    return result;
}

static PyObject *add_row_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "add_row(log, module, kind, path, x, flags) takes 6 arguments");
        return NULL;
    }
    long flags = PyLong_AsLong(args[5]);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    return rows_add_row(args[0], args[1], args[2], args[3], args[4], flags);
}

static PyMethodDef rows_functions[] = {
    {"configure_rows", (PyCFunction)(void (*)(void))configure_rows, METH_VARARGS | METH_KEYWORDS,
     "configure_rows($module, /, *, types, codes, soft_errors, grad_enabled, strided, forward_of, sure, maybe,\n"
     "               stats_bit, tensor_bit, sure_bit, none_bit, maybe_trim, maybe_kept)\n--\n\n"
     "What add_row and next_call check and write (see the top of csrc/rows.c)."},
    {"add_row", (PyCFunction)(void (*)(void))add_row_py, METH_FASTCALL,
     "add_row($module, log, module, kind, path, x, flags, /)\n--\n\n"
     "Record x's statistics or a copy of it as Log._add_tensor would and return True, or return False\n"
     "having done nothing."},
    {"next_call", (PyCFunction)(void (*)(void))next_call_py, METH_FASTCALL,
     "next_call($module, log, module, kind, path, expect, /)\n--\n\n"
     "Log._next_call, in C: the record's call number (what add_row numbers with)."},
    {NULL, NULL, 0, NULL},
};

int rows_init(PyObject *m) {
    if (intern_names() < 0 || !(ONE = PyLong_FromLong(1)) || !(NONE_EXPECTED = PyLong_FromLong(0))) return -1;
    return PyModule_AddFunctions(m, rows_functions);
}
