"""Recording doesn't change a compiled model's numerics (issue 40, item 5: LeViT in train mode).

timm's LeViT compiled with recording got ``.grad``s 10x further from eager
than the plain compiled model's. The cause was the stem: a gradient tap
(the ``tap`` op's copy, opaque to Inductor) between a convolution that
Inductor's layout optimization made channels-last and its BatchNorm kept
the strides it was traced with, so Inductor copied the value back to
contiguous and BatchNorm's statistics were summed in another order. The
forward's values, and then every ``.grad``, changed in the last bits. A
compiled graph's tap that only carries a gradient is now a clone Inductor
lays out and fuses like any other op (``_ops._GradOnlyTap``), and the
compiled instrumented model computes what the plain compiled model does,
bit for bit, idle or recording.

timm needs torchvision, which doesn't install here, so the model is LeViT's
shape in a few lines: ``ConvNorm`` stem, ``LinearNorm`` (Linear, then
BatchNorm1d on the flattened tokens), attention with ``attention_biases``
indexed by a buffer, Hardswish, residual adds, ``Subsample``; train mode, so
BatchNorm updates its running statistics.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picklehooks


class LinearNorm(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(c_in, c_out, bias=False)
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, res: int, heads: int = 2, key_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.key_dim, self.val_dim = heads, key_dim, 2 * key_dim
        self.scale = key_dim ** -0.5
        self.qkv = LinearNorm(dim, heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Sequential(nn.Hardswish(), LinearNorm(heads * self.val_dim, dim))
        pos = torch.stack(torch.meshgrid(torch.arange(res), torch.arange(res), indexing="ij")).flatten(1)
        rel = (pos[..., :, None] - pos[..., None, :]).abs()
        self.attention_biases = nn.Parameter(torch.randn(heads, res * res) * 0.1)
        self.register_buffer("attention_bias_idxs", rel[0] * res + rel[1], persistent=False)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, self.heads, -1).split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        attn = q @ k.transpose(-2, -1) * self.scale + self.attention_biases[:, self.attention_bias_idxs]
        x = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, self.heads * self.val_dim)
        return self.proj(x)


class Subsample(nn.Module):
    def __init__(self, stride: int, res: int) -> None:
        super().__init__()
        self.stride, self.res = stride, res

    def forward(self, x):
        B, _, C = x.shape
        return x.view(B, self.res, self.res, C)[:, ::self.stride, ::self.stride].reshape(B, -1, C)


class Block(nn.Module):
    def __init__(self, dim: int, res: int) -> None:
        super().__init__()
        self.attn = Attention(dim, res)
        self.mlp = nn.Sequential(LinearNorm(dim, 2 * dim), nn.Hardswish(), LinearNorm(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class LeViTLike(nn.Module):
    def __init__(self, dim: int = 32, res: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim // 2, 3, 2, 1, bias=False), nn.BatchNorm2d(dim // 2),
                                  nn.Hardswish(), nn.Conv2d(dim // 2, dim, 3, 2, 1, bias=False), nn.BatchNorm2d(dim))
        self.block1 = Block(dim, res)
        self.down = Subsample(2, res)
        self.block2 = Block(dim, res // 2)
        self.head = LinearNorm(dim, classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.down(self.block1(x))
        x = self.block2(x)
        return self.head(x.mean(1, keepdim=True)).squeeze(1)


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]


def _step(model: nn.Module, batch) -> dict:
    """One training step's loss, ``.grad``s and BatchNorm running statistics, by name."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    got = {"loss": loss.detach().clone()}
    got.update((n.replace("_orig_mod.", "") + ".grad", p.grad.clone()) for n, p in model.named_parameters())
    got.update((n.replace("_orig_mod.", ""), b.clone()) for n, b in model.named_buffers() if "running" in n)
    return got


def _rtol_vs(got: dict, want: dict, atol: float = 1e-6) -> float:
    """The rtol each ``.grad`` needs against ``want`` (with ``atol``), the largest."""
    worst = 0.0
    for key, w in want.items():
        if key.endswith(".grad"):
            excess = ((got[key] - w).abs() - atol).clamp(min=0)
            worst = max(worst, (excess / w.abs()).nan_to_num(0.0, posinf=float("inf")).max().item())
    return worst


@pytest.fixture(scope="module")
def reference():
    """The model's initial state, and each batch's step in eager mode and compiled without picklehooks."""
    torch.manual_seed(0)
    model = LeViTLike().train()
    batches = _batches()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()  # Dynamo doesn't guard on hooks: never reuse another copy's graph
    plain = torch.compile(copy.deepcopy(model), fullgraph=True)
    return model, batches, [_step(eager, b) for b in batches], [_step(plain, b) for b in batches]


@pytest.mark.parametrize("capture", ["all", "default"])
def test_compiled_recording_computes_what_the_compiled_model_does(reference, capture):
    """Idle, then recording: the compiled instrumented model's loss, ``.grad``s and running statistics
    are the plain compiled model's, bit for bit, so recording is no further from eager than compiling."""
    model, batches, eager, plain = reference
    instrumented = copy.deepcopy(model)
    picklehooks.instrument(instrumented, **({} if capture == "default" else {"capture": capture}))
    torch._dynamo.reset()
    compiled = torch.compile(instrumented, fullgraph=True)
    idle = _step(compiled, batches[0])
    with picklehooks.record() as log:
        recording = _step(compiled, batches[1])
    kinds = {r.kind for r in log.records}
    assert {"output", "grad_output"} <= kinds and (capture == "default" or "grad_input" in kinds), kinds
    steps = ((idle, plain[0], eager[0], "idle"), (recording, plain[1], eager[1], "recording"))
    for got, want, want_eager, when in steps:
        differ = [key for key in want if not torch.equal(got[key], want[key])]
        assert not differ, (f"{when}: {len(differ)} differ from the plain compiled model's ({differ[:4]}...); "
                            f"rtol against eager {_rtol_vs(got, want_eager):.1e}, "
                            f"plain compiled's {_rtol_vs(want, want_eager):.1e}")
