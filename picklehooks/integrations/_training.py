"""What the training callbacks share: which steps record, what a recorded step holds, what trackers get.

:class:`StepRecorder` is framework-free; :mod:`~picklehooks.integrations.transformers`
and :mod:`~picklehooks.integrations.lightning` only tell it when a trainer's
events happen. The rules, the same in both:

* **Which steps.** A step is recorded when the framework's own logging rule,
  with ``every_n_steps`` as its logging interval, logs it (each callback
  says which rule), so that with ``every_n_steps`` equal to the trainer's
  logging interval the records and the trainer's logged loss are at the same
  steps; in between the hooks stay idle (``record()``'s cost when nothing
  records). ``every_n_steps=1`` records every step.
* **Steps and micro-batches.** A recorded step's records carry the step the
  trainer's own trackers put that step's loss at (the callback says which),
  and ``call`` counts anew at each step (:meth:`~picklehooks.Log.begin_step`):
  with gradient accumulation, micro-batch ``k`` of a module run once per
  forward is ``call == k``, in every form of the model.
* **Parameter gradients.** With ``"param_grad"`` in ``capture``, the hooks
  don't record the gradient of each backward; instead, once per recorded
  step, ``param_grad`` (``call`` 0) is each parameter's ``.grad`` as the
  optimizer is about to use it: accumulated over the micro-batches, *after*
  gradient clipping. (The norm before clipping is what the trainers log as
  ``grad_norm``.)
* **Recording only inside the training step.** The log records during the
  forward and backward passes of a recorded step only, not during
  evaluation, and never after an exception: one raised inside a step stops
  recording, removes the hooks and writes a sink's waiting records, and a
  :class:`~picklehooks.NonfiniteError` from a guard (``on_nonfinite="raise"``)
  is in the log as a record of the bad value (its counts, its step), also in
  a step that was not recorded, so a report of the log names it.
* **Trackers.** After each recorded step, per-layer summaries go to the
  trainer's trackers at that step, as scalars tagged
  ``picklehooks/<kind>/<statistic>/<module>`` (see :func:`summaries`).

Limits: one optimizer (Lightning: automatic optimization); evaluation passes
are not recorded; the summaries read the step's statistics, one host sync per
device per recorded step.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterable

from .. import _state
from .._deliver import NonfiniteError, record_tensor
from .._shim import PicklehooksError
from ..capture import tree as _tree
from ..capture.instrument import _NAME_ATTR, DEFAULT_CAPTURE, MODES, _check_capture, _select, instrument
from ..capture.log import STAT_NAMES, Log
from ..capture.record import _record_from_row

__all__ = ["StepRecorder", "summaries", "SUMMARY_STATS", "TAG_PREFIX"]

TAG_PREFIX = "picklehooks"
#: What :func:`summaries` writes per layer and kind, pooled over the step's calls and paths:
#: the largest magnitude, or the norm of all of the values together (``sqrt`` of the sum of
#: the squared norms). Every kind also gets ``nonfinite`` (NaN and Inf counted) when it isn't 0.
SUMMARY_STATS = {"input": ("absmax",), "output": ("absmax", "norm"), "grad_input": ("norm",),
                 "grad_output": ("norm",), "param": ("norm",), "buffer": ("absmax",), "param_grad": ("norm",)}


def summaries(records: Iterable) -> dict[str, float]:
    """``{tag: value}`` per layer for the records of one step (see :data:`SUMMARY_STATS`).

    Tags are ``picklehooks/<kind>/<statistic>/<module>`` (``root`` for the model
    itself), so a tracker lists one statistic of one kind for every layer together.
    """
    pooled: dict[tuple[str, str], list] = {}
    for rec in records:
        stats = rec.stats
        if stats is None:
            continue
        acc = pooled.setdefault((rec.module, rec.kind), [0.0, 0.0, 0])
        absmax, norm = float(stats["absmax"]), float(stats["norm"])
        acc[0] = absmax if math.isnan(absmax) or absmax > acc[0] else acc[0]
        acc[1] += norm * norm
        acc[2] += int(stats["n_nan"]) + int(stats["n_inf"])
    out = {}
    for (module, kind), (absmax, sum_sq, bad) in pooled.items():
        values = {"absmax": absmax, "norm": math.sqrt(sum_sq)}
        layer = module or "root"
        for name in SUMMARY_STATS.get(kind, ("absmax",)):
            out[f"{TAG_PREFIX}/{kind}/{name}/{layer}"] = values[name]
        if bad:
            out[f"{TAG_PREFIX}/{kind}/nonfinite/{layer}"] = float(bad)
    return out


class StepRecorder:
    """Records chosen optimizer steps of a training run into one :class:`~picklehooks.Log`.

    ``instrument_args`` are :func:`picklehooks.instrument`'s keyword arguments;
    ``sink``: a directory to stream the records to (Parquet, see :func:`picklehooks.record`).
    """

    def __init__(self, *, every_n_steps: int = 1, sink: str | os.PathLike | None = None,
                 **instrument_args) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise PicklehooksError(f"every_n_steps={every_n_steps!r}: give a whole number of steps, 1 or more")
        unknown = set(instrument_args) - {"modules", "depth", "capture", "mode", "on_nonfinite", "profile"}
        if unknown:
            raise PicklehooksError(
                f"{sorted(unknown)}: not arguments a training callback can pass to instrument(); it takes "
                "modules, depth, capture, mode, on_nonfinite and profile (the trainer's model is eager)")
        kinds = _check_capture(instrument_args.get("capture", DEFAULT_CAPTURE))  # bad input fails here, not in fit
        self.param_grad = "param_grad" in kinds
        self.instrument_args = {**instrument_args, "capture": tuple(k for k in kinds if k != "param_grad")}
        mode = instrument_args.get("mode", "stats")
        if mode not in MODES:
            raise PicklehooksError(f"mode={mode!r}: use one of {', '.join(MODES)}")
        if not self.instrument_args["capture"] and (instrument_args.get("on_nonfinite") or instrument_args.get("profile")):
            raise PicklehooksError(
                f"capture={instrument_args['capture']!r} records parameter gradients only, at the optimizer step, "
                "so no hook would run to guard or time the modules; add a forward kind such as 'output'")
        self.store = MODES[mode]
        self.every_n_steps = every_n_steps
        self.sink = sink
        self.log: Log | None = None
        self.handle = None
        self.step: int | None = None  # the step being recorded, or None
        self._owners: dict = {}
        self._token = None
        self._first = 0

    # -- the run -----------------------------------------------------------------
    def start(self, model) -> None:
        """Instrument ``model`` (a run starts); a log is made the first time, and kept across runs."""
        self.finish()  # what an earlier run that died outside a step left
        taken = [name for name, module in model.named_modules() if _NAME_ATTR in module.__dict__]
        if taken:
            raise PicklehooksError(
                f"modules {taken[:3]} are instrumented already; a training callback instruments the model "
                "itself: call remove() on that handle and pass instrument()'s arguments to the callback")
        if self.param_grad:  # the modules instrument() chooses, containers included: they own parameters too
            self._owners = _select(model, self.instrument_args.get("modules"), self.instrument_args.get("depth"))
        if self.instrument_args["capture"]:
            self.handle = instrument(model, **self.instrument_args)
        if self.log is None:
            self.log = Log(sink=self.sink)

    def finish(self) -> None:
        """Stop recording, remove the hooks and write what a sink's log still holds (a run ends)."""
        self.deactivate()
        self.step = None
        handle, self.handle = self.handle, None
        try:
            if handle is not None:
                handle.remove()
        finally:
            if self.log is not None and self.log.sink is not None:
                self.log.flush()

    # -- one optimizer step ------------------------------------------------------
    def begin_step(self, step: int, chosen: bool) -> bool:
        """An optimizer step begins; its records carry ``step``; ``chosen``: whether the framework's logging
        rule picks it (see the callbacks). Return whether it records."""
        self.deactivate()
        self.step = step if chosen else None
        if self.step is not None:
            _tree.check()  # as record() does: surgery since the last step renames and warns
            self.log.begin_step(step)
            self._first = len(self.log.records)
        return self.step is not None

    def activate(self) -> None:
        """Record from here (a micro-batch of a recorded step starts); nothing outside a recorded step."""
        if self.step is not None and self._token is None:
            self._token = _state.push(self.log)

    def deactivate(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            _state.pop(self.log, token)

    def record_param_grads(self) -> None:
        """``param_grad`` of the recorded step: each chosen module's parameters' ``.grad`` now."""
        if self.step is None or not self.param_grad:
            return
        for name, module in self._owners.items():
            for pname, param in module.named_parameters(recurse=False):
                if param is not None and param.grad is not None:
                    record_tensor(self.log, name, "param_grad", pname, param.grad.detach(), self.store)

    def end_step(self, trackers: Iterable[Callable[[dict, int], None]] = ()) -> dict[str, float]:
        """The step ends: stop recording; give its :func:`summaries` to each tracker; return them."""
        self.deactivate()
        step, self.step = self.step, None
        if step is None:
            return {}
        values = summaries(self.log.records[self._first:])
        if values:
            for tracker in trackers:
                tracker(values, step)
        return values

    def fail(self, exc: BaseException, step: int | None) -> None:
        """An exception left the training step: record a guard's hit if it isn't yet, then :meth:`finish`.

        Never raises: the trainer re-raises ``exc``, which must stay the error the user sees; a
        failure here (a sink that can't be written) is added to it as a note.
        """
        for cleanup in (lambda: self._record_guard_hit(exc, step), self.finish):
            try:
                cleanup()
            except Exception as error:  # noqa: BLE001 - reported on the user's own error instead
                exc.add_note(f"picklehooks could not clean up after this error: {error!r}")

    def _record_guard_hit(self, exc: BaseException, step: int | None) -> None:
        self.deactivate()
        if isinstance(exc, NonfiniteError) and exc.step is None and exc.nan is not None and self.log is not None:
            # Raised outside a recorded step, so check_finite found no log: record what the error knows.
            row = {"module": exc.module, "kind": exc.kind, "path": exc.path, "call": 0,
                   "step": step if step is not None else self.log.step, "shape": list(exc.shape or ()),
                   "dtype": exc.dtype, "value": None, **{name: math.nan for name in STAT_NAMES}}
            row["n_nan"], row["n_inf"] = exc.nan, exc.inf
            self.log.records.append(_record_from_row(row, None))
