"""Tapping values: what eager hooks and traced graphs do with each tensor a module takes or returns.

Pinned runtime (see the docs' wire-contract page): torch.package archives
copy it with :mod:`picklehooks._hookrt`, which re-exports the names below
that generated hook text or earlier versions' runtime reach.

* The tracing checks: whether this call is being traced (torch.compile, FX,
  ``jit.trace``), spelled so that Dynamo installs no guard on them.
* The eager path: :func:`_eager_tap` records a value directly and hooks its
  gradient (through :class:`_Alias` or a fresh view), :func:`_eager_tree`
  walks containers without rebuilding the caller's objects.
* The traced path: :func:`_traced_tap` puts the ``record``/``tap`` ops in the
  graph; :func:`tap_tree` chooses between the two.

It must stay traceable: no data-dependent Python control flow on the traced path.

Limits: non-tensor values are recorded (by repr) only in eager mode; any
forward run inside a backward pass is taken for a checkpoint's recomputation
and records no values.
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter, OrderedDict, defaultdict

import torch

from . import _native, _ops, _state, _stats
from ._views import watch as _watch_view

_FX_SYMBOLIC = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None) or torch.fx._symbolic_trace.is_fx_tracing

_tap = torch.ops.picklehooks.tap
_record = torch.ops.picklehooks.record
# None under an older picklehooks on the host of a torch.package archive made by this version.
_record_stats = getattr(torch.ops.picklehooks, "record_stats", None)
_record_state = torch.ops.picklehooks.record_state
_watch = torch.ops.picklehooks.watch
_watch_one = torch.ops.picklehooks.watch_one
_zero_grads = torch.ops.picklehooks.zero_grads
_clamp_grad = torch.ops.picklehooks.clamp_grad
_range_enter = torch.ops.picklehooks.range_enter
_range_exit = torch.ops.picklehooks.range_exit


# None under an older picklehooks on the host of a torch.package archive made by this version.
_graph_site = getattr(_ops, "graph_site", None)
_compiled_site = getattr(_ops, "compiled_site", None)
_grad_only_tap = getattr(getattr(_ops, "_GradOnlyTap", None), "apply", None)
# Whether torch tells export from compile (see _is_exporting): only then may a compiled graph's tap
# be something an exported program would not keep.
_EXPORT_KNOWN = hasattr(torch.compiler, "_is_exporting_flag")
_is_compiling = torch.compiler.is_compiling  # the same function object, which dynamo answers with True


def _is_exporting() -> bool:
    """Whether ``torch.export`` is tracing, by the flag it sets, read here rather than through
    ``torch.compiler.is_exporting()``: Dynamo before torch 2.13 answers that call with True under
    any ``torch.compile`` trace (2.13 reads this flag), which kept a copy per value in compiled
    ``no_grad`` graphs on torch 2.11. A torch without the flag has no ``is_exporting`` either."""
    return getattr(torch.compiler, "_is_exporting_flag", False)


_is_jit_tracing = torch._C._is_tracing  # torch.jit.is_tracing() without its is_scripting() call
_RECORDING = _state._ANYWHERE  # logs recording in any thread (one list for the process)
_active_log = _state._ACTIVE.get  # the log recording in this context (the host's, inside an archive)
_PLAIN = _ops._PLAIN  # tensor types recorded as they are (not a DTensor's shard)
# Flag bits as globals: the eager path, once per recorded value, reads them without an attribute lookup.
_VALUE, _GRAD, _GUARD = _ops.VALUE, _ops.GRAD, _ops.GUARD
# What the eager path adds to the flags of a value that requires grad: whether it hooks the value's
# gradient, so that the log pairs that gradient with this call or keeps nothing waiting for one. (A
# value that doesn't require grad gets neither: under no_grad, reentrant checkpointing's recomputation
# may still deliver its gradient, which the log's "maybe" calls are for.)
_GRAD_SURE, _GRAD_NONE = _ops.GRAD_SURE, _ops.GRAD_NONE
_INPUT_GRAD = _ops.INPUT_GRAD
_COMPILED = getattr(_ops, "COMPILED", 0)  # (0 under an older host runtime)


def _tracing() -> bool:
    return _is_compiling() or _FX_SYMBOLIC() or _is_jit_tracing()


# _tracing() as the eager hot paths spell it inline, with one call where it makes four (about 0.1 µs
# less per hook): ``_dynamo_compiling() or _compiler._is_compiling_flag or _fx._is_fx_tracing_flag
# or _is_jit_tracing()``. Dynamo answers is_dynamo_compiling() with True while it traces (and reads
# no further); torch sets compiler._is_compiling_flag while anything else compiles or exports, which
# is all is_compiling() reads in eager mode; FX's flag, read once compiling is ruled out, is what
# is_fx_symbolic_tracing() answers. On a torch without them, the same checks as _tracing().
def _inline_checks(compiler, fx) -> tuple:
    """(_dynamo_compiling, _compiler, _fx) from torch.compiler and torch.fx._symbolic_trace, or the
    fallback where either lacks what the inline spelling reads: _tracing() and two flags always False."""
    if all(hasattr(m, a) for m, a in ((compiler, "is_dynamo_compiling"), (compiler, "_is_compiling_flag"),
                                      (fx, "_is_fx_tracing_flag"))):
        return compiler.is_dynamo_compiling, compiler, fx
    never = types.SimpleNamespace(_is_compiling_flag=False, _is_fx_tracing_flag=False)
    return _tracing, never, never


_dynamo_compiling, _compiler, _fx = _inline_checks(torch.compiler, torch.fx._symbolic_trace)


# The graph task autograd is executing in this thread (-1: none, outside backward).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _recomputing() -> bool:
    """True while a forward runs inside a backward pass: activation checkpointing recomputing it.

    ``torch.utils.checkpoint`` reruns the checkpointed forward during backward:
    with ``use_reentrant=False`` from a saved-tensor unpack hook, with
    ``use_reentrant=True`` from its Function's backward. The first forward
    recorded its values and counted its calls, so a recomputation records and
    counts nothing: it only hooks gradients, which arrive from the recomputed
    graph where backward goes through it (``use_reentrant=True``) and from the
    first forward's graph otherwise.
    """
    return _graph_task_id() != -1



def _join(path: str, key) -> str:
    return f"{path}/{key}" if path else str(key)


# FX symbolic tracing hands hooks Proxies where tensors will be.
_TENSORLIKE = (torch.Tensor, torch.fx.Proxy)


def _first_tensor(values) -> int | None:
    return next((i for i, v in enumerate(values) if isinstance(v, _TENSORLIKE)), None)


def _record_grad(name: str, kind: str, path: str, flags: int, grad: torch.Tensor) -> None:
    """What the eager path's tensor hook does with a gradient: check it (a guard), hand it to the log."""
    if flags & _ops.GUARD:
        _ops.check_finite(grad, name, kind, path, from_autograd=True)
    log = _state.active(from_autograd=True)
    if log is not None and flags & _ops.GRAD:
        _ops.record_tensor(log, name, kind, path, grad, flags)  # a DTensor: its shard


class _PyGradRecorder:
    """Tensor hook of the eager path: hands a gradient to the log (:func:`_record_grad`)."""

    __slots__ = ("name", "kind", "path", "flags")

    def __init__(self, name: str, kind: str, path: str, flags: int) -> None:
        self.name, self.kind, self.path, self.flags = name, kind, path, flags

    def __call__(self, grad: torch.Tensor) -> None:
        _record_grad(self.name, self.kind, self.path, self.flags, grad)


# The key of the hook _hook_grad (and the C forward lane) puts in a tensor's hook dictionary: not
# an int, so never the id of a RemovableHandle that Tensor.register_hook adds beside it.
_HOOK_KEY = "picklehooks"

# The C hook lane (csrc/hooks.c): forward()'s eager body for a plain output (and its gradient
# hook, where _eager_tap would hook the output directly), and a GradRecorder that records a plain
# gradient in this context itself and leaves the rest to _record_grad. None, and the Python
# recorder, where the extension is off.
_lanes = _native.hook_lane(recording=_state._ANYWHERE, active=_state._ACTIVE, graph_task_id=_graph_task_id,
                           name_attr="_picklehooks_name", fallback=_record_grad, hook_key=_HOOK_KEY,
                           value_bit=_ops.VALUE, grad_bit=_ops.GRAD, guard_bit=_ops.GUARD, none_bit=_ops.GRAD_NONE,
                           sure_bit=_ops.GRAD_SURE)
_forward_lane, _GradRecorder = _lanes if _lanes is not None else (None, _PyGradRecorder)


class _Alias(torch.autograd.Function):
    """Identity on an output the module made: a new tensor on the same memory (not a view, no copy).

    Its backward hands the gradient to the recorder: the gradient of the value
    the module returned, through the caller's uses only (not the module's own
    uses of the same tensor), also when the caller later changes the tensor in
    place (a hook on a view would be lost then: autograd rebuilds a view's
    history after an in-place change).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, recorder: _GradRecorder) -> torch.Tensor:
        return x.detach()  # shares x's memory and version counter: in-place checks stay as they were

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.recorder = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.recorder(grad)
        return grad, None

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return x_tangent


# Function.apply binds its arguments to forward's signature on every call (about 10 µs);
# outside functorch's transforms the C apply underneath is all it then calls.
_alias = super(torch.autograd.Function, _Alias).apply  # bound to _Alias
_functorch_active = torch._C._are_functorch_transforms_active


_has_torch_function = torch._C._has_torch_function_unary


def _hook_grad(x: torch.Tensor, recorder: _GradRecorder) -> None:
    """``x.register_hook(recorder)``, without the ``RemovableHandle`` nobody would keep.

    On a new non-leaf tensor with no hooks yet this does what
    ``Tensor.register_hook`` does (an ``OrderedDict`` of hooks, registered with
    ``x.grad_fn``) in about 0.9 µs instead of 3.3 µs: once per recorded output
    that requires grad. Hooks added later through ``register_hook`` go into the
    same dictionary and run after this one, as they would have. Anything else
    (a tensor subclass or torch function mode, a functorch transform, a tensor
    with hooks already) takes ``register_hook`` itself.
    """
    if x._backward_hooks is None and x.grad_fn is not None and not _has_torch_function(x) \
            and not _functorch_active():
        hooks = OrderedDict()
        hooks[_HOOK_KEY] = recorder
        x._backward_hooks = hooks
        x.grad_fn._register_hook_dict(x)
    else:
        x.register_hook(recorder)


def _eager_tap(x: torch.Tensor, name: str, kind: str, path: str, flags: int, inputs: tuple | None = None,
               direct: bool = False, keep: bool = False):
    """What the tap op does, for plain eager mode, without the op's dispatch cost.

    No graph has to keep the call, so the value is recorded directly. An output
    the module made (``inputs`` given, and ``x`` neither one of them, nor a
    leaf, nor a view) reaches its caller through :class:`_Alias`, whose
    backward sees its gradient. Anything else (an input, an output that *is*
    an input, a parameter, a view such as ``Flatten``'s output) is hooked
    through a fresh view, as ``register_full_backward_hook`` hands them on:
    autograd keeps a view's base right when the caller changes either in
    place, so an in-place module still changes its caller's tensor, and a
    tensor shared with other consumers only reports the gradient flowing
    through this use. If the caller (or the next module, ``ReLU(inplace=True)``)
    changes such a view in place, autograd routes its gradient past the view's
    node, where a plain tensor hook is lost; :func:`picklehooks._views.rescue` then hooks
    it where the change sends it.

    ``direct``: the module is known not to use its own output (see
    :func:`_keeps_no_output`), or legacy ``register_backward_hook`` hooks
    attach to the output's ``grad_fn``, so a new tensor (no view) is hooked itself: the
    same gradient, without an autograd node of our own (about 10 µs less per
    output, forward and backward).

    ``keep``: ``x`` sits in a container that is handed on as it is (see
    :func:`_eager_tree`): it is hooked itself, never replaced, and its
    gradient is the one flowing through all of its uses.
    """
    if flags & _GUARD:
        _ops.check_finite(x, name, kind, path)
    log = _active_log()  # _state.active(), without the call
    if _graph_task_id() != -1:  # _recomputing(), inlined: checkpoint's recomputation hooks gradients only
        # On a device's autograd thread the log is found as gradient hooks find it.
        if not flags & _GUARD and (not flags & _GRAD or _state.active(from_autograd=True) is None):
            return x
        log = None
    elif log is None and not flags & _GUARD:
        return x
    if log is not None and flags & (_VALUE | _GRAD):
        # A gradient that flows here is hooked below if GRAD is asked for, and then only.
        known = (flags | (_GRAD_SURE if flags & _GRAD else _GRAD_NONE)) if x.requires_grad else flags
        if not flags & _VALUE:
            log._note_call(name, kind, path, x, known)
        elif type(x) in _PLAIN:
            log._add_tensor(name, kind, path, x, known)
        else:
            _ops.record_tensor(log, name, kind, path, x, known)  # a DTensor (tensor parallelism): its shard
    if flags & (_GRAD | _GUARD) and x.requires_grad:
        recorder = _GradRecorder(name, "grad_" + kind, path, flags)
        if keep:
            _hook_grad(x, recorder)  # inside a container the module or caller may hold: x itself
            if x._is_view():
                _watch_view(x, recorder)
        elif inputs is None or x.is_leaf or x._is_view() or any(x is i for i in inputs):
            # A view stays a view (Flatten, view(-1), an input handed back): autograd must know that
            # a caller's in-place change to it changes its base too, which an _Alias would hide.
            # x[...] is aten::alias, a view whose backward hands the gradient on as it is: one
            # operator dispatched, where view_as dispatches a view and, in the backward, a reshape.
            # Tensor subclasses (a jagged nested tensor, a DTensor) may lack aten::alias: view_as.
            x = x[...] if type(x) in _PLAIN else x.view_as(x)
            _hook_grad(x, recorder)
            _watch_view(x, recorder)
        elif direct:
            _hook_grad(x, recorder)  # stays with this value if the caller changes it in place
        elif _functorch_active():  # vmap, grad: the full apply (which binds arguments by signature)
            x = _Alias.apply(x, recorder)
        else:
            x = _alias(x, recorder)
    return x


# Whether a compiled graph reduces CPU values itself. Not where the native kernel is there: the
# record op's kernel then reads the value once at run time, which measured faster than Inductor's
# fused reductions (bench/bench_logging.py, "compile"), and costs nothing while nothing records,
# whereas reductions in the graph run whether or not anything records.
_GRAPH_STATS_ON_CPU = not _native.AVAILABLE


def _stats_in_graph(x, flags: int) -> bool:
    """Whether a graph being compiled computes ``x``'s statistics itself: ``mode="stats"``; a plain
    tensor (a DTensor goes to the record op's kernel, which records its shard); a dtype Inductor
    reduces as exactly as eager (:data:`~picklehooks._stats.GRAPH_DTYPES`); not empty; on a device
    without the native kernel, where the record op would copy the value to reduce it later. FX and
    ``jit.trace`` graphs always call the record op."""
    return (flags & _ops.STATS and not flags & _ops.TENSOR and _is_compiling() and _record_stats is not None
            and (type(x) is torch.Tensor or type(x) is torch.nn.Parameter)
            and x.dtype in _stats.GRAPH_DTYPES and x.numel() > 0
            and (_GRAPH_STATS_ON_CPU or x.device.type != "cpu"))


def _traced_number(x: torch.Tensor) -> bool:
    """Whether ``jit.trace`` made ``x`` from a number (``prim::NumToTensor``), not a tensor the model made."""
    try:
        return torch._C._get_value_trace(x).node().kind() == "prim::NumToTensor"
    except RuntimeError:  # not a traced value
        return False


def _traced_tap(x, name: str, kind: str, path: str, flags: int):
    """What a graph runs for one tensor: the ``record`` op reads it where it is.

    The model keeps ``x`` itself unless a gradient is wanted: only the ``tap``
    op's autograd formula can see the gradient, and it must sit in the dataflow.
    """
    if _is_compiling() and _EXPORT_KNOWN and not _is_exporting():
        flags |= _COMPILED  # a buffer Inductor may reuse; zeros where no gradient came (see _ops.COMPILED)
        if _compiled_site is not None and isinstance(x, torch.Tensor):
            # A site for the value's record and tap ops: its gradient's pairing, and its source.
            flags |= _compiled_site() << _ops._SITE_SHIFT
    if flags & _ops.GRAD and _is_compiling() and isinstance(x, torch.Tensor):
        # Only tracing knows whether this value gets a gradient (a no_grad block inside the
        # model): the compiled forward runs without autograd. Tell the kernels, for pairing.
        flags |= _ops.GRAD_SURE if x.requires_grad else _ops.GRAD_NONE
        if x.requires_grad and _graph_site is not None and not flags >> _ops._SITE_SHIFT:
            # The record op and the tap op share a site, so that the gradient finds this call
            # however the compiled backward is ordered (see _ops.graph_site).
            flags |= _graph_site() << _ops._SITE_SHIFT
    if not _is_compiling() and _is_jit_tracing() and isinstance(x, torch.Tensor) and x.dim() == 0 \
            and _traced_number(x):  # (is_compiling first: Dynamo can't trace torch._C._is_tracing)
        # A number passed to a module (XCiT's H, W), which jit.trace makes a tensor: eager records a value.
        if flags & _ops.VALUE:
            _record(x, name, kind, path, (flags & ~_ops.STATS & ~_ops.TENSOR) | _ops.NUMBER)
        return x
    if flags & _ops.VALUE:
        if _stats_in_graph(x, flags):
            _record_stats(_stats.graph_stats(x), name, kind, path, flags, x.shape, x.dtype)
        else:
            _record(x, name, kind, path, flags)
        flags = (flags & ~_ops.VALUE) | _ops.COUNTED
        if flags & _ops.GRAD_NONE and not _is_exporting():
            # No gradient can reach this value (a no_grad forward), and Dynamo guards on grad mode and
            # on requires_grad, so a call that could get one compiles its own graph. Without the tap
            # the value isn't copied (the record op counted the call). An exported graph may run
            # under another grad mode than it was traced in: it keeps its taps.
            flags &= ~_ops.GRAD
    if flags & (_ops.GRAD | _ops.GUARD):
        if flags & _ops.COUNTED and not flags & _ops.GUARD and _grad_only_tap is not None and _EXPORT_KNOWN \
                and _is_compiling() and not _is_exporting() \
                and (type(x) is torch.Tensor or type(x) is torch.nn.Parameter):
            # Only carries a gradient, in a graph torch.compile traces: a clone Inductor fuses (see _ops).
            return _grad_only_tap(x, name, kind, path, flags)
        return _tap(x, name, kind, path, flags)
    return x


def tap_tree(value, name: str, kind: str, path: str, flags: int, inputs: tuple | None = None,
             direct: bool = False, swaps: list | None = None):
    """Return ``value`` with every tensor in it tapped (the same object, unless gradients are wanted).

    ``inputs``: for an output, the module's positional inputs (see :func:`_eager_tap`).
    ``swaps``: for an input, where the eager path notes the tensors it put into the caller's
    containers for this call (see :mod:`picklehooks._swaps`).
    In eager mode see :func:`_eager_tree`; in a graph being traced, a container
    whose tensors the ``tap`` op replaces is rebuilt as its own type (the graph
    holds copies anyway), and one whose tensors all stay is passed on itself.
    """
    if not _tracing():
        return _eager_tree(value, name, kind, path, flags, inputs, direct, False, swaps)
    if isinstance(value, _TENSORLIKE):
        return _traced_tap(value, name, kind, path, flags)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        items = [tap_tree(v, name, kind, _join(path, f), flags, inputs) for f, v in zip(value._fields, value)]
        return value if _same(value, items) else type(value)(*items)
    if isinstance(value, (tuple, list)):
        items = [tap_tree(v, name, kind, _join(path, i), flags, inputs) for i, v in enumerate(value)]
        return value if _same(value, items) else type(value)(items)
    if isinstance(value, dict):
        items = [tap_tree(v, name, kind, _join(path, k), flags, inputs) for k, v in value.items()]
        return value if _same(value.values(), items) else _rebuild_mapping(value, zip(value, items))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        items = [tap_tree(getattr(value, f), name, kind, _join(path, f), flags, inputs) for f in fields]
        same = _same([getattr(value, f) for f in fields], items)
        return value if same else dataclasses.replace(value, **dict(zip(fields, items)))
    return value


def _same(old, new: list) -> bool:
    return all(a is b for a, b in zip(old, new))


def _rebuild_mapping(value: dict, pairs):
    """A dict of ``value``'s own type holding ``pairs``: ``type(value)(pairs)`` would make a
    ``Counter`` count the pairs and fail for a ``defaultdict`` (its first argument is the factory)."""
    if isinstance(value, defaultdict):
        return type(value)(value.default_factory, pairs)
    if isinstance(value, Counter):
        return type(value)(dict(pairs))
    return type(value)(pairs)


def _eager_tree(value, name: str, kind: str, path: str, flags: int, inputs: tuple | None, direct: bool, keep: bool,
                swaps: list | None = None):
    """:func:`tap_tree` in eager mode: the model and its caller get the very containers they would have.

    * A tuple (or namedtuple) whose tensors get autograd nodes of their own is
      rebuilt, as ``register_full_backward_hook`` rebuilds an output tuple.
    * An input's other containers (list, dict, dataclass, ``Counter``...) are
      handed on as they are: the module may fill them (``cache.append(x)``).
      Where gradients are captured (``swaps``, see :mod:`picklehooks._swaps`),
      each of their tensors is the module's as a hooked view for the call,
      put in its place and put back after it, so that its gradient is the
      one flowing through this module's uses, as in a graph (DenseNet's
      layers each take the list of earlier features). Otherwise, and in a
      frozen dataclass or a tuple subclass, tensors are hooked in place
      (``keep``): through all their uses.
    * An output's list or dict (an HF ``ModelOutput``, a ``defaultdict``)
      stays the same object: a tensor that gets a node of its own is put in
      its place, so its gradient is the caller's, as for a tensor output. A
      frozen dataclass or other container keeps its tensors, hooked in place.
    """
    if isinstance(value, torch.Tensor):
        return _eager_tap(value, name, kind, path, flags, inputs, direct, keep)
    if isinstance(value, tuple) and not keep and (type(value) is tuple or hasattr(value, "_fields")):
        fields = value._fields if hasattr(value, "_fields") else range(len(value))
        items = [_eager_tree(v, name, kind, _join(path, f), flags, inputs, direct, False, swaps)
                 for f, v in zip(fields, value)]
        if _same(value, items):
            return value
        return type(value)._make(items) if hasattr(value, "_fields") else tuple(items)
    keep = keep or (kind == "input" and swaps is None)
    if isinstance(value, dict):
        for k, v in list(value.items()):
            tapped = _eager_tree(v, name, kind, _join(path, k), flags, inputs, direct, keep, swaps)
            if tapped is not v:
                value[k] = tapped
                if swaps is not None:
                    swaps.append((value, k, v, tapped))
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            tapped = _eager_tree(v, name, kind, _join(path, i), flags, inputs, direct, keep, swaps)
            if tapped is not v:
                value[i] = tapped
                if swaps is not None:
                    swaps.append((value, i, v, tapped))
        return value
    if isinstance(value, tuple):  # a tuple subclass that is no namedtuple, or inside a kept container
        for i, v in enumerate(value):
            _eager_tree(v, name, kind, _join(path, i), flags, inputs, direct, True)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        frozen = value.__dataclass_params__.frozen
        for f in dataclasses.fields(value):
            if f.init:
                v = getattr(value, f.name)
                tapped = _eager_tree(v, name, kind, _join(path, f.name), flags, inputs, direct, keep or frozen, swaps)
                if tapped is not v:
                    setattr(value, f.name, tapped)
                    if swaps is not None:
                        swaps.append((value, f.name, v, tapped))
        return value
    if flags & _ops.VALUE:
        log = _state.active()
        if log is not None and not _recomputing():
            log._add_value(name, kind, path, value)
    return value


