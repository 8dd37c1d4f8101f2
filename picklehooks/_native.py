"""The switch between picklehooks' optional C extension, ``picklehooks._speedups``, and its
pure-Python twin, and the functions the rest of picklehooks calls to use whichever is on.

Pinned runtime module: torch.package archives copy it, and the hook runtime
(:mod:`picklehooks._hookrt`, :mod:`picklehooks._taps`), :mod:`picklehooks._ops` and the
row-writing path (:mod:`picklehooks.capture.rows`) call :func:`stats`, :func:`row_lane`,
:func:`record_builder`, :func:`hook_lane`, :func:`register_active`, :func:`set_recording`
and :data:`AVAILABLE` by these names (:func:`same_tree`, for the surgery check, is newer).

**The switch.** ``_speedups`` (built from ``csrc/`` by setup.py, optionally) is used
where it imports, unless ``PICKLEHOOKS_NATIVE=0`` is in the environment (read once, at
import): then, and where it didn't compile, and in a copy of this module inside a
``torch.package`` archive (archives hold Python source only), :class:`_twin` is used
instead, and :data:`AVAILABLE` is ``False``. Importing this module works either way.

**The twin** has every name the extension exports, with the same signature (C
functions carry theirs as text signatures; tests/test_native_twin.py compares them).
Each C function either does its work or declines, answering ``None``, ``False`` or
``NotImplemented`` and leaving the work to its caller's Python code. The twin declines
wherever the C may, because that caller's code *is* the Python way to do it: without
the extension a log records exactly what it recorded before there was a twin. Where the
C can't decline (``next_call``, ``build_records``, ``GradRecorder``), the twin does the
work, as the Python code it replaces does it. With the twin on, :func:`row_lane` and
:func:`hook_lane` return ``None`` instead of its ``add_row`` and ``forward_lane``, which
only decline, and the callers skip the call and use their own Python path (and the
hook runtime's own gradient recorder, the twin's ``GradRecorder`` to the letter): an idle
eager hook measured 400 ns without the twin's ``forward_lane`` in front of it and 670 ns
with it. The tests hold each implementation's lanes to the callers' Python paths
through ``_impl``, the implementation in use.

**The pieces** (csrc/_speedups.h lists the C files, in dependency order):

:func:`stats` returns the :data:`~picklehooks._stats.STAT_NAMES` values of a
tensor, read where it lies (no copy, no PyTorch kernel), or ``None`` when it
can't, and the caller then uses :mod:`picklehooks._stats`. The values come as
one ``_speedups.Stats``: a read-only sequence of the nine floats that compares
equal to their tuple and pickles and copies as one (a log keeps one per
record until read, and one object costs less than ten). It is meant to be
called from inside a hook, once per recorded tensor, so it does as few
Python-level lookups as it can. The twin reads no dtype (its ``DTYPE_CODES``
is empty), so :func:`stats` is ``None`` for every tensor without the extension:
statistics are then PyTorch's, reduced in batches on the tensor's device.

Semantics are those of :func:`picklehooks._stats.tensor_stats`: ``std`` is the
population standard deviation; a tensor containing NaN has NaN ``mean``,
``std``, ``min``, ``max``, ``absmax`` and ``norm``; one containing Inf (and
no NaN) has a NaN ``std``, an infinite ``norm`` and a ``mean`` of +-Inf
(NaN when both signs occur). ``nan`` and ``inf`` are counts, as floats.
Elements that a view repeats (stride 0, ``expand``) count as often as they
appear, as in PyTorch; ``zero_frac`` is ``zeros / n`` (the PyTorch path's
``1 - nonzero / n`` can differ in the last bit). Sums are accumulated in
float64, shifted by the first element of each chunk of 4096 and merged with
Chan's formula, so ``mean``, ``std`` and ``norm`` of finite
float32/float16/bfloat16 input are finite and within about 1e-11 relative
of exact arithmetic on the same values, as close as PyTorch's float64
reductions (a mean near 0: relative to the largest magnitude), including
``finfo(float32).min``-filled attention masks and data whose mean is far
larger than its spread; min, max, absmax and the counts are exact.

``None`` for anything it doesn't handle: the extension missing or disabled,
a tensor not on the CPU (or meta), a dtype other than float32, float64,
float16 and bfloat16, an empty tensor, a tensor subclass (FakeTensor,
DTensor, jagged nested tensors; ``nn.Parameter`` is accepted), a tensor
without plain strided storage (sparse, mkldnn, nested, quantized, functorch's
vmap/grad wrappers), a negative-bit view (``z.conj().imag``; complex
tensors, and so conjugate views, are refused by dtype), a misaligned or null
pointer, more than 64 dimensions, and float64 data whose largest magnitude
is beyond 2**450 or below 2**-400 (squares there could overflow or lose
digits; the PyTorch path scales by a power of two).

Limits: the memory is read without the GIL for tensors of 65536 elements or
more; another thread writing the tensor meanwhile gives statistics of a mix
of old and new values, and one that frees its storage (``resize_``) meanwhile
is undefined behaviour, as it is for PyTorch's own kernels. A tensor whose
storage was freed under it (``untyped_storage().resize_(0)``, as FSDP does)
is refused only when its address is in the first page (zero storage
offset); otherwise reading it is as unsafe as ``x.sum()``.

:func:`row_lane` configures and returns ``add_row``: the common cases of
``Log._add_tensor`` in one C call (statistics only: the checks of :func:`stats`
and the native pass; or a copy only, for ``mode="tensor"``; then the call
number and the row), which returns ``False``, having done nothing, for
anything else; it numbers calls in C (``next_call``, ``Log._next_call`` step
for step). :func:`hook_lane` configures and returns the hook path in front of
it (csrc/hooks.c): ``_hookrt.forward``'s eager body for a plain output (and,
for torch.nn's own leaf modules, the hook on its gradient), and the tensor hook
that records a gradient. Inside a model
the C lanes measured about 2 µs less per statistics record than the same
steps in Python, and 6 µs less for a copy and its gradient
(``bench/bench_record_path.py``). :func:`record_builder` configures and
returns the reading side, ``build_records``: the Records of a log's rows,
built in one call.

:func:`same_tree` tells whether an instrumented model's module tree is still the one
:mod:`picklehooks.capture.tree` fingerprinted (``record()`` asks as each block starts), or
``None`` where only the caller's Python walk can tell (the twin always says ``None``).

:func:`register_active` registers the C kernel of the ``active`` op
(csrc/kernels.c) through libtorch's stable C shim, found with :mod:`ctypes`
(no torch headers at build time; where a torch lacks those functions, on
Windows, and with the twin, which has no kernel, the op keeps its Python
kernel), and :func:`set_recording` sets what it answers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
from collections.abc import Sequence

import torch


class _twin:  # noqa: N801 -- stands in for the extension module: its names are the module's
    """The pure-Python twin of ``picklehooks._speedups``: every name it exports, with its signature.

    Declines (``None``, ``False``, ``NotImplemented``) wherever the C may, so that the
    caller's Python code does the work as it always has; does the work where the C
    can't decline. Configuration lives in class attributes, as the C keeps it in statics.
    """

    DTYPE_CODES: dict[str, int] = {}  # the dtypes stats() reads: none
    ACTIVE = 0  # the address of the active op's kernel: none (the op keeps its Python kernel)
    Stats = tuple  # what a C Stats compares equal to, and pickles and copies as

    _recording: list | None = None  # configure_hooks(): the logs recording anywhere
    _guard_bit = 0
    _fallback = None  # the Python gradient recorder (name, kind, path, flags, grad)
    _record = None  # configure_records(): the Record type and how dtypes are named
    _dtype_name = None
    _flag = False  # what set_recording() said last

    @staticmethod
    def stats(ptr, dtype_code, sizes, strides, /):
        """``None``: not handled here, as C's answer for what it doesn't read (the caller reduces with PyTorch)."""
        return None

    @staticmethod
    def configure_rows(*, types, codes, soft_errors, grad_enabled, strided, forward_of, sure, maybe, stats_bit,
                       tensor_bit, sure_bit, none_bit, maybe_trim, maybe_kept):
        """Nothing to keep: :meth:`add_row` declines everything, :meth:`next_call` asks the log."""

    @staticmethod
    def add_row(log, module, kind, path, x, flags, /):
        """``False``, having done nothing: ``Log._add_tensor``'s Python path records ``x``."""
        return False

    @staticmethod
    def next_call(log, module, kind, path, expect, /):
        """The record's call number: ``Log._next_call``, which the C spells out step for step."""
        return log._next_call(module, kind, path, expect)

    @staticmethod
    def configure_hooks(*, recording, active, graph_task_id, tensor, name_attr, fallback, backward_hooks, hook_key,
                        has_torch_function, functorch_active, value_bit, grad_bit, guard_bit, none_bit, sure_bit):
        """Keep what :meth:`forward_lane` and :class:`GradRecorder` use: the logs, the guard bit, the fallback."""
        _twin._recording, _twin._guard_bit, _twin._fallback = recording, guard_bit, fallback

    @staticmethod
    def forward_lane(module, output, flags, inputs=None, /):
        """``None`` while nothing records and no guard is asked for (the hook is done), else
        ``NotImplemented``: ``_hookrt.forward`` goes on in Python."""
        recording = _twin._recording
        if recording is not None and not recording and not flags & _twin._guard_bit:
            return None
        return NotImplemented

    class GradRecorder:
        """A tensor hook recording a gradient: hands it to the fallback ``configure_hooks`` was given."""

        __slots__ = ("name", "kind", "path", "flags")

        def __init__(self, name, kind, path, flags):
            if not (isinstance(name, str) and isinstance(kind, str) and isinstance(path, str)
                    and isinstance(flags, int)):
                raise TypeError(f"GradRecorder({name!r}, {kind!r}, {path!r}, {flags!r}): give three str and an int")
            self.name, self.kind, self.path, self.flags = name, kind, path, flags

        def __call__(self, grad, /):
            if _twin._fallback is None:
                raise RuntimeError("GradRecorder: configure_hooks() was not called")
            return _twin._fallback(self.name, self.kind, self.path, self.flags, grad)

    @staticmethod
    def configure_records(*, record, fields, dtype_name):
        """Keep the Record type and ``dtype_name`` for :meth:`build_records`."""
        _twin._record, _twin._dtype_name = record, dtype_name

    @staticmethod
    def build_records(rows, n, rank, /):
        """A Record for each of ``rows[:n]``, as ``Log._records_now``'s loop builds them."""
        record, dtype_name = _twin._record, _twin._dtype_name
        if record is None:
            raise RuntimeError("build_records: configure_records() was not called")
        if not isinstance(rows, list) or not 0 <= n <= len(rows):
            raise ValueError("build_records: rows must be a list of at least n rows")
        try:
            # Positional: Record's field order (module ... step, shape, dtype, tensor, value, live, rank, _stats, _src).
            return [record(module, kind, path, call, step, tuple(shape), dtype_name(dtype), tensor, None, live, rank,
                           None, src if stats is None else stats)
                    for module, kind, path, call, step, shape, dtype, stats, src, tensor, live in rows[:n]]
        except (TypeError, ValueError) as error:  # unpacking: a row that isn't an 11-tuple
            if all(type(row) is tuple and len(row) == 11 for row in rows[:n]):
                raise
            raise TypeError("build_records: a log's row is not an 11-tuple") from error

    @staticmethod
    def set_recording(flag, /):
        """Keep ``flag``: there is no C kernel to tell."""
        _twin._flag = bool(flag)

    @staticmethod
    def same_tree(model, tree, /):
        """``None``: not decided here (the caller compares the fingerprints in Python)."""
        return None


# The names the extension must have, all of the twin's: a build without one of them (a stale
# build of an older version) counts as none.
_NAMES = tuple(name for name in vars(_twin) if not name.startswith("_"))

# importlib rather than ``from . import _speedups``: torch.package's exporter (and
# picklehooks' own copying of runtime modules into archives) follows import
# statements, and an extension module can't go into an archive. A copy of this
# file inside an archive (its name is mangled, its __package__ is not) stays
# off rather than reach the host's _speedups: the two may be different versions,
# and a kernel reading raw memory must not be called with the wrong arguments.
try:
    if __name__.startswith("<torch_package_"):
        raise ImportError("picklehooks._speedups is not used from inside a torch.package archive")
    _speedups = importlib.import_module("._speedups", __package__)
    if not all(hasattr(_speedups, name) for name in _NAMES):
        raise ImportError("a stale build of picklehooks._speedups")
except ImportError:  # not built (no compiler), stale, or inside a torch.package archive
    _speedups = None

#: Whether the C extension is in use (it imported, and ``PICKLEHOOKS_NATIVE=0`` didn't turn it off).
AVAILABLE: bool = _speedups is not None and os.environ.get("PICKLEHOOKS_NATIVE", "1").strip() != "0"
# The implementation everything below calls: the extension, or its twin.
_impl = _speedups if AVAILABLE else _twin

# Exact types only: a subclass may keep no data (FakeTensor) or other data than data_ptr() shows.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
# What stats() takes for "not handled" when data_ptr() or stride() raises (no plain strided storage).
_SOFT_ERRORS = (RuntimeError, ValueError, TypeError, OverflowError, NotImplementedError)
# dtype -> the implementation's code for it; the dtypes it doesn't read (all, for the twin) are absent.
_CODES = {getattr(torch, name): code for name, code in _impl.DTYPE_CODES.items()}
_get_code = _CODES.get
_kernel = _impl.stats


def stats(x: torch.Tensor) -> Sequence[float] | None:
    """The 9 :data:`~picklehooks._stats.STAT_NAMES` values of ``x``, or ``None`` (see the module docstring)."""
    if type(x) not in _PLAIN:
        return None
    code = _get_code(x.dtype)
    if code is None or not x.is_cpu or x.is_neg():
        return None
    try:
        # data_ptr() raises for tensors without plain storage (sparse, functorch
        # wrappers), stride() for nested ones; an empty tensor gives None in C.
        return _kernel(x.data_ptr(), code, x.shape, x.stride())
    except _SOFT_ERRORS:
        return None


def row_lane(*, forward_of: dict, sure: int, maybe: int, stats_bit: int, tensor_bit: int, sure_bit: int,
             none_bit: int, maybe_trim: int, maybe_kept: int):
    """``add_row``, configured with the row format's constants; ``None`` with the twin (see the module docstring).

    The row-writing path calls this once at import with its own constants:
    ``forward_of`` maps a gradient's kind to the forward kind it pairs with,
    ``sure``/``maybe`` are what ``_next_call`` takes as ``expect`` for a gradient that
    will come or may come, ``stats_bit`` and ``tensor_bit`` are the flags asking for
    statistics and for a copy, ``sure_bit`` and ``none_bit`` the flags saying a value's
    gradient will be recorded or won't (which decide ``expect`` where set, as in
    ``_expects_grad``); ``maybe_trim`` and ``maybe_kept`` are ``_next_call``'s, which the
    lane does in C (``next_call``); the kinds a gradient pairs with are ``forward_of``'s
    values, and no gradient is ``expect`` 0. The tensor side (types, dtype codes,
    soft errors) is this module's, so both paths check tensors alike.
    """
    _impl.configure_rows(types=tuple(_PLAIN), codes=_CODES, soft_errors=_SOFT_ERRORS,
                         grad_enabled=torch.is_grad_enabled, strided=torch.strided, forward_of=forward_of, sure=sure,
                         maybe=maybe, stats_bit=stats_bit, tensor_bit=tensor_bit, sure_bit=sure_bit,
                         none_bit=none_bit, maybe_trim=maybe_trim, maybe_kept=maybe_kept)
    return _impl.add_row if AVAILABLE else None


_RECORD_FIELDS = ("module", "kind", "path", "call", "step", "shape", "dtype", "tensor", "value", "live", "rank",
                  "_stats", "_src", "source")


def record_builder(record: type, dtype_name):
    """``build_records``, configured to build ``record``s, or ``None`` for a ``record`` it can't build.

    The row-writing path calls this once at import with its ``Record`` and
    ``dtype_name``. ``build_records(rows, n, rank)`` returns the Records that
    ``Log._records_now``'s Python loop would build from ``rows[:n]``; the C fills
    each new instance's slots without running ``__init__``, so it is ``None``
    (the loop stays) unless ``record`` is a dataclass whose fields are exactly
    the thirteen the rows fill, in that order, each a slot of ``record`` itself
    (not of a base class), with no ``__post_init__``.
    """
    if not dataclasses.is_dataclass(record) or hasattr(record, "__post_init__") \
            or tuple(f.name for f in dataclasses.fields(record)) != _RECORD_FIELDS:
        return None
    try:
        _impl.configure_records(record=record, fields=_RECORD_FIELDS, dtype_name=dtype_name)
    except TypeError:  # the C's refusal: a field that isn't a plain writable slot of record's own
        return None
    return _impl.build_records


def hook_lane(*, recording: list, active, graph_task_id, name_attr: str, fallback, hook_key: str, value_bit: int,
              grad_bit: int, guard_bit: int, none_bit: int, sure_bit: int):
    """``(forward_lane, GradRecorder)``, configured; ``None`` with the twin (see the module docstring).

    The hook runtime (:mod:`picklehooks._taps`) calls this once at import with its own state
    and constants: ``recording`` the list of logs recording anywhere,
    ``active`` the context variable of the log recording here,
    ``graph_task_id`` autograd's current graph task (-1 outside backward),
    ``name_attr`` the attribute naming an instrumented module, ``fallback``
    the Python gradient recorder ``(name, kind, path, flags, grad)``, ``hook_key``
    the key under which the forward lane puts its recorder in a tensor's hook dict
    (as ``_taps._hook_grad`` does), and the flag bits (``none_bit`` and ``sure_bit``:
    what the forward lane adds to a value that requires grad when it hooks no
    gradient, and when it does). Both lanes record through
    :func:`row_lane`'s ``add_row``, so this needs :func:`row_lane` called first
    (the row-writing path does, on import); before that they hand everything to Python.
    """
    _impl.configure_hooks(recording=recording, active=active, graph_task_id=graph_task_id, tensor=torch.Tensor,
                          name_attr=name_attr, fallback=fallback,
                          backward_hooks=torch.nn.modules.module._global_backward_hooks, hook_key=hook_key,
                          has_torch_function=torch._C._has_torch_function_unary,
                          functorch_active=torch._C._are_functorch_transforms_active, value_bit=value_bit,
                          grad_bit=grad_bit, guard_bit=guard_bit, none_bit=none_bit, sure_bit=sure_bit)
    return (_impl.forward_lane, _impl.GradRecorder) if AVAILABLE else None


# libtorch's file names on Linux, macOS and Windows; the stable C shim's functions are in it.
_LIBTORCH_CPU = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")
_LIBRARY_HANDLES: list = []  # the torch::Library objects of the kernels registered here, never freed


def _library_functions():
    """The imported torch's ``aoti_torch_library_init_impl`` and ``aoti_torch_library_impl``, or ``None``."""
    # RTLD_NOLOAD: only the libtorch this process has loaded already (a second copy would have
    # a dispatcher of its own). Windows has no such flag: there the Python kernel stays.
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return None
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in _LIBTORCH_CPU:
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            libtorch = ctypes.CDLL(path, mode=no_load | getattr(os, "RTLD_LAZY", 1))
            init, impl = libtorch.aoti_torch_library_init_impl, libtorch.aoti_torch_library_impl
        except (OSError, AttributeError):  # not this process's libtorch, or too old for the shim
            return None
        init.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32,
                         ctypes.POINTER(ctypes.c_void_p)]
        impl.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        init.restype = impl.restype = ctypes.c_int32
        return init, impl
    return None


def register_active(namespace: str, dispatch_key: str) -> bool:
    """Register the C kernel of ``namespace::active`` at ``dispatch_key``; whether it did.

    Through libtorch's stable C shim, so no torch headers at build time (see
    csrc/kernels.c). The op, ``active(int flags) -> bool``, must be defined
    already, with no kernel at that key. The kernel answers what the last
    :func:`set_recording` said, so the caller must call that each time a log
    starts or stops. ``False``, having registered nothing, where the twin is on
    (it has no kernel) or the shim's functions are missing; the caller then
    registers its Python kernel. The registration lasts as long as the process.
    """
    if not _impl.ACTIVE:
        return False
    functions = _library_functions()
    if functions is None:
        return False
    init, impl = functions
    handle = ctypes.c_void_p()
    # The file and line are what torch._C._dispatch_dump shows as where the kernel came from.
    if init(namespace.encode(), dispatch_key.encode(), b"csrc/kernels.c", 1, ctypes.byref(handle)) != 0:
        return False
    if impl(handle, b"active", _impl.ACTIVE) != 0:
        return False  # (the empty Library object is kept: freeing it is as harmless as keeping it)
    _LIBRARY_HANDLES.append(handle)  # freeing it would remove the kernel
    return True


def set_recording(flag: bool) -> None:
    """What the C kernel of ``active`` answers from now on (whether any log records)."""
    _impl.set_recording(flag)


def same_tree(model, tree: list) -> bool | None:
    """Whether ``picklehooks.capture.tree._fingerprint(model) == tree``, walked in C without building
    the new fingerprint; ``None`` where the caller must compare in Python (the twin, always)."""
    return _impl.same_tree(model, tree)
