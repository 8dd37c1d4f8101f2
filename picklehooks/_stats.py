"""Statistics of many tensors at once, on their device, without a host sync.

A forward pass records dozens of tensors, and each statistic is a kernel
launch; so a log copies the tensors it can't reduce in the hook into one
buffer per device and dtype (see :mod:`picklehooks.capture.pending`), and
:func:`segment_stats` reduces all of them with a fixed number of kernels,
however many there are and whatever their shapes. Each copy is a segment of
the buffer padded with zeros to a multiple of :data:`PAD` elements, so the
buffer is a ``(chunks, PAD)`` matrix: row-wise reductions give per-chunk
partial results (min and max with the padding masked, counts, float64
sums), and ``index_add_``/``scatter_reduce_`` over the chunks' segment
indices combine them per tensor. ``std`` takes one more pass, centred on
each tensor's mean: the two-pass value, accurate when ``|mean| >> std``.
:func:`tensor_stats` reduces one tensor (:func:`matrix_stats`).

Semantics follow the per-tensor torch calls: ``std`` is the population
standard deviation; a tensor containing NaN has NaN ``mean``, ``std``,
``min``, ``max``, ``absmax`` and ``norm``; an empty tensor has NaN
statistics and zero counts; complex tensors are summarised by their
magnitude.

Every sum is accumulated in float64, whatever the dtype: a float32 sum of
an attention mask filled with ``finfo(float32).min`` overflows to ``-inf``
(and its std to NaN), and a float32 sum of values that cancel loses more
than 1e-6 of the mean. So the statistics of finite input are finite and
within about 1e-12 of float64 arithmetic on the same values. Values are
converted a block at a time (a float64 copy of a whole buffer would double
its memory; on CPU the conversion, not the reduction, is what costs).
float64 values can overflow float64 sums too (values near
``finfo(float64).max``): they are reduced scaled by a power of two, which
is exact, so only a statistic whose true value is beyond float64's range
(the norm of many such values) is ``inf``.
"""

from __future__ import annotations

import math

import torch

#: The statistics, in the column order of each row.
STAT_NAMES = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf", "zero_frac")
EMPTY = (math.nan,) * 6 + (0, 0, math.nan)

# Float32 rows are converted to float64 this many elements at a time.
_BLOCK = 1 << 18
# segment_stats converts its chunks to float64 in blocks of at least this many elements, and at
# most _SEGMENT_BLOCKS of them: each block costs a fixed number of kernels (about 20), and its
# float64 copy is the working memory (128 MiB, or an eighth of a buffer of more than 128M elements).
_SEGMENT_BLOCK, _SEGMENT_BLOCKS = 1 << 24, 8
# Reinterpreted as integers, a float is +-0 exactly when its bits, sign
# masked off, are 0; NaN and Inf are non-zero, as they should be.
#: Chunk width (in elements) of segment_stats' buffers, which also makes counting zeros fast.
PAD = 256
_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
# The normal powers of two, 2**lowest .. 2**highest, and the mantissa's width (IEEE 754 binary32/64).
_POW2 = {torch.float32: (-126, 127, 23), torch.float64: (-1022, 1023, 52)}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 and integer tensors, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 or not (dtype.is_floating_point or dtype == torch.bool) else torch.float32


def _as_real(x: torch.Tensor) -> torch.Tensor:
    return (x.abs() if x.is_complex() else x).to(compute_dtype(x.dtype))


def _count_true(flags: torch.Tensor) -> torch.Tensor:
    """The True values along the last dimension (:data:`PAD` wide) of a contiguous bool tensor.

    One byte per flag, summed four at a time as int32 lanes: a lane sums at
    most PAD / 4 = 64 bytes of 0 or 1, so none carries into the next, and
    there is no int64 copy of the flags, which summing them as they are would make.
    """
    words = flags.view(torch.int32).sum(-1, dtype=torch.int32)
    return words.view(torch.uint8).view(*words.shape, 4).sum(-1)


def _count_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Non-zero elements per row of a float32/float64 matrix (NaN and Inf count as non-zero)."""
    rows, width = x.shape
    if width % PAD == 0 and x.is_contiguous():
        return _count_true(x.bool().view(rows, width // PAD, PAD)).sum(1, dtype=torch.int32)
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


def _float64_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``(mean, std, norm)`` of each row of a float32 matrix, accumulated in float64, std in two passes.

    Rows are converted a block at a time (:data:`_BLOCK` elements), so the
    float64 copy stays small and is reused from the allocator's cache.
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
        std = torch.linalg.vector_norm(block.sub_(mean[:, None]), dim=1) / math.sqrt(n)
        means.append(mean), stds.append(std), norms.append(norm)
    if len(means) == 1:
        return means[0], stds[0], norms[0]
    return torch.cat(means), torch.cat(stds), torch.cat(norms)


def matrix_stats(x: torch.Tensor) -> torch.Tensor:
    """A float64 ``(rows, len(STAT_NAMES))`` table: the statistics of each row of ``x`` (non-empty rows)."""
    x = _as_real(x)
    n = x.shape[1]
    f64 = torch.float64
    lo, hi = x.amin(1), x.amax(1)  # exact in any dtype
    nonzero = _count_nonzero(x)
    if x.dtype != f64:
        mean, std, norm = _float64_moments(x)
    else:
        mean, std, norm = _moments(x, torch.maximum(lo.abs(), hi.abs()))
    nan, inf = torch.isnan(x).sum(1).to(f64), torch.isinf(x).sum(1).to(f64)
    lo, hi = lo.to(f64), hi.to(f64)
    zero_frac = 1 - nonzero.to(f64) / n
    absmax = torch.maximum(lo.abs(), hi.abs())
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac], dim=1)


def tensor_stats(x: torch.Tensor) -> list[float]:
    """The :data:`STAT_NAMES` values of one tensor, exact, on the host (a sync)."""
    if x.numel() == 0:
        return list(EMPTY)
    return matrix_stats(x.reshape(1, -1))[0].tolist()


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def segment_stats(data: torch.Tensor, segment: torch.Tensor, valid: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """A float64 ``(len(sizes), len(STAT_NAMES))`` table: the statistics of the tensors packed in ``data``.

    ``data`` is 1-D, ``len(segment) * PAD`` elements: chunks of :data:`PAD`.
    Chunk ``c`` belongs to tensor ``segment[c]`` and holds ``valid[c]`` (1 to
    ``PAD``) of its values, then zeros; tensor ``i`` has ``sizes[i]`` values
    (non-empty: an empty tensor has no chunk to take statistics from).
    ``segment`` and ``valid`` are int64, ``sizes`` float64, all on ``data``'s
    device. The kernels are a fixed number per block of chunks (one block
    up to 16M elements, at most :data:`_SEGMENT_BLOCKS`), however many
    tensors and shapes; nothing waits for the device.

    A pass over the chunks in float64 gives each chunk's min and max (the
    padding masked), its non-zero, NaN and Inf counts, and float64 sums of
    the values and their squares; ``index_add_`` and ``scatter_reduce_``
    combine the chunks per tensor. float64 values are summed in a second
    pass, scaled by a power of two per tensor (see :func:`_pow2_scale`). A
    last pass sums the squared deviations from each tensor's mean: the
    two-pass ``std``.
    """
    chunks, f64, device, n = len(segment), torch.float64, data.device, len(sizes)
    x = data.view(chunks, PAD)
    step = max(_SEGMENT_BLOCK // PAD, -(-chunks // _SEGMENT_BLOCKS))
    blocks = [(a, min(a + step, chunks)) for a in range(0, chunks, step)]
    lanes = torch.arange(PAD, device=device)
    buffer = torch.empty((min(step, chunks), PAD), dtype=f64, device=device)
    # Only float64 values can overflow float64 sums (float32's largest squared is about 1e77).
    scaled = x.dtype in (f64, torch.complex128)

    def magnitudes(a: int, b: int) -> torch.Tensor:
        """Chunks ``a:b`` as real values: complex ones by their magnitude, in their own precision as
        elsewhere (:func:`_as_real`)."""
        return x[a:b].abs() if x.is_complex() else x[a:b]

    def widened(a: int, b: int, scale: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
        """Chunks ``a:b`` (or their ``real`` magnitudes) in float64, times the column ``scale`` if given:
        in ``buffer`` (every block reuses it) unless they are float64 already and unscaled."""
        real = magnitudes(a, b) if real is None else real
        if scale is not None:
            return torch.mul(real, scale[a:b], out=buffer[: b - a])
        return real if real.dtype == f64 else buffer[: b - a].copy_(real)

    partial = []
    for a, b in blocks:
        real = magnitudes(a, b)
        # Min, max and the counts are exact in a float's own dtype: taken there, they read the chunks at
        # their width, not float64's. For min and max the padding repeats the chunk's first element,
        # which is always a value.
        r = real if real.is_floating_point() else widened(a, b, real=real)
        lo, hi = torch.aminmax(torch.where(lanes < valid[a:b, None], r, r[:, :1]), dim=1)
        counts = _count_true(torch.stack([r != 0, torch.isnan(r), torch.isinf(r)], dim=1))
        columns = [lo[:, None], hi[:, None], counts]  # torch.cat promotes them to float64
        if not scaled:  # y is a float64 copy or the buffer: squared in place, last
            y = r if r.dtype == f64 else widened(a, b, real=real)
            columns += [y.sum(1, keepdim=True), y.square_().sum(1, keepdim=True)]
        partial.append(torch.cat(columns, dim=1))
    partial = _cat(partial)
    lo = torch.empty(n, dtype=f64, device=device).scatter_reduce_(0, segment, partial[:, 0], "amin",
                                                                  include_self=False)
    hi = torch.empty(n, dtype=f64, device=device).scatter_reduce_(0, segment, partial[:, 1], "amax",
                                                                  include_self=False)
    totals = torch.zeros((n, partial.shape[1] - 2), dtype=f64, device=device).index_add_(0, segment, partial[:, 2:])
    nonzero, nan, inf = totals[:, 0], totals[:, 1], totals[:, 2]
    # scatter_reduce_'s amin/amax need not propagate NaN on every device: the NaN count decides.
    has_nan = nan > 0
    lo, hi = torch.where(has_nan, math.nan, lo), torch.where(has_nan, math.nan, hi)
    absmax = torch.maximum(lo.abs(), hi.abs())

    scale = chunk_scale = None
    sums = totals[:, 3:]
    if scaled:
        scale = _pow2_scale(absmax)
        chunk_scale = scale.index_select(0, segment)[:, None]
        parts = []
        for a, b in blocks:
            y = widened(a, b, chunk_scale)
            total = y.sum(1)
            parts.append(torch.stack([total, y.square_().sum(1)], dim=1))
        sums = torch.zeros((n, 2), dtype=f64, device=device).index_add_(0, segment, _cat(parts))
    mean = sums[:, 0] / sizes

    chunk_mean = mean.index_select(0, segment)[:, None]
    squares = []
    for a, b in blocks:
        y = widened(a, b, chunk_scale)  # the buffer: float64 chunks are scaled
        # Deviations from the tensor's mean where the chunk holds values; the padding stays zero.
        squares.append(y.addcmul_(lanes < valid[a:b, None], chunk_mean[a:b], value=-1).square_().sum(1))
    std = torch.zeros(n, dtype=f64, device=device).index_add_(0, segment, _cat(squares)).div_(sizes).sqrt_()
    norm = sums[:, 1].sqrt()
    if scale is not None:  # dividing by a power of two is exact: only a value beyond float64's range is inf
        mean, std, norm = mean / scale, std / scale, norm / scale
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, 1 - nonzero / sizes], dim=1)


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
    Written for Inductor's code generators: the counts compare (``x != x`` for NaN, ``|x| == inf``)
    rather than call ``isnan``/``isinf``, which its CPU backend runs element by element, and count
    in int32 where the tensor is small enough (int64 lanes are half as wide); the norm is the
    square root of the float64 sum of squares (no scaling: float32 squares can't overflow it).
    """
    n = x.numel()
    count = torch.int32 if isinstance(n, int) and n < 2**31 else torch.int64
    f64 = torch.float64
    v = x.reshape(-1).to(f64)
    mean = v.sum() / n
    std = (v - mean).square().sum().div(n).sqrt()
    norm = v.square().sum().sqrt()
    lo, hi = x.amin().to(f64), x.amax().to(f64)
    absmax = torch.maximum(lo.abs(), hi.abs())
    nan = (x != x).sum(dtype=count).to(f64)
    inf = (x.abs() == math.inf).sum(dtype=count).to(f64)
    zero_frac = (x == 0).sum(dtype=count).to(f64) / n
    return torch.stack([mean, std, lo, hi, absmax, norm, nan, inf, zero_frac])
