"""Weights & Biases: per-layer statistics as run history, ``log.to_wandb(run)``.

:func:`log_metrics` (``log.to_wandb()``) logs, for each record with
statistics, one value per statistic in :data:`STATS`::

    picklehooks/<module>/<kind>[/<path>][/call<k>]/mean
                                                  /std
                                                  /absmax   ... one per name in ``stats``

under TensorBoard's tags (:func:`picklehooks.integrations.tensorboard.tags`),
unchanged: W&B takes any key that doesn't start with ``_``, module names'
dots included. ``/call<k>`` is added for the k-th call (k > 0) of the same
module, kind and path within one step.

**Steps.** W&B's own ``step`` (``run.log(..., step=)``) must grow with every
call in a run, so a log written after other values, or twice, would be
dropped. Instead each step of the log is one ``run.log`` row (in increasing
step order) that carries the step as a value, ``picklehooks/step`` (the
record's own ``step``, see :meth:`Log.next_step`, or ``step`` when given),
and the run is told to plot ``picklehooks/*`` against it
(``run.define_metric("picklehooks/*", step_metric="picklehooks/step")``,
W&B's "custom x-axis"). In a run that already has a step metric, pass it as
``step_metric``: in a ``transformers.Trainer`` run,
``log.to_wandb(step_metric="train/global_step")`` puts the rows at the
Trainer's steps.

The training callbacks send their per-layer summaries
(``picklehooks/<kind>/<statistic>/<layer>``, see
:mod:`picklehooks.integrations._training`) to W&B too: the ``Trainer``
callback, with ``report_to`` including ``"wandb"``, logs each recorded
step's summaries to the run the Trainer's ``WandbCallback`` started
(``wandb.run``) as ``run.log({**summaries, "train/global_step": step})``,
the step metric that callback declares for every key; Lightning's
``WandbLogger`` gets them through ``trainer.loggers`` like any logger (it
adds ``trainer/global_step``, its own step metric).

Limits:

* W&B stores history values as JSON floats (float64): NaN statistics (the
  mean of a tensor holding NaN) and infinite ones are kept as ``NaN`` and
  ``Infinity``; ``n_nan`` and ``n_inf`` are counts, always finite.
* ``define_metric`` globs are suffixes only, and when two globs match a key
  W&B picks one: in a run whose ``"*"`` has a step metric already (the
  Trainer's, Lightning's), ``picklehooks/*`` takes the picklehooks keys,
  summaries of a training callback included, so pass that run's step metric
  as ``step_metric`` (the callbacks' rows carry it).
* A log whose records come from several ranks adds ``/rank<r>`` after the
  module. Records without statistics (``mode="tensor"``) and non-tensor
  values are not logged; kept tensors are not logged as histograms.

Nothing here imports ``wandb`` unless it needs ``wandb.run``, so ``import
picklehooks`` never needs it (``pip install 'picklehooks[wandb]'``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

from .._shim import PicklehooksError
from ._training import TAG_PREFIX
from .mlflow import STATS, _check_stats
from .tensorboard import tags

__all__ = ["log_metrics", "metrics", "STATS", "STEP_METRIC"]

#: The value each row of :func:`log_metrics` carries its step in, and plots ``picklehooks/*`` against.
STEP_METRIC = f"{TAG_PREFIX}/step"
#: The step metric the ``transformers`` Trainer's ``WandbCallback`` declares for every key.
_TRAINER_STEP = "train/global_step"
_INSTALL = "pip install 'picklehooks[wandb]'"


def _wandb():
    """The ``wandb`` package, or say what to install."""
    try:
        import wandb
    except ImportError as exc:
        raise PicklehooksError(
            f"logging to Weights & Biases needs the wandb package: {_INSTALL} (or pip install wandb); "
            f"importing wandb failed: {exc}"
        ) from exc
    return wandb


def metrics(log, step: int | None = None, stats: Iterable[str] = STATS) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}``: the rows :func:`log_metrics` would log, less the step metric::

        for at, row in picklehooks.integrations.wandb.metrics(log).items():
            print(at, row)               # 0 {'picklehooks/0/output/mean': 0.0523..., ...}
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise PicklehooksError(f"step={step!r}: use an int, or None for each record's own step")
    stats = _check_stats(stats)
    rows: dict[int, dict[str, float]] = {}
    for rec, tag, at in tags(log, step):
        values = rec.stats
        if values is not None:
            rows.setdefault(at, {}).update((f"{tag}/{name}", float(values[name])) for name in stats)
    return dict(sorted(rows.items()))


def log_metrics(log, run: Any = None, *, step: int | None = None, stats: Iterable[str] = STATS,
                step_metric: str = STEP_METRIC) -> int:
    """Log ``log``'s per-layer statistics to a W&B run, one row per step; return how many values::

        run = wandb.init(project="exp1")
        picklehooks.integrations.wandb.log_metrics(log, run)        # or log.to_wandb(run)

    ``run``: what ``wandb.init()`` returned (default: ``wandb.run``). ``step``:
    the step for every record; ``None`` uses each record's ``step``. ``stats``:
    which of :data:`~picklehooks.capture.log.STAT_NAMES`. ``step_metric``: the
    key each row carries its step in (see the module's docstring).
    """
    if not isinstance(step_metric, str) or not step_metric or step_metric.startswith("_"):
        raise PicklehooksError(f"step_metric={step_metric!r}: give a key W&B keeps, such as {STEP_METRIC!r}")
    rows = metrics(log, step, stats)
    if run is None:
        run = _wandb().run
        if run is None:
            raise PicklehooksError(
                "no W&B run to log picklehooks metrics to: call wandb.init() first, or pass the run: "
                "log.to_wandb(run)"
            )
    if not callable(getattr(run, "log", None)):
        raise PicklehooksError(f"run={type(run).__name__} has no log(); pass the run that wandb.init() returned")
    define = getattr(run, "define_metric", None)
    if rows and callable(define):
        define(step_metric)  # defined by name, so the glob below doesn't plot the step against itself
        define(f"{TAG_PREFIX}/*", step_metric=step_metric)
    for at, row in rows.items():
        run.log({**row, step_metric: at})
    return sum(len(row) for row in rows.values())


def _tracker(step_metric: str = _TRAINER_STEP) -> Callable[[dict, int], None]:
    """A training callback's ``tracker(values, step)`` for ``wandb.run`` as it is when called.

    Rows carry the step as ``step_metric``, the step metric the trainer's own W&B
    callback declared. Without a run (it was finished) it warns once and skips.
    """
    warned = False

    def write(values: dict, step: int) -> None:
        nonlocal warned
        run = _wandb().run
        if run is None:
            if not warned:
                warned = True
                warnings.warn("picklehooks found no W&B run (wandb.run is None; was it finished during "
                              "training?): the per-layer summaries of this run are not sent to W&B",
                              stacklevel=2)
            return
        run.log({**values, step_metric: step})
    return write
