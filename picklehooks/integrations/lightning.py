"""``PicklehooksCallback`` for Lightning (``pip install 'picklehooks[lightning]'``)::

    from picklehooks.integrations.lightning import PicklehooksCallback

    callback = PicklehooksCallback(capture=("output", "grad_output", "param_grad"), every_n_steps=10)
    trainer = lightning.Trainer(callbacks=[callback], accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(module, loader)
    frame = callback.recorded.to_pandas(kind="param_grad")

The callback instruments the ``LightningModule`` when fitting starts (module
names are relative to it: ``model.0`` for ``self.model[0]``) and removes the
hooks when it ends. How steps, micro-batches, parameter gradients and
trackers are handled is in :mod:`picklehooks.integrations._training`; here:

* **Step numbers** are ``trainer.global_step`` as the optimizer step begins
  (0 for the first): the step Lightning's loggers put values that
  ``self.log`` logged in that step's last ``training_step`` at.
* **Which steps**: Lightning's own logging rule
  (``_LoggerConnector.should_update_logs``) with ``every_n_steps`` as
  ``log_every_n_steps``: step ``i`` (from 0) when
  ``(i + 1) % every_n_steps == 0``, and every step once ``trainer.should_stop``
  is set. With ``every_n_steps == log_every_n_steps`` every recorded step is
  a step whose ``self.log`` values Lightning logs.
* **Micro-batches** (``accumulate_grad_batches``): ``call == k`` for the k-th
  micro-batch of a module run once per forward.
* **param_grad** is read in ``on_train_batch_end`` of the batch that stepped:
  after ``gradient_clip_val`` clipped the gradients and the optimizer used
  them, before the next step zeroes them (Lightning zeroes gradients at the
  start of the next step, not after ``optimizer.step()``). An optimizer that
  changes ``.grad`` in place while stepping would show there.
* **Trackers**: the summaries go to every logger of the trainer
  (``trainer.loggers``: TensorBoard, MLflow, CSV, ...) through
  ``log_metrics``. ``trackers=False`` turns this off.
* **Exceptions**: recording runs from ``on_train_batch_start`` to
  ``on_train_batch_end``; ``on_exception`` stops it and removes the hooks, so
  nothing records after an exception; the records so far stay in ``callback.recorded``.

Limits: automatic optimization with one optimizer; validation and test loops
are not recorded; a step in which ``trainer.should_stop`` is set (which
Lightning logs) is recorded only if the rule chose it as it began; a module
only Lightning's strategy wraps (``DDP``) is instrumented as the
``LightningModule`` it wraps.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import Callback

from ._training import StepRecorder

__all__ = ["PicklehooksCallback"]


class PicklehooksCallback(Callback):
    """Record chosen steps of a Lightning fit into :attr:`recorded` (see the module's docstring).

    ``every_n_steps``: record the steps Lightning would log with ``log_every_n_steps=every_n_steps``
    (step ``i``, from 0, when ``(i + 1) % every_n_steps == 0``).
    ``sink``: a directory to stream the records to as Parquet (``pip install 'picklehooks[parquet]'``).
    ``trackers``: send per-layer summaries of each recorded step to ``trainer.loggers``. The other
    keyword arguments are :func:`picklehooks.instrument`'s: ``modules``, ``depth``, ``capture``,
    ``mode``, ``on_nonfinite``, ``profile``.
    """

    def __init__(self, *, every_n_steps: int = 1, sink: str | os.PathLike | None = None, trackers: bool = True,
                 **instrument_args) -> None:
        self._core = StepRecorder(every_n_steps=every_n_steps, sink=sink, **instrument_args)
        self.trackers = trackers
        self._index: int | None = None  # trainer.global_step when the step being run began

    @property
    def recorded(self):
        """The :class:`~picklehooks.Log` of every recorded step (``None`` before fitting starts)."""
        return self._core.log

    def on_fit_start(self, trainer, pl_module) -> None:
        self._index = None
        self._core.start(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        index = trainer.global_step
        if index != self._index:  # the first micro-batch of an optimizer step
            self._index = index
            # _LoggerConnector.should_update_logs, with every_n_steps as log_every_n_steps: Lightning
            # decides after the step's last batch, when _batches_that_stepped is still what it is here.
            stepped = trainer.fit_loop.epoch_loop._batches_that_stepped
            self._core.begin_step(index, (stepped + 1) % self._core.every_n_steps == 0 or trainer.should_stop)
        self._core.activate()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._core.deactivate()
        if trainer.global_step != self._index:  # this batch stepped the optimizer
            self._core.record_param_grads()
            loggers = list(trainer.loggers) if self.trackers else []
            self._core.end_step([_logger(lg) for lg in loggers])

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._core.fail(exception, self._index)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._core.finish()


def _logger(logger):
    def write(values: dict, step: int) -> None:
        logger.log_metrics(values, step=step)
    return write
