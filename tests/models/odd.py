"""Odd models for the faithfulness tests: each is a shape that once made a graph drop, merge,
reorder or alias a tap, or lose a parameter's gradient (issue 11)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DiscardedOutput(nn.Module):
    """A submodule whose output nobody uses: compilers may delete pure ops that compute it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused, self.lin = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.unused(x)
        return self.lin(x)


class CalledTwice(nn.Module):
    """One module called twice on the same tensor: common-subexpression elimination merges pure calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.lin(x)


class TwoBranches(nn.Module):
    """One module on two independent branches: call 0 and call 1 must keep their order."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.sin()) + 2 * self.lin(x.cos())


class InPlaceAfter(nn.Module):
    """An in-place module whose caller keeps using its input: it must get the caller's tensor, not a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        g = self.a(x) + 1
        self.act(g)  # result discarded: g itself is changed
        return self.b(g)


class Tied(nn.Module):
    """An embedding and a head sharing one weight (GPT-2's wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids)))


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj's parameters without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Conv(nn.Module):
    """Inductor hands custom ops a channels-last copy of a Conv2d weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(torch.relu(self.conv(x)))


class Block(nn.Module):
    """A Hugging Face-style layer: everything arrives by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                position_embeddings: tuple[Tensor, Tensor] | None = None) -> Tensor:
        assert position_embeddings is not None and attention_mask is not None  # (for TorchScript's types)
        cos, sin = position_embeddings
        return self.proj(hidden_states * cos + sin) + attention_mask


class KeywordCalls(nn.Module):
    """Calls its block with keywords only (HF's hidden_states=, attention_mask=, position_embeddings=)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: Tensor) -> Tensor:
        mask = (x > 0).to(x.dtype)
        return self.block(hidden_states=x, attention_mask=mask, position_embeddings=(x.cos(), x.sin()))


#: Modules that the model calls with keyword arguments (TorchScript hooks can't see those).
KEYWORD_CALLED = {"KeywordCalls": ["block"]}


def inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    if name == "Tied":
        return (torch.randint(0, 10, (3, 5), generator=g),)
    if name == "Attention":
        return (torch.randn(2, 5, 8, generator=g),)
    if name == "Conv":
        return (torch.randn(2, 3, 12, 12, generator=g),)
    return (torch.randn(3, 4, generator=g),)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return globals()[name]()


NAMES = ["DiscardedOutput", "CalledTwice", "TwoBranches", "InPlaceAfter", "Tied", "Attention", "Conv",
         "KeywordCalls"]


class SameGradient(nn.Module):
    """f(a) + f(b): both calls' output gradients are one tensor, so a backward graph may merge their taps."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.sin()) + self.lin(x.cos())


class ChangedAfter(nn.Module):
    """The caller changes a module's output in place after the call (and an identity passes its input on)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.same, self.b = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.mul_(3)
        k = self.same(h)
        return self.b(k) + h.sum()


class RelPosBias(nn.Module):
    """MaxViT's relative-position bias: it has a forward, but its owner reads it through another method."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))

    def get_bias(self) -> Tensor:
        return self.table.sum(0)

    def forward(self, x: Tensor) -> Tensor:  # never called
        return x + self.get_bias()


class UsesBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.rel_pos = nn.Linear(4, 4), RelPosBias()

    def forward(self, x: Tensor) -> Tensor:
        return self.qkv(x) + self.rel_pos.get_bias()


class UnrunOwner(nn.Module):
    """A parameter whose module never runs (``attn.rel_pos``), beside one whose module does (``attn.qkv``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = UsesBias(), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.attn(x)))
