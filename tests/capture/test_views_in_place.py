"""Gradient records of values changed in place after a module returned them (issue 40, item 1).

A module whose output is its input handed back (``Identity``) or a view of a
value it made (a slice), changed in place by its caller (``h += x``) or by the
next module (``ReLU(inplace=True)``): the shape of every BatchNorm-activation
block in a CNN (timm's ``BatchNormAct2d``: BatchNorm, ``drop = Identity()``,
an in-place activation) and of HF ResNet's basic layer (``hidden_state +=
residual``).

Ground truth: plain tensor hooks on a clone of each module's inputs and output
in an un-instrumented copy (a clone is no view, so a hook registered on it
before an in-place change fires with the gradient of the value before it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture.instrument import CAPTURE_KINDS


def clone_hook_grads(model: nn.Module, names: list[str], run) -> tuple[dict, dict]:
    """``{(module, kind, path): gradient}`` seen by hooks on clones in a copy, and its ``.grad``s."""
    plain = copy.deepcopy(model)
    seen: dict = {}

    def hooked(value, key):
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return value
        copy_ = value.clone()
        copy_.register_hook(lambda g: seen.__setitem__(key, g.clone()))
        return copy_

    for name in names:
        module = plain.get_submodule(name)
        module.register_forward_pre_hook(
            lambda m, args, name=name: tuple(hooked(a, (name, "grad_input", str(i))) for i, a in enumerate(args)))
        module.register_forward_hook(lambda m, args, out, name=name: hooked_output(out, name))

    def hooked_output(out, name):
        if isinstance(out, dict):  # an HF ModelOutput: the same object, its tensors replaced
            for key, value in list(out.items()):
                out[key] = hooked(value, (name, "grad_output", key))
            return out
        return hooked(out, (name, "grad_output", ""))

    run(plain)
    return seen, {n: p.grad.clone() for n, p in plain.named_parameters()}


def instrumented_grads(model: nn.Module, run, **kwargs) -> tuple[dict, dict]:
    model = copy.deepcopy(model)
    picklehooks.instrument(model, mode="tensor", **kwargs)
    with picklehooks.record() as log:
        run(model)
    got = {}
    for r in log.records:
        if r.kind in ("grad_input", "grad_output"):
            assert r.key not in got, f"{r.key} recorded twice"
            got[r.key] = r.tensor
    return {k[:3]: v for k, v in got.items() if k[3] == 0}, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_gradients(model: nn.Module, run, capture) -> None:
    chosen = copy.deepcopy(model)  # which modules instrument() chooses
    names = list(picklehooks.instrument(chosen, capture=capture).modules)
    want, want_grads = clone_hook_grads(model, names, run)
    got, got_grads = instrumented_grads(model, run, capture=capture)
    kinds = {"grad_input", "grad_output"} & (set(CAPTURE_KINDS) if capture == "all" else set(capture))
    want = {k: v for k, v in want.items() if k[1] in kinds}
    assert sorted(got) == sorted(want), f"missing: {sorted(want.keys() - got.keys())}, extra: {sorted(got.keys() - want.keys())}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")
    for name, grad in want_grads.items():  # the model's own gradients: unchanged, bitwise
        assert torch.equal(got_grads[name], grad), name


class IdentityThenAddInPlace(nn.Module):
    """The issue's block: the Identity's output (its input handed back) changed in place by the caller."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act, self.relu = nn.Linear(4, 4), nn.Identity(), nn.ReLU()

    def forward(self, x):
        h = self.act(self.lin(x))
        h += x
        return self.relu(h)


class BatchNormAct(nn.Module):
    """timm's BatchNormAct2d: BatchNorm, then ``drop = Identity()``, then an in-place activation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.drop(self.bn(self.conv(x)))).mean((2, 3))


class Half(nn.Module):
    """Returns a slice of its own result (GhostNet's ghost module: ``out[:, :self.oup]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        return self.lin(x)[:, :4]


class SliceThenAddInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ghost, self.out = Half(), nn.Linear(4, 2)

    def forward(self, x):
        y = self.ghost(x)
        y += x  # the shortcut, in place on the slice
        return self.out(y)


class ReadThenChange(nn.Module):
    """The view is used before the change as well: its gradient is the sum over both uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.flat, self.out = nn.Linear(4, 4), nn.Flatten(0), nn.Linear(12, 2)

    def forward(self, x):
        h = self.flat(self.lin(x))
        before = h * 3
        h.mul_(2)
        return self.out(h + before)


CASES = {
    "Identity, +=": (IdentityThenAddInPlace, lambda: torch.randn(3, 4, requires_grad=True)),
    "Identity, ReLU(inplace)": (
        lambda: (torch.manual_seed(0), nn.Sequential(nn.Linear(4, 6), nn.Identity(), nn.ReLU(inplace=True),
                                                     nn.Linear(6, 2)))[1],
        lambda: torch.randn(3, 4, requires_grad=True)),
    "BatchNormAct": (BatchNormAct, lambda: torch.randn(2, 3, 5, 5, requires_grad=True)),
    "slice, +=": (SliceThenAddInPlace, lambda: torch.randn(3, 4, requires_grad=True)),
    "read, then changed": (ReadThenChange, lambda: torch.randn(3, 4, requires_grad=True)),
}


@pytest.mark.parametrize("capture", ["all", ("grad_output",), ("grad_input",)])
@pytest.mark.parametrize("case", CASES)
def test_a_value_changed_in_place_keeps_its_gradient_records(case, capture):
    make, make_input = CASES[case]
    model = make().train()
    torch.manual_seed(1)
    x = make_input()

    def run(m):
        m(x.detach().clone().requires_grad_()).pow(2).sum().backward()

    assert_same_gradients(model, run, capture)


def test_hf_resnet_basic_layers_keep_their_gradient_records():
    """HF ResNet, basic blocks, train mode: each layer ends with an ``Identity`` activation whose output
    the layer then changes in place (``hidden_state += residual``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ResNetConfig(layer_type="basic", embedding_size=8, hidden_sizes=[8, 16], depths=[2, 1],
                                       num_labels=3)
    model = transformers.ResNetForImageClassification(config).train()
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 16, 16)

    def run(m):
        m(pixel_values=pixels.clone().requires_grad_()).logits.pow(2).sum().backward()

    assert_same_gradients(model, run, ("grad_output",))


def test_a_change_after_the_last_hook_is_reported():
    """Nothing runs between the change and the backward pass: the record can't be kept, and a warning says so."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Flatten(0))
    picklehooks.instrument(model, capture=("grad_output",))
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"no gradient for 1 output: the value was changed in place"):
        with picklehooks.record() as log:
            out = model(x)
            out.mul_(2)
            out.sum().backward()
    assert {r.module for r in log.records if r.kind == "grad_output"} == {"0"}


def _in_form(model: nn.Module, form: str, x: torch.Tensor):
    if form == "trace":
        return torch.jit.trace(model, (x,), check_trace=False)
    if form == "compile":
        torch._dynamo.reset()  # Dynamo doesn't guard on hooks: never reuse another copy's graph
        return torch.compile(model, fullgraph=True)
    return torch.export.export(model, (x,)).module()


@pytest.mark.parametrize("form", ["trace", "compile", "export"])
@pytest.mark.parametrize("case", ["Identity, ReLU(inplace)", "BatchNormAct", "slice, +="])
def test_graphs_record_what_eager_records_for_a_value_changed_in_place(case, form):
    """The same shapes in each graph form: the gradient records of hooks on clones, as in eager."""
    make, make_input = CASES[case]
    model = make().eval()  # (eval: tracing and exporting run the forward once, which would step BatchNorm)
    torch.manual_seed(1)
    x = make_input()
    chosen = copy.deepcopy(model)  # which modules instrument() chooses (the handle holds it weakly)
    names = list(picklehooks.instrument(chosen, capture="all").modules)
    want, _ = clone_hook_grads(model, names, lambda m: m(x.detach().clone().requires_grad_()).pow(2).sum().backward())
    instrumented = copy.deepcopy(model)
    picklehooks.instrument(instrumented, capture="all", mode="tensor")
    run = _in_form(instrumented, form, x.detach().clone().requires_grad_())
    with picklehooks.record() as log:
        run(x.detach().clone().requires_grad_()).pow(2).sum().backward()
    got = {r.key[:3]: r.tensor for r in log.records if r.kind in ("grad_input", "grad_output") and r.call == 0}
    assert sorted(got) == sorted(want), f"missing: {sorted(want.keys() - got.keys())}, extra: {sorted(got.keys() - want.keys())}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
