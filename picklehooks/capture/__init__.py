"""The logging layer: instrumenting a model and recording what flows through it.

* :mod:`~picklehooks.capture.instrument`: ``instrument(model)``, which generates typed,
  portable hooks (:mod:`~picklehooks.capture.generate`) and installs them
  (:mod:`~picklehooks.capture.hookdict`); :mod:`~picklehooks.capture.spec` (``handle.spec``:
  what was asked for, as JSON), :mod:`~picklehooks.capture.tree` (model surgery noticed at
  ``record()``), :mod:`~picklehooks.capture.hookfile` (``save_hooks``/``load_hooks``);
* the log: :mod:`~picklehooks.capture.log` (``record()``, ``Log``, its reading side),
  :mod:`~picklehooks.capture.rows` (the row-writing path the ops call),
  :mod:`~picklehooks.capture.pairing` (forward calls and their gradients),
  :mod:`~picklehooks.capture.pending` (batched statistics on the device),
  :mod:`~picklehooks.capture.record` (``Record``), :mod:`~picklehooks.capture.table`
  (tables and filters), :mod:`~picklehooks.capture.logfile` (``Log.save``'s files),
  :mod:`~picklehooks.capture.sink` (the Parquet sink);
* :mod:`~picklehooks.capture.batching`: Inductor's pass that makes a compiled graph's records
  one host call.

Imports the pinned runtime and :mod:`picklehooks.serialize`; never diagnostics or integrations
(``Log.to_tensorboard``, ``Log.to_mlflow``, ``Log.vjp`` and ``Log.jacobian_norm`` are thin
delegations that import them when called).
"""
