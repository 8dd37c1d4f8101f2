"""Find the first module where NaN or Inf appears, in the forward pass or, if that is clean, in backward.

:func:`find_nonfinite` runs one forward pass, with positional and/or keyword
arguments as HF models take (and one backward pass of ``loss_fn``'s loss or,
without one, of the output's own ``.loss``), under ``record()`` and returns
the first recorded value, in execution order, holding NaN or Inf: a module's input (the model's own input,
or code between modules), its output, or a gradient. :func:`first_nonfinite`
does the same on any :class:`~picklehooks.Log`, e.g. one loaded from disk or
recorded from a scripted, compiled or exported model.

Limits: it sees only what is recorded. A plain model is instrumented with
``input``, ``output``, ``param``, ``grad_output`` and ``grad_input``; an already
instrumented model brings its own capture, and without ``grad_input`` a
gradient turned non-finite inside module M is first seen at the ``grad_output``
of the module before M. Values computed outside every instrumented module
(a parent's own code, the loss) are located only as "before this input" or
"arriving at this output". The backward pass uses ``torch.autograd.grad``, so
no parameter's ``.grad`` changes. A model instrumented with
``on_nonfinite="raise"`` stops at its first guard: the report then comes from
what was recorded before it, or the guard's ``NonfiniteError`` (which names
the module) is raised.
"""

from __future__ import annotations

import dataclasses

import torch

from .._ops import NonfiniteError
from ..capture.log import Log, Record, record
from ._common import backward, batch_tensors, hooked, loss_of, need, nonfinite_count, own_loss, stats_of

__all__ = ["NonfiniteReport", "find_nonfinite", "first_nonfinite"]

_FORWARD, _BACKWARD = ("input", "output"), ("grad_output", "grad_input")


@dataclasses.dataclass
class NonfiniteReport:
    """Where NaN/Inf first appeared, and what the module was given when it did."""

    module: str
    kind: str  # input, output, grad_output or grad_input
    path: str
    call: int
    step: int
    phase: str  # "forward" or "backward"
    stats: dict  # the offending record's statistics (n_nan and n_inf are counts)
    inputs: list[dict]  # {"path", **stats} for each input record of this module's same call
    params: list[dict]  # {"name", **stats} for each recorded parameter of that call
    note: str  # how to read it
    source: str | None = None  # the line of code that called the module, and its class (Record.source)

    def __str__(self) -> str:
        """``first NaN: h.3.mlp.act output (call 0), .../modeling_gpt2.py:412 in GPT2MLP.forward (...)``, and the note."""
        what = "NaN" if self.stats.get("n_nan") else "Inf" if self.stats.get("n_inf") else "non-finite value"
        where = f", {self.source}" if self.source else ""
        return f"first {what}: {self.module or '<root>'} {self.kind} (call {self.call}){where}: {self.note}"


def _note(rec: Record, log: Log, inputs: list[dict]) -> str:
    if rec.kind == "input":
        produced = any(r.kind == "output" and r.step == rec.step for r in log.records[:log.records.index(rec)])
        return (f"the value entering {rec.module!r} is already non-finite: it was made by code outside every "
                "instrumented module (e.g. a parent's forward)" if produced else
                "the model's input is already non-finite (or code before the first instrumented module made it so)")
    if rec.kind == "output":
        clean = inputs and all(row["n_nan"] + row["n_inf"] == 0 for row in inputs)
        return f"module {rec.module!r} turned finite inputs into a non-finite output" if clean else \
            f"module {rec.module!r} produced a non-finite output"
    if rec.kind == "grad_input":
        return (f"the backward of module {rec.module!r} turned a finite output gradient into a non-finite "
                "input gradient")
    return (f"the gradient arriving at the output of module {rec.module!r} is non-finite: it came from the loss or from "
            "code after this module (with grad_input captured, a module's own backward would be caught there)")


def first_nonfinite(log: Log) -> NonfiniteReport | None:
    """The first input, output or gradient record of ``log`` holding NaN or Inf, or None.

    >>> with picklehooks.record() as log: model(x)
    >>> first_nonfinite(log)          # NonfiniteReport(module='2', kind='output', ...) or None
    """
    rec = next((r for r in log.records if r.kind in _FORWARD + _BACKWARD and nonfinite_count(r)), None)
    if rec is None:
        return None
    same_call = [r for r in log.records if r.module == rec.module and r.step == rec.step and r.call == rec.call]
    inputs = [{"path": r.path, **stats_of(r)} for r in same_call if r.kind == "input" and stats_of(r)]
    params = [{"name": r.path, **stats_of(r)} for r in same_call if r.kind == "param" and stats_of(r)]
    return NonfiniteReport(rec.module, rec.kind, rec.path, rec.call, rec.step,
                           "forward" if rec.kind in _FORWARD else "backward", stats_of(rec), inputs, params,
                           _note(rec, log, inputs), rec.source)


def _nonfinite_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (tuple, list)) and any(_nonfinite_tensor(v) for v in value)


def find_nonfinite(model, *inputs, loss_fn=None, **kwargs) -> NonfiniteReport | None:
    """Run ``model(*inputs, **kwargs)`` (and backward of its loss); report where NaN/Inf first appears.

    >>> report = find_nonfinite(model, x, loss_fn=lambda out: out.pow(2).mean())
    >>> report.module, report.kind   # e.g. ('3', 'output'); None when everything stayed finite
    >>> find_nonfinite(hf_model, **batch)   # keyword arguments, as HF models take; backward of out.loss

    The backward pass runs on ``loss_fn(output)``, or, without ``loss_fn``,
    on the output's own loss (an HF ``ModelOutput``'s ``.loss``, there when
    the batch has ``labels``); with neither, the forward alone is checked.
    A model keyword called ``loss_fn`` can't be passed this way.
    """
    capture = ("input", "output", "param") + _BACKWARD  # gradients are recorded only if backward runs
    with hooked(model, capture=capture, mode="stats"), record() as log:
        try:
            output = model(*inputs, **kwargs)
            need(log, ("output", "input"), "find_nonfinite")
            found = first_nonfinite(log)
            if found is None and _nonfinite_tensor(output):
                return NonfiniteReport("", "output", "", 0, log.step, "forward", {}, [], [],
                                       "the model's output is non-finite but no recorded value is: the fault is "
                                       "in code outside every instrumented module")
            if found is not None or (loss_fn is None and own_loss(output) is None):
                return found  # a non-finite forward explains any backward; no need to run it
            backward(loss_of(output, loss_fn), model, batch_tensors(inputs, kwargs))
        except NonfiniteError:
            # A model instrumented with on_nonfinite="raise" stops at its guard, which records the
            # value it stops at: the log shows it.
            found = first_nonfinite(log)
            if found is None:
                raise
            return found
    return first_nonfinite(log)
