"""Small models shared by the logging tests: each exercises a different hook shape."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    """Conv + BatchNorm (buffers), in eval mode so every backend sees the same buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 1.5)
    return model.eval()


class Attention(nn.Module):
    """Two tensor inputs (one optional), a tuple output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(-1)
        return self.out(weights @ v), weights


class Block(nn.Module):
    """A transformer block called with a keyword argument."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, scale: float = 1.0) -> Tuple[Tensor, Tensor]:
        h, weights = self.attn(self.norm1(x), mask)
        x = x + h * scale
        return x + self.mlp(self.norm2(x)), weights


class Transformer(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.block = Block(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        y, weights = self.block(x, mask=mask, scale=0.5)
        return self.head(y), weights


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return Transformer()


class Twice(nn.Module):
    """One submodule called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(self.act(self.shared(x)))


def twice() -> nn.Module:
    torch.manual_seed(0)
    return Twice()


class Stage(nn.Module):
    """A block that ``ThreePlaces`` calls in a loop, from one line."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.lin(x))


class ThreePlaces(nn.Module):
    """One ``nn.Identity`` called from three lines (one of them in a loop) and blocks called in a loop:
    every call of a module has its own line of code (the sources' tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.same = nn.Identity()
        self.stages = nn.ModuleList([Stage(), Stage()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.same(x)
        for stage in self.stages:
            x = self.same(stage(x))
        return self.head(self.same(x))


def inputs(name: str) -> tuple:
    """Example inputs for each model (deterministic)."""
    g = torch.Generator().manual_seed(1)
    if name == "cnn":
        return (torch.randn(2, 1, 6, 6, generator=g),)
    if name == "transformer":
        x = torch.randn(2, 5, 8, generator=g)
        mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -1e9)
        return (x, mask)
    return (torch.randn(3, 4, generator=g),)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "twice": twice}


# An LSTM called with a (h0, c0) tuple: an overloaded forward TorchScript can't take hooks on.
class RNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x, h0, c0):
        out, (h, c) = self.lstm(x, (h0, c0))
        return self.head(out + h[-1].unsqueeze(1))


def rnn_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 4, generator=g), torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
