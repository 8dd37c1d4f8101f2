"""The statistics of one CPU tensor in one pass over its memory, by the C extension ``_fstats``;
and the eager record lane built on it, by ``_frow``.

:func:`stats` returns the :data:`~picklehooks._stats.STAT_NAMES` values of a
tensor, read where it lies (no copy, no PyTorch kernel), or ``None`` when it
can't, and the caller then uses :mod:`picklehooks._stats`. The values come as
one ``_fstats.Stats``: a read-only sequence of the nine floats that compares
equal to their tuple and pickles and copies as one (a log keeps one per
record until read, and one object costs less than ten). It is meant to be
called from inside a hook, once per recorded tensor, so it does as few
Python-level lookups as it can.

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

:func:`row_lane` configures and returns ``_frow.add_row``: the common
cases of ``picklehooks.log.Log._add_tensor`` in one C call (statistics only:
the checks of :func:`stats` and the native pass; or a copy only, for
``mode="tensor"``; then the call number and the row), which returns
``False``, having done nothing, for anything else; it numbers calls in C
(``_frow.next_call``, ``Log._next_call`` step for step). :func:`hook_lane`
configures and returns the hook path in front of it (``_fhook.c``, built into
``_frow``): ``_hookrt.forward``'s eager body for an output that needs no
gradient hook, and the tensor hook that records a gradient. Inside a model
the C lanes measured about 2 µs less per statistics record than the same
steps in Python, and 6 µs less for a copy and its gradient
(``bench/bench_record_path.py``). :func:`record_builder` configures and
returns the reading side, ``_frow.build_records``: the Records of a log's
rows, built in one call.

:func:`register_active` registers the C kernel of the ``active`` op
(``_fkernels.c``) through libtorch's stable C shim, found with :mod:`ctypes`
(no torch headers at build time; where a torch lacks those functions, and
on Windows, the op keeps its Python kernel), and :func:`set_recording`
sets what it answers.

``PICKLEHOOKS_NATIVE=0`` in the environment, read once at import, turns the
extensions off: :data:`AVAILABLE` is ``False``, :func:`stats` returns
``None``, :func:`row_lane`, :func:`hook_lane` and :func:`record_builder`
return ``None`` and :func:`register_active` ``False``. Where an extension
didn't compile (``pip`` builds them optionally), and in a copy of this
module inside a ``torch.package`` archive (archives hold Python source
only), it is off too (``_frow`` and ``_fkernels`` without ``_fstats`` count
as off), and importing this module still works.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
from collections.abc import Sequence

import torch

# importlib rather than ``from . import _fstats``: torch.package's exporter (and
# picklehooks' own copying of runtime modules into archives) follows import
# statements, and an extension module can't go into an archive. A copy of this
# file inside an archive (its name is mangled, its __package__ is not) stays
# off rather than reach the host's _fstats: the two may be different versions,
# and a kernel reading raw memory must not be called with the wrong arguments.
try:
    if __name__.startswith("<torch_package_"):
        raise ImportError("picklehooks._fstats is not used from inside a torch.package archive")
    _fstats = importlib.import_module("._fstats", __package__)
    # A stale build without these attributes counts as no build.
    _CODES = {getattr(torch, name): code for name, code in _fstats.DTYPE_CODES.items()}
    _kernel = _fstats.stats
except (ImportError, AttributeError):  # not built (no compiler), or inside a torch.package archive
    _fstats, _CODES, _kernel = None, {}, None
try:
    if __name__.startswith("<torch_package_"):
        raise ImportError("picklehooks._fkernels is not used from inside a torch.package archive")
    _fkernels = importlib.import_module("._fkernels", __package__)
    _fkernels.ACTIVE, _fkernels.set_recording  # noqa: B018 -- a stale build without them counts as none
except (ImportError, AttributeError):
    _fkernels = None
try:
    if _fstats is None:
        raise ImportError("the row lane needs _fstats")
    _frow = importlib.import_module("._frow", __package__)
    _frow.configure, _frow.add_row  # noqa: B018 -- a stale build without them counts as none
except (ImportError, AttributeError):
    _frow = None

#: Whether :func:`stats` computes anything (the extension imported and wasn't disabled).
AVAILABLE: bool = _fstats is not None and os.environ.get("PICKLEHOOKS_NATIVE", "1").strip() != "0"

# Exact types only: a subclass may keep no data (FakeTensor) or other data than data_ptr() shows.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
# What stats() takes for "not handled" when data_ptr() or stride() raises (no plain strided storage).
_SOFT_ERRORS = (RuntimeError, ValueError, TypeError, OverflowError, NotImplementedError)


if AVAILABLE:
    _get_code = _CODES.get  # dtype -> the extension's code for it; other dtypes get None

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
else:

    def stats(x: torch.Tensor) -> Sequence[float] | None:
        """Always ``None``: the extension is off (see the module docstring)."""
        return None


def row_lane(*, paired: frozenset, sure: int, maybe: int, none: int, stats_bit: int, tensor_bit: int,
             sure_bit: int, none_bit: int, forward_of: dict, maybe_trim: int, maybe_kept: int):
    """``_frow.add_row``, configured with the row format's constants, or ``None`` where it's off.

    ``picklehooks.log`` calls this once at import with its own constants:
    ``paired`` kinds await a gradient, ``sure``/``maybe``/``none`` are what
    ``_next_call`` takes as ``expect``, ``stats_bit`` and ``tensor_bit`` are
    the flags asking for statistics and for a copy, ``sure_bit`` and ``none_bit``
    the flags saying a value's gradient will be recorded or won't (which decide
    ``expect`` where set, as in ``_expects_grad``); ``forward_of``, ``maybe_trim`` and
    ``maybe_kept`` are ``_next_call``'s, which the lane does in C (``_frow.next_call``).
    The tensor side (types, dtype codes, kernel, soft errors) is
    this module's, so both paths check tensors alike.
    """
    if not AVAILABLE or _frow is None:
        return None
    _frow.configure(types=tuple(_PLAIN), codes=_CODES, kernel=_kernel, soft_errors=_SOFT_ERRORS,
                    grad_enabled=torch.is_grad_enabled, strided=torch.strided, paired=paired, sure=sure,
                    maybe=maybe, none=none, stats_bit=stats_bit, tensor_bit=tensor_bit, sure_bit=sure_bit,
                    none_bit=none_bit, forward_of=forward_of, maybe_trim=maybe_trim, maybe_kept=maybe_kept)
    return _frow.add_row


def record_builder(record: type, dtype_name):
    """``_frow.build_records``, configured to build ``record``s, or ``None`` where it's off.

    :mod:`picklehooks.log` calls this once at import with its ``Record`` and
    ``dtype_name``. ``build_records(rows, n, rank)`` returns the Records that
    ``Log._records_now``'s Python loop would build from ``rows[:n]``, filling
    each new instance's slots without running ``__init__``; so it is ``None``
    (the loop stays) unless ``record`` is a slotted dataclass whose fields are
    exactly the thirteen the rows fill, in that order, with no ``__post_init__``.
    """
    fields = ("module", "kind", "path", "call", "step", "shape", "dtype", "tensor", "value", "live", "rank",
              "_stats", "_src")
    if not AVAILABLE or _frow is None or not hasattr(_frow, "build_records"):
        return None
    if not dataclasses.is_dataclass(record) or hasattr(record, "__post_init__") \
            or tuple(f.name for f in dataclasses.fields(record)) != fields:
        return None
    _frow.configure_records(record=record, fields=fields, dtype_name=dtype_name)
    return _frow.build_records


def hook_lane(*, recording: list, active, graph_task_id, name_attr: str, fallback, value_bit: int, grad_bit: int,
              guard_bit: int, none_bit: int):
    """``(_frow.forward_lane, _frow.GradRecorder)``, configured, or ``None`` where the lanes are off.

    :mod:`picklehooks._hookrt` calls this once at import with its own state
    and constants: ``recording`` the list of logs recording anywhere,
    ``active`` the context variable of the log recording here,
    ``graph_task_id`` autograd's current graph task (-1 outside backward),
    ``name_attr`` the attribute naming an instrumented module, ``fallback``
    the Python gradient recorder ``(name, kind, path, flags, grad)``, and the
    flag bits (``none_bit``: what the forward lane adds to a value that requires
    grad, since it hooks no gradient). Both lanes record through
    :func:`row_lane`'s ``add_row``, so this needs :func:`row_lane` called first
    (``picklehooks.log`` does, on import); before that they hand everything to Python.
    """
    if not AVAILABLE or _frow is None or not hasattr(_frow, "forward_lane"):
        return None
    _frow.configure_hooks(recording=recording, active=active, graph_task_id=graph_task_id, tensor=torch.Tensor,
                          name_attr=name_attr, fallback=fallback, value_bit=value_bit, grad_bit=grad_bit,
                          guard_bit=guard_bit, none_bit=none_bit)
    return _frow.forward_lane, _frow.GradRecorder


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
    """Register ``_fkernels``' C kernel of ``namespace::active`` at ``dispatch_key``; whether it did.

    Through libtorch's stable C shim, so no torch headers at build time (see
    ``_fkernels.c``). The op, ``active(int flags) -> bool``, must be defined
    already, with no kernel at that key. The kernel answers what the last
    :func:`set_recording` said, so the caller must call that each time a log
    starts or stops. ``False``, having registered nothing, where the extension
    or the shim's functions are missing or native code is off; the caller then
    registers its Python kernel. The registration lasts as long as the process.
    """
    if not AVAILABLE or _fkernels is None:
        return False
    functions = _library_functions()
    if functions is None:
        return False
    init, impl = functions
    handle = ctypes.c_void_p()
    # The file and line are what torch._C._dispatch_dump shows as where the kernel came from.
    if init(namespace.encode(), dispatch_key.encode(), b"picklehooks/_fkernels.c", 1, ctypes.byref(handle)) != 0:
        return False
    if impl(handle, b"active", _fkernels.ACTIVE) != 0:
        return False  # (the empty Library object is kept: freeing it is as harmless as keeping it)
    _LIBRARY_HANDLES.append(handle)  # freeing it would remove the kernel
    return True


def set_recording(flag: bool) -> None:
    """What the C kernel of ``active`` answers from now on (whether any log records)."""
    if _fkernels is not None:
        _fkernels.set_recording(flag)
