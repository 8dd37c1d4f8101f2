"""Write a :class:`~picklehooks.capture.log.Log` to TensorBoard: ``log.to_tensorboard(writer)``.

For each record with statistics, :func:`write` adds four scalars::

    picklehooks/<module>/<kind>[/<path>][/call<k>]/mean
                                                  /std
                                                  /norm
                                                  /n_nan   (the count of NaN elements)

and, for each record that kept its tensor (``instrument(..., mode="tensor")``
or ``"both"``), a histogram of the tensor's values tagged
``picklehooks/<module>/<kind>[/<path>][/call<k>]``. ``<module>`` is the
qualified name, ``(root)`` for the model itself; ``/<path>`` is left out for
a plain tensor value. ``/call<k>`` is added for the k-th call (k > 0) of the
same module, kind and path within one TensorBoard step, so a module called
twice per step gets two series instead of two points on one. Each value is
written at the record's own ``step`` (see :meth:`Log.next_step`), or at
``step`` for every record when given.

``writer`` is a ``torch.utils.tensorboard.SummaryWriter``, or anything with
its ``add_scalar(tag, value, global_step)`` and ``add_histogram(tag, values,
global_step)`` (such as ``tensorboardX.SummaryWriter``), or a directory, for
which :func:`write` opens a ``SummaryWriter`` and closes it when done (that
needs ``pip install 'picklehooks[tensorboard]'``). Nothing here imports
TensorBoard unless given a directory, so ``import picklehooks`` never needs it.

Limits:

* TensorBoard stores scalars as float32: statistics lose precision beyond
  about seven significant digits, and NaN ``mean``/``std``/``norm`` (a
  tensor holding NaN) are written as NaN, which TensorBoard plots as gaps.
* Histograms count the finite values only (``np.histogram`` rejects NaN and
  infinity; the ``n_nan`` scalar still reports NaN); a tensor with no finite
  value, or no value at all, gets no histogram. Complex tensors are
  histogrammed by magnitude, as their statistics are. TensorBoard's own
  buckets span about ±1e20; a tensor with a finite value beyond them gets
  64 equal-width buckets instead (with a ``SummaryWriter``, which takes
  ``bins=``).
* A log whose records come from several ranks (``Record.rank``) adds
  ``/rank<r>`` after the module so their series stay apart.
* Records without statistics (``mode="tensor"``) get a histogram only, and
  non-tensor values (recorded by ``repr``) get nothing.
"""

from __future__ import annotations

import os
from typing import Any

from .._shim import PicklehooksError

__all__ = ["write", "SCALARS", "tags"]

#: The statistics written as scalars for each record, in order.
SCALARS = ("mean", "std", "norm", "n_nan")
#: Equal-width buckets for histograms whose values lie beyond ``SummaryWriter.default_bins``.
_WIDE_BINS = 64
_INSTALL = "pip install 'picklehooks[tensorboard]'"


def _summary_writer(log_dir: str | os.PathLike):
    """Open a ``SummaryWriter`` on ``log_dir``, or say what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # ModuleNotFoundError: no tensorboard; ImportError: too old a one
        raise PicklehooksError(
            f"writing a log to TensorBoard needs the tensorboard package: {_INSTALL} "
            f"(or pip install tensorboard); importing torch.utils.tensorboard failed: {exc}"
        ) from exc
    return SummaryWriter(log_dir=os.fspath(log_dir))


def tags(log, step: int | None = None) -> list[tuple[Any, str, int]]:
    """``(record, tag prefix, step)`` for every record of ``log`` that :func:`write` would write.

    The tag prefix is the histogram tag; the scalars' tags add
    ``/mean``, ``/std``, ``/norm`` and ``/n_nan`` to it.
    """
    ranks = {r.rank for r in log.records}
    several_ranks = len(ranks) > 1
    groups: dict[tuple, list[tuple[int, int, Any]]] = {}
    for index, rec in enumerate(log.records):
        if rec.shape is None:  # a non-tensor value: nothing to plot
            continue
        at = rec.step if step is None else step
        groups.setdefault((rec.module, rec.kind, rec.path, rec.rank, at), []).append((rec.call, index, rec))
    out = []
    for (module, kind, path, rank, at), members in groups.items():
        members.sort(key=lambda m: (m[0], m[1]))
        for k, (_, index, rec) in enumerate(members):
            parts = ["picklehooks", module or "(root)"]
            if several_ranks:
                parts.append(f"rank{rank}")
            parts.append(kind)
            if path:
                parts.append(path)
            if k:
                parts.append(f"call{k}")
            out.append((index, rec, "/".join(parts), at))
    out.sort(key=lambda item: item[0])  # in recording order
    return [(rec, tag, at) for _, rec, tag, at in out]


def _histogram_values(tensor):
    """The finite values of ``tensor`` as a flat float64 CPU tensor (magnitudes if complex)."""
    import torch

    values = tensor.detach()
    if values.is_complex():
        values = values.abs()
    values = values.reshape(-1).to(device="cpu", dtype=torch.float64)
    return values[torch.isfinite(values)]


def write(log, writer, step: int | None = None, *, histograms: bool = True) -> int:
    """Write ``log``'s per-layer scalars (and histograms of kept tensors) to ``writer``; return how many values.

    ``writer``: a ``SummaryWriter`` (or anything with ``add_scalar`` and
    ``add_histogram``), or a directory to open one on. ``step``: the
    TensorBoard step for every record; ``None`` uses each record's ``step``.
    ``histograms=False`` writes the scalars only. Counts each scalar and each
    histogram as one value.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise PicklehooksError(f"step={step!r}: use an int, or None for each record's own step")
    if isinstance(writer, (str, os.PathLike)):
        opened = _summary_writer(writer)
        try:
            return write(log, opened, step, histograms=histograms)
        finally:
            opened.close()
    needs = ("add_scalar", "add_histogram") if histograms else ("add_scalar",)
    missing = [name for name in needs if not callable(getattr(writer, name, None))]
    if missing:
        raise PicklehooksError(
            f"writer={type(writer).__name__} has no {' or '.join(missing)}(); pass a "
            "torch.utils.tensorboard.SummaryWriter (or a directory to open one on)"
        )
    default_bins = getattr(writer, "default_bins", None)  # SummaryWriter's "tensorflow" buckets
    outside = max(abs(b) for b in default_bins) if default_bins else None
    written = 0
    for rec, tag, at in tags(log, step):
        stats = rec.stats
        if stats is not None:
            for name in SCALARS:
                writer.add_scalar(f"{tag}/{name}", float(stats[name]), at)
                written += 1
        if histograms and rec.tensor is not None:
            values = _histogram_values(rec.tensor)
            if values.numel():
                if outside is not None and values.abs().max().item() > outside:
                    # TensorBoard's fixed buckets end near 1e20: beyond, they'd count nothing.
                    writer.add_histogram(tag, values, at, bins=_WIDE_BINS)
                else:
                    writer.add_histogram(tag, values, at)
                written += 1
    flush = getattr(writer, "flush", None)
    if callable(flush):
        flush()
    return written
