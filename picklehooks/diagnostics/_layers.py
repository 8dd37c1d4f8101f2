"""Reading a log by layer: names, forward order, steps, and statistics pooled over calls.

What :mod:`~picklehooks.diagnostics.plots` draws and :mod:`~picklehooks.diagnostics.report`
tabulates. A "layer" is a module's qualified name (``(root)`` for the root), followed by
``/path`` for a value inside a tuple or dict output. Records without a shape (non-tensor
values) are left out.
"""

from __future__ import annotations

import math
from typing import Iterable

from ..capture.log import Log, Record
from ._common import stats_of

_GRAD_KINDS = ("grad_output", "grad_input", "param_grad")


def label(module: str, path: str = "") -> str:
    """A layer's display name: ``module`` (``(root)`` for ``""``), plus ``/path`` inside nested values."""
    name = module or "(root)"
    return f"{name}/{path}" if path else name


def forward_order(log: Log) -> dict[str, int]:
    """Module name -> position of its first forward (non-gradient) record."""
    order: dict[str, int] = {}
    for rec in log.records:
        if rec.kind not in _GRAD_KINDS:
            order.setdefault(rec.module, len(order))
    return order


def layers(log: Log, kind: str, *, step: int | None = None) -> dict[str, list[Record]]:
    """Tensor records of ``kind`` (at ``step`` if given), grouped by layer, in forward order.

    Gradients arrive in backward order; they are put in the order of their
    modules' forward records (modules only seen in backward come last, in
    reverse order of arrival, which is forward order too).
    """
    groups: dict[str, list[Record]] = {}
    first: dict[str, int] = {}
    for i, rec in enumerate(log.records):
        if rec.kind != kind or rec.shape is None or (step is not None and rec.step != step):
            continue
        key = label(rec.module, rec.path)
        groups.setdefault(key, []).append(rec)
        first.setdefault(key, i)
    if kind in _GRAD_KINDS:
        order = forward_order(log)
        keyed = {k: (0, order[g[0].module], first[k]) if g[0].module in order else (1, -first[k], 0)
                 for k, g in groups.items()}
        groups = {k: groups[k] for k in sorted(groups, key=keyed.__getitem__)}
    return groups


def steps_of(log: Log, kind: str) -> list[int]:
    """The steps at which ``kind`` was recorded, sorted."""
    return sorted({r.step for r in log.records if r.kind == kind and r.shape is not None})


def _numel(shape) -> int:
    return math.prod(shape) if shape is not None else 0


def pooled(records: Iterable[Record]) -> dict | None:
    """The statistics of several records taken as one set of values (``None`` when none has statistics).

    ``mean`` and ``std`` (population) are over all elements, ``norm`` is the
    norm of all elements, ``min``/``max``/``absmax`` the extremes, ``n_nan``/``n_inf``
    summed, ``zero_frac`` weighted by size; ``calls`` counts the records.
    """
    rows = [(s, _numel(r.shape)) for r in records if (s := stats_of(r)) is not None]
    if not rows:
        return None
    if len(rows) == 1:
        return {**rows[0][0], "calls": 1, "numel": rows[0][1]}
    total = sum(n for _, n in rows)
    weighted = lambda name: sum(s[name] * n for s, n in rows) / total if total else math.nan  # noqa: E731
    mean = weighted("mean")
    second = sum((s["std"] ** 2 + s["mean"] ** 2) * n for s, n in rows) / total if total else math.nan
    var = second - mean * mean
    return {
        "shape": rows[-1][0].get("shape"),
        "dtype": rows[-1][0].get("dtype"),
        "mean": mean,
        "std": math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.nan,
        "min": _reduce(min, [s["min"] for s, _ in rows]),
        "max": _reduce(max, [s["max"] for s, _ in rows]),
        "absmax": _reduce(max, [s["absmax"] for s, _ in rows]),
        "norm": math.sqrt(sum(s["norm"] ** 2 for s, _ in rows)),
        "n_nan": sum(s["n_nan"] for s, _ in rows),
        "n_inf": sum(s["n_inf"] for s, _ in rows),
        "zero_frac": weighted("zero_frac"),
        "calls": len(rows),
        "numel": total,
    }


def _reduce(fn, values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else fn(values)
