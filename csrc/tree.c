/* picklehooks._speedups, part six (depends on no other part): whether an instrumented model's
 * module tree is still the one it was instrumented as.
 *
 *   same_tree(model, tree) -> True, False, or None
 *       Whether picklehooks.capture.tree._fingerprint(model) == tree, without building the new
 *       fingerprint: the same depth-first walk over each module's _modules dict (every module's
 *       id(), then the key of each child that isn't None, children pushed in order and popped
 *       last first), compared with tree's items as it goes. None, having decided nothing, for
 *       what the walk can't read the way Python does without running Python code: a module
 *       whose instance dict has no _modules entry, or one that is neither exactly a dict nor
 *       exactly an OrderedDict (a subclass may iterate as it likes), a key that is not exactly a str, and a
 *       tree that is not a list, or holds something other than an int or a str where the walk
 *       gets to it. The caller then compares in Python.
 *
 * Why: record() runs the check as each block starts, for every live instrumentation. The
 * Python walk measured 10 us on the bench's 37-module MLP with warm caches, and 28 to 45 us
 * right after a forward pass, where the bytecode, the branch predictors and the module dicts
 * are cold; this walk reads the same dicts with a fraction of the instructions.
 *
 * The walk holds a reference to each module it has yet to visit: materialising an instance
 * dict may allocate, an allocation may run the garbage collector, and that may run finalisers.
 */
#include "_speedups.h"

static PyObject *S_modules;

/* The _modules dict of module: a new reference; NULL without an error set where the walk can't
 * read it (the caller answers None); NULL with one on failure. */
static PyObject *children_of(PyObject *module) {
    PyObject *dict = PyObject_GenericGetDict(module, NULL);
    if (!dict) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear(); /* no instance dict */
        return NULL;
    }
    PyObject *children = PyDict_GetItemWithError(dict, S_modules); /* borrowed */
    Py_XINCREF(children);
    Py_DECREF(dict);
    if (children && !PyDict_CheckExact(children) && !PyODict_CheckExact(children)) Py_CLEAR(children);
    return children;
}

/* The next (key, child) of children in the order of children.items(): a dict's by PyDict_Next, an
 * OrderedDict's (ModuleList.__delitem__ leaves one) by its iterator, which is C, as are its exact
 * str keys' hashes. 1 with borrowed references set, 0 at the end, -1 with an error set. */
static int next_child(PyObject *children, PyObject *keys, Py_ssize_t *pos, PyObject **key, PyObject **child) {
    if (!keys) return PyDict_Next(children, pos, key, child);
    PyObject *next = PyIter_Next(keys);
    if (!next) return PyErr_Occurred() ? -1 : 0;
    *key = next;
    *child = PyDict_GetItemWithError(children, next); /* borrowed; children holds the key too */
    Py_DECREF(next);
    if (!*child) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "same_tree: a module's _modules changed");
        return -1;
    }
    return 1;
}

/* 1 if item (a fingerprint's entry) is the module's id(), 0 if not (a str is a key), -1 if it is
 * neither an int nor a str (what Python would compare it with is anyone's guess: 1.0 == 1). */
static int is_id_of(PyObject *item, PyObject *module) {
    if (!PyLong_CheckExact(item)) return PyUnicode_CheckExact(item) ? 0 : -1;
    void *address = PyLong_AsVoidPtr(item);
    if (!address && PyErr_Occurred()) {
        PyErr_Clear();
        return 0; /* no address a module can have */
    }
    return address == (void *)module;
}

/* 1 if item is the key, 0 if not (an int is a module's id), -1 if the key is not exactly a str or
 * item neither an int nor a str. */
static int is_key(PyObject *item, PyObject *key) {
    if (!PyUnicode_CheckExact(key)) return -1;
    if (item == key) return 1;
    if (!PyUnicode_CheckExact(item)) return PyLong_CheckExact(item) ? 0 : -1;
    return PyUnicode_Compare(item, key) == 0; /* exact strs: no error, no Python code */
}

static PyObject *same_tree(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_tree(model, tree) takes 2 arguments");
        return NULL;
    }
    PyObject *tree = args[1];
    if (!PyList_CheckExact(tree)) Py_RETURN_NONE;
    Py_ssize_t capacity = 64, depth = 0, at = 0, n = PyList_GET_SIZE(tree);
    PyObject **stack = PyMem_New(PyObject *, capacity);
    if (!stack) return PyErr_NoMemory();
    PyObject *answer = Py_False; /* borrowed: Py_True, Py_False, Py_None, or NULL for an error */
    stack[depth++] = Py_NewRef(args[0]);
    while (depth > 0) {
        PyObject *module = stack[--depth]; /* owned from here */
        int same = at < n ? is_id_of(PyList_GET_ITEM(tree, at), module) : 0;
        at++;
        PyObject *children = same == 1 ? children_of(module) : NULL;
        Py_DECREF(module);
        if (same != 1) {
            answer = same == 0 ? Py_False : Py_None;
            goto done;
        }
        if (!children) {
            answer = PyErr_Occurred() ? NULL : Py_None;
            goto done;
        }
        PyObject *keys = PyDict_CheckExact(children) ? NULL : PyObject_GetIter(children);
        if (!keys && PyErr_Occurred()) {
            Py_DECREF(children);
            answer = NULL;
            goto done;
        }
        PyObject *key, *child;
        Py_ssize_t pos = 0;
        int more;
        while ((more = next_child(children, keys, &pos, &key, &child)) == 1) {
            if (child == Py_None) continue;
            int match = at < n ? is_key(PyList_GET_ITEM(tree, at), key) : 0;
            at++;
            if (match != 1) {
                answer = match == -1 ? Py_None : Py_False;
                break;
            }
            if (depth == capacity) {
                PyObject **bigger = PyMem_Resize(stack, PyObject *, capacity * 2);
                if (!bigger) {
                    PyErr_NoMemory();
                    more = -1;
                    break;
                }
                stack = bigger;
                capacity *= 2;
            }
            stack[depth++] = Py_NewRef(child);
        }
        Py_XDECREF(keys);
        Py_DECREF(children);
        if (more == -1) answer = NULL;
        if (more != 0) goto done;
    }
    answer = at == n ? Py_True : Py_False;
done:
    while (depth > 0) Py_DECREF(stack[--depth]);
    PyMem_Free(stack);
    return answer ? Py_NewRef(answer) : NULL;
}

static PyMethodDef tree_functions[] = {
    {"same_tree", (PyCFunction)(void (*)(void))same_tree, METH_FASTCALL,
     "same_tree($module, model, tree, /)\n--\n\n"
     "Whether model's module tree is the one its fingerprint tree describes; None where only Python can tell."},
    {NULL, NULL, 0, NULL},
};

int tree_init(PyObject *m) {
    if (!(S_modules = PyUnicode_InternFromString("_modules"))) return -1;
    return PyModule_AddFunctions(m, tree_functions);
}
