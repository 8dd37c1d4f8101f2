"""``PicklehooksCallback`` for the ``transformers`` ``Trainer`` (``pip install 'picklehooks[transformers]'``)::

    from picklehooks.integrations.transformers import PicklehooksCallback

    callback = PicklehooksCallback(capture=("output", "grad_output", "param_grad"), every_n_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    frame = callback.recorded.to_pandas(kind="param_grad")   # or record to Parquet with sink="runs/exp1"

The callback instruments the model when training begins (with
:func:`picklehooks.instrument`'s arguments, given to it) and removes the
hooks when it ends. How steps, micro-batches, parameter gradients and
trackers are handled is in :mod:`picklehooks.integrations._training`; here:

* **Step numbers** are the Trainer's ``state.global_step`` once the step is
  done (1 for the first optimizer step): the step the Trainer logs that
  step's ``loss`` and ``grad_norm`` at, so both line up in TensorBoard.
* **Which steps**: the Trainer's own logging rule (``DefaultFlowCallback``)
  with ``every_n_steps`` as ``logging_steps``: step ``s`` when
  ``s % every_n_steps == 0``, and step 1 too where ``logging_first_step``
  is set. With ``every_n_steps == logging_steps`` every recorded step is a
  step whose loss the Trainer logs.
* **Micro-batches** (``gradient_accumulation_steps``): ``call == k`` for the
  k-th micro-batch of a module run once per forward.
* **param_grad** is read in ``on_pre_optimizer_step``: after the Trainer
  clipped the gradients (``max_grad_norm``), before ``optimizer.step()``.
* **Trackers**: with ``report_to`` including ``"tensorboard"``, the summaries
  go to the Trainer's own ``SummaryWriter``; with ``"mlflow"``, to the MLflow
  run the Trainer started; with ``"wandb"``, to the W&B run the Trainer
  started (``wandb.run``), each row carrying ``train/global_step``, the
  step metric the Trainer's ``WandbCallback`` declares (on the main process
  only). ``trackers=False`` turns this off.
* **Exceptions**: the callback records only inside ``Trainer.training_step``
  (the forward and backward passes), which it wraps for the run, so an
  exception there (a guard's :class:`~picklehooks.NonfiniteError`, an
  out-of-memory error) leaves nothing recording and no hooks; the records so
  far stay in ``callback.recorded``.

Limits: the Trainer is found from the callback's ``on_train_begin`` (the
frame that called it); a training loop that calls the callback's events
itself, without a ``Trainer``, gets no exception safety and no trackers, and
is warned. Evaluation and prediction are not recorded. Which steps record
follows the ``"steps"`` logging rule whatever ``logging_strategy`` is.
"""

from __future__ import annotations

import os
import sys
import warnings

import transformers
from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback

from .._shim import PicklehooksError
from ._training import StepRecorder
from .wandb import _tracker as _wandb_tracker

__all__ = ["PicklehooksCallback"]


def _calling_trainer(depth: int = 12):
    """The ``Trainer`` whose training loop is calling us: the ``self`` of a frame up the stack."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


class PicklehooksCallback(transformers.TrainerCallback):
    """Record chosen steps of a ``Trainer`` run into :attr:`recorded` (see the module's docstring).

    ``every_n_steps``: record the steps the Trainer would log with ``logging_steps=every_n_steps``
    (step ``s``, from 1, when ``s % every_n_steps == 0``; also step 1 with ``logging_first_step``).
    ``sink``: a directory to stream the records to as Parquet (``pip install 'picklehooks[parquet]'``).
    ``trackers``: send per-layer summaries of each recorded step to the Trainer's TensorBoard,
    MLflow and W&B. The other keyword arguments are :func:`picklehooks.instrument`'s: ``modules``,
    ``depth``, ``capture``, ``mode``, ``on_nonfinite``, ``profile``.
    """

    def __init__(self, *, every_n_steps: int = 1, sink: str | os.PathLike | None = None, trackers: bool = True,
                 **instrument_args) -> None:
        self._core = StepRecorder(every_n_steps=every_n_steps, sink=sink, **instrument_args)
        self.trackers = trackers
        self._trainer = None
        self._wrapped = None
        self._wandb = None  # one W&B tracker a run, so that a missing run is warned about once

    @property
    def recorded(self):
        """The :class:`~picklehooks.Log` of every recorded step (``None`` before training begins)."""
        return self._core.log

    # -- events -------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise PicklehooksError("on_train_begin got no model: PicklehooksCallback needs the Trainer's model")
        self._core.start(model)
        self._wandb = None
        trainer = _calling_trainer()
        if trainer is None:
            warnings.warn("PicklehooksCallback found no transformers.Trainer calling it: an exception inside a "
                          "training step may leave recording on until the next step begins, and no tracker gets "
                          "the summaries", stacklevel=2)
        else:
            self._wrap(trainer)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1  # what global_step is once this step is done, when the Trainer decides
        # DefaultFlowCallback.on_step_end's rule for should_log, with every_n_steps as logging_steps.
        chosen = step % self._core.every_n_steps == 0 or (step == 1 and args.logging_first_step)
        if self._trainer is None:  # no wrapped training_step: record from here to the step's end
            if self._core.begin_step(step, chosen):
                self._core.activate()
            return
        self._core.begin_step(step, chosen)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._core.deactivate()
        self._core.record_param_grads()

    def on_step_end(self, args, state, control, **kwargs):
        self._core.end_step(self._trackers(args) if self.trackers else ())

    def on_train_end(self, args, state, control, **kwargs):
        self._unwrap()
        self._core.finish()

    # -- the Trainer ----------------------------------------------------------------
    def _wrap(self, trainer) -> None:
        """Record inside ``trainer.training_step`` only, and stop everything if it raises."""
        self._unwrap()
        original, core = trainer.training_step, self._core
        state = trainer.state

        def training_step(*args, **kwargs):
            core.activate()
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                core.fail(exc, state.global_step + 1)
                self._unwrap()
                raise
            finally:
                core.deactivate()

        training_step.__wrapped__ = original
        trainer.training_step = training_step  # an instance attribute, deleted again by _unwrap
        self._trainer, self._wrapped = trainer, training_step

    def _unwrap(self) -> None:
        trainer, wrapped = self._trainer, self._wrapped
        self._trainer = self._wrapped = None
        if trainer is not None and trainer.__dict__.get("training_step") is wrapped:
            del trainer.training_step

    def _trackers(self, args) -> list:
        """The Trainer's active trackers, as ``tracker(values, step)`` callables."""
        trainer = self._trainer
        if trainer is None:
            return []
        out = []
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and getattr(callback, "tb_writer", None) is not None:
                out.append(_tensorboard(callback.tb_writer))
            elif isinstance(callback, MLflowCallback) and getattr(callback, "_initialized", False):
                out.append(_mlflow())
            elif isinstance(callback, WandbCallback) and getattr(callback, "_initialized", False) \
                    and trainer.is_world_process_zero():  # the Trainer starts a W&B run there only
                if self._wandb is None:
                    self._wandb = _wandb_tracker()
                out.append(self._wandb)
        return out


def _tensorboard(writer):
    def write(values: dict, step: int) -> None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
        writer.flush()
    return write


def _mlflow():
    def write(values: dict, step: int) -> None:
        import mlflow

        from .mlflow import _key_part
        if mlflow.active_run() is not None:
            mlflow.log_metrics({"/".join(map(_key_part, tag.split("/"))): value for tag, value in values.items()},
                               step=step)
    return write
