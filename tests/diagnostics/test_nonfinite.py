"""find_nonfinite names the module where a planted NaN/Inf first appears, in any backend."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import picklehooks
from picklehooks.diagnostics import find_nonfinite, first_nonfinite
from tests.models.faults import ExpOverflow, MulNaN, NaNGrad, mlp_with

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
LOSS = lambda out: out.pow(2).mean()  # noqa: E731
GRAD_KINDS = ("input", "output", "grad_output", "grad_input")


@pytest.mark.parametrize("fault, position, want", [
    (MulNaN, 2, ("2", "output", "forward")),
    (ExpOverflow, 1, ("1", "output", "forward")),
    (NaNGrad, 3, ("3", "grad_input", "backward")),
])
def test_finds_the_planted_fault(fault, position, want):
    model = mlp_with(fault(), position)
    report = find_nonfinite(model, X, loss_fn=LOSS)
    assert (report.module, report.kind, report.phase) == want
    assert report.stats["n_nan"] + report.stats["n_inf"] > 0
    assert [row["n_nan"] + row["n_inf"] for row in report.inputs] == [0]  # its input was finite
    assert not any(hasattr(m, "_picklehooks_name") or m._forward_hooks for m in model.modules())  # cleaned up


def test_inf_is_counted_as_inf():
    report = find_nonfinite(mlp_with(ExpOverflow(), 1), X)
    assert report.stats["n_inf"] == report.stats["shape"][0] * report.stats["shape"][1] and report.stats["n_nan"] == 0


def test_backward_fault_is_invisible_without_a_loss():
    assert find_nonfinite(mlp_with(NaNGrad(), 3), X) is None
    assert find_nonfinite(mlp_with(NaNGrad(), 3), X, loss_fn=LOSS).kind == "grad_input"


def test_clean_model_gives_none():
    assert find_nonfinite(mlp_with(torch.nn.Identity(), 0), X, loss_fn=LOSS) is None


def test_nonfinite_model_input():
    x = X.clone()
    x[1, 2] = float("nan")
    report = find_nonfinite(mlp_with(torch.nn.Identity(), 0), x)
    assert (report.module, report.kind, report.stats["n_nan"]) == ("0", "input", 1)
    assert "model's input" in report.note


def instrumented(fault, position, capture=GRAD_KINDS):
    model = mlp_with(fault(), position)
    handle = picklehooks.instrument(model, capture=capture, example_inputs=(X,), scriptable=True)
    return model, handle


@pytest.mark.parametrize("fault, position, want", [(MulNaN, 2, "2"), (ExpOverflow, 1, "1")])
def test_scripted_model_gives_the_same_answer(fault, position, want):
    model, _ = instrumented(fault, position)
    eager = find_nonfinite(model, X, loss_fn=LOSS)
    scripted = find_nonfinite(torch.jit.script(model), X, loss_fn=LOSS)
    assert (scripted.module, scripted.kind) == (eager.module, eager.kind) == (want, "output")
    assert [scripted.stats[k] for k in ("shape", "n_nan", "n_inf")] == [eager.stats[k] for k in ("shape", "n_nan", "n_inf")]


def test_scripted_backward_fault_through_the_tap_op():
    """TorchScript can't hold the autograd.Function, but a scripted clean model still reports None."""
    model, _ = instrumented(torch.nn.Identity, 0)
    assert find_nonfinite(torch.jit.script(model), X, loss_fn=LOSS) is None


def test_fx_and_an_instrumented_eager_model_keep_their_hooks():
    model, handle = instrumented(NaNGrad, 3)
    assert find_nonfinite(model, X, loss_fn=LOSS).module == "3"
    assert all(hasattr(m, "_picklehooks_name") for m in handle.modules.values())  # its own hooks stay
    traced = torch.fx.symbolic_trace(instrumented(MulNaN, 2)[0])
    report = find_nonfinite(traced, X)
    assert (report.module, report.kind) == ("2", "output")


def test_with_only_grad_output_the_module_before_is_reported():
    """Documented limit: without grad_input, a gradient fault inside M shows at the grad_output of M's predecessor."""
    model, _ = instrumented(NaNGrad, 3, capture=("output", "grad_output"))
    report = find_nonfinite(model, X, loss_fn=LOSS)
    assert (report.module, report.kind) == ("2", "grad_output")


def test_from_a_saved_log(tmp_path):
    model, _ = instrumented(MulNaN, 2)
    with picklehooks.record() as log:
        model(X)
    log.save(tmp_path / "log")
    report = first_nonfinite(picklehooks.Log.load(tmp_path / "log"))
    assert (report.module, report.kind, report.call, report.step) == ("2", "output", 0, 0)


def test_script_without_hooks_is_refused():
    with pytest.raises(picklehooks.PicklehooksError, match="instrument"):
        find_nonfinite(torch.jit.script(mlp_with(torch.nn.Identity(), 0)), X)


def test_compiled_and_exported_models():
    torch._dynamo.reset()
    compiled = torch.compile(instrumented(NaNGrad, 3)[0], fullgraph=True, backend="aot_eager")
    report = find_nonfinite(compiled, X, loss_fn=LOSS)
    assert (report.module, report.kind) == ("3", "grad_input")
    exported = torch.export.export(instrumented(ExpOverflow, 1)[0], (X,)).module()
    report = find_nonfinite(exported, X, loss_fn=LOSS)
    assert (report.module, report.kind) == ("1", "output")


def test_a_model_guarded_with_on_nonfinite_raise():
    """The guard stops the model; the records, the guard's own included, locate the fault."""
    guarded = mlp_with(NaNGrad(), 3)
    picklehooks.instrument(guarded, capture=GRAD_KINDS, on_nonfinite="raise")
    report = find_nonfinite(guarded, X, loss_fn=LOSS)
    assert (report.module, report.kind) == ("3", "grad_input")
    guarded = mlp_with(MulNaN(), 2)
    picklehooks.instrument(guarded, capture=GRAD_KINDS, on_nonfinite="raise")
    report = find_nonfinite(guarded, X)  # the guard records the value it stops at
    assert (report.module, report.kind) == ("2", "output")
    with pytest.raises(picklehooks.PicklehooksError, match="module '2'"):
        guarded(X)  # outside record(): the guard's error names the module
