"""Hutchinson's estimate of a Jacobian's Frobenius norm, from vector-Jacobian products.

Shared by :func:`picklehooks.diagnostics.jacobian.hutchinson_jacobian_norm`
(an eager model, its own forward) and :meth:`picklehooks.Log.jacobian_norm`
(values recorded with ``record(keep_graph=True)``, in any backend that
keeps them autograd-connected: eager, FX, TorchScript).

For Rademacher probes ``v`` (entries ±1, shaped like the output),
``E[||J^T v||^2] = trace(J J^T) = ||J||_F^2``; one backward pass gives one
probe, never the norm itself.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._shim import PicklehooksError


def hutchinson(y: torch.Tensor, vjp: Callable[[torch.Tensor, bool], torch.Tensor], *, samples: int,
               seed: int) -> tuple[float, float]:
    """``(estimate, standard error)`` of ``||J||_F``; ``vjp(v, retain_graph)`` returns ``J^T v``.

    The estimate is the square root of the mean of ``||J^T v||^2`` over
    ``samples`` probes; its standard error comes from their sample variance
    by the delta method (``se(sqrt(m)) = se(m) / (2 sqrt(m))``). Probes come
    from a CPU generator seeded with ``seed``: the same on every device, and
    the global RNG is left alone.
    """
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 2:
        raise PicklehooksError(f"samples={samples!r}: use at least 2 probes (the standard error needs two)")
    generator = torch.Generator().manual_seed(seed)
    squares = []
    for i in range(samples):
        v = torch.randint(0, 2, y.shape, generator=generator).to(device=y.device, dtype=y.dtype) * 2 - 1
        squares.append(vjp(v, i < samples - 1).detach().double().pow(2).sum())
    s = torch.stack(squares).cpu()
    mean = float(s.mean())
    se_mean = float(s.std(unbiased=True)) / math.sqrt(samples)
    estimate = math.sqrt(max(mean, 0.0))
    return estimate, (se_mean / (2 * estimate) if estimate > 0 else 0.0)
