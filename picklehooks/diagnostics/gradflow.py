"""Gradient flow: each layer's gradient norm over training steps, and the layers where it vanishes or explodes.

:func:`gradient_flow` runs ``loss_fn`` on the model's output for each batch
(a tuple, a dict of keyword arguments as HF models take, or a tensor; the
loss is the output's own ``.loss`` when ``loss_fn`` is left out) and
backward (stepping ``optimizer`` when given: a real training loop),
recording each module's ``grad_output``, with a progress bar in a terminal. A layer's gradient norm at a step
is the norm of the gradient arriving at its output (all of its outputs and
calls at that step together). :func:`flow_from_log` does the same from any
log holding ``grad_output`` records (steps by ``Record.step``).

Flags, with ``median`` a layer's median norm over steps and ``reference`` the
median of the layer nearest the loss (the first one backward reaches, whose
gradient is set by the loss alone), so ``ratio = median / reference`` says
what the layers in between did to the gradient on its way down:

* ``vanishing``: ``ratio < vanish`` (default 1e-7), or ``median <= floor``
  (default 0: no gradient at all);
* ``exploding``: ``ratio > explode`` (default 1e3);
* ``non-finite``: a NaN or Inf norm at any step.

Limits: measures activation gradients (``grad_output``), not parameter
gradients; a layer that gets no gradient at some step (an unused branch) has
``None`` there. Without ``optimizer`` the gradients go through
``torch.autograd.grad``: no ``.grad`` is changed and the model doesn't learn.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Iterable

from .._shim import PicklehooksError
from ..capture.log import Log, record
from ._common import (BATCH_FORMS, backward, batch_tensors, batches_of, hooked, loss_of, need, progress,
                      split_batch, stats_of)

__all__ = ["GradientFlow", "gradient_flow", "flow_from_log"]


@dataclasses.dataclass
class GradientFlow:
    """Per-layer gradient norms over steps, and the layers flagged."""

    layers: list[str]  # forward order (reverse of the order backward reached them)
    norms: dict[str, list[float | None]]  # one norm per step; None where the layer got no gradient
    reference: str  # the layer nearest the loss: ratios are relative to its median
    rows: list[dict]  # per layer: module, median, min, max, ratio, flag (None when fine)
    flagged: list[dict]  # the rows with a flag
    losses: list[float]  # per step (empty when built from a log)

    @property
    def steps(self) -> int:
        return len(next(iter(self.norms.values()), []))


def _norms_by_step(log: Log) -> tuple[list[str], dict[int, dict[str, float]]]:
    """(layers in backward order, {step: {layer: norm}}) from a log's grad_output records."""
    order: dict[str, None] = {}
    squares: dict[int, dict[str, float]] = {}
    for rec in log.records:
        stats = stats_of(rec) if rec.kind == "grad_output" else None
        if stats is None:
            continue
        order.setdefault(rec.module)
        step = squares.setdefault(rec.step, {})
        step[rec.module] = step.get(rec.module, 0.0) + stats["norm"] ** 2  # outputs and calls of a step combine
    return list(order), {s: {m: math.sqrt(v) for m, v in layer.items()} for s, layer in squares.items()}


def _check(**thresholds: float) -> None:
    for name, value in thresholds.items():
        if not isinstance(value, (int, float)) or not value >= 0:
            raise PicklehooksError(f"{name}={value!r}: use a non-negative number")


def _flow(backward_order: list[str], steps: list[dict[str, float]], losses: list[float], *, vanish: float,
          explode: float, floor: float) -> GradientFlow:
    norms = {m: [step.get(m) for step in steps] for m in reversed(backward_order)}
    medians = {}
    for m, values in norms.items():
        finite = [v for v in values if v is not None and math.isfinite(v)]
        medians[m] = statistics.median(finite) if finite else math.nan
    reference = backward_order[0]
    ref = medians[reference]
    rows = []
    for m, values in norms.items():
        present = [v for v in values if v is not None]
        ratio = medians[m] / ref if ref > 0 else math.nan
        if any(not math.isfinite(v) for v in present):
            flag = "non-finite"
        elif medians[m] <= floor or ratio < vanish:
            flag = "vanishing"
        elif ratio > explode:
            flag = "exploding"
        else:
            flag = None
        rows.append({"module": m, "median": medians[m], "min": min(present), "max": max(present),
                     "ratio": ratio, "flag": flag})
    return GradientFlow(list(norms), norms, reference, rows, [r for r in rows if r["flag"]], losses)


def flow_from_log(log: Log, *, vanish: float = 1e-7, explode: float = 1e3, floor: float = 0.0) -> GradientFlow:
    """:class:`GradientFlow` from a log's ``grad_output`` records, one step per ``Record.step``.

    >>> flow = flow_from_log(picklehooks.Log.load("run1"))
    >>> [row["module"] for row in flow.flagged]
    """
    _check(vanish=vanish, explode=explode, floor=floor)
    need(log, ("grad_output",), "flow_from_log")
    order, by_step = _norms_by_step(log)
    return _flow(order, [by_step[s] for s in sorted(by_step)], [], vanish=vanish, explode=explode, floor=floor)


def gradient_flow(model, batches: Iterable, loss_fn: Callable | None = None, *, optimizer=None,
                  n_inputs: int | None = None, vanish: float = 1e-7, explode: float = 1e3,
                  floor: float = 0.0) -> GradientFlow:
    """Per-layer gradient norms over ``batches``; flags vanishing and exploding layers.

    >>> flow = gradient_flow(model, [(x, y)], lambda out, y: F.mse_loss(out, y), n_inputs=1, optimizer=opt)
    >>> flow.flagged   # [{'module': '0', 'median': 3e-12, 'ratio': 1e-11, 'flag': 'vanishing', ...}, ...]
    >>> gradient_flow(hf_model, [batch_dict, ...])   # each run as model(**batch); the loss is out.loss

    A batch is a tuple, a dict or a single tensor. A tuple's first
    ``n_inputs`` items (default: all) go to the model, the rest to
    ``loss_fn(output, *rest)``; a dict goes to the model as keyword arguments
    (``model(**batch)``), a tensor as its one argument. ``loss_fn`` returns a
    scalar; one taking a single argument gets the output alone; without it
    the output's own ``.loss`` is used (an HF model given ``labels``).
    """
    _check(vanish=vanish, explode=explode, floor=floor)
    if n_inputs is not None and (not isinstance(n_inputs, int) or n_inputs < 0):
        raise PicklehooksError(f"n_inputs={n_inputs!r}: use how many leading batch items the model takes")
    batches = batches_of(batches, "gradient_flow")
    order: dict[str, None] = {}
    steps, losses = [], []
    with hooked(model, capture=("grad_output",), mode="stats"):
        for i, batch in enumerate(progress(batches, "gradient_flow")):
            args, kwargs, rest = split_batch(batch, f"batch {i}", n_inputs)
            with record(step=i) as log:  # one log per batch: memory stays one batch's
                output = model(*args, **kwargs)
                loss = loss_of(output, loss_fn, rest)
                if optimizer is not None:
                    optimizer.zero_grad()
                    loss.backward()
                else:
                    backward(loss, model, batch_tensors(args, kwargs))
            if optimizer is not None:
                optimizer.step()
            need(log, ("grad_output",), "gradient_flow")
            layers, by_step = _norms_by_step(log)
            order.update(dict.fromkeys(layers))
            steps.append(by_step.get(i, {}))
            losses.append(float(loss.detach()))
    if not steps:
        raise PicklehooksError(f"gradient_flow got no batches; pass an iterable of batches, each {BATCH_FORMS}")
    return _flow(list(order), steps, losses, vanish=vanish, explode=explode, floor=floor)
