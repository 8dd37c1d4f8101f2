"""MLflow: per-layer statistics as run metrics, and helpers to log an instrumented model as ``"pt2"``.

:func:`log_metrics` (``log.to_mlflow()``) writes, for each record with
statistics, one MLflow metric per statistic in :data:`STATS`::

    picklehooks/<module>/<kind>[/<path>][/call<k>]/mean
                                                  /std
                                                  /absmax   ... one per name in ``stats``

The keys are TensorBoard's tags (:func:`picklehooks.integrations.tensorboard.tags`) with
every character MLflow refuses replaced by ``_``: MLflow keys may hold ASCII
letters and digits, ``_ - . /`` and space (colons are refused on Windows, so
they are replaced too), so the root module's ``(root)`` becomes ``_root_``, and
a path segment that is empty, ``.`` or ``..`` (which MLflow would read as a
file path) becomes underscores. ``/call<k>`` is added for the k-th call
(k > 0) of the same module, kind and path within one step, so a module
called twice per step gets two series instead of two values at one step.
Each value is logged at the record's own ``step`` (see :meth:`Log.next_step`),
or at ``step`` when given, all with one timestamp, in batches of at most
1000 metrics (``MlflowClient.log_batch``'s limit).

An instrumented model logs with MLflow's default ``serialization_format="pt2"``
(``torch.export``): the exported program keeps the ``picklehooks::`` ops, so
the loaded model records what the eager model recorded, forward and backward,
at any batch size (given an example batch of more than one), and the
archive holds only tensors and JSON (MLflow loads it with
``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false``). Besides the ``input_example``
that ``"pt2"`` always needs, it takes a ``signature`` (MLflow infers one with
SciPy, which ``mlflow-skinny`` lacks: :func:`signature`), ``pip_requirements``
(MLflow's inference can't load the model: :func:`pip_requirements`), and a
loading process that imports picklehooks first::

    mlflow.pytorch.log_model(model, name="model", input_example=x,
                             signature=picklehooks.integrations.mlflow.signature(x),
                             pip_requirements=picklehooks.integrations.mlflow.pip_requirements())
    # the loading process:
    import picklehooks                       # registers the ops: before load_model
    model = mlflow.pytorch.load_model("models:/NAME/1")

Limits:

* NaN statistics (the mean of a tensor holding NaN) are logged as NaN, which
  MLflow's SQL stores keep as NaN. MLflow's SQL stores can't hold infinity:
  they store ±Inf as ±1.7976931348623157e308 (the largest float64), so an
  infinite ``absmax`` or ``norm`` reads back as that. ``nan`` and ``inf`` are
  counts, always finite.
* Two records whose keys differ only in characters MLflow refuses (modules
  ``"a:b"`` and ``"a_b"``) would share a key: :func:`metrics` raises instead
  of mixing their series. A key longer than MLflow's 250 characters raises too.
* A log whose records come from several ranks adds ``/rank<r>`` after the
  module. Records without statistics (``mode="tensor"``) and non-tensor values
  are not logged.
* A ``"pt2"`` model can only be loaded by a process that imported picklehooks
  first (the ops are registered at import, and ``torch.export.load`` refuses
  ops it doesn't know). MLflow's own loaders don't, so its requirement
  inference (which loads the model in a subprocess) fails, and so would
  ``mlflow models serve`` and ``mlflow.pyfunc.load_model`` in a process that
  hasn't imported picklehooks; shipping picklehooks with ``code_paths`` does not
  help either, as MLflow puts ``code/`` on ``sys.path`` only inside
  ``load_model``. ``"pickle"`` has none of these limits (unpickling imports
  picklehooks).

Nothing here imports MLflow until called, so ``import picklehooks`` never needs it.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import time
import warnings
from typing import Any, Iterable

from .._shim import PicklehooksError
from ..capture.record import RENAMED_STATS, STAT_NAMES
from .tensorboard import tags

__all__ = ["log_metrics", "metrics", "pip_requirements", "signature", "STATS"]

#: The statistics :func:`log_metrics` logs for each record unless told otherwise, in order.
STATS = ("mean", "std", "absmax", "norm", "n_nan", "n_inf", "zero_frac")
#: ``MlflowClient.log_batch`` takes at most this many metrics per request.
_BATCH = 1000
#: MLflow's longest metric key.
_MAX_KEY = 250
#: What MLflow refuses in a key (its rule, ``[/\\w.\\- ]``, minus non-ASCII letters, which
#: older servers and other stores may not accept; ``:`` is refused on Windows).
_REFUSED = re.compile(r"[^A-Za-z0-9_\-. /]")
_INSTALL = "pip install 'picklehooks[mlflow]'"


def _mlflow():
    """The ``mlflow`` package, or say what to install."""
    try:
        import mlflow
        import mlflow.entities
        import mlflow.tracking
    except ImportError as exc:
        raise PicklehooksError(
            f"logging to MLflow needs the mlflow package: {_INSTALL} (or pip install mlflow); "
            f"importing mlflow failed: {exc}"
        ) from exc
    return mlflow


def _key_part(segment: str) -> str:
    segment = _REFUSED.sub("_", segment)
    # "", "." and ".." would make MLflow read the key as a different file path.
    return "_" * max(len(segment), 1) if not segment.strip(".") else segment


def _outside() -> int:
    """The ``stacklevel`` of the caller's first frame outside picklehooks: the user's line, where
    Python's default filters show a ``DeprecationWarning`` (code in ``__main__``)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "picklehooks":
        frame, level = frame.f_back, level + 1
    return level


def _check_stats(stats: Iterable[str]) -> tuple[str, ...]:
    if isinstance(stats, str):
        stats = (stats,)
    stats = tuple(stats)
    old = [s for s in stats if s in RENAMED_STATS]
    if old:
        warnings.warn(f"stats={stats!r}: {', '.join(f'{s!r} is now {RENAMED_STATS[s]!r}' for s in old)}; "
                      "the old names go away in the next release", DeprecationWarning, stacklevel=_outside())
        stats = tuple(RENAMED_STATS.get(s, s) for s in stats)
    unknown = [s for s in stats if s not in STAT_NAMES]
    if unknown or not stats:
        raise PicklehooksError(f"stats={stats!r}: choose among {', '.join(STAT_NAMES)}")
    return stats


def metrics(log, step: int | None = None, stats: Iterable[str] = STATS) -> list[tuple[str, float, int]]:
    """``(key, value, step)`` for every metric :func:`log_metrics` would log, in recording order::

        for key, value, at in picklehooks.integrations.mlflow.metrics(log):
            print(at, key, value)        # 0 picklehooks/0/output/mean 0.0523...
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise PicklehooksError(f"step={step!r}: use an int, or None for each record's own step")
    stats = _check_stats(stats)
    owners: dict[tuple[str, int], str] = {}  # (key prefix, step) -> the tag that took it
    out = []
    for rec, tag, at in tags(log, step):
        values = rec.stats
        if values is None:
            continue
        prefix = "/".join(_key_part(part) for part in tag.split("/"))
        owner = owners.setdefault((prefix, at), tag)
        if owner != tag:
            raise PicklehooksError(
                f"records {owner!r} and {tag!r} would both be logged as MLflow metrics {prefix!r}/... at "
                f"step {at}: MLflow keys allow only letters, digits, '_', '-', '.', '/' and space, and both "
                "names become the same once other characters are replaced by '_'; rename one module "
                "(or write the metrics yourself from picklehooks.integrations.tensorboard.tags(log))"
            )
        longest = f"{prefix}/{max(stats, key=len)}"
        if len(longest) > _MAX_KEY:
            raise PicklehooksError(
                f"MLflow metric key {longest!r} has {len(longest)} characters; MLflow allows {_MAX_KEY}. "
                "Record fewer nested paths, or write the metrics yourself from picklehooks.integrations.tensorboard.tags(log)"
            )
        out.extend((f"{prefix}/{name}", float(values[name]), at) for name in stats)
    return out


def log_metrics(log, *, step: int | None = None, run_id: str | None = None, client: Any = None,
                stats: Iterable[str] = STATS) -> int:
    """Log ``log``'s per-layer statistics as metrics of the active MLflow run (or ``run_id``); return how many::

        with picklehooks.record(step=step) as log:
            loss_fn(model(x), y).backward()
        picklehooks.integrations.mlflow.log_metrics(log)            # or log.to_mlflow(), inside mlflow.start_run()

    ``step``: the MLflow step for every record; ``None`` uses each record's
    ``step``. ``client``: an ``MlflowClient`` (default: one on the current
    tracking URI). ``stats``: which of :data:`~picklehooks.capture.log.STAT_NAMES`.
    Calls ``client.log_batch`` (so ``MLFLOW_ENABLE_ASYNC_LOGGING`` applies).
    """
    found = metrics(log, step, stats)
    mlflow = _mlflow()
    if run_id is None:
        run = mlflow.active_run()
        if run is None:
            raise PicklehooksError(
                "no active MLflow run to log picklehooks metrics to: call inside `with mlflow.start_run():`, "
                "or pass run_id="
            )
        run_id = run.info.run_id
    if client is None:
        client = mlflow.tracking.MlflowClient()
    timestamp = int(time.time() * 1000)
    Metric = mlflow.entities.Metric
    entries = [Metric(key, value, timestamp, at) for key, value, at in found]
    for start in range(0, len(entries), _BATCH):
        client.log_batch(run_id, metrics=entries[start:start + _BATCH])
    return len(entries)


def pip_requirements(*extra: str) -> list[str]:
    """MLflow's PyTorch requirements plus ``picklehooks==<this version>`` (and ``extra``), for ``log_model``::

        mlflow.pytorch.log_model(model, name="model", input_example=x, signature=signature(x),
                                 pip_requirements=picklehooks.integrations.mlflow.pip_requirements())

    Needed for ``"pt2"``: MLflow infers requirements by loading the model in a
    subprocess that never imports picklehooks, which can't load the exported
    ops; the inference then fails (and MLflow falls back to requirements
    without picklehooks, or raises with ``MLFLOW_REQUIREMENTS_INFERENCE_RAISE_ERRORS``).
    Passing ``pip_requirements`` skips it. The pin installs only from an index
    that has this version of picklehooks.
    """
    _mlflow()
    import mlflow.pytorch

    try:
        version = importlib.metadata.version("picklehooks")
    except importlib.metadata.PackageNotFoundError:  # a copy not installed as a distribution
        from .._version import __version__ as version
    return [*mlflow.pytorch.get_default_pip_requirements(), f"picklehooks=={version}", *extra]


def _numpy_dtype(x):
    import torch

    if isinstance(x, torch.Tensor):
        try:
            return torch.empty((), dtype=x.dtype).numpy().dtype
        except TypeError as exc:
            raise PicklehooksError(
                f"an example input of dtype {x.dtype} has no NumPy dtype, which MLflow signatures need; "
                "give a float32 (or other NumPy-typed) example and cast inside the model"
            ) from exc
    return x.dtype


def signature(*example_inputs):
    """An MLflow ``ModelSignature`` of ``TensorSpec`` inputs for these example tensors, first dimension variable::

        sig = picklehooks.integrations.mlflow.signature(x)       # inputs: [Tensor('float32', (-1, 4))]

    It is what MLflow infers from a NumPy ``input_example`` (``"pt2"`` needs
    one, and exports the ``-1`` dimension as dynamic), without running the
    model, and without SciPy, which MLflow's inference imports but
    ``mlflow-skinny`` (``picklehooks[mlflow]``) doesn't install. Several
    inputs are named ``input0``, ``input1``, ...; outputs are left out.
    """
    mlflow = _mlflow()
    import mlflow.models
    import mlflow.types

    if not example_inputs or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in example_inputs):
        raise PicklehooksError(
            f"signature() takes the model's example inputs as tensors or NumPy arrays; got "
            f"{[type(x).__name__ for x in example_inputs]}"
        )
    several = len(example_inputs) > 1
    specs = [
        mlflow.types.TensorSpec(_numpy_dtype(x), (-1, *x.shape[1:]) if len(x.shape) else (),
                                name=f"input{i}" if several else None)
        for i, x in enumerate(example_inputs)
    ]
    return mlflow.models.ModelSignature(inputs=mlflow.types.Schema(specs))

