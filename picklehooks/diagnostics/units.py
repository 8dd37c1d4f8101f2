"""Find dead and saturated units: activations that never fire, or that are always pinned at a bound.

:func:`dead_units` runs the model over a stream of batches and, for every
activation module, counts the units (channels of a ``(N, C, ...)`` output,
features of a ``(N, F)`` output) that

* never activate: ``ReLU``, ``ReLU6``, ``LeakyReLU``, ``GELU``, ``SiLU``, ``ELU``
  output ``<= 0`` for every sample of every batch;
* are always saturated: ``Tanh``/``Hardtanh`` ``|y| > 0.99``, ``Sigmoid``
  ``y < 0.01`` or ``y > 0.99``, for every sample of every batch.

Such units pass no signal (dead) or no gradient (saturated): they can be
pruned or the layer re-initialised.

Each batch's recorded outputs are reduced at once to one boolean per unit
("seen alive"), so memory stays that of one batch whatever the number of
batches.

Limits: needs the outputs' tensors (``mode="tensor"``/``"both"``); a plain model
is instrumented that way for the call. Activation types are read from the
modules, so an exported model (whose modules are flattened away) reports
nothing. The model runs as it is under ``torch.no_grad()``: call ``model.eval()``
first for inference behaviour (dropout, batch norm). A module called several
times per forward pools its calls.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable

import torch

from .._shim import PicklehooksError
from ..capture.log import record
from ._common import call, hooked, module_types, need, progress

__all__ = ["dead_units", "NEVER_ACTIVE", "SATURATING"]

#: Activations whose unit is dead when its output is <= 0 on every sample.
NEVER_ACTIVE = ("ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "ELU")
#: Activations whose unit is saturated when its output is near a bound on every sample.
SATURATING = ("Tanh", "Sigmoid", "Hardtanh")


def _criterion(class_names: tuple[str, ...]) -> str | None:
    # Most specific class first: ReLU6 subclasses Hardtanh but dies like a ReLU.
    return next((n for n in class_names if n in NEVER_ACTIVE or n in SATURATING), None)


def _alive(kind: str, y: torch.Tensor, unit_dim: int) -> torch.Tensor:
    """One boolean per unit: did any sample of ``y`` show this unit working?"""
    if kind in NEVER_ACTIVE:
        working = y > 0
    elif kind == "Sigmoid":
        working = (y >= 0.01) & (y <= 0.99)
    else:
        working = y.abs() <= 0.99
    return working.movedim(unit_dim, 0).reshape(y.shape[unit_dim], -1).any(1)


def _selected(name: str, class_names: tuple[str, ...], modules) -> bool:
    if modules is None:
        return True
    if isinstance(modules, (str, type)):
        modules = [modules]
    return any(fnmatch.fnmatchcase(name, p) if isinstance(p, str) else p.__name__ in class_names for p in modules)


def dead_units(model, batches: Iterable[tuple], *, modules=None, unit_dim: int | None = None) -> list[dict]:
    """Fraction of each activation layer's units that never activate / are always saturated over ``batches``.

    >>> rows = dead_units(model, [(x,) for x in loader_batches])
    >>> rows[0]   # {'module': '1', 'type': 'ReLU', 'units': 64, 'dead': 16, 'dead_frac': 0.25, ...}

    ``modules`` narrows the layers by name pattern or type, as in ``instrument``
    (default: every activation module); ``unit_dim`` overrides the unit
    dimension (default 1 for outputs of 2 or more dimensions, 0 for 1-D).
    One row per layer: ``module, type, criterion, units``, ``dead``/``dead_frac``
    or ``saturated``/``saturated_frac``, ``indices`` (of those units), ``batches``.
    """
    alive: dict[str, torch.Tensor] = {}  # per module: has any sample shown this unit working?
    kinds: dict[str, str] = {}
    n_batches = 0
    activations = [getattr(torch.nn, n) for n in NEVER_ACTIVE + SATURATING]
    with hooked(model, capture=("output",), mode="tensor", modules=activations if modules is None else modules):
        types = module_types(model)  # read inside: a temporary instrumentation names the modules too
        for batch in progress(batches, "dead_units"):
            with torch.no_grad(), record() as log:
                call(model, batch)
            need(log, ("output",), "dead_units", tensors=True)
            for rec in log.records:
                class_names = types.get(rec.module, ())
                kind = _criterion(class_names)
                if (rec.kind != "output" or rec.tensor is None or rec.tensor.dim() == 0 or kind is None
                        or not _selected(rec.module, class_names, modules)):
                    continue
                dim = unit_dim if unit_dim is not None else (1 if rec.tensor.dim() >= 2 else 0)
                seen = _alive(kind, rec.tensor, dim)
                if rec.module in alive:
                    if alive[rec.module].shape != seen.shape:
                        raise PicklehooksError(
                            f"module {rec.module!r} has {alive[rec.module].numel()} units in one call and "
                            f"{seen.numel()} in another; pass unit_dim= to choose the unit dimension")
                    seen = alive[rec.module] | seen
                alive[rec.module], kinds[rec.module] = seen, kind
            n_batches += 1  # the log (and its tensors) is dropped here: memory stays one batch's
    if n_batches == 0:
        raise PicklehooksError("dead_units got no batches; pass an iterable of input tuples, e.g. [(x,)]")
    if not alive:
        raise PicklehooksError(
            f"no recorded output of {type(model).__name__} comes from an activation module "
            f"({', '.join(NEVER_ACTIVE + SATURATING)}) chosen by modules={modules!r}; an exported model's "
            "module types are unknown")
    rows = []
    for name, seen in alive.items():
        key = "dead" if kinds[name] in NEVER_ACTIVE else "saturated"
        indices = (~seen).nonzero().flatten().tolist()
        rows.append({"module": name, "type": types[name][0],
                     "criterion": "never active" if key == "dead" else "always saturated",
                     "units": seen.numel(), key: len(indices), f"{key}_frac": len(indices) / seen.numel(),
                     "indices": indices, "batches": n_batches})
    return rows
