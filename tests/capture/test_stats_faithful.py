"""Statistics of large finite values (attention masks filled with finfo.min) are finite and right (issue 11).

Ground truth: plain forward hooks on an un-instrumented copy of the model
clone what each call returns, and plain PyTorch computes each statistic of
that clone in float64 (scaled by a power of two, which is exact, where a
float64 sum of squares would overflow).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import picklehooks
import picklehooks._native
from picklehooks.capture.log import STAT_NAMES

from tests.testutils import use_pytorch_stats

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class Masks(nn.Module):
    """Builds the large-valued tensors real models make and passes each through ``emit`` (an Identity)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.emit = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = torch.finfo(self.dtype).min, torch.finfo(self.dtype).max
        x = x.to(self.dtype)
        scores = x @ x.T
        causal = torch.ones_like(scores, dtype=torch.bool).triu(1)
        self.emit(torch.zeros_like(scores).masked_fill(causal, lo))  # a Hugging Face causal mask
        self.emit(scores + torch.zeros_like(scores).masked_fill(causal, lo))  # scores + mask
        self.emit(scores.masked_fill(causal, lo))
        self.emit(torch.full_like(scores, lo))  # every value the same: std 0
        self.emit(torch.full_like(scores, hi).masked_fill(causal, lo))  # both extremes
        self.emit(x * (hi / 8))  # large values of both signs, no zeros
        return scores


def reference(t: torch.Tensor) -> dict:
    """Every statistic of ``t`` from plain PyTorch in float64 (complex: the magnitudes torch computes
    in its dtype), reduced scaled by a power of two (exact) where float64 sums of ``t`` would overflow."""
    v = (t.abs() if t.is_complex() else t).to(torch.float64).flatten()
    if not v.numel():
        return dict(zip(STAT_NAMES, (math.nan,) * 6 + (0, 0, math.nan)))
    absmax = v.abs().max().item()
    exponent = math.frexp(absmax)[1] if math.isfinite(absmax) else 0
    half = -exponent // 2  # in two steps: 2**1028 (for subnormal values) isn't a float64
    w = v * 2.0**half * 2.0 ** (-exponent - half)

    def unscale(value: float) -> float:
        try:
            return math.ldexp(value, exponent)
        except OverflowError:  # the true value is beyond float64's range
            return math.copysign(math.inf, value)

    return {
        "mean": unscale(w.mean().item()),
        "std": unscale(w.std(correction=0).item()),
        "min": v.min().item(),
        "max": v.max().item(),
        "absmax": absmax,
        "norm": unscale(torch.linalg.vector_norm(w).item()),
        "n_nan": int(torch.isnan(v).sum()),
        "n_inf": int(torch.isinf(v).sum()),
        "zero_frac": (v == 0).sum().item() / v.numel(),
    }


def plain_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What ``model.emit`` returns on each call, from a plain forward hook on an un-instrumented copy."""
    plain = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    plain.emit.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    plain(x)
    return seen


def recorded(model: nn.Module, x: torch.Tensor) -> list[dict]:
    picklehooks.instrument(model, capture="output")
    with picklehooks.record() as log:
        model(x)
    records = sorted((r for r in log.records if r.module == "emit"), key=lambda r: r.call)
    return [r.stats for r in records]


@pytest.fixture(params=["native", "fast", "exact"])
def reduction(request, monkeypatch):
    """The three ways a log reduces: the native kernel in the hook; or (the PyTorch fallback) batched
    at read time (fast, then repaired), or exactly as copies pile up."""
    if request.param == "native":
        if not picklehooks._native.AVAILABLE:
            pytest.skip("the native statistics extension isn't built here")
        return request.param
    use_pytorch_stats(monkeypatch)
    if request.param == "exact":
        monkeypatch.setattr(picklehooks.capture.pending, "PENDING_BYTES", 1)  # reduce after every record
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
class TestLargeFiniteValues:
    def test_statistics_match_float64(self, dtype, reduction):
        """Every statistic of every record is within 1e-6 (relative) of the float64 value; counts are exact."""
        torch.manual_seed(0)
        model, x = Masks(dtype), torch.randn(8, 4)
        want = plain_outputs(model, x)
        got = recorded(model, x)
        assert len(got) == len(want) == 6
        for call, (stats, tensor) in enumerate(zip(got, want)):
            ref = reference(tensor)
            for name in STAT_NAMES:
                # A constant row's float64 std is 0; rounding may leave a trace far below its values.
                slack = 1e-6 * ref["absmax"] if name == "std" else 0.0
                assert stats[name] == pytest.approx(ref[name], rel=1e-6, abs=slack), (call, name, stats[name], ref)

    def test_finite_input_has_finite_statistics(self, dtype, reduction):
        """No NaN or Inf in the statistics of finite input (short of a float64 norm beyond float64's range)."""
        torch.manual_seed(0)
        model, x = Masks(dtype), torch.randn(8, 4)
        want = plain_outputs(model, x)
        for call, (stats, tensor) in enumerate(zip(recorded(model, x), want)):
            assert torch.isfinite(tensor).all()
            names = [n for n in STAT_NAMES if not (n == "norm" and math.isinf(reference(tensor)["norm"]))]
            assert all(math.isfinite(stats[n]) for n in names), (call, stats)
            assert stats["n_nan"] == 0 and stats["n_inf"] == 0
