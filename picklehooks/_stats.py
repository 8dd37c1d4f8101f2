"""Statistics of many tensors at once, on their device, without a host sync.

A forward pass records dozens of tensors, and each statistic is a kernel
launch; so a log copies recorded tensors of equal size and dtype into the
rows of one matrix (see :mod:`picklehooks.log`) and every statistic is one
row-wise reduction over it (:func:`matrix_stats`). The reductions used (sum,
norm, amin, amax, sign) are the vectorised ones on CPU; counting with
boolean masks is several times slower there, so the fast path leaves NaN and
Inf counts ``NaN`` ("unknown") and :func:`exact_counts` fills them in for
the few rows whose sums are not finite.

Semantics follow the per-tensor torch calls: ``std`` is the population
standard deviation (two passes, so a large mean doesn't swamp it); a tensor
containing NaN has NaN ``mean``, ``std``, ``min``, ``max``, ``absmax`` and
``norm``; an empty tensor has NaN statistics and zero counts; complex
tensors are summarised by their magnitude. float64 and integer tensors are
reduced in float64, everything else in float32 (relative error about 1e-6).
"""

from __future__ import annotations

import math

import torch

#: The statistics, in the column order of each row.
STAT_NAMES = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf", "zero_frac")
NAN_COL, INF_COL, ZERO_COL = 6, 7, 8


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 or not (dtype.is_floating_point or dtype == torch.bool) else torch.float32


def empty_row(device: torch.device) -> torch.Tensor:
    """The row of an empty tensor: NaN statistics, zero counts."""
    row = torch.full((len(STAT_NAMES),), math.nan, dtype=torch.float64, device=device)
    row[NAN_COL] = row[INF_COL] = 0
    return row


def matrix_stats(x: torch.Tensor, *, counts: bool = False) -> torch.Tensor:
    """A float64 ``(rows, len(STAT_NAMES))`` table: the statistics of each row of ``x``.

    With ``counts=False`` the ``nan`` and ``inf`` columns are NaN (unknown)
    and ``zero_frac`` is NaN for rows holding NaN; see :func:`exact_counts`.
    """
    if x.is_complex():
        x = x.abs()
    x = x.to(_compute_dtype(x.dtype))
    n = x.shape[1]
    f64 = torch.float64  # the reductions run in x's dtype; the divisions in float64
    mean = x.sum(1).to(f64) / n
    std = torch.linalg.vector_norm(x - mean.to(x.dtype)[:, None], dim=1).to(f64) / math.sqrt(n)
    norm = torch.linalg.vector_norm(x, dim=1).to(f64)
    lo, hi = x.amin(1).to(f64), x.amax(1).to(f64)
    absmax = torch.maximum(lo.abs(), hi.abs())
    if counts:
        nan, inf = torch.isnan(x).sum(1).to(f64), torch.isinf(x).sum(1).to(f64)
        zero_frac = (x == 0).sum(1).to(f64) / n
    else:
        nan = inf = torch.full_like(mean, math.nan)
        # Counting ones in float32 is exact below 2**24 elements; NaN where x holds NaN.
        zero_frac = 1 - x.abs().sign().sum(1).to(f64) / n
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac], dim=1)


def exact_counts(x: torch.Tensor) -> tuple[int, int, float]:
    """(nan count, inf count, zero fraction) of one tensor, on the host."""
    if x.is_complex():
        x = x.abs()
    if x.numel() == 0:
        return 0, 0, math.nan
    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum()), float((x == 0).sum()) / x.numel()
