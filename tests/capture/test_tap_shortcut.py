"""The ``tap`` op's autograd formula calls its kernels directly where nothing traces.

``_TapFunction`` (what TorchScript's gradient taps run at the Autograd key)
skips re-dispatching ``tap`` and ``tap_grad`` for a plain tensor with no
dispatch mode and no ``jit.trace`` (``picklehooks._ops._runs_as_is``), about
2.5 µs per call each way; so does ``tap``'s Autograd kernel where no gradient
can flow (a ``jit.trace`` graph run under ``no_grad``). Records must be those
of the dispatcher's path, gradients and outputs those of the un-instrumented
model, and every tracer must still see the ops themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import picklehooks
from picklehooks import _ops


def mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    return model, torch.randn(4, 6)


def scripted_records(monkeypatch, shortcut: bool, mode: str):
    model, x = mlp()
    plain = copy.deepcopy(model)
    picklehooks.instrument(model, mode=mode, scriptable=True, example_inputs=(x,))
    scripted = torch.jit.script(model)
    with monkeypatch.context() as patch:
        if not shortcut:
            patch.setattr(_ops, "_runs_as_is", lambda x: False)
        with picklehooks.record() as log:
            scripted(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    for (name, p), q in zip(scripted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    return log


@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_scripted_records_are_those_of_the_dispatchers_path(monkeypatch, mode):
    direct, dispatched = scripted_records(monkeypatch, True, mode), scripted_records(monkeypatch, False, mode)
    assert [r.key for r in direct.records] == [r.key for r in dispatched.records]
    assert {r.kind for r in direct.records} == {"output", "grad_output"}
    for a, b in zip(direct.records, dispatched.records):
        if mode == "tensor":
            torch.testing.assert_close(a.tensor, b.tensor, rtol=0, atol=0)
        else:
            assert a.stats == b.stats


def test_the_shortcut_is_taken_for_plain_tensors_and_nowhere_else():
    x = torch.randn(3)
    assert _ops._runs_as_is(x)
    assert _ops._runs_as_is(torch.nn.Parameter(x))
    assert not _ops._runs_as_is(x.as_subclass(_Sub))
    assert not _ops._runs_as_is(torch.empty(3, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not _ops._runs_as_is(torch.empty(3))


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_tracers_still_see_tap_and_tap_grad(tracing_mode):
    """make_fx traces the joint forward and backward through the Autograd key: the graph must hold
    the ops (a direct kernel call would leave aten.clone and record at trace time instead)."""
    flags = _ops.VALUE | _ops.GRAD | _ops.STATS

    def joint(x):
        y = torch.ops.picklehooks.tap(x * 2, "m", "output", "", flags)
        return torch.autograd.grad(y.sum(), x)

    with picklehooks.record() as log:
        graph = make_fx(joint, tracing_mode=tracing_mode)(torch.randn(3, requires_grad=True))
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert torch.ops.picklehooks.tap.default in targets
    assert torch.ops.picklehooks.tap_grad.default in targets
    if tracing_mode == "fake":
        assert len(log) == 0  # fake values are never recorded


def test_jit_trace_still_records_the_tap_op():
    flags = _ops.GRAD | _ops.STATS

    def fn(x):
        return torch.ops.picklehooks.tap(x * 2, "m", "output", "", flags).sum()

    traced = torch.jit.trace(fn, (torch.randn(3, requires_grad=True),))
    assert "picklehooks::tap" in str(traced.graph)


def traced_records(monkeypatch, shortcut: bool):
    """A jit.trace'd instrumented MLP run under no_grad, recording: its taps take the Autograd
    kernel's no-gradient branch."""
    model, x = mlp()
    plain = copy.deepcopy(model)
    picklehooks.instrument(model, capture=("output", "grad_output"), mode="tensor", example_inputs=(x,))
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert "picklehooks::tap" in str(traced.inlined_graph)
    below = []
    with monkeypatch.context() as patch:
        if not shortcut:
            patch.setattr(_ops, "_runs_as_is", lambda x: False)
        patch.setattr(_ops, "_tap_below_autograd",
                      lambda *args, real=_ops._tap_below_autograd: below.append(args[1]) or real(*args))
        with torch.no_grad(), picklehooks.record() as log:
            out = traced(x)
    want = {}  # ground truth: each submodule's output, by plain hooks on the un-instrumented copy
    for name, module in plain.named_children():
        module.register_forward_hook(lambda m, args, output, name=name: want.setdefault(name, output.clone()))
    with torch.no_grad():
        torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    got = {r.module: r.tensor for r in log.records}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    return log, below


def test_traced_taps_without_gradient_call_the_kernel_directly(monkeypatch):
    direct, below_direct = traced_records(monkeypatch, True)
    dispatched, below_dispatched = traced_records(monkeypatch, False)
    assert below_direct == [] and len(below_dispatched) >= 4  # the shortcut was taken, and only with it
    assert [r.key for r in direct.records] == [r.key for r in dispatched.records]
    assert {r.kind for r in direct.records} == {"output"}
    for a, b in zip(direct.records, dispatched.records):
        torch.testing.assert_close(a.tensor, b.tensor, rtol=0, atol=0)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_tracers_still_see_tap_without_gradient(tracing_mode):
    """make_fx under no_grad: the tap reaches the Autograd kernel's no-gradient branch, and the graph
    must still hold the op."""
    def fn(x):
        with torch.no_grad():
            return torch.ops.picklehooks.tap(x * 2, "m", "output", "", _ops.GRAD | _ops.STATS)

    graph = make_fx(fn, tracing_mode=tracing_mode)(torch.randn(3))
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert torch.ops.picklehooks.tap.default in targets


def test_jit_trace_records_the_tap_op_without_gradient():
    def fn(x):
        return torch.ops.picklehooks.tap(x * 2, "m", "output", "", _ops.GRAD | _ops.STATS).sum()

    with torch.no_grad():
        traced = torch.jit.trace(fn, (torch.randn(3),))
    assert "picklehooks::tap" in str(traced.graph)
