"""Statistics of many tensors at once, on their device, without a host sync.

A forward pass records dozens of tensors, and each statistic is a kernel
launch; so a log stacks recorded tensors of equal shape and dtype into the
rows of one matrix (see :mod:`picklehooks.log`) and every statistic is one
row-wise reduction over it (:func:`matrix_stats`). The fast path makes five
passes, all of them vectorised reductions on CPU: sum, norm, min, max, and
a count of non-zero bit patterns (counting with boolean masks is several
times slower there). ``std`` then comes from the sum and the norm, which
loses precision when ``|mean| >> std``, and NaN/Inf counts are left unknown;
:func:`finish` repairs exactly those rows, from the kept matrix, once the
table is on the host (reading syncs anyway), so the common row costs
nothing more.

Semantics follow the per-tensor torch calls: ``std`` is the population
standard deviation; a tensor containing NaN has NaN ``mean``, ``std``,
``min``, ``max``, ``absmax`` and ``norm``; an empty tensor has NaN
statistics and zero counts; complex tensors are summarised by their
magnitude. float64 and integer tensors are reduced in float64, everything
else in float32 (relative error about 1e-6).
"""

from __future__ import annotations

import math

import torch

#: The statistics, in the column order of each row.
STAT_NAMES = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf", "zero_frac")
MEAN_COL, STD_COL, NORM_COL, NAN_COL, INF_COL = 0, 1, 5, 6, 7
EMPTY = (math.nan,) * 6 + (0, 0, math.nan)

# The fast std is sqrt(norm**2/n - mean**2); its relative error grows like
# eps * mean**2 / var, so rows past this ratio get the two-pass std (error
# ~eps) in finish(). 16 keeps float32 within about 2e-6 of torch.std.
_ILL_CONDITIONED = 16.0
# Reinterpreted as integers, a float is +-0 exactly when its bits, sign
# masked off, are 0; NaN and Inf are non-zero, as they should be.
#: Row width (in elements) that makes counting zeros fast; see matrix_stats(padded=).
PAD = 256
_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 and integer tensors, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 or not (dtype.is_floating_point or dtype == torch.bool) else torch.float32


def _as_real(x: torch.Tensor) -> torch.Tensor:
    return (x.abs() if x.is_complex() else x).to(compute_dtype(x.dtype))


def _count_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Non-zero elements per row of a float32/float64 matrix (NaN and Inf count as non-zero)."""
    rows, width = x.shape
    if width % PAD == 0 and x.is_contiguous():
        # One byte per element, summed four at a time: as int32 lanes, 64 words
        # hold at most 64 per byte lane, so no lane carries into the next.
        words = x.bool().view(torch.int32).view(rows, width // PAD, PAD // 4)
        return words.sum(2, dtype=torch.int32).view(torch.uint8).view(rows, -1).sum(1, dtype=torch.int32)
    int_dtype, mask = _BITS[x.dtype]
    return x.view(int_dtype).bitwise_and(mask).clamp_(max=1).sum(1, dtype=int_dtype)


def matrix_stats(x: torch.Tensor, *, exact: bool = False, padded: torch.Tensor | None = None) -> torch.Tensor:
    """A float64 ``(rows, len(STAT_NAMES))`` table: the statistics of each row of ``x`` (non-empty rows).

    ``padded``, if given, holds the same rows followed by zeros up to a
    multiple of :data:`PAD` columns, contiguous: zeros are counted faster there.
    With ``exact=False`` the ``nan`` and ``inf`` columns are NaN (unknown)
    and ``std`` is the one-pass value; :func:`finish` completes such rows.
    """
    x = _as_real(x)
    n = x.shape[1]
    f64 = torch.float64  # the reductions run in x's dtype; the arithmetic on their results in float64
    mean = x.sum(1).to(f64) / n
    norm = torch.linalg.vector_norm(x, dim=1).to(f64)
    lo, hi = x.amin(1).to(f64), x.amax(1).to(f64)
    nonzero = _count_nonzero(padded if padded is not None and padded.dtype == x.dtype else x)
    if exact:
        std = torch.linalg.vector_norm(x - mean.to(x.dtype)[:, None], dim=1).to(f64) / math.sqrt(n)
        nan, inf = torch.isnan(x).sum(1).to(f64), torch.isinf(x).sum(1).to(f64)
    else:
        std = (norm.square() / n - mean.square()).clamp_(min=0).sqrt_()
        nan = inf = torch.full_like(mean, math.nan)
    zero_frac = 1 - nonzero.to(f64) / n
    absmax = torch.maximum(lo.abs(), hi.abs())
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac], dim=1)


def finish(x: torch.Tensor, rows: list[list[float]]) -> list[list[float]]:
    """Complete the host ``rows`` of a fast :func:`matrix_stats` table of ``x``, in place.

    NaN/Inf counts are zero where mean and norm are finite and are counted
    otherwise; ``std`` and ``norm`` are recomputed in float64 (``std`` in two
    passes) where the one-pass ``std`` may be inaccurate (``mean**2 > 16 var``)
    or the float32 sum of squares overflowed.
    """
    count, refine = [], []
    for i, row in enumerate(rows):
        mean, std, norm = row[MEAN_COL], row[STD_COL], row[NORM_COL]
        if math.isnan(row[NAN_COL]):
            if math.isfinite(mean) and math.isfinite(norm):
                row[NAN_COL] = row[INF_COL] = 0
            else:
                count.append(i)
        if math.isfinite(mean) and not (math.isfinite(norm) and mean * mean <= _ILL_CONDITIONED * std * std):
            refine.append(i)
    if count:
        sub = _as_real(x[torch.tensor(count, device=x.device)])
        for i, nan, inf in zip(count, torch.isnan(sub).sum(1).tolist(), torch.isinf(sub).sum(1).tolist()):
            rows[i][NAN_COL], rows[i][INF_COL] = nan, inf
    if refine:
        sub = _as_real(x[torch.tensor(refine, device=x.device)]).double()
        stds, norms = torch.std(sub, dim=1, correction=0).tolist(), torch.linalg.vector_norm(sub, dim=1).tolist()
        for i, std, norm in zip(refine, stds, norms):
            rows[i][STD_COL], rows[i][NORM_COL] = std, norm
    return rows


def tensor_stats(x: torch.Tensor) -> list[float]:
    """The :data:`STAT_NAMES` values of one tensor, exact, on the host (a sync)."""
    if x.numel() == 0:
        return list(EMPTY)
    return matrix_stats(x.reshape(1, -1), exact=True)[0].tolist()
