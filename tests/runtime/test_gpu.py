"""On a GPU, recording makes no host synchronisation; statistics stay on the device until read.

Skipped where CUDA isn't available (the development machines have none); run
it wherever one is: ``pytest tests/runtime/test_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture.log import STAT_NAMES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


@pytest.mark.parametrize("mode", ["stats", "tensor", "both"])
def test_recording_makes_no_host_sync(mode):
    plain = _model().cuda()
    model = copy.deepcopy(plain)
    picklehooks.instrument(model, capture="all", mode=mode)
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    model(x).sum().backward()  # warm-up: allocator, cuBLAS handles, parameter gradient hooks
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with picklehooks.record() as log:
            model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(log) > 0

    # Ground truth: the un-instrumented copy's outputs, from plain hooks, in float64 on the host.
    outputs = {}
    for name, module in plain.named_children():
        module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.detach().double().cpu()))
    plain(x)
    for name, want in outputs.items():
        (rec,) = log.find(name, "output")
        if mode == "tensor":
            torch.testing.assert_close(rec.tensor.double().cpu(), want)
            continue
        expected = {"mean": want.mean().item(), "std": want.std(correction=0).item(),
                    "min": want.min().item(), "max": want.max().item(), "norm": want.norm().item()}
        for stat, value in expected.items():
            assert rec.stats[stat] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, stat)
        assert set(STAT_NAMES) <= set(rec.stats)
