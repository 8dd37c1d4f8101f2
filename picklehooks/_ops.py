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
* ``picklehooks::record_state(values, module, kind, names, flags)``: record
  parameters or buffers (``names`` comma-joined).
* ``picklehooks::watch_one(param, module, name, flags)``: the same for one
  parameter, as ``torch.jit.trace`` records it.
* ``picklehooks::active(flags) -> bool``: whether any log records; a scripted
  hook returns at once when it doesn't. Its kernel is C (``_fkernels.c``, so
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

Limits: Inductor in torch 2.13 loses the ordering edges between effectful
ops (pytorch/pytorch#189209), so a compiled graph may run record ops out of
program order. The ops are registered when picklehooks is imported; a
process that loads a scripted or exported instrumented model must import
picklehooks first. Gradient capture costs one copy per tapped tensor in graphs, and that
copy can move Inductor's fusion boundaries (gradients then differ in the last
bits); eager hooks skip the ops entirely while nothing records. Only ``active`` has a C kernel:
the others need Python while a log records (the log is a Python object), and a kernel
registered through libtorch's stable C shim can neither raise (``GUARD``'s
:class:`NonfiniteError`) nor pass on an exception from the Python kernel it would call, so
graphs that call them while nothing records (``jit.trace``, ``torch.compile``) still enter
Python for each call.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import threading
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _native, _shards, _state
from ._shim import PicklehooksError

VALUE, GRAD, STATS, TENSOR = 1, 2, 4, 8
#: ``param_grad`` is captured: pre-hooks watch the module's parameters (see :func:`watch_grads`).
PARAM_GRAD = 16
#: Raise :class:`NonfiniteError` when a tapped value or its gradient is not finite.
GUARD = 32
#: Set on a ``tap`` whose forward value the ``record`` op already recorded (and counted):
#: the tap only carries the gradient.
COUNTED = 64
#: Set by ``torch.compile``/``torch.export`` tracing, which sees whether a value requires grad
#: (the compiled forward later runs without autograd, so the kernels can't): a gradient of
#: this value will follow (:data:`GRAD_SURE`) or can't (:data:`GRAD_NONE`).
GRAD_SURE, GRAD_NONE = 128, 256
#: In a forward hook's flags only: ``grad_input`` is captured, so the eager hook looks for inputs
#: the module changed in place (see ``_hookrt._rescue_inplace``). No kernel or record sees it.
INPUT_GRAD = 512


class NonfiniteError(PicklehooksError, FloatingPointError):
    """``instrument(..., on_nonfinite="raise")`` saw NaN or Inf: the message names the module and step.

    Also as attributes: ``module``, ``kind``, ``path``, ``step`` (``None`` outside ``record()``).
    """

    def __init__(self, message: str, module: str = "", kind: str = "", path: str = "", step: int | None = None):
        super().__init__(message)
        self.module, self.kind, self.path, self.step = module, kind, path, step

    def __reduce__(self):
        return type(self), (str(self), self.module, self.kind, self.path, self.step)


def check_finite(x: torch.Tensor, module: str, kind: str, path: str, *, from_autograd: bool = False) -> None:
    """Raise :class:`NonfiniteError` if ``x`` holds NaN or Inf (a host sync: guards pay one per tensor)."""
    if not bool(torch.isfinite(x).all()):
        log = _state.active(from_autograd=from_autograd)
        where = f"at step {log.step}" if log is not None else "outside picklehooks.record(), so no step is known"
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        at = f" (path {path!r})" if path else ""
        raise NonfiniteError(f"non-finite {kind} in module {module!r}{at} {where}: {nan} NaN, {inf} Inf "
                             f"among {x.numel()} values", module, kind, path, None if log is None else log.step)

_NAMESPACE = "picklehooks"

# Tap sites are numbered in the bits above the flags (see _tap_setup); kernels only test flag bits.
_SITES = itertools.count()
_SITE_SHIFT, _SITE_MODULUS = 16, 1 << 40

#: Attribute instrument() sets on each watched parameter: ((module, name), ...) of its owners.
_OWNERS_ATTR = "_picklehooks_owners"

# Watched parameters -> {(module, name): hook handle}; weak so models can be freed.
# A parameter may have several owners: a tied weight (GPT-2's lm_head and wte)
# is recorded under each chosen module that holds it.
_WATCHED = WeakIdKeyDictionary()


def watch_grads(module: str, names: list[str], params: list, flags: int, *, claim: bool = False) -> None:
    """Record each parameter's gradient as ``param_grad`` of ``module`` once it is accumulated.

    Attached once per (parameter, module, name). Only the parameter itself can
    carry the hook: a copy (as Inductor hands a Conv2d weight it converted to
    channels-last) is skipped, which is why ``instrument()`` also attaches
    these hooks itself, outside any graph, with ``claim=True``: that names
    ``module`` as an owner on the parameter, for later :func:`watch_grads`
    calls in a process that loads the model.

    Under FSDP2 (``fully_shard``) a module holds, during its forward, the
    unsharded parameter FSDP all-gathered: its gradient is this rank's,
    before reduce-scatter. The hook goes on FSDP's sharded parameter instead,
    whose hooks FSDP calls once it has assigned the reduced gradient (see
    :func:`picklehooks.distributed.fsdp_sharded`).
    """
    if _FSDP_STATE in _MODULES:  # only a process that uses FSDP2 pays for the look-up
        params = _shards.fsdp_sharded(params)
    for name, param in zip(names, params):
        if claim and param is not None and (module, name) not in param.__dict__.get(_OWNERS_ATTR, ()):
            param.__dict__[_OWNERS_ATTR] = (*param.__dict__.get(_OWNERS_ATTR, ()), (module, name))
        if param is None or not param.requires_grad or not param.is_leaf:
            continue
        owners = _WATCHED.get(param)
        if owners is None:
            owners = _WATCHED[param] = {}
        # Every owner instrument() named on the parameter (it travels with the parameter
        # through pickle and torch.package), so that a tied weight is recorded under an
        # owner that never runs in a loaded model (T5's shared embedding) too.
        for key in [(module, name), *param.__dict__.get(_OWNERS_ATTR, ())]:
            if key not in owners:
                owners[key] = param.register_post_accumulate_grad_hook(functools.partial(_deliver_grad, *key, flags))


def _deliver_grad(module: str, name: str, flags: int, p: torch.Tensor) -> None:
    log = _state.active(from_autograd=True)
    if log is not None and p.grad is not None:
        record_tensor(log, module, "param_grad", name, p.grad, flags)


# FSDP2's module: imported exactly when a process can hold FSDP2-sharded parameters.
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
# sys.modules, through importlib: torch.package's exporter can't package sys (it has no file),
# and follows import statements in the copy of this file it puts in an archive.
_MODULES = importlib.import_module("sys").modules


def record_tensor(log, module: str, kind: str, path: str, x: torch.Tensor, flags: int) -> None:
    """``log._add_tensor``, except that a ``DTensor`` (FSDP2's sharded parameters and their
    gradients, tensor parallelism) is recorded as this rank's shard, with its place in the whole,
    which :func:`picklehooks.distributed.gather` merges across ranks."""
    if type(x) not in _PLAIN:
        dtensor = _MODULES.get("torch.distributed.tensor")  # no DTensor exists before it is imported
        if dtensor is not None and isinstance(x, dtensor.DTensor):
            _shards.add_shard(log, module, kind, path, x, flags)
            return
    log._add_tensor(module, kind, path, x, flags)


def unwatch_grads(params, module: str | None = None) -> None:
    """Remove the hooks :func:`watch_grads` attached to these parameters, and the owner
    names it put on them (for ``module``, or all)."""
    def mine(key: tuple) -> bool:
        return module is None or key[0] == module

    for param in params:
        kept = tuple(key for key in param.__dict__.get(_OWNERS_ATTR, ()) if not mine(key))
        if kept:
            param.__dict__[_OWNERS_ATTR] = kept
        else:
            param.__dict__.pop(_OWNERS_ATTR, None)
        owners = _WATCHED.get(param)
        if not owners:
            continue
        for key in [k for k in owners if mine(k)]:
            owners.pop(key).remove()
        if not owners:
            del _WATCHED[param]


# Parameters whose gradient is zeroed, and the tensor hooks' handles.
_ZEROED = WeakIdKeyDictionary()


def zero_grads(params: list) -> None:
    """Make each parameter's gradient zero (a tensor hook, attached once per parameter)."""
    for param in params:
        if param is not None and param.requires_grad and param not in _ZEROED:
            _ZEROED[param] = param.register_hook(torch.zeros_like)


def unzero_grads(params) -> None:
    """Remove the hooks :func:`zero_grads` attached to these parameters."""
    for param in params:
        handle = _ZEROED.pop(param, None)
        if handle is not None:
            handle.remove()


#: What a module's profiler range is named before its qualified name ("2.0" alone
#: would be mangled by the profiler into ".0").
RANGE_PREFIX = "module:"
_RANGES = threading.local()  # this thread's open ranges: (name, record_function)


def range_enter(name: str) -> None:
    """Open the profiler range ``module:<name>`` (cheap while no profiler runs)."""
    rf = torch.autograd.profiler.record_function(RANGE_PREFIX + name)
    rf.__enter__()
    _RANGES.__dict__.setdefault("stack", []).append((name, rf))


def range_exit(name: str) -> None:
    """Close the innermost open range of ``name``, and any left open inside it (by an exception)."""
    stack = _RANGES.__dict__.get("stack", [])
    if not any(n == name for n, _ in stack):
        return
    while stack:
        n, rf = stack.pop()
        rf.__exit__(None, None, None)
        if n == name:
            return




_active_log = _state._ACTIVE.get  # _state.active() outside autograd's threads


def _deliver(x: torch.Tensor, module: str, kind: str, path: str, flags: int, *, from_autograd: bool = False) -> None:
    log = _state.active(from_autograd=from_autograd)
    if log is not None:
        log._add_tensor(module, kind, path, x, flags)  # the log copies (and detaches) it


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
        log._add_tensor(module, kind, path, x, flags)
        if flags >> _SITE_SHIFT:
            _note_site(log, module, kind, path, flags)


def _record_stats_kernel(stats: torch.Tensor, module: str, kind: str, path: str, flags: int, shape: list,
                         dtype: torch.dtype) -> None:
    log = _state.active()
    if log is not None:
        log._add_stats(module, kind, path, stats, flags, tuple(shape), dtype)
        if flags >> _SITE_SHIFT:
            _note_site(log, module, kind, path, flags)


# Gradient pairing by tap site, for compiled graphs. A gradient record takes the latest call of its
# module that awaits one (Log._next_call): right in eager mode, where backward runs in reverse, but
# Inductor orders a backward graph's kernels as it likes, so a module called twice on independent
# branches could get its two gradients swapped. In a graph being compiled, the record op and the
# tap op of one value share a site number (graph_site(), above the flag bits); the record op's
# kernel notes which call that site's value got, and tap_grad's kernel moves that call to the end
# of the awaiting list, where the log takes it from.
_SITE_CALLS_KEPT = 64  # per site: forwards of one graph whose backward never comes (inference)


def graph_site() -> int:
    """A new tap site number (never 0), constant in the graph being traced."""
    return 1 + next(_SITES) % (_SITE_MODULUS - 1)


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo here: Dynamo
# calls the function while tracing and puts the number in the graph as a constant, with no guard.
graph_site._dynamo_marked_constant = True


def _note_site(log, module: str, kind: str, path: str, flags: int) -> None:
    waiting = log._awaiting_grad.get((module, kind, path))
    if not waiting:
        return  # no gradient awaited for this value: nothing to pair
    sites = log.__dict__.setdefault("_site_calls", {})
    calls = sites.setdefault((module, kind, path, flags >> _SITE_SHIFT), [])
    calls.append(waiting[-1])
    if len(calls) > _SITE_CALLS_KEPT:
        del calls[0]


def _pair_by_site(log, module: str, kind: str, path: str, flags: int) -> None:
    """Before a gradient of ``kind`` is recorded: make the call its tap site's value got the one taken."""
    sites = log.__dict__.get("_site_calls")
    calls = sites and sites.get((module, kind[len("grad_"):], path, flags >> _SITE_SHIFT))
    if not calls:
        return
    call = calls.pop()
    waiting = log._awaiting_grad.get((module, kind[len("grad_"):], path))
    if waiting and waiting[-1] != call and call in waiting:
        waiting.remove(call)
        waiting.append(call)


def _record_state_kernel(values: list, module: str, kind: str, names: str, flags: int) -> None:
    # Schemas have no list-of-str type, so the names arrive comma-joined.
    for name, value in zip(names.split(","), values):
        if value is not None:
            _deliver(value, module, kind, name, flags)


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
    "record_state": ("record_state(Tensor?[] values, str module, str kind, str names, int flags) -> ()",
                     _record_state_kernel),
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
    return x.clone()


def _tap_grad_kernel(g: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
    if flags & GUARD:
        check_finite(g, module, kind, path, from_autograd=True)
    if flags & GRAD:
        log = _state.active(from_autograd=True)
        if log is not None:
            _pair_by_site(log, module, kind, path, flags)
            _deliver(g, module, kind, path, flags, from_autograd=True)
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
        torch.library.register_fake(f"{_NAMESPACE}::{name}", lambda *args: None, lib=lib)
        _register_ordered_effect(getattr(torch.ops.picklehooks, name).default)
    # Whether any log records: what a scripted hook asks first (TorchScript can't read
    # Python state otherwise). Not an effect op: graphs other than TorchScript's never call
    # it. Its kernel is C where picklehooks._fkernels is built (TorchScript then calls it
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


# The host's picklehooks registers the ops. A copy of this file inside a
# torch.package archive (see picklehooks._shim) defers to the host's when
# picklehooks is installed there, and otherwise registers them itself, once,
# however many archives are loaded: op names are global to the process.
if __name__ != "picklehooks._ops":
    try:
        _host = importlib.import_module("picklehooks._ops")
    except ImportError:
        pass
    else:
        # One set of watched parameters and open ranges, and the host's error class
        # (so that ``except picklehooks.NonfiniteError`` catches packaged hooks' errors).
        (NonfiniteError, check_finite, watch_grads, unwatch_grads, zero_grads, unzero_grads, range_enter,
         range_exit) = (_host.NonfiniteError, _host.check_finite, _host.watch_grads, _host.unwatch_grads,
                        _host.zero_grads, _host.unzero_grads, _host.range_enter, _host.range_exit)
if not _defined():
    _define_ops()
    _define_library_ops()
