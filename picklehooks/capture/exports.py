"""What a :class:`~picklehooks.capture.log.Log` hands to other tools: pandas, TensorBoard, MLflow, W&B.

A mixin of thin delegations, each importing its tool's module only when
called, so that none of these packages is imported with picklehooks (they
are optional extras). The trackers' own limits are in their modules under
:mod:`picklehooks.integrations`.
"""

from __future__ import annotations

from . import table as _table


class Exports:
    """The ``to_*`` methods of :class:`~picklehooks.capture.log.Log`."""

    def to_pandas(self, module=None, kind=None, path=None, call=None, step=None, rank=None, *,
                  columns: list[str] | None = None):
        """The records as a ``pandas.DataFrame`` of :meth:`table` rows, those matching every filter given.

        Each filter is one value or a collection of values (``step=range(100, 200)``,
        ``kind=("output", "grad_output")``); ``columns`` picks columns. With a
        sink, this reads the records written there too (with ``append=True``,
        earlier runs' as well), reading from the files only the row groups and
        columns needed::

            frame = log.to_pandas(module="encoder.0", kind="output", step=range(1000, 2000))
        """
        filters = _table._filters(module=module, kind=kind, path=path, call=call, step=step, rank=rank)
        return _table.to_pandas(self, filters, columns)

    def to_tensorboard(self, writer, step: int | None = None, *, histograms: bool = True) -> int:
        """Write per-layer scalars and histograms to a ``SummaryWriter`` (``pip install 'picklehooks[tensorboard]'``)."""
        from ..integrations.tensorboard import write
        return write(self, writer, step, histograms=histograms)

    def to_mlflow(self, *, step: int | None = None, run_id: str | None = None, client=None,
                  stats: tuple[str, ...] | None = None) -> int:
        """Log per-layer statistics as metrics of the active MLflow run (``pip install 'picklehooks[mlflow]'``).

        Returns the number of metrics written; see :func:`picklehooks.integrations.mlflow.log_metrics`.
        """
        from ..integrations.mlflow import STATS, log_metrics
        return log_metrics(self, step=step, run_id=run_id, client=client, stats=STATS if stats is None else stats)

    def to_wandb(self, run=None, *, step: int | None = None, stats: tuple[str, ...] | None = None,
                 step_metric: str | None = None) -> int:
        """Log per-layer statistics to a W&B run, default ``wandb.run`` (``pip install 'picklehooks[wandb]'``).

        One row per step, carrying it as ``picklehooks/step``; returns the number of values written;
        see :func:`picklehooks.integrations.wandb.log_metrics`.
        """
        from ..integrations.wandb import STATS, STEP_METRIC, log_metrics
        return log_metrics(self, run, step=step, stats=STATS if stats is None else stats,
                           step_metric=STEP_METRIC if step_metric is None else step_metric)
