"""Runtime for generated logging hooks, outside TorchScript.

Pinned runtime: generated hook text calls :func:`pre`, :func:`pre_kw`,
:func:`forward`, :func:`skip`, :func:`clamp_tree`, :func:`zero_pre`,
:func:`range_pre` and :func:`range_post` by these names (see the docs'
wire-contract page); the value tapping they share is :mod:`picklehooks._taps`.

A generated hook (see :mod:`picklehooks.capture.generate`) has two bodies: a typed
one that TorchScript compiles, and ``if not torch.jit.is_scripting():``
a call into this module, which walks any nested value (tuples, lists, dicts,
namedtuples, dataclasses) and taps every tensor in it. Eager mode, FX,
``torch.jit.trace``, ``torch.compile`` and ``torch.export`` all run this path;
all but eager trace it, so it must stay traceable: no data-dependent Python
control flow. In a graph a value is read by the no-output ``record`` op and
the model keeps its own tensor; only gradients go through the ``tap`` op.

While nothing records, :func:`skip` lets eager hooks return at once; while
tracing it never skips, because the trace must contain the ops whatever the
recording state is when the graph later runs.

``param_grad`` is recorded by post-accumulate-grad hooks on the parameters,
attached by ``instrument()`` and, in a model loaded elsewhere, once by the
pre-hook: directly in eager mode, through the ``watch`` op where the hook is
scripted or in a graph.

A forward recomputed by activation checkpointing (``torch.utils.checkpoint``,
either ``use_reentrant``) records nothing again: see :func:`_recomputing`.
Under FSDP2 a module's pre-hook runs after FSDP's own (FSDP prepends it), so
``param`` records read the unsharded parameter.

Limits: non-tensor values are recorded (by repr) only in eager mode. Any
forward run inside a backward pass (say, by a gradient hook) is taken for a
recomputation and records no values.
"""

from __future__ import annotations

import weakref

import torch

from . import _ops, _shim, _sites, _state, _swaps, _taps, _views
from ._swaps import SWAPPED as _SWAPPED
from ._views import VIEWS as _VIEWS
from ._shim import PicklehooksError
from ._taps import (  # noqa: F401 - re-exported: tests, bench and earlier versions' archives read them here
    _EXPORT_KNOWN, _FX_SYMBOLIC, _GRAD, _GRAD_NONE, _GRAD_SURE, _GRAPH_STATS_ON_CPU, _GUARD, _INPUT_GRAD, _PLAIN,
    _RECORDING, _TENSORLIKE, _VALUE, _Alias, _active_log, _alias, _clamp_grad, _compiler, _dynamo_compiling,
    _eager_tap, _eager_tree, _first_tensor, _forward_lane, _functorch_active, _fx, _graph_task_id, _hook_grad,
    _inline_checks, _is_compiling, _is_exporting, _is_jit_tracing, _join, _PyGradRecorder, _range_enter, _range_exit,
    _recomputing, _record, _record_grad, _record_state, _record_stats, _tap, _traced_tap, _tracing, _watch,
    _watch_one, _zero_grads, tap_tree)


def _top_frames_eager(fn) -> None:
    """Have Dynamo run a generated hook as it is, never compiled, where the hook is a frame of its own.

    ``torch.compile(model)`` runs the root's ``nn.Module.__call__`` in eager mode and compiles
    each frame it calls: the root's hooks and its ``forward``, each a graph (a submodule's hooks
    are inlined into the ``forward``'s graph). A root hook's graph hands its tapped values to
    the next graph, so where the caller gives one of them no gradient (an output the loss
    doesn't use, an input that only feeds ``mask == 0``) autograd gives that graph's backward
    zeros and its ``tap_grad`` recorded them (issue 40, item 3). Run as it is, the hook taps
    as in eager mode, and records exactly what eager mode records.

    A code object's Dynamo strategy (libtorch's ``set_code_exec_strategy``, which skips the hook's
    frame and every frame it calls) applies where Dynamo is asked to compile the frame, never
    where it inlines the hook into a graph it traces. Called by the shim for each hook it defines
    (:data:`picklehooks._shim.ON_DEFINE`); a torch without the function compiles the hook as before.
    """
    code = fn.__code__
    if _SKIP_FRAMES is None or not code.co_name.startswith("picklehooks_") \
            or getattr(fn.__globals__.get("_rt"), "_top_frames_eager", None) is not _top_frames_eager:
        return  # not a hook generated to call this runtime (a user's portable hook is compiled as ever)
    try:
        _set_strategy(code, _SKIP_FRAMES)
    except Exception:  # noqa: BLE001 - a torch that changed the function: hooks are compiled as before
        pass


# libtorch's own module, read as an attribute: no import of torch._dynamo (1.2 s), and none a
# torch.package importer would have to resolve (it can't import torch._C's submodules).
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
try:
    _set_strategy = _eval_frame.set_code_exec_strategy
    _SKIP_FRAMES = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.SKIP)
except (AttributeError, TypeError):  # an older torch
    _SKIP_FRAMES = _set_strategy = None
if _top_frames_eager not in _shim.ON_DEFINE:
    _shim.ON_DEFINE.append(_top_frames_eager)


def skip(flags: int = 0) -> bool:
    """True when an eager hook can return without doing anything (guards and profiler ranges never skip).

    :func:`pre`, :func:`pre_kw` and :func:`forward` ask it themselves; hooks
    generated by earlier versions (in saved models) also ask it first.
    """
    if flags & _ops.GUARD:
        return False
    if _dynamo_compiling():
        return _compiled_idle()
    return not (_compiler._is_compiling_flag or _RECORDING or _fx._is_fx_tracing_flag or _is_jit_tracing())


def _compiled_idle() -> bool:
    """Under Dynamo: whether the graph being traced may leave this hook out because nothing records.

    ``torch.compile`` reads :data:`_state.SWITCH` and guards on it, so a compiled model has one
    graph while nothing records, with no picklehooks op in it (it runs the plain model's work),
    and one while something does; after one call in each state, starting and stopping recording
    switches between them without compiling again. ``torch.export`` (which Dynamo traces too)
    never skips: an exported program keeps its ops and their runtime check, and so does a graph
    on a torch that doesn't say whether it is exporting or whether Dynamo is tracing, or under a
    host runtime without the switch.
    """
    switch = _state.SWITCH
    # On a torch without is_dynamo_compiling, _dynamo_compiling is _tracing(), true under any tracer.
    return (switch is not None and _EXPORT_KNOWN and _dynamo_compiling is not _tracing and not _is_exporting()
            and not switch.on)



def _call_begins(module, name: str, pre: bool) -> None:
    """Tell the log recording here that a call of ``module`` runs its hooks (``pre``: its pre-hook), so
    that it counts the call and finds where it came from (``picklehooks.capture.sources``). Not in a
    checkpoint's recomputation, whose calls record nothing; not to a log of an earlier version."""
    log = _active_log()
    if log is not None and _graph_task_id() == -1:
        begins = getattr(log, "_call_begins", None)
        if begins is not None:
            begins(module, name, pre)


# None under an older picklehooks on the host of a torch.package archive made by this version.
_call_site = getattr(torch.ops.picklehooks, "call_site", None)


def _trace_call_site(module, name: str, pre: bool) -> None:
    """In a graph that ``jit.trace``, FX or ``torch.export`` traces, say where this call of ``module``
    comes from: a ``call_site`` op, once per call (its pre-hook's, else its forward hook's; see
    :mod:`picklehooks._sites`). ``torch.compile``'s values carry their sites themselves."""
    if _call_site is None:
        return
    if _dynamo_compiling():
        if not (_EXPORT_KNOWN and _is_exporting()):
            return
        site = _sites.dynamo_call_site(name, pre)  # a constant, which Dynamo computes while tracing
    else:
        site = _sites.trace_call_site(module, name, pre)
    if site is None:
        return
    if not _dynamo_compiling() and _FX_SYMBOLIC():
        # An op without a Proxy argument would run now instead of joining the graph: add the node.
        tracer = _sites.fx_tracer()
        if tracer is not None:
            tracer.create_proxy("call_function", _call_site.default, (name, *site), {})
        return
    _call_site(name, *site)


def _state_site() -> int:
    """Site bits for a ``record_state`` op a ``torch.compile`` graph calls (its records' source), else 0."""
    compiled_site = getattr(_ops, "compiled_site", None)
    if compiled_site is None or not _is_compiling() or not _EXPORT_KNOWN or _is_exporting():
        return 0
    return compiled_site() << _ops._SITE_SHIFT


def _name_of(module) -> str:
    try:
        return module._picklehooks_name
    except AttributeError:
        # e.g. quantize_dynamic swapped the module: torch copies hooks, not attributes.
        raise PicklehooksError(
            f"a {type(module).__name__} carries picklehooks' hooks but not its name: it was replaced "
            "after instrument() (by a quantization or module swap); instrument the transformed model instead"
        ) from None


def pre(module, inputs: tuple, flags: int, state_flags: int, params: tuple, buffers: tuple, below: tuple = ()):
    """Pre-hook body: tap positional inputs; record params/buffers; watch parameters' gradients.

    A dotted name (``"ws.0"``) is a parameter of a child that has no call of its own (a
    ``ParameterList`` or ``ParameterDict`` this module reads): it is read here, at this module's
    call, and recorded and watched under the child's qualified name (``"ws"``, path ``"0"``),
    as ``instrument()`` names its ``param_grad``. ``below``: descendants' parameters whose
    ``param_grad`` is watched too, never recorded as ``param`` (see :func:`_watch_below`).
    """
    if skip(flags):
        return None
    name = _name_of(module)
    tracing = _tracing()
    if not tracing:
        _call_begins(module, name, True)
    else:
        _trace_call_site(module, name, True)
    if state_flags & _ops.VALUE:
        for kind, all_names in (("param", params), ("buffer", buffers)):
            for where, names, values in _by_owner(module, name, all_names):
                if tracing and torch.jit.is_tracing():
                    # jit.trace can't take the Tensor?[] argument of record_state ("unsupported
                    # input list type: Tensor?"): one record op per value delivers the same.
                    for n, v in zip(names, values):
                        if v is not None:
                            _record(v, where, kind, n, state_flags)
                elif tracing:
                    _record_state(values, where, kind, ",".join(names), state_flags | _state_site())
                else:
                    log = None if _recomputing() else _state.active()
                    for n, v in zip(names, values):
                        if log is not None and v is not None:
                            # A DTensor (FSDP2 outside its unsharded forward, tensor parallelism): its shard.
                            # Not detached: the log reads it now or keeps it (no operator on the device path).
                            _ops.record_tensor(log, where, kind, n, v, state_flags)
    if state_flags & _ops.PARAM_GRAD and params:
        for where, names, values in _by_owner(module, name, params):
            _watch_group(where, names, values, state_flags, tracing)
    if below and state_flags & _ops.PARAM_GRAD:
        _watch_below(module, name, below, state_flags, tracing)
    if not flags:
        return None  # the module gets its own arguments
    swaps = [] if flags & _GRAD and not tracing else None
    out = tuple(_tap_inputs(name, _positional(inputs), flags, [], swaps))
    if swaps:
        _swaps.push(module, swaps)
    return out


# id(module) -> (a weak reference to it, the ``below`` it watched in this process: the hook text's
# own tuple, so a hook generated anew, with other names, watches again). By id, not a weak-keyed
# dictionary: a look-up is then about 0.1 µs (torch's WeakIdKeyDictionary builds a key object per
# look-up, several µs), and a module that defines __eq__ or no __hash__ is no problem. An entry
# goes when its module is freed (before the id can be reused).
_WATCHED_BELOW: dict = {}


def _watch_below(module, name: str, below: tuple, state_flags: int, tracing: bool) -> None:
    """Watch ``param_grad`` of the descendants' parameters ``below`` (``"rel_pos.table"``: ``table``
    of child ``rel_pos``, recorded under ``"<name>.rel_pos"``), whose own module may never run
    (MaxViT calls its relative-position modules' ``get_bias()``, not their forward).

    ``instrument()`` watched them itself; this is for a model loaded elsewhere, where only hooks
    that run attach anything. A watch is kept per (parameter, module, name), so a descendant
    that runs and watches them too still records once. Eager: once per module and process (the
    hooks stay on the parameters), so after its first call an ancestor pays one dictionary
    look-up per call, not a watch; a parameter replaced afterwards, or one that requires grad
    only later, is watched once its own module runs. A graph keeps no state between calls, so
    its ops watch at every call; ``instrument()`` lists here only parameters whose module the
    example forward didn't show running (all of them without ``example_inputs``): see
    ``picklehooks.capture.watchers.below``.
    """
    if not tracing:
        key = id(module)
        seen = _WATCHED_BELOW.get(key)
        if seen is not None and seen[1] is below and seen[0]() is module:
            return
        _WATCHED_BELOW[key] = (weakref.ref(module, lambda _, key=key: _WATCHED_BELOW.pop(key, None)), below)
        try:
            groups = _by_owner(module, name, below)
        except AttributeError:  # surgery moved a descendant (tree.check warns, naming refresh()): not ours to fail
            return
        for where, names, values in groups:  # (a swapped module's weight may be no tensor: a method)
            _watch_group(where, names, [v if isinstance(v, torch.Tensor) else None for v in values], state_flags,
                         False)
        return
    for where, names, values in _by_owner(module, name, below):
        _watch_group(where, names, values, state_flags, True)


def _watch_group(where: str, names, values: list, state_flags: int, tracing: bool) -> None:
    """Have the gradients of one owner's parameters recorded as its ``param_grad``: directly in eager
    mode, through the op that attaches the hooks in a graph (also after saving and loading)."""
    if not tracing:
        _ops.watch_grads(where, names, values, state_flags)
    elif torch.jit.is_tracing():  # jit.trace can't take a Tensor?[] argument: one op per parameter
        # (torch.jit.is_tracing(), which dynamo understands; not torch._C._is_tracing)
        for n, v in zip(names, values):
            if v is not None:
                _watch_one(v, where, n, state_flags)
    else:
        _watch(values, where, ",".join(names), state_flags)


def _by_owner(module, name: str, names: tuple) -> tuple:
    """``((module name, names there, values), ...)`` for the parameters or buffers ``names`` that
    ``module``'s pre-hook reads: one group per owner, the module's own first. A dotted name
    (``"ws.0"``) belongs to a child with no call of its own (see :func:`pre`)."""
    if not names:
        return ()
    if "." not in ",".join(names):  # the common case, once per call: only the module's own
        return ((name, names, [getattr(module, n) for n in names]),)
    groups: dict = {}
    for n in names:
        child, _, leaf = n.rpartition(".")
        owner = module.get_submodule(child) if child else module
        where = (f"{name}.{child}" if name else child) if child else name
        group = groups.setdefault(child, (where, [], []))
        group[1].append(leaf)
        group[2].append(getattr(owner, leaf))
    return tuple(groups.values())


def _positional(args: tuple) -> list:
    """``(path, value)`` of each positional argument: the path is its position."""
    return [(str(i), v) for i, v in enumerate(args)]


def _tap_inputs(name: str, items: list, flags: int, tapped: list, swaps: list | None = None) -> list:
    """Tap each ``(path, value)`` input; the same tensor given twice stays one tensor.

    ``attn(x, x, x)`` must still see ``query is key is value`` (MultiheadAttention
    takes another path otherwise), so a repeated tensor gets the tensor tapped
    for its first position; its value is recorded at every position, its
    gradient (the sum over all of them) at the first. ``tapped`` holds
    ``(tensor, what the module gets in its place)`` for each tensor seen.

    Tensors are matched by ``is``, never by ``id()``: torch.compile would turn
    an ``id()`` into a guard on that very tensor object, and recompile for
    every new batch. ``swaps``: see :mod:`picklehooks._swaps`.
    """
    out = []
    for path, value in items:
        if not isinstance(value, _TENSORLIKE):
            out.append(tap_tree(value, name, "input", path, flags, swaps=swaps))
            continue
        first = next((t for v, t in tapped if v is value), None)
        if first is None:
            first = tap_tree(value, name, "input", path, flags)
            tapped.append((value, first))
        elif flags & _ops.VALUE:
            tap_tree(value, name, "input", path, flags & ~(_ops.GRAD | _ops.GUARD))
        out.append(first)
    return out


def pre_kw(module, args: tuple, kwargs: dict, flags: int, state_flags: int, params: tuple, buffers: tuple,
           below: tuple = ()):
    """Body of a ``with_kwargs`` pre-hook: :func:`pre`, and keyword inputs recorded under their names.

    A keyword input's record path is the keyword (``"attention_mask"``), or the
    keyword and its position inside the value (``"position_embeddings/0"``).
    """
    if skip(flags):
        return None
    pre(module, args, 0, state_flags, params, buffers, below)
    if not flags:
        return None
    name, tapped = _name_of(module), []
    swaps = [] if flags & _GRAD and not _tracing() else None
    positional = _tap_inputs(name, _positional(args), flags, tapped, swaps)
    keywords = _tap_inputs(name, list(kwargs.items()), flags, tapped, swaps)
    if swaps:
        _swaps.push(module, swaps)
    return tuple(positional), dict(zip(kwargs, keywords))


_module_globals = torch.nn.modules.module


def _legacy_backward_hooks(module) -> bool:
    """Whether ``nn.Module`` will attach ``register_backward_hook`` (non-full) hooks to this call's
    output's ``grad_fn`` (``_call_impl`` does so after the forward hooks ran)."""
    return ((bool(module._backward_hooks) and module._is_full_backward_hook is False)
            or (bool(_module_globals._global_backward_hooks) and _module_globals._global_is_full_backward_hook is False))


def _keeps_no_output(module) -> bool:
    """Whether ``module`` is one of torch.nn's own modules without submodules (``Linear``, ``LayerNorm``,
    ``GELU``...), which compute their output last and never use it themselves (``MultiheadAttention``,
    whose attention weights are both used and returned, has submodules)."""
    return type(module).__module__.startswith("torch.nn.modules.") and not module._modules


def forward(module, output, flags: int, inputs: tuple | None = None):
    """Forward-hook body: tap every tensor in the output.

    ``inputs`` (the hook's positional inputs) lets a gradient hook sit on the
    output itself; hooks generated before it existed pass none and hook a view.
    Every eager call first looks for hooked views changed in place since they
    were hooked (:func:`picklehooks._views.rescue`): an input this module
    changed (``ReLU(inplace=True)``), an earlier module's output its caller changed.
    """
    if _dynamo_compiling():
        if not flags & _GUARD and _compiled_idle():
            return None
        return _traced_output(module, output, flags, inputs)
    if _compiler._is_compiling_flag or _fx._is_fx_tracing_flag or _is_jit_tracing():
        # _tracing() (see _dynamo_compiling); first, as in skip()
        return _traced_output(module, output, flags, inputs)
    if _SWAPPED:  # the caller's tensors, which the pre-hook replaced by views in its containers
        _swaps.restore(module)
    if _VIEWS:  # hooked views, which this module or its caller may have changed in place since
        _views.rescue()
    if _RECORDING:
        _call_begins(module, _name_of(module), False)
    if flags & _INPUT_GRAD:  # (generated hooks pass it where grad_input is captured; views cover it now)
        flags &= ~_INPUT_GRAD
        if not flags:
            return None
    if _forward_lane is not None and _forward_lane(module, output, flags, inputs) is None:
        return None  # done in C: idle, or recorded (and its gradient hooked; see csrc/hooks.c)
    if not (_RECORDING or flags & _GUARD):  # skip(), the rest of it
        return None
    if flags & _GRAD and (module._backward_hooks or _module_globals._global_backward_hooks) \
            and _legacy_backward_hooks(module):
        # register_backward_hook's hooks attach to the output's grad_fn, which must stay the module's own.
        return tap_tree(output, _name_of(module), "output", "", flags, inputs, direct=True)
    if type(output) is not torch.Tensor:
        return tap_tree(output, _name_of(module), "output", "", flags, inputs)
    # The common case, with as few calls as it takes: this runs once per module call while recording.
    try:
        name = module._picklehooks_name
    except AttributeError:
        name = _name_of(module)  # raises, saying why
    if flags & _GRAD and output.requires_grad:
        return _eager_tap(output, name, "output", "", flags, inputs, _keeps_no_output(module))
    if flags & (_VALUE | _GUARD) == _VALUE:  # nothing to check or hook: record the value, if a log records here
        log = _active_log()
        if log is not None and _graph_task_id() == -1:  # not a checkpoint's recomputation (see _eager_tap)
            # Its gradient, if any, isn't hooked (GRAD isn't asked for, or output doesn't require grad).
            log._add_tensor(name, "output", "", output, flags | _GRAD_NONE if output.requires_grad else flags)
            return None
    return _eager_tap(output, name, "output", "", flags, inputs)


# -- gradient surgery (picklehooks.diagnostics.surgery), outside TorchScript ----------------------

def _traced_output(module, output, flags: int, inputs: tuple | None):
    """The forward hook in a graph being traced: the call's site, if its pre-hook gave none; the output's taps."""
    name = _name_of(module)
    _trace_call_site(module, name, False)
    return tap_tree(output, name, "output", "", flags & ~_INPUT_GRAD, inputs)


def clamp_tree(output, lo: float | None, hi: float | None):
    """Forward-hook body of ``clamp_grad``: route every tensor of the output through the clamping op."""
    if isinstance(output, _TENSORLIKE):
        return _clamp_grad(output, lo, hi) if _tracing() or output.requires_grad else output
    if isinstance(output, (tuple, list)):
        return _rebuild(output, [clamp_tree(v, lo, hi) for v in output])
    if isinstance(output, dict):
        return type(output)((k, clamp_tree(v, lo, hi)) for k, v in output.items())
    return output


def _rebuild(seq, items: list):
    """``seq``'s type (tuple, list, namedtuple) holding ``items``."""
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)


def zero_pre(module, inputs: tuple, names: tuple):
    """Pre-hook body of ``zero_param_grad``: have the named parameters' gradients zeroed."""
    params = [getattr(module, n) for n in names]
    if not _tracing():
        _ops.zero_grads(params)
        return None
    out = list(inputs)
    first = _first_tensor(out)
    if first is None:
        raise PicklehooksError(f"zero_param_grad: {type(module).__name__} gets no tensor argument to carry "
                               "the op through a traced graph; hook a module that does")
    out[first] = _zero_grads(out[first], params)
    return tuple(out)


# -- profiler ranges (instrument(profile=True)), outside TorchScript --------------------------------

def range_pre(module, inputs: tuple):
    """Pre-hook body of ``profile=True``: open the module's range (in a graph: through its first tensor input)."""
    name = _name_of(module)
    if not _tracing():
        _ops.range_enter(name)
        return None
    first = _first_tensor(inputs)
    if first is None:  # nothing to carry the op: this module gets no range in the graph
        return None
    out = list(inputs)
    out[first] = _range_enter(out[first], name)
    return tuple(out)


def range_post(module, output):
    """Forward-hook body of ``profile=True`` (always called, also when forward raised): close the range."""
    name = _name_of(module)
    if not _tracing():
        _ops.range_exit(name)
        return None
    if isinstance(output, _TENSORLIKE):
        return _range_exit(output, name)
    if isinstance(output, (tuple, list)) and (first := _first_tensor(output)) is not None:
        out = list(output)
        out[first] = _range_exit(out[first], name)
        return _rebuild(output, out)
    return None
