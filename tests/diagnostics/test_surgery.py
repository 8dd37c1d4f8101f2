"""picklehooks.diagnostics.surgery: clamp_grad and zero_param_grad, in process and after torch.save/load.

Expected gradients are computed by hand from the planted fault (the clamp
bounds, the zeroed parameter), never from the hooked model itself.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks import audit
from picklehooks.diagnostics.surgery import clamp_grad, zero_param_grad
from tests.testutils import run_fresh, transformed

LIMIT = 0.05


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def inputs() -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, 15).reshape(5, 3)


def loss(model, x):
    return (model(x) * torch.tensor([3.0, -2.0])).sum()


def grads(model, x, *, backwards: int = 1) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for _ in range(backwards):
        loss(model, x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def clamped_first_layer_grads(model, x, lo, hi) -> dict[str, torch.Tensor]:
    """Layer 0's parameter gradients with dL/d(output of layer 0) clamped, by hand."""
    h = model[0](x).detach().requires_grad_(True)
    (g,) = torch.autograd.grad((model[2](model[1](h)) * torch.tensor([3.0, -2.0])).sum(), h)
    g = g.clamp(lo, hi)
    return {"0.weight": g.T @ x, "0.bias": g.sum(0)}


class TestClampGrad:
    def test_clamps_the_gradient_into_the_module(self):
        """Layer 0's parameter gradients are those of the clamped output gradient; later layers are untouched."""
        model, x = make_model(), inputs()
        plain = grads(model, x)
        want = clamped_first_layer_grads(model, x, -LIMIT, LIMIT)
        assert plain["0.weight"].abs().max() > 2 * LIMIT  # the clamp has something to do
        handle = clamp_grad(model[0], min=-LIMIT, max=LIMIT)
        got = grads(model, x)
        torch.testing.assert_close(got["0.weight"], want["0.weight"])
        torch.testing.assert_close(got["0.bias"], want["0.bias"])
        assert not torch.allclose(got["0.weight"], plain["0.weight"])
        for name in ("2.weight", "2.bias"):
            torch.testing.assert_close(got[name], plain[name])
        handle.remove()
        assert not model[0]._forward_hooks
        after = grads(model, x)
        for name in plain:
            torch.testing.assert_close(after[name], plain[name])

    def test_one_sided(self):
        """min only: negative gradient components are raised to min, positive ones stay."""
        model, x = make_model(), inputs()
        clamp_grad(model[0], min=0.0)
        got = grads(model, x)
        want = clamped_first_layer_grads(model, x, 0.0, None)
        torch.testing.assert_close(got["0.bias"], want["0.bias"])
        torch.testing.assert_close(got["0.weight"], want["0.weight"])

    def test_is_portable_and_bakes_its_bounds(self, tmp_path):
        """The hook is a portable function; the saved file's audit shows the bounds baked in as constants."""
        model = make_model()
        clamp_grad(model[0], min=-LIMIT, max=LIMIT)
        (hook,) = model[0]._forward_hooks.values()
        assert picklehooks.is_portable(hook)
        torch.save(model, tmp_path / "model.pt")
        entries = [e for e in audit.find_hooks(tmp_path / "model.pt") if not e.foreign]
        assert len(entries) == 1 and f"lo = {-LIMIT!r}" in entries[0].source and f"hi = {LIMIT!r}" in entries[0].source

    @pytest.mark.parametrize("bad", [dict(), dict(min=1.0, max=-1.0), dict(min="a"), dict(max=float("nan"))])
    def test_bad_bounds(self, bad):
        with pytest.raises(picklehooks.PicklehooksError, match="clamp_grad"):
            clamp_grad(make_model()[0], **bad)


class TestZeroParamGrad:
    def test_zeroes_exactly_that_parameter(self):
        """Only 2.bias gets a zero gradient; every other gradient equals the unhooked model's."""
        model, x = make_model(), inputs()
        plain = grads(model, x)
        handle = zero_param_grad(model[2], "bias")
        got = grads(model, x)
        assert torch.equal(got["2.bias"], torch.zeros(2)) and plain["2.bias"].abs().min() > 0
        for name in ("0.weight", "0.bias", "2.weight"):
            torch.testing.assert_close(got[name], plain[name])
        handle.remove()
        assert not model[2]._forward_pre_hooks and not model[2].bias._backward_hooks
        torch.testing.assert_close(grads(model, x)["2.bias"], plain["2.bias"])

    def test_attaches_once_per_parameter(self):
        """Many forwards, and two hooks on one parameter, attach one tensor hook."""
        model, x = make_model(), inputs()
        zero_param_grad(model[2], "bias")
        zero_param_grad(model, "2.bias")  # the same parameter, by its dotted name from the root
        got = grads(model, x, backwards=3)
        assert len(model[2].bias._backward_hooks) == 1
        assert torch.equal(got["2.bias"], torch.zeros(2))

    def test_pickle_and_deepcopy_keep_working(self):
        """Copies carry the pre-hook, not the tensor hook; they attach their own."""
        model, x = make_model(), inputs()
        zero_param_grad(model[2], "bias")
        grads(model, x)  # attached and marked
        assert len(model[2].bias._backward_hooks) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "backward hook will not be serialized" warning
            copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model),
                      torch.load(io.BytesIO(_saved(model)), weights_only=False)]
        for other in copies:
            assert not other[2].bias._backward_hooks
            got = grads(other, x)
            assert torch.equal(got["2.bias"], torch.zeros(2))
            assert len(other[2].bias._backward_hooks) == 1

    def test_unknown_parameter(self):
        with pytest.raises(picklehooks.PicklehooksError, match="no parameter 'gamma'.*'weight', 'bias'"):
            zero_param_grad(make_model()[2], "gamma")


def _saved(model) -> bytes:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


CHILD = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)   # no picklehooks import: the hooks bring it
x = torch.linspace(-2.0, 2.0, 15).reshape(5, 3)
lo, hi = float(sys.argv[2]), float(sys.argv[3])
h = model[0](x).detach().requires_grad_(True)
(g,) = torch.autograd.grad((model[2](model[1](h)) * torch.tensor([3.0, -2.0])).sum(), h)
g = g.clamp(lo, hi)
for _ in range(2):
    model.zero_grad(set_to_none=True)
    (model(x) * torch.tensor([3.0, -2.0])).sum().backward()
torch.testing.assert_close(model[0].weight.grad, g.T @ x)
torch.testing.assert_close(model[0].bias.grad, g.sum(0))
assert torch.equal(model[2].bias.grad, torch.zeros(2))
assert model[2].weight.grad.abs().min() > 0
assert len(model[2].bias._backward_hooks) == 1
print("surgery ok")
"""


def test_survives_torch_save_in_a_fresh_process(tmp_path):
    """Saved with both hooks, loaded in a fresh interpreter: the clamp and the zeroing still act."""
    model, x = make_model(), inputs()
    clamp_grad(model[0], min=-LIMIT, max=LIMIT)
    zero_param_grad(model[2], "bias")
    grads(model, x)  # the live model has attached its tensor hook before saving
    path = tmp_path / "model.pt"
    torch.save(model, path)
    assert run_fresh(CHILD, str(path), str(-LIMIT), str(LIMIT)).strip() == "surgery ok"


def expected_surgery_grads(x) -> dict[str, torch.Tensor]:
    """Gradients with layer 0's output gradient clamped and 2.bias zeroed, by hand, from the plain model."""
    plain = make_model()
    want = grads(plain, x)
    want.update(clamped_first_layer_grads(plain, x, -LIMIT, LIMIT))
    want["2.bias"] = torch.zeros(2)
    return want


def with_surgery() -> nn.Sequential:
    model = make_model()
    clamp_grad(model[0], min=-LIMIT, max=LIMIT)
    zero_param_grad(model, "2.bias")
    return model


SCRIPT_CHILD = """
import sys, torch
import picklehooks  # registers the picklehooks:: ops a scripted model calls
model = torch.jit.load(sys.argv[1])
x, want = torch.load(sys.argv[2])
for _ in range(2):
    model.zero_grad(set_to_none=True)
    (model(x) * torch.tensor([3.0, -2.0])).sum().backward()
got = dict(model.named_parameters())
for name, w in want.items():
    torch.testing.assert_close(got[name].grad, w)
print("scripted surgery ok")
"""


@pytest.mark.parametrize("backend", ["script", "script_saveload", "fx", "compile", "export"])
def test_surgery_in_every_backend(backend, tmp_path):
    """The clamp and the zeroing act the same under TorchScript (also loaded in a fresh process), FX, compile and export."""
    x = inputs()
    want = expected_surgery_grads(x)
    model = with_surgery()
    if backend == "script_saveload":
        torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
        torch.save((x, want), tmp_path / "expected.pt")
        assert run_fresh(SCRIPT_CHILD, str(tmp_path / "model.pt"), str(tmp_path / "expected.pt")).strip() == \
            "scripted surgery ok"
        return
    run = transformed(model, backend, (x,))
    for _ in range(2):  # the second step runs with the zeroing hook attached by the first
        got = {name.removeprefix("_orig_mod."): g for name, g in grads(run, x).items()}
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, msg=f"{backend}: {name}")


def test_clamp_keeps_a_namedtuple_output():
    """clamp_grad rebuilds tuple-like outputs as their own type (a namedtuple stays one) and clamps each tensor."""
    import collections

    Pair = collections.namedtuple("Pair", "a b")

    class Split(nn.Module):
        def forward(self, x):
            return Pair(x * 3, x * -3)

    model, x = Split(), torch.ones(2, 2, requires_grad=True)
    clamp_grad(model, min=-1.0, max=1.0)
    out = model(x)
    assert isinstance(out, Pair)
    (out.a.sum() + out.b.sum()).backward()
    # dL/da = dL/db = 1, inside the clamp: x.grad = 3 - 3.
    torch.testing.assert_close(x.grad, torch.zeros(2, 2))
    x.grad = None
    out = model(x)
    (5 * out.a.sum()).backward()  # dL/da = 5, clamped to 1: x.grad = 3
    torch.testing.assert_close(x.grad, torch.full((2, 2), 3.0))
