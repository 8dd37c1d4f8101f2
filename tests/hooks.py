"""Hooks and small models shared by the tests.

The hooks here are deliberately ordinary: module-level defs, closures, and
typed hooks of the kind TorchScript accepts.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

SCALE = 3.0


def double_output(module, inputs, output):
    return output * 2


def add_one_pre(module, inputs):
    return (inputs[0] + 1,)


def make_clamp(limit: float, dtype=torch.float32):
    def clamp_hook(module, inputs, output):
        return F.relu(output).clamp(max=limit).to(dtype) * SCALE + math.pi * 0

    return clamp_hook


def make_recorder(sink: list):
    def recorder(module, inputs, output):
        sink.append(output)

    return recorder


def typed_forward(module: nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    return output * 2 + 1


def typed_pre(module: nn.Module, inputs: Tuple[torch.Tensor]) -> Tuple[torch.Tensor]:
    return (inputs[0] - 1,)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))


def import_in_body(module, inputs, output):
    """A hook that imports inside its body (run when called, not when decoded)."""
    import statistics

    return output * statistics.fmean([1.0, 3.0])
