"""Shapes from a peer's model zoo (timm) that the forms recorded differently (issue 40, item 5).

timm needs torchvision, whose only wheel here doesn't import beside the CPU
torch, so each pattern is reproduced in a few lines. Ground truth: eager mode
on an un-instrumented copy, or eager recording where that is what every form
must agree with.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import picklehooks


class XCiTAttention(nn.Module):
    """XCiT's blocks pass the token grid's height and width along as ints."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, H: int, W: int):
        return self.lin(x) * H + W


class XCiTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = XCiTAttention()

    def forward(self, x):
        H, W = x.shape[0], x.shape[1]
        return self.attn(x, H, W)


def _number_records(log) -> dict:
    return {(r.module, r.path, r.call): r.value for r in log.records if r.kind == "input" and r.module == "attn"}


@pytest.mark.parametrize("form", ["trace", "trace saved and loaded"])
def test_int_arguments_are_recorded_as_numbers_under_jit_trace(form):
    model = XCiTBlock()
    picklehooks.instrument(model, capture=("input",))
    traced = torch.jit.trace(model, (torch.randn(3, 4),))
    if form == "trace saved and loaded":
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        traced = torch.jit.load(buffer)
    x = torch.randn(5, 4)  # another shape than the trace's: the numbers come from this call
    with picklehooks.record() as eager:
        model(x)
    with picklehooks.record() as log:
        traced(x)
    want = _number_records(eager)
    assert want[("attn", "1", 0)] == repr(x.shape[0]) and want[("attn", "2", 0)] == repr(x.shape[1])
    assert _number_records(log) == want
