"""Statistics of many tensors at once, on their device, without a host sync.

A forward pass records dozens of tensors, and each statistic is a kernel
launch; so a log stacks recorded tensors of equal shape and dtype into the
rows of one matrix (see :mod:`picklehooks.capture.log`) and every statistic is one
row-wise reduction over it (:func:`matrix_stats`). The fast path makes a
few passes: min, max and a count of non-zero bit patterns in the recorded
dtype (counting with boolean masks is several times slower on CPU), then a
sum and a norm accumulated in float64. ``std`` comes from the sum and the
norm, which loses precision when ``|mean| >> std``, and NaN/Inf counts are
left unknown; :func:`finish` repairs exactly those rows, from the kept
matrix, once the table is on the host (reading syncs anyway), so the
common row costs nothing more.

Semantics follow the per-tensor torch calls: ``std`` is the population
standard deviation; a tensor containing NaN has NaN ``mean``, ``std``,
``min``, ``max``, ``absmax`` and ``norm``; an empty tensor has NaN
statistics and zero counts; complex tensors are summarised by their
magnitude.

Every sum is accumulated in float64, whatever the dtype: a float32 sum of
an attention mask filled with ``finfo(float32).min`` overflows to ``-inf``
(and its std to NaN), and a float32 sum of values that cancel loses more
than 1e-6 of the mean. So the statistics of finite input are finite and
within about 1e-12 of float64 arithmetic on the same values. Float32 rows
are converted a block at a time (a float64 copy of a whole group would
double its memory; on CPU the conversion, not the reduction, is what costs).
float64 rows can overflow too (values near ``finfo(float64).max``): the
exact path and :func:`finish` reduce them scaled by a power of two, which
is exact, so only a statistic whose true value is beyond float64's range
(the norm of many such values) is ``inf``.
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
# ~eps) in finish(). Sums are float64 (eps 1.1e-16), so 1e3 keeps std within
# about 1e-13 of the float64 two-pass value.
_ILL_CONDITIONED = 1e3
# Float32 rows are converted to float64 this many elements at a time.
_BLOCK = 1 << 18
# Reinterpreted as integers, a float is +-0 exactly when its bits, sign
# masked off, are 0; NaN and Inf are non-zero, as they should be.
#: Row width (in elements) that makes counting zeros fast; see matrix_stats(padded=).
PAD = 256
_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
# The normal powers of two, 2**lowest .. 2**highest, and the mantissa's width (IEEE 754 binary32/64).
_POW2 = {torch.float32: (-126, 127, 23), torch.float64: (-1022, 1023, 52)}


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


def _pow2_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Per row, a power of two ``s`` (in ``absmax``'s float dtype) with ``absmax * s`` near 1.

    Multiplying by a power of two is exact (short of the subnormal range), so
    ``x * s`` has the same digits as ``x`` and its sums cannot overflow. It is
    built from its bits, not with ``ldexp``/``exp2``, which round through
    float32 or a polynomial on some devices. Rows that are empty of finite
    magnitude (NaN, Inf, all zeros) get ``s = 1`` and keep their usual result.
    """
    int_dtype = _BITS[absmax.dtype][0]
    lowest, highest, mantissa_bits = _POW2[absmax.dtype]
    _, exponent = torch.frexp(absmax)  # absmax = m * 2**exponent, 0.5 <= m < 1
    exponent = torch.where(torch.isfinite(absmax) & (absmax > 0), exponent, 0).to(int_dtype)
    # 2**-exponent, kept within the normal range; the bias of the exponent field is `highest`.
    power = (-exponent).clamp_(min=lowest, max=highest)
    return ((power + highest) << mantissa_bits).view(absmax.dtype)


def _moments(x: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, std, norm)`` of each row of a float64 matrix, reduced scaled (no overflow), std in two passes."""
    n = x.shape[1]
    scale = _pow2_scale(absmax)
    scaled = x * scale[:, None]
    mean = scaled.sum(1) / n
    norm = torch.linalg.vector_norm(scaled, dim=1)
    std = torch.linalg.vector_norm(scaled.sub_(mean[:, None]), dim=1) / math.sqrt(n)
    # Dividing by a power of two is exact; only a value beyond float64's range becomes inf.
    return mean / scale, std / scale, norm / scale


def _float64_moments(x: torch.Tensor, *, exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``(mean, std, norm)`` of each row of a float32 matrix, accumulated in float64.

    Rows are converted a block at a time (:data:`_BLOCK` elements), so the
    float64 copy stays small and is reused from the allocator's cache. With
    ``exact=False``, ``std`` is the one-pass value (see :func:`finish`).
    """
    rows, n = x.shape
    step = max(1, min(rows, _BLOCK // n))
    # One buffer for every block: a fresh allocation per block costs more in page faults than the conversion.
    buffer = torch.empty((step, n), dtype=torch.float64, device=x.device)
    means, stds, norms = [], [], []
    for start in range(0, rows, step):
        part = x[start : start + step]
        block = buffer[: len(part)].copy_(part)
        mean = block.sum(1) / n
        norm = torch.linalg.vector_norm(block, dim=1)
        if exact:
            std = torch.linalg.vector_norm(block.sub_(mean[:, None]), dim=1) / math.sqrt(n)
        else:
            std = (norm.square() / n - mean.square()).clamp_(min=0).sqrt_()
        means.append(mean), stds.append(std), norms.append(norm)
    if len(means) == 1:
        return means[0], stds[0], norms[0]
    return torch.cat(means), torch.cat(stds), torch.cat(norms)


def matrix_stats(x: torch.Tensor, *, exact: bool = False, padded: torch.Tensor | None = None) -> torch.Tensor:
    """A float64 ``(rows, len(STAT_NAMES))`` table: the statistics of each row of ``x`` (non-empty rows).

    ``padded``, if given, holds the same rows followed by zeros up to a
    multiple of :data:`PAD` columns, contiguous: zeros are counted faster there.
    With ``exact=False`` the ``nan`` and ``inf`` columns are NaN (unknown)
    and ``std`` is the one-pass value; :func:`finish` completes such rows.
    """
    x = _as_real(x)
    n = x.shape[1]
    f64 = torch.float64
    lo, hi = x.amin(1), x.amax(1)  # exact in any dtype
    nonzero = _count_nonzero(padded if padded is not None and padded.dtype == x.dtype else x)
    if x.dtype != f64:
        mean, std, norm = _float64_moments(x, exact=exact)
    elif exact:
        mean, std, norm = _moments(x, torch.maximum(lo.abs(), hi.abs()))
    else:
        # float64 sums can overflow too: such a row has a non-finite mean or norm, and finish() redoes it.
        mean = x.sum(1) / n
        norm = torch.linalg.vector_norm(x, dim=1)
        std = (norm.square() / n - mean.square()).clamp_(min=0).sqrt_()
    if exact:
        nan, inf = torch.isnan(x).sum(1).to(f64), torch.isinf(x).sum(1).to(f64)
    else:
        nan = inf = torch.full_like(mean, math.nan)
    lo, hi = lo.to(f64), hi.to(f64)
    zero_frac = 1 - nonzero.to(f64) / n
    absmax = torch.maximum(lo.abs(), hi.abs())
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac], dim=1)


def finish(x: torch.Tensor, rows: list[list[float]]) -> list[list[float]]:
    """Complete the host ``rows`` of a fast :func:`matrix_stats` table of ``x``, in place.

    NaN/Inf counts are zero where mean and norm are finite and are counted
    otherwise. Where the input is finite but the one-pass ``std`` may be
    inaccurate (``mean**2 > 1e3 var``) or a float64 sum overflowed (``mean``,
    ``std`` or ``norm`` is not finite: float64 values near its maximum),
    ``mean``, ``std`` (in two passes) and ``norm`` are recomputed from the
    rows scaled by a power of two.
    """
    count = []
    for i, row in enumerate(rows):
        if math.isnan(row[NAN_COL]):
            if math.isfinite(row[MEAN_COL]) and math.isfinite(row[NORM_COL]):
                row[NAN_COL] = row[INF_COL] = 0
            else:
                count.append(i)
    if count:
        sub = _as_real(x[torch.tensor(count, device=x.device)])
        for i, nan, inf in zip(count, torch.isnan(sub).sum(1).tolist(), torch.isinf(sub).sum(1).tolist()):
            rows[i][NAN_COL], rows[i][INF_COL] = nan, inf
    refine = []
    for i, row in enumerate(rows):
        if row[NAN_COL] or row[INF_COL]:
            continue  # NaN/Inf statistics are the right answer for non-finite input
        mean, std, norm = row[MEAN_COL], row[STD_COL], row[NORM_COL]
        if not (math.isfinite(mean) and math.isfinite(std) and math.isfinite(norm)) or \
                mean * mean > _ILL_CONDITIONED * std * std:
            refine.append(i)
    if refine:
        sub = _as_real(x[torch.tensor(refine, device=x.device)]).double()
        absmax = sub.abs().amax(1)
        means, stds, norms = (column.tolist() for column in _moments(sub, absmax))
        for i, mean, std, norm in zip(refine, means, stds, norms):
            rows[i][MEAN_COL], rows[i][STD_COL], rows[i][NORM_COL] = mean, std, norm
    return rows


def tensor_stats(x: torch.Tensor) -> list[float]:
    """The :data:`STAT_NAMES` values of one tensor, exact, on the host (a sync)."""
    if x.numel() == 0:
        return list(EMPTY)
    return matrix_stats(x.reshape(1, -1), exact=True)[0].tolist()


#: Dtypes whose statistics a compiled graph computes itself (:func:`graph_stats`). Others go to
#: the record op: float64, whose sums can overflow and need scaling; float16 and bfloat16, which
#: Inductor computes in float32 and, fusing the reduction, doesn't round first (its
#: ``emulate_precision_casts`` is off), so the statistics would be of other values than eager's
#: (about 1e-3 apart); integers and complex.
GRAPH_DTYPES = (torch.float32,)


def graph_stats(x: torch.Tensor) -> torch.Tensor:
    """The :data:`STAT_NAMES` values of a non-empty float32 tensor (:data:`GRAPH_DTYPES`), as one
    float64 tensor computed by torch ops alone: what a graph compiled by ``torch.compile`` (or
    exported) computes in place of the record op's kernel, so Inductor fuses the reductions.

    The semantics of :func:`tensor_stats`: sums in float64 (float32 values can't overflow
    them), ``std`` in two passes, NaN/Inf propagating as there, ``zero_frac`` as ``zeros / n``.
    """
    n = x.numel()
    v = x.reshape(-1).to(torch.float64)
    mean = v.sum() / n
    std = (v - mean).square().sum().div(n).sqrt()
    norm = torch.linalg.vector_norm(v)
    lo, hi = x.amin().to(torch.float64), x.amax().to(torch.float64)
    absmax = torch.maximum(lo.abs(), hi.abs())
    nan = torch.isnan(x).sum().to(torch.float64)
    inf = torch.isinf(x).sum().to(torch.float64)
    zero_frac = (x == 0).sum().to(torch.float64) / n
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac])
