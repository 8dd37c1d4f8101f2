"""Find dead and saturated units: activations that never fire, or that are always pinned at a bound.

:func:`dead_units` runs the model over a stream of batches and, for every
activation module, counts the units (channels of a ``(N, C, ...)`` output,
features of a ``(N, F)`` output; the last dimension, features, for
``transformers.activations`` modules) that

* never activate: output ``<= 0`` for every sample of every batch, for
  ``torch.nn``'s ``ReLU``, ``ReLU6``, ``LeakyReLU``, ``RReLU``, ``GELU``,
  ``SiLU``, ``ELU``, ``CELU``, ``SELU``, ``Mish``, ``Hardswish`` and
  ``transformers.activations``' GELU and SiLU variants (``GELUActivation``,
  ``NewGELUActivation``, ``GELUTanh``, ``SiLUActivation``, ... : see
  :data:`HF_NEVER_ACTIVE`);
* are always saturated: ``Tanh``/``Hardtanh`` ``|y| > 0.99``, ``Sigmoid``,
  ``Hardsigmoid`` (and ``transformers``' ``LaplaceActivation``) ``y < 0.01``
  or ``y > 0.99``, for every sample of every batch.

"Never active" is one test for all of them because each is positive exactly
where its input is: the unit's pre-activation was never positive. For ReLU
that means no signal and no gradient; for the smooth ones (GELU, SiLU, Mish,
...) a negative input still gives a small output (GELU's is never below
-0.17, SiLU's -0.28) and a small gradient, so "dead" means the unit never
left that near-off regime, which is what pruning it or re-initialising the
layer is about.

What counts as an activation is decided by class: a module whose class is,
or subclasses, one of the classes named above, from ``torch.nn`` or from
``transformers.activations`` (matched by the class's module and name, so
transformers is never imported here). A scripted module keeps only its eager
class's bare name, which is matched against the same names. Anything else
(a custom activation, a ``Linear``) is not guessed at: naming one in
``modules=`` is an error that says why and what would count.

Batches come in every form :func:`picklehooks.diagnostics` takes: a tuple of
positional arguments, a dict of keyword arguments (an HF batch, run as
``model(**batch)``) or a single tensor. Each batch's recorded outputs are
reduced at once to one boolean per unit ("seen alive"), so memory stays that
of one batch whatever the number of batches. In a terminal, a tqdm progress
bar counts the batches.

Limits: needs the outputs' tensors (``mode="tensor"``/``"both"``); a plain model
is instrumented that way for the call (its chosen activation modules only).
Activation types are read from the modules, so an exported model (whose
modules are flattened away) reports nothing. The model runs as it is under
``torch.no_grad()``: call ``model.eval()`` first for inference behaviour
(dropout, batch norm). A module called several times per forward pools its
calls. Activations applied as functions (``F.relu`` in a forward) are not
modules and are not seen.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from .._shim import PicklehooksError
from ..capture.log import record
from ._common import BATCH_FORMS, batches_of, call, class_path, hooked, is_instrumented, module_types, need, progress

__all__ = ["dead_units", "NEVER_ACTIVE", "SATURATING", "HF_NEVER_ACTIVE", "HF_SATURATING"]

#: torch.nn activations whose unit is dead when its output is <= 0 on every sample.
NEVER_ACTIVE = ("ReLU", "ReLU6", "LeakyReLU", "RReLU", "GELU", "SiLU", "ELU", "CELU", "SELU", "Mish", "Hardswish")
#: torch.nn activations whose unit is saturated when its output is near a bound on every sample.
SATURATING = ("Tanh", "Sigmoid", "Hardtanh", "Hardsigmoid")
#: transformers.activations classes that are dead like a ReLU: each is positive exactly where its input is.
HF_NEVER_ACTIVE = ("GELUActivation", "NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation",
                   "QuickGELUActivation", "ClippedGELUActivation", "AccurateGELUActivation", "SiLUActivation",
                   "MishActivation", "ReLUSquaredActivation")
#: transformers.activations classes that saturate like a Sigmoid (a CDF with values in (0, 1)).
HF_SATURATING = ("LaplaceActivation",)

_TORCH, _HF = "torch.nn.modules.activation", "transformers.activations"
_KNOWN = {**{f"{_TORCH}.{n}": n for n in NEVER_ACTIVE + SATURATING},
          **{f"{_HF}.{n}": n for n in HF_NEVER_ACTIVE + HF_SATURATING}}
_BARE = frozenset(_KNOWN.values())  # what a scripted module's original_name can be matched against
_DEAD = frozenset(NEVER_ACTIVE + HF_NEVER_ACTIVE)
_HF_NAMES = frozenset(HF_NEVER_ACTIVE + HF_SATURATING)
_UNIT_INTERVAL = frozenset(("Sigmoid", "Hardsigmoid", "LaplaceActivation"))  # saturated near 0 or 1, else near +-1


def _activation(class_ids: tuple[str, ...]) -> str | None:
    """The known activation class a module's classes (qualified names, most specific first) are or subclass."""
    # Most specific class first: ReLU6 subclasses Hardtanh but dies like a ReLU.
    for c in class_ids:
        if c in _KNOWN:
            return _KNOWN[c]
        if "." not in c and c in _BARE:  # a scripted module: only its eager class's bare name survives
            return c
    return None


def _alive(kind: str, y: torch.Tensor, unit_dim: int) -> torch.Tensor:
    """One boolean per unit: did any sample of ``y`` show this unit working?"""
    if kind in _DEAD:
        working = y > 0
    elif kind in _UNIT_INTERVAL:
        working = (y >= 0.01) & (y <= 0.99)
    else:
        working = y.abs() <= 0.99
    return working.movedim(unit_dim, 0).reshape(y.shape[unit_dim], -1).any(1)


def _short_type(class_ids: tuple[str, ...]) -> str:
    return class_ids[0].rpartition(".")[2]


def _matches(name: str, class_ids: tuple[str, ...], pattern) -> bool:
    if isinstance(pattern, str):
        return fnmatch.fnmatchcase(name, pattern)
    return class_path(pattern) in class_ids or pattern.__name__ in class_ids  # the bare name: scripted


def _known_list() -> str:
    return (f"torch.nn's {', '.join(NEVER_ACTIVE + SATURATING)} or transformers.activations' "
            f"{', '.join(HF_NEVER_ACTIVE + HF_SATURATING)}")


def _not_activation(name: str, class_ids: tuple[str, ...], types: dict, modules) -> PicklehooksError:
    inside = [f"{n!r} ({_short_type(c)})" for n, c in types.items()
              if _activation(c) and (name == "" or n.startswith(name + "."))]
    hint = (f"; the activations inside it are {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}: name "
            "those" if inside else "")
    return PicklehooksError(
        f"modules={modules!r} names module {name!r} of class {class_ids[0]}, which is not an activation dead_units "
        f"can judge: a module counts when its class is, or subclasses, one of {_known_list()}{hint}; a custom "
        "activation counts when its class subclasses the listed one whose test fits it (class MyAct(nn.ReLU) "
        "is dead where its output stays <= 0)")


def _choose(types: dict[str, tuple[str, ...]], modules, model, plain: bool) -> dict[str, str]:
    """Module name -> activation class name of the modules to judge; precise errors for anything else."""
    where = f"{type(model).__name__}" if plain else f"the instrumented modules of {type(model).__name__}"
    if modules is None:
        chosen = {n: _activation(c) for n, c in types.items() if _activation(c)}
        if not chosen:
            raise PicklehooksError(
                f"found no activation module dead_units can judge ({_known_list()}, or a subclass of one) among "
                f"{where}" + ("" if plain else "; instrument them (capture='output', mode='tensor'), or pass the "
                              "plain model") + "; an exported model's module types are unknown")
        return chosen
    patterns = [modules] if isinstance(modules, (str, type)) else modules
    if not isinstance(patterns, Iterable) or not all(isinstance(p, (str, type)) for p in patterns):
        raise PicklehooksError(f"modules={modules!r}: use name patterns ('h.*.mlp.act') and/or module classes")
    patterns = list(patterns)
    named = {n: c for n, c in types.items() if any(_matches(n, c, p) for p in patterns)}
    if not named:
        raise PicklehooksError(f"modules={modules!r} chose no module of {where}; names look like "
                               f"{[n for n in types if n][:4]}")
    # Named outright (a class, or a name without wildcards) but not an activation: say so, don't skip it.
    exact = [p for p in patterns if isinstance(p, type) or not any(ch in p for ch in "*?[")]
    for n, c in named.items():
        if _activation(c) is None and any(_matches(n, c, p) for p in exact):
            raise _not_activation(n, c, types, modules)
    chosen = {n: _activation(c) for n, c in named.items() if _activation(c)}
    if not chosen:
        if len(named) == 1:
            raise _not_activation(*next(iter(named.items())), types, modules)
        some = ", ".join(f"{n!r} ({_short_type(c)})" for n, c in list(named.items())[:3])
        raise PicklehooksError(
            f"modules={modules!r} chose {len(named)} modules of {where} ({some}, ...), none of them an activation "
            f"dead_units can judge: a module counts when its class is, or subclasses, one of {_known_list()}")
    return chosen


def _unit_dim(kind: str, ndim: int) -> int:
    """The default unit dimension: features come last where transformers applies its activations
    (``(batch, sequence, features)``, and channels-last in its conv models); channels of ``(N, C, ...)``
    for torch.nn's; the only one of a 1-D output."""
    if ndim < 2:
        return 0
    return -1 if kind in _HF_NAMES else 1


def _exact(name: str) -> str:
    """An fnmatch pattern matching exactly ``name``."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


def dead_units(model, batches: Iterable, *, modules=None, unit_dim: int | None = None) -> list[dict]:
    """Fraction of each activation layer's units that never activate / are always saturated over ``batches``.

    >>> rows = dead_units(model, [(x,) for x in loader_batches])      # or [batch_dict, ...] for an HF model
    >>> rows[0]   # {'module': '1', 'type': 'ReLU', 'units': 64, 'dead': 16, 'dead_frac': 0.25, ...}

    Each batch is a tuple of positional arguments, a dict of keyword
    arguments (``model(**batch)``) or a single tensor. ``modules`` narrows
    the layers by name pattern or type, as in ``instrument`` (default: every
    activation module); a module named outright (a type, or a name without
    wildcards) that isn't an activation is an error. ``unit_dim`` overrides
    the unit dimension (default: the last for ``transformers.activations``
    modules, whose outputs are ``(batch, sequence, features)`` or
    channels-last; 1, the channels of ``(N, C, ...)``, for torch.nn's; 0 for
    a 1-D output; a torch.nn activation inside a transformer wants
    ``unit_dim=-1``). One row per layer: ``module, type, criterion,
    units``, ``dead``/``dead_frac`` or ``saturated``/``saturated_frac``,
    ``indices`` (of those units), ``batches``, and ``sources``: the lines of
    code that called the layer (``Record.source``; one per call site).
    """
    batches = batches_of(batches, "dead_units")
    alive: dict[str, torch.Tensor] = {}  # per module: has any sample shown this unit working?
    sources: dict[str, list] = {}  # per module: where its calls came from (Record.source), first seen first
    n_batches = 0
    # A plain model is instrumented on exactly the activations chosen; an instrumented one is read
    # as it is (hooked() refuses a scripted or compiled model that carries no hooks).
    plain = (isinstance(model, nn.Module) and not is_instrumented(model)
             and not isinstance(model, torch.jit.ScriptModule) and not hasattr(model, "_orig_mod"))
    types = module_types(model, named=False) if plain else {}
    chosen = _choose(types, modules, model, plain) if plain else {}
    with hooked(model, capture=("output",), mode="tensor", modules=[_exact(n) for n in chosen] if plain else None):
        if not plain:
            types = module_types(model)  # read inside: the names are the instrumentation's
            chosen = _choose(types, modules, model, plain)
        for i, batch in enumerate(progress(batches, "dead_units")):
            with torch.no_grad(), record() as log:
                call(model, batch, f"batch {i}")
            need(log, ("output",), "dead_units", tensors=True)
            for rec in log.records:
                kind = chosen.get(rec.module)
                if rec.kind != "output" or rec.tensor is None or rec.tensor.dim() == 0 or kind is None:
                    continue
                dim = unit_dim if unit_dim is not None else _unit_dim(kind, rec.tensor.dim())
                seen = _alive(kind, rec.tensor, dim)
                if rec.module in alive:
                    if alive[rec.module].shape != seen.shape:
                        raise PicklehooksError(
                            f"module {rec.module!r} has {alive[rec.module].numel()} units in one call and "
                            f"{seen.numel()} in another; pass unit_dim= to choose the unit dimension")
                    seen = alive[rec.module] | seen
                alive[rec.module] = seen
                called = sources.setdefault(rec.module, [])
                if rec.source is not None and rec.source not in called:
                    called.append(rec.source)
            n_batches += 1  # the log (and its tensors) is dropped here: memory stays one batch's
    if n_batches == 0:
        raise PicklehooksError(f"dead_units got no batches; pass an iterable of batches, each {BATCH_FORMS}")
    if not alive:
        raise PicklehooksError(
            f"none of the activation modules chosen ({', '.join(repr(n) for n in list(chosen)[:4])}) recorded a "
            "tensor output: they didn't run in the forward, or returned no tensor")
    rows = []
    for name, seen in alive.items():
        key = "dead" if chosen[name] in _DEAD else "saturated"
        indices = (~seen).nonzero().flatten().tolist()
        rows.append({"module": name, "type": _short_type(types[name]),
                     "criterion": "never active" if key == "dead" else "always saturated",
                     "units": seen.numel(), key: len(indices), f"{key}_frac": len(indices) / seen.numel(),
                     "indices": indices, "batches": n_batches, "sources": sources.get(name, [])})
    return rows
