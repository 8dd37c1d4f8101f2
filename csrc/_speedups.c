/* picklehooks._speedups: the optional C extension of picklehooks, one module made of the parts
 * listed in _speedups.h (statistics, the record lane, the hook lane, reading, the active kernel,
 * the tree check).
 *
 * Only picklehooks/_native.py imports it; that module also holds its pure-Python twin (the same
 * names, the same signatures), which it uses instead where the extension isn't built, inside a
 * torch.package archive, and with PICKLEHOOKS_NATIVE=0 in the environment. The parts call each
 * other as C functions, never through Python.
 */
#include "_speedups.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "The optional C speed-ups of picklehooks (see picklehooks._native, which also holds their Python twin).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (stats_init(m) < 0 || rows_init(m) < 0 || hooks_init(m) < 0 || records_init(m) < 0 ||
              kernels_init(m) < 0 || tree_init(m) < 0))
        Py_CLEAR(m);
    return m;
}
