"""instrument() on model shapes nobody here wrote: containers, LSTM, ParameterList, inner gradient steps, tuples.

Ground truth: plain forward hooks on an un-instrumented deep copy, which
clone what each module returns (issue 11, "instrument() itself").
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import picklehooks
from tests.models.small import RNN, rnn_inputs
from tests.testutils import REPO, run_fresh


def plain_outputs(model: nn.Module, names: list[str], *args) -> tuple[dict, object]:
    """{module name: what it returned} and the model's output, from an un-instrumented copy."""
    plain = copy.deepcopy(model)
    seen = {}
    for name in names:
        plain.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: seen.setdefault(name, torch.utils._pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, o)))
    return seen, plain(*args)


def leaves(value, path: str = "") -> dict[str, torch.Tensor]:
    """The tensors in a nested output, by record path ("", "0", "1/0")."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    out = {}
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out.update(leaves(v, f"{path}/{i}" if path else str(i)))
    return out


def assert_outputs_recorded(log: picklehooks.Log, want: dict) -> None:
    """Every tensor each module returned has one output record with its statistics."""
    got = {(r.module, r.path): r.stats for r in log.records if r.kind == "output" and r.call == 0}
    for name, value in want.items():
        for path, tensor in leaves(value).items():
            stats = got[(name, path)]
            assert stats["shape"] == tuple(tensor.shape), (name, path)
            assert stats["mean"] == pytest.approx(tensor.double().mean().item(), rel=1e-6, abs=1e-7), (name, path)
            assert stats["norm"] == pytest.approx(tensor.double().norm().item(), rel=1e-6, abs=1e-7), (name, path)


class WithContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})
        self.scales = nn.ParameterList([nn.Parameter(torch.full((4,), 0.5))])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * self.scales[0]
        return self.heads["a"](x)


class TestContainers:
    @pytest.mark.parametrize("scriptable", [False, True])
    def test_containers_are_skipped_and_the_model_scripts(self, scriptable):
        """ModuleList/ModuleDict/ParameterList get no hooks (named in skipped); the model scripts and records."""
        model, x = WithContainers(), torch.randn(3, 4)
        names = ["layers.0", "layers.1", "heads.a"]
        want, plain_out = plain_outputs(model, names, x)
        examples = {"example_inputs": (x,)} if scriptable else {}
        handle = picklehooks.instrument(model, capture="all", scriptable=scriptable, **examples)
        assert {"layers", "heads", "scales"} <= set(handle.skipped)
        assert all("no forward of its own" in handle.skipped[n] for n in ("layers", "heads", "scales"))
        # Recording inputs for TorchScript takes scriptable=True (positional hooks); otherwise eager.
        scripted = torch.jit.script(model) if scriptable else model
        with picklehooks.record() as log:
            out = scripted(x)
        assert torch.equal(out, plain_out)
        assert_outputs_recorded(log, want)

    def test_scripted_model_records_in_a_fresh_process(self, tmp_path):
        """The scripted, saved model loads and records in a fresh interpreter."""
        model, x = WithContainers(), torch.randn(3, 4)
        want, plain_out = plain_outputs(model, ["layers.0", "heads.a"], x)
        picklehooks.instrument(model, capture="output", scriptable=True, example_inputs=(x,))
        torch.jit.save(torch.jit.script(model), tmp_path / "m.pt")
        torch.save(x, tmp_path / "x.pt")
        child = run_fresh(
            """
            import sys, json, torch, picklehooks
            model, x = torch.jit.load(sys.argv[1]), torch.load(sys.argv[2])
            with picklehooks.record() as log:
                out = model(x)
            print(json.dumps({"out": out.tolist(),
                              "means": {r.module: r.stats["mean"] for r in log.records}}))
            """, str(tmp_path / "m.pt"), str(tmp_path / "x.pt"), cwd=REPO)
        result = __import__("json").loads(child)
        assert torch.equal(torch.tensor(result["out"]), plain_out)
        for name in want:
            assert result["means"][name] == pytest.approx(want[name].double().mean().item(), rel=1e-6, abs=1e-7)


class TestLeafModel:
    @pytest.mark.parametrize("make", [lambda: nn.Linear(4, 3), lambda: nn.LayerNorm(4)], ids=["Linear", "LayerNorm"])
    def test_a_model_that_is_one_leaf_module_is_instrumented_at_its_root(self, make):
        """With nothing below the root, the default choice is the root: its records are what plain hooks see."""
        torch.manual_seed(0)
        model, x = make(), torch.randn(2, 4, requires_grad=True)
        plain, seen = copy.deepcopy(model), {}
        clone = lambda t: t.detach().clone()  # noqa: E731
        plain.register_forward_pre_hook(lambda m, args: seen.__setitem__(("input", "0"), clone(args[0])))
        plain.register_forward_hook(lambda m, args, out: seen.__setitem__(("output", ""), clone(out)))
        plain.register_full_backward_hook(lambda m, gin, gout: seen.update(
            {("grad_input", "0"): clone(gin[0]), ("grad_output", ""): clone(gout[0])}))
        plain(x.detach().clone().requires_grad_()).sum().backward()
        for n, p in plain.named_parameters():
            seen[("param", n)], seen[("param_grad", n)] = clone(p), clone(p.grad)
        handle = picklehooks.instrument(model, capture="all")
        assert list(handle.modules) == [""] and handle.spec["modules"] == "all"
        with picklehooks.record() as log:
            model(x).sum().backward()
        got = {(r.kind, r.path): r.stats for r in log.records if r.module == ""}
        assert sorted(got) == sorted(seen) and len(log.records) == len(seen)
        for key, value in seen.items():
            assert got[key]["shape"] == tuple(value.shape), key
            assert got[key]["mean"] == pytest.approx(value.double().mean().item(), rel=1e-6, abs=1e-7), key
            assert got[key]["norm"] == pytest.approx(value.double().norm().item(), rel=1e-6, abs=1e-7), key

    def test_a_model_with_submodules_still_leaves_its_root_out(self):
        model = nn.Sequential(nn.Linear(4, 4))
        assert list(picklehooks.instrument(model).modules) == ["0"]


class NumberedParameter(nn.Module):
    """A parameter whose name is no identifier, as ParameterList's are."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("0", nn.Parameter(torch.arange(4.0)))

    def forward(self, x):
        return x * getattr(self, "0")


class HoldsNumbered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = NumberedParameter()

    def forward(self, x):
        return self.scale(x)


class TestParameterNames:
    def test_parameter_named_0_is_recorded_after_pickling_in_a_fresh_process(self, tmp_path):
        """A parameter named "0" is read with getattr, which the shim accepts in a fresh interpreter."""
        model = HoldsNumbered()
        picklehooks.instrument(model, capture="param")
        torch.save(model, tmp_path / "m.pt")
        child = run_fresh(
            """
            import sys, json, torch, picklehooks
            model = torch.load(sys.argv[1], weights_only=False)
            with picklehooks.record() as log:
                model(torch.ones(2, 4))
            print(json.dumps([[r.module, r.kind, r.path, r.stats["mean"], r.stats["max"]] for r in log.records]))
            """, str(tmp_path / "m.pt"), cwd=REPO)
        plain = getattr(copy.deepcopy(model).scale, "0")
        want = ["scale", "param", "0", plain.double().mean().item(), plain.max().item()]
        assert __import__("json").loads(child) == [want]


class TestLSTM:
    def test_scriptable_skips_lstm_with_the_reason(self):
        """With scriptable=True the LSTM (overloaded forward) is skipped, named, and the model scripts."""
        model, args = RNN(), rnn_inputs()
        want, plain_out = plain_outputs(model, ["head"], *args)
        handle = picklehooks.instrument(model, capture="all", scriptable=True, example_inputs=args)
        assert "overloaded" in handle.skipped["lstm"]
        scripted = torch.jit.script(model)
        with picklehooks.record() as log:
            out = scripted(*args)
        assert torch.equal(out, plain_out)
        assert_outputs_recorded(log, want)

    def test_eager_records_lstm_outputs(self):
        """Without scriptable, the LSTM keeps its hooks and records (out, (h, c)) like a plain hook sees it."""
        model, args = RNN(), rnn_inputs()
        want, plain_out = plain_outputs(model, ["lstm", "head"], *args)
        picklehooks.instrument(model, capture="output", example_inputs=args)
        with picklehooks.record() as log:
            out = model(*args)
        assert torch.equal(out, plain_out)
        assert_outputs_recorded(log, want)


class InnerStep(nn.Module):
    """A forward that takes a gradient step of its own (meta-learning)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        w = self.lin.weight
        inner = self.lin(x).pow(2).sum()
        (g,) = torch.autograd.grad(inner, w, create_graph=True)
        return x @ (w - 0.1 * g).T


class TestForwardThatNeedsAutograd:
    def test_example_forward_runs_with_grad_and_leaves_grads_alone(self):
        """example_inputs run with grad enabled; parameters' .grad are the same objects with the same values."""
        model, x = InnerStep(), torch.randn(3, 4)
        marker = torch.full_like(model.lin.bias, 7.0)
        model.lin.bias.grad = marker
        plain = copy.deepcopy(model)
        handle = picklehooks.instrument(model, capture="all", example_inputs=(x,))
        assert "lin" in handle.modules
        assert model.lin.weight.grad is None
        assert model.lin.bias.grad is marker and torch.equal(marker, torch.full_like(marker, 7.0))
        with picklehooks.record() as log:
            out = model(x)
            out.sum().backward()
        plain_out = plain(x)
        plain_out.sum().backward()
        assert torch.equal(out, plain_out)
        assert torch.equal(model.lin.weight.grad, plain.lin.weight.grad)
        assert any(r.module == "lin" and r.kind == "output" for r in log.records)

    def test_example_forward_that_calls_backward_leaves_grads_alone(self):
        """Even a forward that calls backward() itself doesn't leave anything in .grad."""

        class CallsBackward(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                self.lin(x).sum().backward(retain_graph=True)
                return self.lin(x)

        model = CallsBackward()
        picklehooks.instrument(model, capture="output", example_inputs=(torch.randn(2, 4),))
        assert all(p.grad is None for p in model.parameters())


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y * 2


class UsesPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pair = Pair()

    def forward(self, x):
        a, b = self.pair(x)
        return a + b


class Ambiguous(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return x, x


class UsesAmbiguous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Ambiguous()

    def forward(self, x):
        return self.inner(x)


class TestUnannotatedTuple:
    @pytest.mark.parametrize("scriptable", [False, True])
    def test_tuple_return_is_read_off_the_source(self, scriptable):
        """`return y, y * 2` without annotation or example_inputs gives a Tuple hook; the model scripts."""
        model, x = UsesPair(), torch.randn(3, 4)
        want, plain_out = plain_outputs(model, ["pair", "pair.lin"], x)
        picklehooks.instrument(model, capture="output", scriptable=scriptable)
        scripted = torch.jit.script(model)
        with picklehooks.record() as log:
            out = scripted(x)
        assert torch.equal(out, plain_out)
        assert_outputs_recorded(log, want)

    def test_undecidable_return_is_refused_up_front(self):
        """Returns of different shapes, scriptable=True, no example_inputs: a PicklehooksError naming example_inputs=."""
        with pytest.raises(picklehooks.PicklehooksError, match="example_inputs="):
            picklehooks.instrument(UsesAmbiguous(), capture="output", scriptable=True)
