"""The eager path's gradient hooks live beside the user's own tensor hooks.

A recorded output that requires grad gets its gradient hook without
``Tensor.register_hook`` (``picklehooks._hookrt._hook_grad`` fills the
tensor's hook dictionary itself, 2.4 µs less per output). These tests hold
it to what ``register_hook`` promises: the user's hooks on the same output,
added before or after ours, still run (and can change the gradient the
rest of backward sees), their handles still remove them, and what is
recorded is the gradient plain tensor hooks see on an un-instrumented copy.
"""

from __future__ import annotations

import copy

import pytest
import torch

import picklehooks
from picklehooks import _hookrt


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def _grad_outputs(log) -> dict:
    return {r.module: r.tensor for r in log.records if r.kind == "grad_output"}


def _plain_grad_outputs(model: torch.nn.Module, x: torch.Tensor, extra_hook=None) -> tuple[dict, dict]:
    """Ground truth: plain tensor hooks on each output of an un-instrumented copy, and its ``.grad``s."""
    seen: dict = {}
    for name in ("a", "act", "b"):
        def post(m, inputs, output, name=name):
            output.register_hook(lambda g: seen.__setitem__(name, g.clone()))
            if extra_hook is not None and name == "act":
                output.register_hook(extra_hook)
        getattr(model, name).register_forward_hook(post)
    model(x).pow(2).sum().backward()
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


def _recorded_grad_outputs(model, x, want_grads: dict) -> dict:
    """Record the instrumented ``model``'s forward+backward; its ``.grad``s must equal ``want_grads``."""
    with picklehooks.record() as log:
        model(x).pow(2).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=0, atol=0)
    return _grad_outputs(log)


def _setup():
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4, 6)
    return model, copy.deepcopy(model), x


def test_recorded_gradients_are_those_of_plain_tensor_hooks():
    model, plain, x = _setup()
    want, want_grads = _plain_grad_outputs(plain, x)
    picklehooks.instrument(model, mode="tensor")
    got = _recorded_grad_outputs(model, x, want_grads)
    assert got.keys() == want.keys() == {"a", "act", "b"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_a_users_hook_added_after_ours_runs_and_can_change_the_gradient():
    """The user's hook, registered on the output after picklehooks' forward hook, doubles the
    gradient flowing back through ``act``: the parameters' ``.grad`` must show it, as on the plain copy."""
    model, plain, x = _setup()

    def double(g):
        return g * 2

    want, want_grads = _plain_grad_outputs(plain, x, extra_hook=double)
    picklehooks.instrument(model, mode="tensor")
    model.act.register_forward_hook(lambda m, i, o: o.register_hook(double) and None)
    got = _recorded_grad_outputs(model, x, want_grads)
    # Ours ran first, as the plain copy's recording hook did: both see the gradient before doubling.
    torch.testing.assert_close(got["act"], want["act"], rtol=0, atol=0)



def test_a_users_hook_removed_by_its_handle_is_gone_and_ours_stays():
    model, plain, x = _setup()
    want, want_grads = _plain_grad_outputs(plain, x)
    picklehooks.instrument(model, mode="tensor")
    model.act.register_forward_hook(lambda m, i, o: o.register_hook(lambda g: g * 2).remove())
    got = _recorded_grad_outputs(model, x, want_grads)
    torch.testing.assert_close(got["act"], want["act"], rtol=0, atol=0)


def test_a_users_hook_added_before_ours_runs_first():
    order = []
    y = torch.randn(3, requires_grad=True) * 2
    y.register_hook(lambda g: order.append("user"))
    _hookrt._hook_grad(y, lambda g: order.append("ours"))
    y.sum().backward()
    assert order == ["user", "ours"]


def test_hook_grad_takes_register_hook_where_it_must(monkeypatch):
    """A tensor with hooks already, a subclass with ``__torch_function__``, a functorch transform:
    ``Tensor.register_hook`` itself (counted by a wrapper), and the hook still runs."""
    calls = []
    real = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook", lambda self, hook: calls.append(self) or real(self, hook))
    got = []

    y = torch.randn(3, requires_grad=True) * 2
    _hookrt._hook_grad(y, lambda g: got.append(g))
    assert not calls  # a fresh output: the lean path
    _hookrt._hook_grad(y, lambda g: got.append(g))  # hooks there already
    assert len(calls) == 1 and calls[0] is y

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    z = (torch.randn(3, requires_grad=True) * 2).as_subclass(Sub)
    _hookrt._hook_grad(z, lambda g: got.append(g))
    assert any(c is z for c in calls)  # (its __torch_function__ calls register_hook again)
    (y.sum() + z.sum()).backward()
    assert len(got) == 3


@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_grad_output_under_torch_func_grad(mode):
    """Under ``torch.func.grad`` the hook goes through ``register_hook``; values are still right."""
    model, plain, x = _setup()
    want, _ = _plain_grad_outputs(plain, x)
    picklehooks.instrument(model, mode=mode)
    params = dict(model.named_parameters())

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).pow(2).sum()

    with picklehooks.record() as log:
        torch.func.grad(loss)(params)
    got = {r.module: r for r in log.records if r.kind == "grad_output"}
    assert got.keys() == want.keys()
    if mode == "tensor":
        for name in want:
            torch.testing.assert_close(got[name].tensor, want[name], rtol=0, atol=0)
