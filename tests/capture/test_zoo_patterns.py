"""Shapes from a peer's model zoo (timm) that the forms recorded differently (issue 40, item 5).

timm needs torchvision, whose only wheel here doesn't import beside the CPU
torch, so each pattern is reproduced in a few lines. Ground truth: eager mode
on an un-instrumented copy, or eager recording where that is what every form
must agree with.
"""

from __future__ import annotations

import io
from typing import List

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


class DenseLayer(nn.Module):
    """DenseNet's layer: takes the list of all earlier features."""

    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.lin = nn.Linear(c_in, 2)

    def forward(self, features: List[torch.Tensor]):
        return torch.tanh(self.lin(torch.cat(features, 1)))


class DenseBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([DenseLayer(4), DenseLayer(6), DenseLayer(8)])

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


def _list_grads_from_clones(model: nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    """Ground truth: plain hooks on a clone of each list element, handed to each layer in a new list."""
    seen = {}

    def pre(module, args, name):
        (features,) = args
        copies = []
        for i, t in enumerate(features):
            c = t.clone()
            c.register_hook(lambda g, key=(name, "grad_input", f"0/{i}"): seen.__setitem__(key, g.clone()))
            copies.append(c)
        return (copies,)

    for name, module in model.named_modules():
        if isinstance(module, DenseLayer):
            module.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name))
    model(x.clone().requires_grad_()).pow(2).sum().backward()
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


def _list_records(log) -> dict:
    return {r.key[:3]: r.tensor for r in log.records if r.kind == "grad_input" and r.path.startswith("0/")}


def _form(model: nn.Module, form: str, x: torch.Tensor):
    if form == "trace":
        return torch.jit.trace(model, (x,), check_trace=False)
    if form == "compile":
        return torch.compile(model, fullgraph=True)
    if form == "export":
        return torch.export.export(model, (x,)).module()
    return model


@pytest.mark.parametrize("form", ["eager", "trace", "compile", "export"])
def test_a_tensor_in_an_input_list_records_its_gradient_through_this_modules_use(form):
    """DenseNet: every form records an element's gradient through the module's own use of it (as hooks
    on a clone of the element see it), and the model's .grads stay the plain model's."""
    x = torch.randn(3, 4)
    want, _ = _list_grads_from_clones(DenseBlock(), x)
    plain = DenseBlock()
    plain(x.clone().requires_grad_()).pow(2).sum().backward()
    model = DenseBlock()
    picklehooks.instrument(model, capture=("grad_input",), mode="tensor", modules=["layers.*"])
    run = _form(model, form, x.clone().requires_grad_())
    with picklehooks.record() as log:
        run(x.clone().requires_grad_()).pow(2).sum().backward()
    got = _list_records(log)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")
    exact = {"rtol": 0, "atol": 0} if form == "eager" else {}  # graphs may sum in another order
    for (name, p), q in zip(run.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **exact, msg=name)


class Appends(nn.Module):
    def forward(self, features: List[torch.Tensor]):
        features.append(features[0] * 2)
        return features[-1].sum()


def test_the_callers_list_keeps_its_tensors_and_what_the_module_added():
    model = Appends()
    picklehooks.instrument(model, capture=("grad_input",), modules=[""])
    a, b = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    features = [a * 1, b * 1]
    mine = list(features)
    with picklehooks.record() as log:
        model(features).backward()
    assert len(features) == 3 and features[0] is mine[0] and features[1] is mine[1]
    assert {r.path for r in log.records if r.kind == "grad_input"} == {"0/0"}  # b isn't used: no gradient


class DLARoot(nn.Module):
    """DLA's aggregation node: the children's features in a list, beside two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x2, x1, children: List[torch.Tensor]):
        return torch.relu(self.lin(torch.cat([x2, x1, *children], 1)))


class DLATree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tree1, self.tree2, self.root = nn.Linear(4, 4), nn.Linear(4, 4), DLARoot()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        bottom = self.proj(x)
        x1 = self.tree1(bottom)
        x2 = self.tree2(x1)
        return self.root(x2, x1, [bottom, x1 * bottom]) + bottom  # bottom and x1: three uses each


def _dla_grads(capture) -> dict:
    model = DLATree()
    if capture is not None:
        picklehooks.instrument(model, capture=capture)
    torch.manual_seed(2)
    x = torch.randn(5, 4)
    with picklehooks.record():
        model(x).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_captures_that_add_no_gradient_node_keep_grads_bitwise_and_gradient_captures_stay_within_rounding():
    """DLA: value captures leave the model's .grads bitwise those of the plain model; gradient captures
    hook each use through a node of its own, which may regroup a tensor's gradient sum: measured here
    against the gradient's own scale (float32 rounding, about 6e-8 an addition)."""
    plain = _dla_grads(None)
    values = _dla_grads(("input", "output", "param", "buffer"))
    assert all(torch.equal(values[n], g) for n, g in plain.items())
    everything = _dla_grads("all")
    for name, g in plain.items():
        deviation = (everything[name] - g).abs().max() / g.abs().max()
        assert deviation <= 1e-6, f"{name}: {deviation:.2e} of its scale"
