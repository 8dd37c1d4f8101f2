"""The recording ops: ``torch.library`` ops that hooks put into the model's graphs.

Values are read by ops with no output (:data:`_EFFECT_OPS`): declared
CONSERVATIVE, so TorchScript assumes side effects and keeps them, and
registered as ORDERED effects, so ``torch.compile`` and ``torch.export``
thread them with effect tokens and never drop or merge them, and order them
(but see the limits below). The model keeps its own tensors (no copy):
in-place modules and ``a is b`` behave as without picklehooks.

* ``picklehooks::record(x, module, kind, path, flags)``: record ``x``.
* ``picklehooks::record_stats(stats, module, kind, path, flags, shape, dtype)``:
  record statistics that a compiled or exported graph computed itself
  (:func:`picklehooks._stats.graph_stats`) for a value of that shape and dtype.
* ``picklehooks::record_batch(values, modules, kinds, paths, flags, dtypes, shapes)``: a run of
  those two in a ``torch.compile`` graph, as Inductor runs it (:mod:`picklehooks.capture.batching`;
  never in a saved artifact), in program order.
* ``picklehooks::record_state(values, module, kind, names, flags)``: record
  parameters or buffers (``names`` comma-joined).
* ``picklehooks::watch_one(param, module, name, flags)``: the same for one
  parameter, as ``torch.jit.trace`` records it.
* ``picklehooks::call_site(module, site, cls)``: a call of ``module`` begins, from the line
  ``site`` (``"file:line in function"``; empty: the line that calls the program, found when it
  runs), of a module whose class is ``cls`` (``"Class, file:line"``): what ``jit.trace``, FX and
  ``torch.export`` graphs say once per module call, so that records name their source
  (:mod:`picklehooks._sites`).
* ``picklehooks::active(flags) -> bool``: whether any log records; a scripted
  hook returns at once when it doesn't. Its kernel is C (``csrc/kernels.c`` in ``picklehooks._speedups``, so
  TorchScript asks without entering Python) where that extension is built.
* ``picklehooks::watch(params, module, names, flags)``: attach, once per
  parameter and owner, a post-accumulate-grad hook that records
  ``param_grad``. Tensor hooks are never pickled and can't be attached from
  TorchScript or a graph, but the kernel gets the parameters themselves
  (except Inductor's converted Conv2d weights, which is why ``instrument()``
  attaches them too).

Gradients need an op in the dataflow, whose autograd formula sees them:

* ``picklehooks::tap(x, module, kind, path, flags)``: returns a copy of ``x``;
  its gradient goes through ``tap_grad``, which records it as ``"grad_" + kind``.
  That is how gradients are captured where backward hooks are not supported
  (TorchScript, export).
* ``picklehooks::tap_grad(g, module, kind, path, flags)``: record ``g``.
* ``picklehooks::tap_state`` and ``picklehooks::watch_grads`` (copies threaded
  through ``x``) are what earlier versions generated; they stay registered so
  that models scripted or exported then still load and record.
* ``picklehooks::range_enter(x, name)`` and ``picklehooks::range_exit(x,
  name)``: ``instrument(profile=True)``'s profiler ranges around a module's
  forward, threaded through its first tensor input and its output so that
  graphs keep them in order (:func:`range_enter`, :func:`range_exit`).
* ``picklehooks::clamp_grad(x, min, max)`` and ``picklehooks::zero_grads(x,
  params)``: gradient surgery (:mod:`picklehooks.diagnostics.surgery`), by
  the same two routes: an autograd formula that clamps the gradient flowing
  back through ``x``, and a kernel that attaches, once per parameter, a
  tensor hook zeroing its gradient.

``flags`` bits: :data:`VALUE`, :data:`GRAD`, :data:`STATS`, :data:`TENSOR`,
:data:`PARAM_GRAD`, :data:`GUARD`, :data:`COUNTED`; a gradient tap's site
number sits above them (see ``_tap_setup``).

Limits: a process that loads a scripted or exported instrumented model must import
picklehooks first (it registers the ops). Gradient capture costs one copy per tapped tensor in graphs. Under
``torch.compile`` a tap whose call the ``record`` op counted is a clone Inductor fuses
(:class:`_GradOnlyTap`); the ``tap`` op's copy elsewhere keeps the strides it was traced
with, so Inductor may copy a channels-last value back to contiguous for it and sum the next
reduction in another order (gradients then differ in the last bits); eager hooks skip the
ops entirely while nothing records. Only ``active`` has a C kernel: the others need Python
while a log records (the log is a Python object), and a kernel registered through libtorch's
stable C shim can neither raise (``GUARD``'s :class:`NonfiniteError`) nor pass on an
exception from the Python kernel it would call.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native, _state
from ._deliver import (  # noqa: F401 - re-exported: generated text, archives and the host read them here
    COUNTED, GRAD, GRAD_NONE, GRAD_SURE, GUARD, INPUT_GRAD, NUMBER, PARAM_GRAD, RANGE_PREFIX, STATS, TENSOR, VALUE,
    _FSDP_STATE, _MODULES, _OWNERS_ATTR, _PLAIN, _RANGES, _SITE_CALLS_KEPT, _SITE_MODULUS, _SITE_SHIFT, _SITES,
    COMPILED, _WATCHED, _ZEROED, NonfiniteError, _active_log, _deliver, _deliver_grad, _note_site, _pair_by_site,
    SITE_FRAMES, check_finite, compiled_site, graph_site, range_enter, range_exit, record_tensor, unwatch_grads,
    unzero_grads, watch_grads, zero_grads)

_NAMESPACE = "picklehooks"


def _defined() -> bool:
    try:
        torch.ops.picklehooks.tap  # noqa: B018 - raises if the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_ops() -> None:
    """Register the ops (once per process)."""

    @torch.library.custom_op(f"{_NAMESPACE}::tap_state", mutates_args=())
    def tap_state(
        x: torch.Tensor, values: list[Optional[torch.Tensor]], module: str, kind: str, names: str, flags: int
    ) -> torch.Tensor:
        if flags & VALUE:
            # Schemas have no list-of-str type, so the names arrive comma-joined.
            # Optional because TorchScript types attributes such as Conv2d.bias as Tensor?.
            for name, value in zip(names.split(","), values):
                if value is not None:
                    _deliver(value, module, kind, name, flags)
        return x.clone()

    @tap_state.register_fake
    def _tap_state_fake(x, values, module, kind, names, flags):
        return torch.empty_like(x)

    def _tap_state_setup(ctx, inputs, output) -> None:
        ctx.n_values = len(inputs[1])

    def _tap_state_backward(ctx, grad):
        # The recorded values get no gradient through this op: it only reads them.
        return grad, [None] * ctx.n_values, None, None, None, None

    tap_state.register_autograd(_tap_state_backward, setup_context=_tap_state_setup)

    @torch.library.custom_op(f"{_NAMESPACE}::watch_grads", mutates_args=())
    def watch_grads_op(
        x: torch.Tensor, params: list[Optional[torch.Tensor]], module: str, names: str, flags: int
    ) -> torch.Tensor:
        watch_grads(module, names.split(","), params, flags)
        return x.clone()

    @watch_grads_op.register_fake
    def _watch_grads_fake(x, params, module, names, flags):
        return torch.empty_like(x)

    def _watch_grads_setup(ctx, inputs, output) -> None:
        ctx.n_values = len(inputs[1])
        if not inputs[0].requires_grad:
            # The parameters are inputs only so that the kernel sees them: they
            # must not make x (say, the model's input) require grad.
            ctx.mark_non_differentiable(output)

    def _watch_grads_backward(ctx, grad):
        return grad, [None] * ctx.n_values, None, None, None

    watch_grads_op.register_autograd(_watch_grads_backward, setup_context=_watch_grads_setup)

    @torch.library.custom_op(f"{_NAMESPACE}::zero_grads", mutates_args=())
    def zero_grads_op(x: torch.Tensor, params: list[Optional[torch.Tensor]]) -> torch.Tensor:
        zero_grads(params)
        return x.clone()

    @zero_grads_op.register_fake
    def _zero_grads_fake(x, params):
        return torch.empty_like(x)

    def _zero_grads_backward(ctx, grad):
        return grad, [None] * ctx.n_values

    zero_grads_op.register_autograd(_zero_grads_backward, setup_context=_watch_grads_setup)

    @torch.library.custom_op(f"{_NAMESPACE}::range_enter", mutates_args=())
    def range_enter_op(x: torch.Tensor, name: str) -> torch.Tensor:
        range_enter(name)
        return x.clone()

    @torch.library.custom_op(f"{_NAMESPACE}::range_exit", mutates_args=())
    def range_exit_op(x: torch.Tensor, name: str) -> torch.Tensor:
        range_exit(name)
        return x.clone()

    for op in (range_enter_op, range_exit_op):
        op.register_fake(lambda x, name: torch.empty_like(x))
        op.register_autograd(lambda ctx, grad: (grad, None))

    @torch.library.custom_op(f"{_NAMESPACE}::clamp_grad", mutates_args=())
    def clamp_grad(x: torch.Tensor, min: Optional[float], max: Optional[float]) -> torch.Tensor:
        return x.clone()

    @clamp_grad.register_fake
    def _clamp_grad_fake(x, min, max):
        return torch.empty_like(x)

    def _clamp_grad_setup(ctx, inputs, output) -> None:
        ctx.bounds = inputs[1:3]

    def _clamp_grad_backward(ctx, grad):
        return grad.clamp(*ctx.bounds), None, None

    clamp_grad.register_autograd(_clamp_grad_backward, setup_context=_clamp_grad_setup)


def _record_kernel(x: torch.Tensor, module: str, kind: str, path: str, flags: int) -> None:
    log = _active_log()  # _deliver(), inlined: every value a graph or scripted hook records comes here
    if log is not None:
        if flags & NUMBER:
            log._add_value(module, kind, path, x.item())
            return
        log._add_tensor(module, kind, path, x, flags)
        if flags >> _SITE_SHIFT:
            _note_site(log, module, kind, path, flags)
        else:
            _script_site(log, module, kind, path)


def _script_site(log, module: str, kind: str, path: str) -> None:
    note = getattr(log, "_script_site", None)  # (a host log of an earlier version: none)
    if note is not None:
        note(module, kind, path)


def _record_stats_kernel(stats: torch.Tensor, module: str, kind: str, path: str, flags: int, shape: list,
                         dtype: torch.dtype) -> None:
    log = _state.active()
    if log is not None:
        log._add_stats(module, kind, path, stats, flags, tuple(shape), dtype)
        if flags >> _SITE_SHIFT:
            _note_site(log, module, kind, path, flags)


def _record_batch_kernel(values: list, modules: list, kinds: list, paths: list, flags: list, dtypes: list,
                         shapes: list) -> None:
    # A compiled graph's run of record and record_stats ops (picklehooks.capture.batching), in
    # program order; a record_stats item names its dtype, its shape follows its rank in ``shapes``.
    # The values live until this returns: the log keeps them by reference meanwhile (_lend).
    log = _active_log()
    lend = getattr(log, "_lend", None)  # (None: no log, or a host log of an earlier version)
    if lend is not None:
        lend()
    try:
        at = 0
        for x, module, kind, path, flag, dtype in zip(values, modules, kinds, paths, flags, dtypes):
            if dtype:
                rank = shapes[at]
                _record_stats_kernel(x, module, kind, path, flag, shapes[at + 1:at + 1 + rank], getattr(torch, dtype))
                at += 1 + rank
            else:
                _record_kernel(x, module, kind, path, flag)
    finally:
        if lend is not None:
            log._give_back()


def _record_state_kernel(values: list, module: str, kind: str, names: str, flags: int) -> None:
    # Schemas have no list-of-str type, so the names arrive comma-joined.
    log, sited, last = _active_log(), flags >> _SITE_SHIFT, None
    for name, value in zip(names.split(","), values):
        if value is not None:
            _deliver(value, module, kind, name, flags)
            if sited and log is not None:
                _note_site(log, module, kind, name, flags)
            last = name
    if last is not None and not sited and log is not None:
        _script_site(log, module, kind, last)  # one per call: the source is the call's


def _call_site_kernel(module: str, site: str, cls: str) -> None:
    log = _active_log()
    if log is not None:
        note = getattr(log, "_call_site", None)  # (a host log of an earlier version: none)
        if note is not None:
            note(module, site, cls)


def _watch_kernel(params: list, module: str, names: str, flags: int) -> None:
    watch_grads(module, names.split(","), params, flags)


def _watch_one_kernel(param: torch.Tensor, module: str, name: str, flags: int) -> None:
    watch_grads(module, [name], [param], flags)


# The ops that only look: no output, so the model keeps its own tensors (no
# copy, in-place changes and ``a is b`` survive), declared CONSERVATIVE so
# TorchScript assumes they have side effects and keeps them, and registered as
# ORDERED effects so that torch.compile and torch.export thread them with
# effect tokens: never dropped, merged with an identical call, or reordered.
# Each value is read at its place in the program, before later in-place ops.
def _active_kernel(flags: int) -> bool:
    return bool(_state._ANYWHERE)


_EFFECT_OPS = {
    "record": ("record(Tensor x, str module, str kind, str path, int flags) -> ()", _record_kernel),
    # What a compiled (or exported) graph calls instead of record in mode "stats": the graph
    # computed the statistics (picklehooks._stats.graph_stats); the value's shape and dtype name it.
    "record_stats": ("record_stats(Tensor stats, str module, str kind, str path, int flags, SymInt[] shape, "
                     "ScalarType dtype) -> ()", _record_stats_kernel),
    # A compiled graph's run of record and record_stats ops: one trip into Python, not one per value.
    "record_batch": ("record_batch(Tensor[] values, str[] modules, str[] kinds, str[] paths, int[] flags, "
                     "str[] dtypes, SymInt[] shapes) -> ()", _record_batch_kernel),
    "record_state": ("record_state(Tensor?[] values, str module, str kind, str names, int flags) -> ()",
                     _record_state_kernel),
    # Where a traced program calls a module from (see picklehooks._sites): once per call.
    "call_site": ("call_site(str module, str site, str cls) -> ()", _call_site_kernel),
    "watch": ("watch(Tensor?[] params, str module, str names, int flags) -> ()", _watch_kernel),
    # One parameter: what torch.jit.trace records (it can't take a Tensor?[] argument).
    "watch_one": ("watch_one(Tensor param, str module, str name, int flags) -> ()", _watch_one_kernel),
}
_LIBRARY = None  # kept alive: dropping a Library removes its registrations


def _tap_kernel(x: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
    if flags & GUARD:
        check_finite(x, module, kind, path)
    if flags & VALUE:
        _deliver(x, module, kind, path, flags)
    elif flags & GRAD and not flags & COUNTED:
        log = _state.active()
        if log is not None:
            log._note_call(module, kind, path, x, flags)  # so the gradient's record gets the right call
            if flags >> _SITE_SHIFT:
                _note_site(log, module, kind, path, flags)
            else:
                _script_site(log, module, kind, path)
    return x.clone()


def _tap_grad_kernel(g: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
    if flags & GUARD:
        check_finite(g, module, kind, path, from_autograd=True)
    if flags & GRAD:
        log = _state.active(from_autograd=True)
        if log is not None:
            _pair_by_site(log, module, kind, path, flags)
            _deliver(g, module, kind, path, flags, from_autograd=True)
            if flags & COMPILED and flags & STATS:
                mark = getattr(log, "_mark_zeros_if_none", None)  # (a host log of an earlier version: none)
                if mark is not None:
                    mark(module, kind, path)
    return g.clone()


def _fake_like(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(x)


_dispatch_modes = torch._C._len_torch_dispatch_stack  # FakeTensorMode, make_fx, functionalization...
_jit_tracing_state = torch._C._get_tracing_state


def _runs_as_is(x) -> bool:
    """Whether an op's kernel may be called directly on ``x``, skipping the dispatcher: ``x`` is a
    plain tensor with data (not a fake, functional, meta or subclass tensor), and nothing traces
    (no dispatch mode such as FakeTensorMode or make_fx's, no ``jit.trace``), so nothing needs to
    see the op itself. Then the dispatcher would only call the CompositeExplicitAutograd kernel
    (which TorchScript and graphs run at run time), at about 2.5 µs per call."""
    return (type(x) in _PLAIN and not _dispatch_modes() and _jit_tracing_state() is None
            and not x.is_meta)


class _TapFunction(torch.autograd.Function):
    """``tap``'s autograd formula: its backward hands the gradient to ``tap_grad``."""

    @staticmethod
    def forward(ctx, x, module, kind, path, flags):
        ctx.module, ctx.kind, ctx.path, ctx.flags = module, kind, path, flags
        # A number per tap site, above the flag bits: two calls of one module whose
        # gradients are the same tensor (f(a) + f(b)) must not look like one call to a
        # compiler's common-subexpression elimination in the backward graph.
        # A graph being compiled gave this value's record op and tap op one site (graph_site()).
        ctx.site = flags >> _SITE_SHIFT or next(_SITES) % _SITE_MODULUS
        if _runs_as_is(x):  # (forward runs under no_grad: the kernel's clone is this Function's output)
            return _tap_kernel(x, module, kind, path, flags)
        return _tap_below_autograd(x, module, kind, path, flags)

    @staticmethod
    def backward(ctx, grad):
        if ctx.flags & (GRAD | GUARD) and grad is not None:
            args = (grad, ctx.module, "grad_" + ctx.kind, ctx.path, ctx.flags | ctx.site << _SITE_SHIFT)
            grad = _tap_grad_kernel(*args) if _runs_as_is(grad) else torch.ops.picklehooks.tap_grad.default(*args)
        return grad, None, None, None, None


_tap_function = super(torch.autograd.Function, _TapFunction).apply  # the C apply: no signature binding


class _GradOnlyTap(torch.autograd.Function):
    """A tap that only carries a gradient, in a graph ``torch.compile`` traces: ``x.clone()``, whose
    backward hands the gradient to the ``tap_grad`` op, as the ``tap`` op's autograd formula does.

    The ``tap`` op is opaque to Inductor: its output keeps the strides it was traced with. After
    a convolution that Inductor's layout optimization made channels-last, that meant a copy back
    to contiguous, which the next reduction (BatchNorm's statistics) then read in another order,
    so the forward's values and every ``.grad`` changed in the last bits (issue 40, item 5:
    LeViT's stem). A clone is laid out and fused like any other op: the compiled forward and
    backward compute what the plain compiled model's do, bit for bit
    (``tests/capture/test_compiled_numerics.py``). Only where the ``record`` op counted the call
    (``COUNTED``) and no guard checks the value: a tap whose forward has work to do stays the
    ``tap`` op, and exported programs keep it.
    """

    @staticmethod
    def forward(ctx, x, name: str, kind: str, path: str, flags: int):
        ctx.where = (name, "grad_" + kind, path, flags)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            grad = torch.ops.picklehooks.tap_grad.default(grad, *ctx.where)
        return grad, None, None, None, None


def _tap_below_autograd(x: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
    """``tap`` from the keys below Autograd: its kernel, or a tracer's fake or functional one."""
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.picklehooks.tap.default(x, module, kind, path, flags)


def _tap_autograd(x: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
    """``tap`` at the Autograd key: through :class:`_TapFunction` where a gradient can flow."""
    if torch.is_grad_enabled() and x.requires_grad:
        if torch._C._are_functorch_transforms_active():
            return _TapFunction.apply(x, module, kind, path, flags)
        return _tap_function(x, module, kind, path, flags)
    # No gradient can flow: what the dispatcher would reach below Autograd is the kernel itself
    # (a jit.trace graph's tap at run time, under no_grad or on a value without grad), so call
    # it, skipping the guard and the second dispatch: 5.6 µs per tap from TorchScript, not 8.5
    # (bench/bench_record_path.py; the copy is 2.9 of them).
    if _runs_as_is(x) and not torch._C._are_functorch_transforms_active():
        return _tap_kernel(x, module, kind, path, flags)
    return _tap_below_autograd(x, module, kind, path, flags)


# tap and tap_grad: ``Library`` ops with Python kernels, rather than torch.library.custom_op,
# whose layers made a tap cost about 12 µs without grad and 27 µs with (TorchScript and
# jit.trace graphs call it for every gradient tap), against about 8 and 12 here, a 32 KiB
# copy included. The schemas are the ones custom_op inferred, which saved scripted models and
# exported programs name.
_TAP_OPS = {
    "tap": ("tap(Tensor x, str module, str kind, str path, SymInt flags) -> Tensor", _tap_kernel),
    "tap_grad": ("tap_grad(Tensor g, str module, str kind, str path, SymInt flags) -> Tensor", _tap_grad_kernel),
}


#: Called whenever an effect op is traced (picklehooks.capture.batching.install: cheap once set up).
_ON_TRACE: list = []


def _effect_fake(*args) -> None:
    for setup in tuple(_ON_TRACE):
        try:
            setup()
        except Exception as exc:  # an optimization only: tracing goes on without it
            _ON_TRACE.remove(setup)
            import warnings
            warnings.warn(f"picklehooks: setting up compiled graphs' record batching failed ({exc!r}); "
                          "each record stays its own op", RuntimeWarning, stacklevel=2)


def _define_library_ops() -> None:
    """Register the ops defined through one kept ``Library``: ``tap``/``tap_grad``, the effect ops, ``active``."""
    global _LIBRARY
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    for name, (schema, kernel) in _TAP_OPS.items():
        lib.define(schema)
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{_NAMESPACE}::{name}", _fake_like, lib=lib)
    lib.impl("tap", _tap_autograd, "Autograd")
    for name, (schema, kernel) in _EFFECT_OPS.items():
        lib.define(schema, alias_analysis="CONSERVATIVE")
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{_NAMESPACE}::{name}", _effect_fake, lib=lib)
        _register_ordered_effect(getattr(torch.ops.picklehooks, name).default)
    # Whether any log records: what a scripted hook asks first (TorchScript can't read
    # Python state otherwise). Not an effect op: graphs other than TorchScript's never call
    # it. Its kernel is C where picklehooks._speedups is built (TorchScript then calls it
    # without entering Python: an idle scripted hook costs about 0.16 µs more than an empty
    # scripted function, against 0.8 µs for _active_kernel); the C kernel answers what
    # _state's change hooks last told it, which the lock keeps in step with _ANYWHERE.
    lib.define("active(int flags) -> bool", alias_analysis="CONSERVATIVE")
    if _native.register_active(_NAMESPACE, "CompositeExplicitAutograd"):
        with _state._LOCK:
            _state._ON_CHANGE.append(_native.set_recording)
            _native.set_recording(bool(_state._ANYWHERE))
    else:
        lib.impl("active", _active_kernel, "CompositeExplicitAutograd")
    _LIBRARY = lib


def _register_ordered_effect(op) -> None:
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:
        from torch._library.effects import EffectType

        register(op, EffectType.ORDERED)
    else:  # torch before 2.10
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op, _EffectType.ORDERED)



# The host's picklehooks registers the ops. A copy of this file inside a torch.package archive
# registers them itself only where no picklehooks did (op names are global to the process), once,
# however many archives are loaded; its _deliver copy defers to the host's functions.
if not _defined():
    _define_ops()
    _define_library_ops()
