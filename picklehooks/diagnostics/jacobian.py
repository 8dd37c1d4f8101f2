"""Jacobians between two layers of a model: vector-Jacobian products and a Frobenius-norm estimate.

For the map from the output of an earlier module ``input_module`` (``h``) to
the output of a later one ``output_module`` (``y = f(h)``), with
``J = dy/dh``::

    from picklehooks.diagnostics.jacobian import vjp, hutchinson_jacobian_norm
    g = vjp(model, (x,), "head", "encoder.0")               # v^T J (v = ones), shaped like h
    norm, stderr = hutchinson_jacobian_norm(model, (x,), "head", "encoder.0", samples=64)

How strongly a layer's output reacts to an earlier layer's output (gain,
sensitivity, a block's Lipschitz behaviour around ``x``) without writing the
sub-network out by hand: the model runs forward once, with temporary plain
forward hooks that keep the two modules' live (autograd-connected) outputs;
the hooks are removed again whatever happens. Modules are given as module
objects or qualified names (``"encoder.0"``); ``call`` picks which call of a
module used several times (0 = first; a pair ``(output_call, input_call)``
picks each side's, e.g. ``(1, 0)`` for a block applied twice).

``inputs`` is one batch: a tensor, a tuple of positional arguments or a
dict of keyword arguments (an HF batch). In a terminal, a progress bar counts
Hutchinson's probes.

Both work on the whole captured tensors, batch included: for a batch of
independent samples ``J`` is block-diagonal and ``||J||_F^2`` is the sum of the
samples' own squared norms; use a batch of one for one sample's Jacobian.

Limits: eager mode (plain forward hooks; a scripted, FX or exported model's
submodules aren't called as modules). A ``torch.compile``-d model is
differentiated through its original module (the same function and
parameters, run eagerly). For scripted and FX models, record an instrumented
model with ``picklehooks.record(keep_graph=True)`` and use
:meth:`picklehooks.Log.vjp` and :meth:`picklehooks.Log.jacobian_norm`. The forward runs as the model is:
call ``model.eval()`` first if dropout or batch-norm statistics should stay
out of it (a training-mode forward also updates running statistics). A
captured output that a later module changes in place (``inplace=True``
activations) gives the Jacobian of the changed value; turn ``inplace`` off.
Tensors only: the two modules must each return one tensor. The backward
pass is the model's own: gradient hooks on the way (tensor hooks, such as
:func:`picklehooks.diagnostics.surgery.clamp_grad`'s, including one on the
earlier output itself) change the result, so remove them first for the
plain Jacobian. For a log
recorded with ``picklehooks.record(keep_graph=True)``, :meth:`picklehooks.Log.vjp`
does the same between recorded values.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .._shim import PicklehooksError
from ._common import progress, split_batch

__all__ = ["vjp", "hutchinson_jacobian_norm", "recorded_vjp", "recorded_jacobian_norm"]


def _module(model: nn.Module, which, role: str) -> tuple[str, nn.Module]:
    if isinstance(which, nn.Module):
        for name, module in model.named_modules():
            if module is which:
                return name, module
        raise PicklehooksError(f"{role}: {type(which).__name__} is not a submodule of the model")
    if isinstance(which, str):
        try:
            return which, model.get_submodule(which)
        except AttributeError:
            names = [n for n, _ in model.named_modules()][1:6]
            raise PicklehooksError(f"{role}: the model has no submodule {which!r}; names look like {names}") from None
    raise PicklehooksError(f"{role} must be a submodule or its qualified name, got {type(which).__name__}")


def _calls(call) -> tuple[int, int]:
    pair = call if isinstance(call, (tuple, list)) else (call, call)
    if len(pair) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in pair):
        raise PicklehooksError(f"call={call!r}: use a call index >= 0, or a pair (output_call, input_call)")
    return pair[0], pair[1]


def _forward(model: nn.Module, inputs, output_module, input_module, call) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` once; return the live outputs (y, h) of the two modules."""
    calls = {"out": _calls(call)[0], "in": _calls(call)[1]}
    if not isinstance(model, nn.Module):
        raise PicklehooksError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise PicklehooksError(
            "a scripted model runs no Python forward hooks: instrument it before scripting, record with "
            "picklehooks.record(keep_graph=True), then use log.vjp(...) / log.jacobian_norm(...)")
    # A compiled model's intermediates live inside its graph, outside autograd; its original
    # module computes the same function with the same parameters, eagerly.
    model = getattr(model, "_orig_mod", model) if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    out_name, out_mod = _module(model, output_module, "output_module")
    in_name, in_mod = _module(model, input_module, "input_module")
    if out_mod is in_mod:
        raise PicklehooksError(f"output_module and input_module are the same module {out_name!r}")
    args, kwargs, _ = split_batch(inputs, "inputs")
    seen = {"out": [], "in": []}

    def keep(role: str, name: str):
        def hook(module, hook_inputs, output):
            seen[role].append(output)
            if role == "in" and len(seen[role]) == calls["in"] + 1 and isinstance(output, torch.Tensor) \
                    and not output.requires_grad:
                # Nothing before it needs a gradient (frozen, or an input layer): start the graph here.
                output = output.detach().requires_grad_(True)
                seen[role][-1] = output
                return output
            return None
        return hook

    handles = [in_mod.register_forward_hook(keep("in", in_name)),
               out_mod.register_forward_hook(keep("out", out_name))]
    try:
        with torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    picked = []
    for role, name in (("out", out_name), ("in", in_name)):
        values, k = seen[role], calls[role]
        if len(values) <= k:
            raise PicklehooksError(f"module {name!r} ran {len(values)} time(s) in the forward; "
                                   f"call={call!r} asks for its call number {k} (0 = first)")
        value = values[k]
        if not isinstance(value, torch.Tensor):
            raise PicklehooksError(f"module {name!r} returned {type(value).__name__}, not a tensor; "
                                   "pick a module that returns one tensor")
        picked.append(value)
    y, h = picked
    if not y.requires_grad:
        raise PicklehooksError(f"the output of {out_name!r} does not depend on the output of {in_name!r} "
                               "(it doesn't require grad); is input_module earlier in the forward?")
    return y, h


def _grad(y: torch.Tensor, h: torch.Tensor, v: torch.Tensor, *, retain: bool, unrelated: str) -> torch.Tensor:
    """``v^T dy/dh``; ``unrelated`` is the error when ``y`` doesn't depend on ``h``."""
    (g,) = torch.autograd.grad(y, h, grad_outputs=v, retain_graph=retain, allow_unused=True)
    if g is None:
        raise PicklehooksError(unrelated)
    return g


def _unrelated_outputs(names: tuple) -> str:
    return (f"the output of {names[0]!r} does not depend on the output of {names[1]!r}; "
            "is input_module earlier in the forward?")


def _names(output_module, input_module) -> tuple:
    return tuple(m if isinstance(m, str) else type(m).__name__ for m in (output_module, input_module))


def vjp(model: nn.Module, inputs, output_module, input_module, v: torch.Tensor | None = None, *,
        call: int | tuple[int, int] = 0) -> torch.Tensor:
    """``v^T J``: the vector-Jacobian product of ``output_module``'s output w.r.t. ``input_module``'s output.

    ``inputs`` is a tensor, a tuple of forward arguments or a dict of keyword
    arguments (``model(**inputs)``, an HF batch); ``v`` (shaped like
    the later output) defaults to ones, which gives the gradient of
    ``output.sum()``. Returns a tensor shaped like the earlier output.
    Parameters' ``.grad`` are not touched.
    """
    y, h = _forward(model, inputs, output_module, input_module, call)
    if v is None:
        v = torch.ones_like(y)
    elif not isinstance(v, torch.Tensor) or v.shape != y.shape:
        raise PicklehooksError(f"v must be a tensor shaped like the output of output_module {tuple(y.shape)}, "
                               f"got {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    return _grad(y, h, v.to(device=y.device, dtype=y.dtype), retain=False,
                 unrelated=_unrelated_outputs(_names(output_module, input_module)))


def hutchinson_jacobian_norm(model: nn.Module, inputs, output_module, input_module, *, samples: int = 64,
                             seed: int = 0, call: int | tuple[int, int] = 0) -> tuple[float, float]:
    """Estimate ``||J||_F`` between the two modules' outputs; return ``(estimate, standard_error)``.

    One backward pass gives one vector-Jacobian product ``J^T v``, never the
    norm itself: the exact ``||J||_F`` would take one backward per element of
    the output (every row of ``J``). Instead, for Rademacher probes ``v``
    (entries ±1 with equal probability, shaped like the output),
    ``E[||J^T v||^2] = trace(J J^T) = ||J||_F^2``; the estimate is the square
    root of the mean over ``samples`` probes (one forward, ``samples``
    backward passes). The standard error comes from the sample variance of
    ``||J^T v||^2`` by the delta method: ``se(sqrt(m)) = se(m) / (2 sqrt(m))``.
    The square root makes the estimate slightly low (Jensen), by far less
    than one standard error. Its variance is ``2 (||J J^T||_F^2 - sum_i (J J^T)_ii^2)``
    per probe, so it is exact (standard error 0) when the output has one
    element or ``J``'s rows are orthogonal.

    Probes come from a CPU ``torch.Generator`` seeded with ``seed``: the same
    on every device and unaffected by (and not affecting) the global RNG.
    For a scripted or FX model, record with ``picklehooks.record(keep_graph=True)``
    and use :meth:`picklehooks.Log.jacobian_norm`.
    """
    y, h = _forward(model, inputs, output_module, input_module, call)
    names = _names(output_module, input_module)
    unrelated = _unrelated_outputs(names)
    return hutchinson(y, lambda v, retain: _grad(y, h, v, retain=retain, unrelated=unrelated), samples=samples,
                      seed=seed)


# -- between values a log recorded with record(keep_graph=True) ----------------------------

def _recorded(log, name):
    """The one record ``name`` names in ``log`` (a module's first output, or a full key), with its graph."""
    key = (name, "output", "", 0) if isinstance(name, str) else tuple(name)
    found = log.find(*key)
    if len(found) != 1:
        example = log.records[0].key if log.records else ("fc", "output", "", 0)
        raise PicklehooksError(
            f"{name!r} names {len(found)} records; give a module name (its first output) or a "
            f"(module, kind, path, call) key such as {example}"
        )
    if found[0].live is None:
        raise PicklehooksError(
            f"record {key} kept no autograd graph; record with picklehooks.record(keep_graph=True) "
            "(eager, FX or TorchScript models; compiled and exported graphs don't expose intermediates)"
        )
    return found[0].live


def _unrelated_records(names: tuple) -> str:
    return f"{names[0]!r} does not depend on {names[1]!r}: no path between them in the graph"


def recorded_vjp(log, output_name, input_name, v: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`picklehooks.Log.vjp`: ``v^T d(output)/d(input)`` between two values ``log`` recorded.

    Names are module names (their first output) or ``(module, kind, path, call)`` keys;
    ``v`` defaults to ones. Needs ``record(keep_graph=True)``::

        with picklehooks.record(keep_graph=True) as log:
            model(x)
        g = log.vjp("head", "encoder.0")
    """
    out, inp = _recorded(log, output_name), _recorded(log, input_name)
    return _grad(out, inp, torch.ones_like(out) if v is None else v, retain=True,
                 unrelated=_unrelated_records((output_name, input_name)))


def recorded_jacobian_norm(log, output_name, input_name, *, samples: int = 64, seed: int = 0) -> tuple[float, float]:
    """:meth:`picklehooks.Log.jacobian_norm`: Hutchinson's estimate between two values ``log`` recorded.

    Returns ``(estimate, standard_error)`` of ``||d(output)/d(input)||_F`` from
    ``samples`` Rademacher probes, one backward pass each. Names as in
    :func:`recorded_vjp`; needs ``record(keep_graph=True)``.
    """
    out, inp = _recorded(log, output_name), _recorded(log, input_name)
    # retain_graph always: the log's graph stays usable for further vjp() calls.
    unrelated = _unrelated_records((output_name, input_name))
    return hutchinson(out, lambda v, _: _grad(out, inp, v, retain=True, unrelated=unrelated),
                      samples=samples, seed=seed)


# Hutchinson's estimate: for Rademacher probes v (entries +-1, shaped like the output),
# E[||J^T v||^2] = trace(J J^T) = ||J||_F^2; one backward pass gives one probe, never the norm itself.
def hutchinson(y: torch.Tensor, vjp: Callable[[torch.Tensor, bool], torch.Tensor], *, samples: int,
               seed: int) -> tuple[float, float]:
    """``(estimate, standard error)`` of ``||J||_F``; ``vjp(v, retain_graph)`` returns ``J^T v``.

    The estimate is the square root of the mean of ``||J^T v||^2`` over
    ``samples`` probes; its standard error comes from their sample variance
    by the delta method (``se(sqrt(m)) = se(m) / (2 sqrt(m))``). Probes come
    from a CPU generator seeded with ``seed``: the same on every device, and
    the global RNG is left alone.
    """
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 2:
        raise PicklehooksError(f"samples={samples!r}: use at least 2 probes (the standard error needs two)")
    generator = torch.Generator().manual_seed(seed)
    squares = []
    for i in progress(range(samples), "Jacobian norm", unit="probe"):
        v = torch.randint(0, 2, y.shape, generator=generator).to(device=y.device, dtype=y.dtype) * 2 - 1
        squares.append(vjp(v, i < samples - 1).detach().double().pow(2).sum())
    s = torch.stack(squares).cpu()
    mean = float(s.mean())
    se_mean = float(s.std(unbiased=True)) / math.sqrt(samples)
    estimate = math.sqrt(max(mean, 0.0))
    return estimate, (se_mean / (2 * estimate) if estimate > 0 else 0.0)
