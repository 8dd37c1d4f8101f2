"""Models with a planted fault whose diagnosis is known, shared by the diagnostics tests and examples."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn


class MulNaN(nn.Module):
    """Multiplies by NaN: a forward fault."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tensor(float("nan"))


class ExpOverflow(nn.Module):
    """exp of a huge value: Inf in the forward."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x + 1000.0)


class _NaNGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class NaNGrad(nn.Module):
    """Identity forward, NaN gradient: a backward-only fault."""

    def forward(self, x: Tensor) -> Tensor:
        return _NaNGradFn.apply(x)


def mlp_with(fault: nn.Module, position: int, width: int = 8) -> nn.Sequential:
    """Linear, ReLU, Linear, ReLU, Linear with ``fault`` inserted at index ``position``."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2)]
    layers.insert(position, fault)
    return nn.Sequential(*layers)


def dead_relu(dead: int, units: int = 16) -> nn.Sequential:
    """The first ``dead`` of ``units`` ReLU units can never fire: their bias is -1e4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, units), nn.ReLU(), nn.Linear(units, 2))
    with torch.no_grad():
        model[0].bias[:dead] = -1e4
    return model


def dead_channels(dead: int, channels: int = 6) -> nn.Sequential:
    """A conv whose first ``dead`` output channels have bias -1e4 before a ReLU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, channels, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with torch.no_grad():
        model[0].bias[:dead] = -1e4
    return model


def saturated_tanh(saturated: int, units: int = 16) -> nn.Sequential:
    """The first ``saturated`` Tanh units have 1000x weights and bias 1e4: pinned at +1 for inputs in [-1, 1]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, units), nn.Tanh(), nn.Linear(units, 2), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight[:saturated] *= 1000
        model[0].bias[:saturated] = 1e4
    return model


def deep_mlp(depth: int, scale: float, activation: type[nn.Module] | None = None, width: int = 16) -> nn.Sequential:
    """``depth`` x Linear(width) with weights multiplied by ``scale``, each followed by ``activation``."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        with torch.no_grad():
            linear.weight *= scale
        layers += [linear] + ([activation()] if activation else [])
    return nn.Sequential(*layers)


class TwoHeads(nn.Module):
    """A shared trunk; head ``a`` reads the first half of its features, head ``b`` the second half."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.half = d // 2
        self.trunk = nn.Linear(d, d)
        self.head_a = nn.Linear(self.half, 1)
        self.head_b = nn.Linear(d - self.half, 1)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.trunk(x)
        return self.head_a(h[:, : self.half]), self.head_b(h[:, self.half :])


def two_heads() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


def compare_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
