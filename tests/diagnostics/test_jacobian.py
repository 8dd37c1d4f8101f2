"""picklehooks.diagnostics.jacobian: vjp and the Hutchinson Frobenius-norm estimate between two layers.

The reference is ``torch.autograd.functional.jacobian`` of the sub-network
between the two layers, written out by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.diagnostics.jacobian import hutchinson_jacobian_norm, vjp
from tests.testutils import transformed


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def one_output_case() -> tuple[nn.Sequential, torch.Tensor, float]:
    """A model with one output element, an input, and ||J||_F between its layers 0 and 2, from autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(1, 3)
    h = model[0](x).detach()
    return model, x, float(torch.autograd.functional.jacobian(lambda t: model[2](model[1](t)), h).norm())


def reference_jacobian(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """d(layer 2 output)/d(layer 0 output) for one sample, as an (out, in) = (2, 4) matrix."""
    h = model[0](x).detach()
    return torch.autograd.functional.jacobian(lambda t: model[2](model[1](t)), h).reshape(2, 4)


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules())


class TestVjp:
    def test_matches_reference(self):
        """v^T J for a planted v and for the default ones; names and module objects both work."""
        model, x = make_model(), torch.randn(1, 3, generator=torch.Generator().manual_seed(1))
        jac = reference_jacobian(model, x)
        v = torch.tensor([[1.0, -2.0]])
        torch.testing.assert_close(vjp(model, (x,), "2", "0", v), (v @ jac))
        torch.testing.assert_close(vjp(model, x, model[2], model[0]), jac.sum(0, keepdim=True))
        assert no_hooks_left(model)
        assert all(p.grad is None for p in model.parameters())

    def test_input_layer_without_grad(self):
        """A frozen first layer (its output needs no grad) still gives the Jacobian after it."""
        model, x = make_model(), torch.randn(1, 3)
        model[0].requires_grad_(False)
        jac = reference_jacobian(model, x)
        torch.testing.assert_close(vjp(model, x, "2", "0"), jac.sum(0, keepdim=True))

    def test_second_call(self):
        """call=(1, 0): the second call of a Linear applied twice, by the activation between the calls."""

        class Twice(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self.act = nn.Linear(2, 2), nn.Tanh()

            def forward(self, x):
                return self.lin(self.act(self.lin(x)))

        torch.manual_seed(0)
        model, x = Twice(), torch.randn(1, 2)
        v = torch.tensor([[2.0, -1.0]])
        torch.testing.assert_close(vjp(model, x, "lin", "act", v, call=(1, 0)), v @ model.lin.weight)
        with pytest.raises(picklehooks.PicklehooksError, match="does not depend on"):
            vjp(model, x, "lin", "act", call=0)  # the first call runs before the activation
        with pytest.raises(picklehooks.PicklehooksError, match="call=.*asks for its call number 2"):
            vjp(model, x, "lin", "act", call=(2, 0))

    def test_wrong_order_and_bad_arguments(self):
        """Differentiating an earlier layer by a later one, unknown names and bad v all say what is wrong."""
        model, x = make_model(), torch.randn(1, 3)
        with pytest.raises(picklehooks.PicklehooksError, match="does not depend on"):
            vjp(model, x, "0", "2")
        assert no_hooks_left(model)
        with pytest.raises(picklehooks.PicklehooksError, match="no submodule 'nope'"):
            vjp(model, x, "nope", "0")
        with pytest.raises(picklehooks.PicklehooksError, match="shaped like the output"):
            vjp(model, x, "2", "0", torch.ones(3))
        with pytest.raises(picklehooks.PicklehooksError, match="same module"):
            vjp(model, x, "0", model[0])
        with pytest.raises(picklehooks.PicklehooksError, match="ran 1 time"):
            vjp(model, x, "2", "0", call=1)
        with pytest.raises(picklehooks.PicklehooksError, match="call="):
            vjp(model, x, "2", "0", call=-1)

    def test_hooks_removed_when_the_forward_fails(self):
        model = make_model()
        with pytest.raises(RuntimeError):
            vjp(model, torch.randn(1, 5), "2", "0")
        assert no_hooks_left(model)


class TestHutchinson:
    def test_within_three_standard_errors(self):
        """The estimate of ||J||_F is within 3 standard errors of the reference's norm."""
        model, x = make_model(), torch.randn(1, 3, generator=torch.Generator().manual_seed(2))
        exact = float(torch.linalg.matrix_norm(reference_jacobian(model, x)))
        for samples in (64, 512):
            estimate, stderr = hutchinson_jacobian_norm(model, x, "2", "0", samples=samples, seed=samples)
            assert stderr > 0
            assert abs(estimate - exact) < 3 * stderr, (samples, estimate, exact, stderr)
        assert no_hooks_left(model)
        assert all(p.grad is None for p in model.parameters())

    def test_stderr_shrinks_with_samples(self):
        """16× the probes gives about a quarter of the standard error (1/sqrt(n))."""
        model, x = make_model(), torch.randn(1, 3)
        _, few = hutchinson_jacobian_norm(model, x, "2", "0", samples=32)
        _, many = hutchinson_jacobian_norm(model, x, "2", "0", samples=512)
        assert many < few / 2

    def test_deterministic_and_leaves_global_rng_alone(self):
        model, x = make_model(), torch.randn(1, 3)
        state = torch.random.get_rng_state()
        first = hutchinson_jacobian_norm(model, x, "2", "0", samples=8, seed=3)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert hutchinson_jacobian_norm(model, x, "2", "0", samples=8, seed=3) == first
        assert hutchinson_jacobian_norm(model, x, "2", "0", samples=8, seed=4) != first

    def test_exact_for_one_output(self):
        """With one output element every Rademacher probe gives ||J||^2 exactly: standard error 0."""
        model, x, exact = one_output_case()
        estimate, stderr = hutchinson_jacobian_norm(model, x, "2", "0", samples=4)
        assert estimate == pytest.approx(exact, rel=1e-6) and stderr == pytest.approx(0, abs=1e-9)

    def test_batch_norm_is_sum_over_samples(self):
        """For a batch, ||J||_F^2 is the sum of the samples' own squared norms (J is block-diagonal)."""
        model = make_model()
        xs = torch.randn(3, 3, generator=torch.Generator().manual_seed(5))
        exact = sum(float(torch.linalg.matrix_norm(reference_jacobian(model, xs[i:i + 1]))) ** 2 for i in range(3)) ** 0.5
        estimate, stderr = hutchinson_jacobian_norm(model, xs, "2", "0", samples=256)
        assert abs(estimate - exact) < 3 * stderr

    def test_needs_two_samples(self):
        with pytest.raises(picklehooks.PicklehooksError, match="at least 2"):
            hutchinson_jacobian_norm(make_model(), torch.randn(1, 3), "2", "0", samples=1)


class TestFromLog:
    """Log.jacobian_norm: the same estimate from values recorded with keep_graph, in eager, FX and TorchScript."""

    @pytest.mark.parametrize("backend", ["eager", "fx", "script"])
    def test_within_three_standard_errors(self, backend):
        model, x = make_model(), torch.randn(1, 3, generator=torch.Generator().manual_seed(2))
        exact = float(torch.linalg.matrix_norm(reference_jacobian(model, x)))
        picklehooks.instrument(model, capture=("output",), example_inputs=(x,))
        run = transformed(model, backend, (x,))
        with picklehooks.record(keep_graph=True) as log:
            run(x)
        estimate, stderr = log.jacobian_norm("2", "0", samples=256, seed=1)
        assert stderr > 0
        assert abs(estimate - exact) < 3 * stderr, (backend, estimate, exact, stderr)
        # The same probes as the eager-model estimator: the same answer.
        assert (estimate, stderr) == pytest.approx(hutchinson_jacobian_norm(make_model(), x, "2", "0", samples=256, seed=1))
        # The graph is kept: vjp still works afterwards.
        assert log.vjp("2", "0").shape == (1, 4)

    def test_exact_for_one_output_scripted(self):
        model, x, exact = one_output_case()
        picklehooks.instrument(model, capture=("output",), example_inputs=(x,))
        with picklehooks.record(keep_graph=True) as log:
            torch.jit.script(model)(x)
        estimate, stderr = log.jacobian_norm("2", "0", samples=4)
        assert estimate == pytest.approx(exact, rel=1e-6) and stderr == pytest.approx(0, abs=1e-9)

    def test_needs_keep_graph(self):
        model = make_model()
        picklehooks.instrument(model, capture=("output",))
        with picklehooks.record() as log:
            model(torch.randn(1, 3))
        with pytest.raises(picklehooks.PicklehooksError, match="keep_graph=True"):
            log.jacobian_norm("2", "0")


def test_compiled_model_uses_its_original_module():
    """vjp and the Hutchinson estimate on a torch.compile'd model equal those of the eager model."""
    model, x = make_model(), torch.randn(2, 3)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x)
    torch.testing.assert_close(vjp(compiled, x, "2", "0"), vjp(model, x, "2", "0"))
    assert hutchinson_jacobian_norm(compiled, x, "2", "0", samples=8) == hutchinson_jacobian_norm(model, x, "2", "0", samples=8)


def test_scripted_model_is_pointed_to_the_log():
    with pytest.raises(picklehooks.PicklehooksError, match="keep_graph=True"):
        vjp(torch.jit.script(make_model()), torch.randn(1, 3), "2", "0")
