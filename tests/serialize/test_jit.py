"""TorchScript: scripting modules with portable hooks, then jit.save / jit.load in a fresh process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picklehooks
from tests import hooks
from tests.testutils import run_fresh, run_without_picklehooks

X = torch.ones(2, 4)


@pytest.fixture(scope="module")
def scripted():
    model = hooks.mlp()
    model[0].register_forward_hook(picklehooks.portable(hooks.typed_forward))
    model[2].register_forward_pre_hook(picklehooks.portable(hooks.typed_pre))
    model[3].register_forward_hook(picklehooks.portable(hooks.typed_forward))
    return model, torch.jit.script(model)


def test_script_matches_eager(scripted):
    """The scripted model runs the hooks exactly as eager does."""
    model, script = scripted
    assert torch.allclose(script(X), model(X))
    assert not torch.allclose(hooks.mlp()(X), model(X)), "the hooks must change the result"


def test_script_after_pickle_round_trip(scripted, tmp_path):
    """A model loaded from torch.save can be scripted in a fresh process."""
    model, _ = scripted
    path = tmp_path / "eager.pt"
    torch.save(model, path)
    out = run_fresh(
        "import sys, torch\nm = torch.load(sys.argv[1], weights_only=False)\n"
        "print(torch.jit.script(m)(torch.ones(2, 4)).tolist())",
        str(path),
    )
    assert out.strip() == str(model(X).tolist())


def test_jit_save_load_in_fresh_process(scripted, tmp_path):
    """jit.save here, jit.load in a fresh interpreter that cannot import picklehooks."""
    model, script = scripted
    path = tmp_path / "scripted.pt"
    torch.jit.save(script, path)
    out = run_without_picklehooks(
        """
        import torch
        loaded = torch.jit.load(sys.argv[1])
        print(loaded(torch.ones(2, 4)).tolist())
        """,
        str(path),
    )
    assert out.strip() == str(model(X).tolist())


def test_op_schemas_that_saved_models_name_are_unchanged():
    """Scripted models and exported programs saved by earlier versions call the ops by these
    schemas; ``tap``/``tap_grad`` were torch.library.custom_ops then (whose inferred schema types
    ``int`` as ``SymInt``) and are Library ops now."""
    ops = torch.ops.picklehooks
    assert str(ops.tap.default._schema) == \
        "picklehooks::tap(Tensor x, str module, str kind, str path, SymInt flags) -> Tensor"
    assert str(ops.tap_grad.default._schema) == \
        "picklehooks::tap_grad(Tensor g, str module, str kind, str path, SymInt flags) -> Tensor"
    assert str(ops.record.default._schema) == \
        "picklehooks::record(Tensor x, str module, str kind, str path, int flags) -> ()"


def test_scripted_gradient_through_tap_matches_plain():
    """The tap op's autograd formula (a Library op's Autograd kernel) passes the gradient through
    unchanged and records it, scripted, against plain tensor hooks on an un-instrumented copy."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(plain)
    x = torch.randn(3, 4, requires_grad=True)
    picklehooks.instrument(model, capture=("output", "grad_output"), scriptable=True, example_inputs=(x,))
    scripted = torch.jit.script(model)
    grads = {}
    def watch(name):
        def hook(module, inputs, output):
            output.register_hook(lambda g: grads.__setitem__(name, g))
        return hook

    hooks = [m.register_forward_hook(watch(n)) for n, m in plain.named_children()]
    plain(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    for h in hooks:
        h.remove()
    with picklehooks.record() as log:
        scripted(x).square().sum().backward()
    torch.testing.assert_close(x.grad, want)
    got = {r.module: r for r in log.records if r.kind == "grad_output"}
    assert got.keys() == grads.keys()
    for name, g in grads.items():
        assert got[name].stats["norm"] == pytest.approx(g.double().norm().item(), rel=1e-6)
        assert got[name].stats["mean"] == pytest.approx(g.double().mean().item(), rel=1e-6, abs=1e-9)
