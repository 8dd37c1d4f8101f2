"""What the recording ops and hooks do on the host side: flags, guards, and delivery to the log.

Pinned runtime (see the docs' wire-contract page): generated hook text and
torch.package archives reach these names through :mod:`picklehooks._ops`,
which re-exports every one of them; this module never moves or renames them.

* flag bits (:data:`VALUE` ... :data:`INPUT_GRAD`) that generated text writes into each op call;
* :class:`NonfiniteError` and :func:`check_finite` (``instrument(on_nonfinite="raise")``);
* ``param_grad``: post-accumulate-grad hooks on parameters (:func:`watch_grads`);
* gradient surgery's zeroing hooks (:func:`zero_grads`) and profiler ranges (:func:`range_enter`);
* :func:`record_tensor` and :func:`_deliver`: a value to the active log's row-writing path;
* tap sites (:func:`graph_site`): which forward call a compiled graph's gradient belongs to.

Limits: :func:`check_finite` syncs with the device once per guarded tensor.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _shards, _sites, _state
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
#: the module changed in place (read by earlier versions; views are watched now). No kernel sees it.
INPUT_GRAD = 512
#: On a ``record`` op traced by ``jit.trace``: the value is a number the tracer turned into a 0-dim
#: tensor (``x.shape[0]`` passed to a module), recorded as the number eager mode records.
NUMBER = 1024
#: Set by ``torch.compile`` tracing (not ``torch.export``) on every value it records or taps. Such a
#: value is a buffer of the compiled graph, which Inductor may reuse for later values once the op
#: returns, without a version bump: the log copies it, never keeps it by reference. And a compiled
#: backward gets zeros, not ``None``, for a graph output the caller gave no gradient, so an all-zero
#: gradient there may stand for none (the log marks it: see
#: :meth:`picklehooks.capture.rows.Rows._mark_zeros_if_none`). Earlier versions' kernels ignore it.
COMPILED = 2048


class NonfiniteError(PicklehooksError, FloatingPointError):
    """``instrument(..., on_nonfinite="raise")`` saw NaN or Inf: the message names the module and step.

    Also as attributes: ``module``, ``kind``, ``path``, ``step`` (``None`` outside ``record()``),
    and, when raised by a guard, ``nan`` and ``inf`` (the counts), ``shape`` and ``dtype`` of the value.
    """

    def __init__(self, message: str, module: str = "", kind: str = "", path: str = "", step: int | None = None,
                 nan: int | None = None, inf: int | None = None, shape: tuple | None = None,
                 dtype: str | None = None):
        super().__init__(message)
        self.module, self.kind, self.path, self.step = module, kind, path, step
        self.nan, self.inf, self.shape, self.dtype = nan, inf, shape, dtype

    def __reduce__(self):
        return type(self), (str(self), self.module, self.kind, self.path, self.step, self.nan, self.inf,
                            self.shape, self.dtype)


def check_finite(x: torch.Tensor, module: str, kind: str, path: str, *, from_autograd: bool = False) -> None:
    """Raise :class:`NonfiniteError` if ``x`` holds NaN or Inf (a host sync: guards pay one per tensor).

    While a log records, the bad value's statistics are recorded first, so the log (and the report
    written from it after the stop) names the module, step and counts, as the error does.
    """
    if not bool(torch.isfinite(x).all()):
        log = _state.active(from_autograd=from_autograd)
        where = f"at step {log.step}" if log is not None else "outside picklehooks.record(), so no step is known"
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        at = f" (path {path!r})" if path else ""
        error = NonfiniteError(
            f"non-finite {kind} in module {module!r}{at} {where}: {nan} NaN, {inf} Inf among {x.numel()} values",
            module, kind, path, None if log is None else log.step, nan, inf, tuple(x.shape),
            str(x.dtype).removeprefix("torch."))
        if log is not None:
            try:
                record_tensor(log, module, kind, path, x.detach(), STATS)
            except Exception as exc:  # the guard's error comes first; say why its record is missing
                error.add_note(f"picklehooks could not record this value in the log: {exc!r}")
        raise error


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
    :func:`picklehooks.integrations.distributed.fsdp_sharded`).
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
    which :func:`picklehooks.integrations.distributed.gather` merges across ranks."""
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

#: Site -> the Python stack Dynamo was tracing when :func:`compiled_site` drew it, innermost first:
#: ``(code, line, globals, whether the frame's self is a module, the hooked module's class or None)``
#: per frame (classes, not modules: a model must stay free to go). For this process's compiled
#: graphs only; a log turns it into the record's source (picklehooks.capture.sources).
SITE_FRAMES: dict[int, tuple] = {}


def compiled_site() -> int:
    """:func:`graph_site`, remembering where in the model's code the value being traced is (a
    ``torch.compile`` graph's records then get their ``source``, as eager mode finds it)."""
    site = graph_site()
    frames = _sites.dynamo_frames()
    if frames is not None:
        SITE_FRAMES[site] = frames
    return site


compiled_site._dynamo_marked_constant = True


def _note_site(log, module: str, kind: str, path: str, flags: int) -> None:
    frames = SITE_FRAMES.get(flags >> _SITE_SHIFT)
    if frames is not None:
        note = getattr(log, "_graph_call_site", None)  # (a host log of an earlier version: none)
        if note is not None:
            note(module, kind, path, frames)
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



# A copy of this file inside a torch.package archive (see picklehooks._shim) defers to the host's
# picklehooks where one is installed: one set of watched parameters and open ranges, and the host's
# error class (so that ``except picklehooks.NonfiniteError`` catches packaged hooks' errors). The
# host's picklehooks._ops has these names in every version.
if __name__ != "picklehooks._deliver":
    try:
        _host = importlib.import_module("picklehooks._ops")
    except ImportError:
        pass
    else:
        (NonfiniteError, check_finite, watch_grads, unwatch_grads, zero_grads, unzero_grads, range_enter,
         range_exit) = (_host.NonfiniteError, _host.check_finite, _host.watch_grads, _host.unwatch_grads,
                        _host.zero_grads, _host.unzero_grads, _host.range_enter, _host.range_exit)
