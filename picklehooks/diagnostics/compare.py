"""Compare two logs of the same model: before and after a transformation, or two backends, layer by layer.

:func:`compare` matches the records of two logs by ``(module, kind, path,
call)`` (the n-th occurrence with the n-th, so multi-step logs pair step by
step) and computes, per record, in the execution order of the first log:

* ``max_abs``: ``max |a - b|``;
* ``rel_err``: ``||a - b|| / ||a||``;
* ``sqnr_db``: ``10 log10(||a||² / ||a - b||²)`` (``inf`` when equal);
* ``cosine``: ``a·b / (||a|| ||b||)``;

and the first diverging record (``rel_err > tol``, or shapes differ, or NaN
where the other has none): with everything before it exact, that is the
layer the transformation changed (a progress bar counts the records in a
terminal). :func:`record_forward` makes such a log from a model in any form,
called with positional and/or keyword arguments (``record_forward(model,
**batch)`` for an HF model).

Limits: the per-element numbers need tensors (``mode="tensor"`` or
``"both"``). When a pair has only statistics, its row says
``basis="stats"`` and ``rel_err`` is ``max(|Δnorm|, √n|Δmean|, √n|Δstd|) /
||a||``: a lower bound of the true relative error (each term is at most
``||a - b||``), blind to changes that keep those statistics (a permutation,
say); ``max_abs``, ``sqnr_db`` and ``cosine`` are then ``None``. Records found
in only one log are listed in ``missing`` / ``extra``, not compared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch

from .._shim import PicklehooksError
from ..capture.instrument import CAPTURE_KINDS
from ..capture.log import Log, Record, record
from ._common import hooked, need, progress, stats_of

__all__ = ["Comparison", "compare", "record_forward"]

_FORWARD_KINDS = ("input", "output", "param", "buffer")


@dataclasses.dataclass
class Comparison:
    """Per-record errors of log B against log A, and where they first diverge."""

    rows: list[dict]  # module, kind, path, call, step, source, basis, max_abs, rel_err, sqnr_db, cosine, diverged, note
    first_divergence: dict | None  # the first row with diverged=True, in log A's execution order
    missing: list[tuple]  # keys (module, kind, path, call) only in log A
    extra: list[tuple]  # keys only in log B
    basis: str  # "tensor", "stats" or "mixed": what the rows were computed from ("none": no rows)
    tol: float

    def __str__(self) -> str:
        """One line: where the logs first diverge (with the line of code that called that module), or that they agree."""
        first = self.first_divergence
        if first is None:
            return f"no divergence above rel_err {self.tol:g} in {len(self.rows)} compared records"
        where = f", {first['source']}" if first.get("source") else ""
        return (f"first divergence: {first['module'] or '<root>'} {first['kind']} (call {first['call']}){where}: "
                f"rel_err {first['rel_err']:.3g}")


def _keyed(records: Iterable[Record], kinds: tuple[str, ...]) -> dict[tuple, Record]:
    seen: dict[tuple, int] = {}
    keyed = {}
    for rec in records:
        if rec.kind in kinds and rec.shape is not None:
            n = seen[rec.key] = seen.get(rec.key, -1) + 1
            keyed[(rec.key, n)] = rec
    return keyed


def _tensor_row(a: torch.Tensor, b: torch.Tensor) -> dict:
    if a.shape != b.shape:
        return {"max_abs": None, "rel_err": math.inf, "sqnr_db": None, "cosine": None,
                "note": f"shape {tuple(a.shape)} vs {tuple(b.shape)}"}
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    if torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0)):
        return {"max_abs": 0.0, "rel_err": 0.0, "sqnr_db": math.inf, "cosine": 1.0}  # NaN where both have NaN
    diff = a - b
    na, nb, nd = float(a.norm()), float(b.norm()), float(diff.norm())  # nd > 0 here (or NaN)
    if na == 0:
        sqnr = -math.inf  # all signal is error
    else:
        sqnr = 20 * math.log10(na / nd) if math.isfinite(nd) else math.nan
    return {
        "max_abs": float(diff.abs().max()),
        "rel_err": nd / na if na > 0 else math.inf,
        "sqnr_db": sqnr,
        "cosine": float(a.flatten() @ b.flatten()) / (na * nb) if na > 0 and nb > 0 else math.nan,
    }


def _stats_row(sa: dict, sb: dict) -> dict:
    if sa["shape"] != sb["shape"]:
        return {"max_abs": None, "rel_err": math.inf, "sqnr_db": None, "cosine": None,
                "note": f"shape {sa['shape']} vs {sb['shape']}"}
    n = max(1, math.prod(sa["shape"] or ()))
    diffs = {k: abs(sa[k] - sb[k]) for k in ("mean", "std", "norm")}
    bound = max(diffs["norm"], math.sqrt(n) * diffs["mean"], math.sqrt(n) * diffs["std"])
    rel = bound / sa["norm"] if sa["norm"] > 0 else (0.0 if bound == 0 else math.inf)
    return {"max_abs": None, "rel_err": rel, "sqnr_db": None, "cosine": None,
            **{f"{k}_diff": v for k, v in diffs.items()}}


def compare(log_a: Log, log_b: Log, *, kinds: Iterable[str] = ("output",), tol: float = 1e-3) -> Comparison:
    """Per-record errors of ``log_b`` against ``log_a`` and the first diverging record.

    >>> result = compare(record_forward(model, x), record_forward(transformed, x))
    >>> result.first_divergence["module"], result.rows[0]["sqnr_db"]
    """
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in CAPTURE_KINDS]
    if bad or not kinds:
        raise PicklehooksError(f"kinds={kinds!r}: {bad or 'nothing'} is not a record kind; use any of "
                               f"{', '.join(CAPTURE_KINDS)}")
    if not isinstance(tol, (int, float)) or not tol >= 0:
        raise PicklehooksError(f"tol={tol!r}: use a non-negative relative error")
    a, b = _keyed(log_a.records, kinds), _keyed(log_b.records, kinds)
    if not a:
        raise PicklehooksError(f"log_a has no tensor records of kinds {kinds}; it recorded "
                               f"{sorted({r.kind for r in log_a.records}) or 'nothing'}")
    rows = []
    for key, ra in progress(a.items(), "compare", unit="record"):
        rb = b.get(key)
        if rb is None:
            continue
        if ra.tensor is not None and rb.tensor is not None:
            row = {"basis": "tensor", **_tensor_row(ra.tensor, rb.tensor)}
        else:
            row = {"basis": "stats", **_stats_row(stats_of(ra), stats_of(rb))}
        rel = row["rel_err"]
        row["diverged"] = not rel <= tol  # NaN diverges too
        row.setdefault("note", None)
        rows.append({"module": ra.module, "kind": ra.kind, "path": ra.path, "call": ra.call, "step": ra.step,
                     "source": ra.source if ra.source is not None else rb.source, **row})
    bases = {r["basis"] for r in rows}
    return Comparison(
        rows, next((r for r in rows if r["diverged"]), None),
        missing=[k for k, n in a if (k, n) not in b], extra=[k for k, n in b if (k, n) not in a],
        basis=bases.pop() if len(bases) == 1 else ("mixed" if bases else "none"), tol=tol)


def record_forward(model, *inputs, kinds: Iterable[str] = ("output",), **kwargs) -> Log:
    """One forward pass of ``model`` (in any form) under ``record()``, keeping tensors: a log for :func:`compare`.

    >>> log = record_forward(model, x)               # a plain model is instrumented for the call
    >>> log_q = record_forward(torch.jit.script(instrumented), x)
    >>> log_hf = record_forward(hf_model, **batch)   # keyword arguments, as HF models take

    ``model(*inputs, **kwargs)`` is what runs; a model keyword called
    ``kinds`` can't be passed this way.
    """
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in _FORWARD_KINDS]
    if bad or not kinds:
        raise PicklehooksError(f"kinds={kinds!r}: record_forward records {', '.join(_FORWARD_KINDS)}")
    with hooked(model, capture=kinds, mode="tensor"), torch.no_grad(), record() as log:
        model(*inputs, **kwargs)
    need(log, kinds, "record_forward")
    return log
