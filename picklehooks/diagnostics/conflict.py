"""Gradient conflict between tasks: how much, and in which direction, each task's loss pulls the shared weights.

:func:`gradient_conflict` runs one forward pass, computes each task's loss on
the output and its gradient with respect to the shared parameters
(``torch.autograd.grad``, so no ``.grad`` changes), and reports each task's
gradient norm and the pairwise cosine similarity of the flattened gradients:
+1 the tasks agree, 0 they are independent, below 0 they fight (one task's
step undoes the other's). Large norm ratios mean one task dominates the
shared trunk. ``layers`` breaks the cosines down per module.

Shared parameters are those that get a non-zero gradient from at least two
tasks (heads drop out), or the ones named in ``params``.

The batch is a tuple, a dict of keyword arguments (as HF models take) or a
tensor.

Limits: one batch (run it on a few to see if a conflict is systematic); works
on parameter gradients, so it needs no hooks and accepts a model in any form
(eager, scripted, compiled, exported), but a model without trainable
parameters has nothing to report. A task with zero gradient has cosine NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import torch

from .._shim import PicklehooksError
from ._common import loss_of, split_batch

__all__ = ["ConflictReport", "gradient_conflict"]


@dataclasses.dataclass
class ConflictReport:
    """Per-task gradient norms and pairwise cosines over the shared parameters."""

    tasks: list[str]
    params: list[str]  # the shared parameters compared
    losses: dict[str, float]
    norms: dict[str, float]  # each task's gradient norm over ``params``
    matrix: list[list[float]]  # cosine similarity, tasks x tasks (diagonal 1, NaN for a zero gradient)
    rows: list[dict]  # per pair: task_a, task_b, cosine, norm_a, norm_b
    layers: list[dict]  # the same per module owning shared parameters, plus "module"


def _cosine(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    na, nb = float(a.norm()), float(b.norm())
    return (float(a @ b) / (na * nb) if na > 0 and nb > 0 else math.nan), na, nb


def _pairs(tasks: list[str], flat: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for i, a in enumerate(tasks):
        for b in tasks[i + 1:]:
            cos, na, nb = _cosine(flat[a], flat[b])
            rows.append({"task_a": a, "task_b": b, "cosine": cos, "norm_a": na, "norm_b": nb})
    return rows


def _choose(named: dict[str, torch.Tensor], grads: dict[str, list[torch.Tensor]], params) -> list[str]:
    names = list(named)
    if params is None:
        touched = [sum(bool(g[i].any()) for g in grads.values()) for i in range(len(names))]
        chosen = [n for n, k in zip(names, touched) if k >= 2]
        if not chosen:
            raise PicklehooksError("no parameter gets a non-zero gradient from two tasks: the tasks share nothing "
                                   "(or their losses don't depend on the model); name parameters with params=")
        return chosen
    by_id = {id(p): n for n, p in named.items()}
    chosen = []
    for p in [params] if isinstance(params, (str, torch.Tensor)) else params:
        name = by_id.get(id(p)) if isinstance(p, torch.Tensor) else p
        if name not in named:
            raise PicklehooksError(f"params: {p if isinstance(p, str) else 'a tensor'!r} is not a trainable parameter "
                                   f"of the model; names look like {names[:4]}")
        chosen.append(name)
    return chosen


def gradient_conflict(model, inputs, losses: dict[str, Callable], *,
                      params: Iterable[str | torch.Tensor] | None = None) -> ConflictReport:
    """Each task's gradient norm on the shared parameters and the pairwise cosine similarities.

    >>> report = gradient_conflict(model, (x,), {"a": lambda out: out[0].mean(), "b": lambda out: out[1].mean()})
    >>> report.matrix   # [[1.0, -0.93], [-0.93, 1.0]]: the tasks pull the trunk in opposite directions

    ``inputs`` is one batch: a tuple of positional arguments, a dict of
    keyword arguments (``model(**inputs)``, an HF batch) or a single tensor.
    Each loss function gets the model's output.
    """
    if not isinstance(losses, dict) or len(losses) < 2 or not all(callable(f) for f in losses.values()):
        raise PicklehooksError(f"losses must be a dict of two or more {{task: loss_fn(output)}}, got {losses!r}")
    args, kwargs, _ = split_batch(inputs, "inputs")
    # A compiled model's parameters live under "_orig_mod."; report the eager names.
    named = {n.removeprefix("_orig_mod."): p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise PicklehooksError(f"{type(model).__name__} has no trainable parameters: there is no gradient to compare")
    output = model(*args, **kwargs)
    grads, values = {}, {}
    for task, loss_fn in losses.items():
        loss = loss_of(output, loss_fn, what=f"losses[{task!r}]")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PicklehooksError(f"losses[{task!r}] must return a scalar tensor")
        values[task] = float(loss.detach())
        if not loss.requires_grad:  # constant in the parameters: a zero gradient, honestly reported
            grads[task] = [torch.zeros_like(p) for p in named.values()]
            continue
        got = torch.autograd.grad(loss, list(named.values()), retain_graph=True, allow_unused=True)
        grads[task] = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(got, named.values())]
    shared = _choose(named, grads, params)
    index = {n: i for i, n in enumerate(named)}
    tasks = list(losses)

    def flatten(names: list[str]) -> dict[str, torch.Tensor]:
        return {t: torch.cat([grads[t][index[n]].reshape(-1).double() for n in names]) for t in tasks}

    flat = flatten(shared)
    rows = _pairs(tasks, flat)
    cos = {(r["task_a"], r["task_b"]): r["cosine"] for r in rows}
    self_cos = {t: 1.0 if bool(flat[t].any()) else math.nan for t in tasks}  # a zero gradient has no direction
    matrix = [[self_cos[a] if a == b else cos.get((a, b), cos.get((b, a))) for b in tasks] for a in tasks]
    modules: dict[str, list[str]] = {}
    for n in shared:
        modules.setdefault(n.rpartition(".")[0], []).append(n)
    layers = [{"module": m, **row} for m, names in modules.items() for row in _pairs(tasks, flatten(names))]
    return ConflictReport(tasks, shared, values, {t: float(flat[t].norm()) for t in tasks}, matrix, rows, layers)
