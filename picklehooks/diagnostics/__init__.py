"""Diagnostics built on picklehooks logs: one module per question about a model.

* :mod:`~picklehooks.diagnostics.nonfinite`: where does NaN/Inf first appear?
* :mod:`~picklehooks.diagnostics.units`: which units are dead or saturated?
* :mod:`~picklehooks.diagnostics.gradflow`: where do gradients vanish or explode?
* :mod:`~picklehooks.diagnostics.conflict`: do the tasks of a multi-task model pull against each other?
* :mod:`~picklehooks.diagnostics.compare`: where does a transformed model first differ from the original?

Imported on their own (not from here): :mod:`~picklehooks.diagnostics.profile`
(per-module time of a profiled run), :mod:`~picklehooks.diagnostics.surgery`
(portable gradient-surgery hooks), :mod:`~picklehooks.diagnostics.jacobian`
(VJP and Hutchinson Frobenius-norm estimate between layers),
:mod:`~picklehooks.diagnostics.plots` (figures of a log; needs matplotlib) and
:mod:`~picklehooks.diagnostics.report` (``python -m picklehooks report``).

Each takes a model in any form: a plain ``nn.Module`` is instrumented for the
call and cleaned up afterwards; an already instrumented model (eager, loaded,
scripted, FX-traced, compiled, exported) is used with its own hooks. Results
are dataclasses and lists of dict rows, ready for a table.

Each takes what Hugging Face models take: a batch is a tuple of positional
arguments, a dict of keyword arguments (run as ``model(**batch)``) or a
single tensor, and functions taking ``*inputs`` take keyword arguments too.
A ``loss_fn`` gets the output and the batch items the model didn't take, or
the output alone when it takes one argument; with none, the output's own
``.loss`` is used. Loops over batches show a tqdm bar in a terminal.

>>> from picklehooks.diagnostics import find_nonfinite
>>> find_nonfinite(model, x)   # None, or where NaN/Inf first appeared
>>> find_nonfinite(hf_model, **batch)   # keyword arguments; backward of out.loss when there are labels
"""

from __future__ import annotations

from .compare import Comparison, compare, record_forward
from .conflict import ConflictReport, gradient_conflict
from .gradflow import GradientFlow, flow_from_log, gradient_flow
from .nonfinite import NonfiniteReport, find_nonfinite, first_nonfinite
from .units import dead_units

__all__ = [
    "find_nonfinite",
    "first_nonfinite",
    "NonfiniteReport",
    "dead_units",
    "gradient_flow",
    "flow_from_log",
    "GradientFlow",
    "gradient_conflict",
    "ConflictReport",
    "compare",
    "record_forward",
    "Comparison",
]
