"""Where logs go: TensorBoard, MLflow, and torch.distributed ranks.

Each module takes a :class:`~picklehooks.Log` and imports its framework only
when called, so ``import picklehooks`` never needs one:

* :mod:`~picklehooks.integrations.tensorboard`: scalars and histograms per layer;
* :mod:`~picklehooks.integrations.mlflow`: metrics, and instrumented models as MLflow models;
* :mod:`~picklehooks.integrations.distributed`: gathering logs across ranks, FSDP2 shards;
* :mod:`~picklehooks.integrations.transformers` and :mod:`~picklehooks.integrations.lightning`:
  ``PicklehooksCallback`` for a training run (they import their framework when imported).
"""
