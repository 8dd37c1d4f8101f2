/* picklehooks._speedups, part five (depends on no other part): kernels that PyTorch's dispatcher
 * calls without Python.
 *
 *   ACTIVE                the address of the boxed kernel of picklehooks::active(int flags) -> bool
 *   set_recording(flag)   what that kernel answers from now on: whether any log records
 *
 * Why: every hook of a scripted instrumented model first asks picklehooks::active whether any
 * log records, and returns at once when none does. With a Python kernel that question costs about
 * 0.8 µs above an empty scripted function per hook, since TorchScript's interpreter takes the GIL
 * and enters Python for it; this kernel reads one int (0.16 µs above it).
 * picklehooks._native.register_active registers it with libtorch's stable C shim
 * (aoti_torch_library_init_impl and aoti_torch_library_impl, plain C functions looked up with
 * ctypes), so this file needs no torch headers and builds with the rest of the package;
 * picklehooks._ops keeps the Python kernel where that fails (no build, a torch whose shim lacks
 * them, Windows, PICKLEHOOKS_NATIVE=0, a torch.package archive). picklehooks._ops adds
 * set_recording to picklehooks._state._ON_CHANGE, which _state calls under its lock each time a
 * log starts or stops, so the answer is that of bool(picklehooks._state._ANYWHERE).
 *
 * A boxed kernel gets the op's arguments as a stack of 64-bit StableIValues (the int64 flags here,
 * unused) and writes its returns at the bottom of it; a bool is stored as torch's stable headers
 * store it (stableivalue_conversions.h: the value's bytes copied into the low-order end of a zeroed
 * word). The kernel runs in whatever thread calls the op, without the GIL: the flag is read and
 * written atomically where the compiler offers it.
 */
#include "_speedups.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

static int recording; /* whether any log records anywhere in the process */

#if defined(__GNUC__) || defined(__clang__)
#define LOAD_FLAG() __atomic_load_n(&recording, __ATOMIC_RELAXED)
#define STORE_FLAG(v) __atomic_store_n(&recording, (v), __ATOMIC_RELAXED)
#else /* MSVC: aligned int reads and writes are atomic on its targets */
#define LOAD_FLAG() (*(volatile int *)&recording)
#define STORE_FLAG(v) (*(volatile int *)&recording = (v))
#endif

static void active_kernel(uint64_t *stack, uint64_t num_args, uint64_t num_outputs) {
    (void)num_args;
    (void)num_outputs;
    bool answer = LOAD_FLAG() != 0;
    uint64_t word = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    memcpy((unsigned char *)&word + sizeof word - sizeof answer, &answer, sizeof answer);
#else
    memcpy(&word, &answer, sizeof answer);
#endif
    stack[0] = word;
}

static PyObject *set_recording(PyObject *self, PyObject *flag) {
    (void)self;
    int value = PyObject_IsTrue(flag);
    if (value < 0) return NULL;
    STORE_FLAG(value);
    Py_RETURN_NONE;
}

static PyMethodDef kernels_functions[] = {
    {"set_recording", set_recording, METH_O,
     "set_recording($module, flag, /)\n--\n\nWhat picklehooks::active answers from now on."},
    {NULL, NULL, 0, NULL},
};

int kernels_init(PyObject *m) {
    if (PyModule_AddFunctions(m, kernels_functions) < 0) return -1;
    PyObject *address = PyLong_FromVoidPtr((void *)(uintptr_t)&active_kernel);
    if (!address || PyModule_AddObject(m, "ACTIVE", address) < 0) {
        Py_XDECREF(address);
        return -1;
    }
    return 0;
}
