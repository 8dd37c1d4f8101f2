"""Taps never change what a model computes, and graphs never drop, merge or reorder them.

Every odd model of ``tests/models/odd.py`` runs instrumented in each form the
model itself supports and is compared with two kinds of ground truth from
plain PyTorch on an un-instrumented copy: plain forward pre-hooks and
forward hooks that clone what each module receives and returns, and the
parameters' ``.grad`` after backward. The instrumented model's output and
gradients must be bitwise those of the un-instrumented model in the same form.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch

import picklehooks
from tests.models import odd
from tests.testutils import transformed

FORMS = ["eager", "script", "trace", "fx", "compile", "export"]
CAPTURE = ("input", "output", "param", "param_grad")


def plain_records(model: torch.nn.Module, args: tuple) -> tuple[dict, torch.Tensor, dict]:
    """Ground truth: {(module, kind, path, call): tensor} from plain hooks; the output; the .grads."""
    seen: dict = {}
    calls: dict = defaultdict(int)

    def put(name, kind, path, value):
        key = (name, kind, path)
        seen[(*key, calls[key])] = value.detach().clone()
        calls[key] += 1

    handles = []
    for name, module in model.named_modules():
        if not name or type(module).forward is torch.nn.Module.forward:
            continue  # containers are never called

        def pre(m, inputs, kwargs, name=name):
            for path, v in [*((str(i), v) for i, v in enumerate(inputs)), *_leaves(kwargs)]:
                if isinstance(v, torch.Tensor):
                    put(name, "input", path, v)
            for pname, p in m.named_parameters(recurse=False):
                put(name, "param", pname, p)

        def post(m, inputs, output, name=name):
            outs = {"": output} if isinstance(output, torch.Tensor) else {
                str(i): v for i, v in enumerate(output) if isinstance(v, torch.Tensor)}
            for path, v in outs.items():
                put(name, "output", path, v)

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        out = model(*args)
    finally:
        for h in handles:
            h.remove()
    out.float().sum().backward()
    for name, module in model.named_modules():
        if name:
            for pname, p in module.named_parameters(recurse=False):
                if p.grad is not None:
                    seen[(name, "param_grad", pname, 0)] = p.grad.clone()
    return seen, out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _leaves(kwargs: dict) -> list:
    """(record path, value) of every keyword argument: the keyword, then positions inside tuples."""
    out = []
    for key, value in kwargs.items():
        if isinstance(value, (tuple, list)):
            out += [(f"{key}/{i}", v) for i, v in enumerate(value)]
        else:
            out.append((key, value))
    return out


def _form(model, form: str, args: tuple):
    if form == "trace":
        return torch.jit.trace(model, args, check_trace=False)
    return transformed(model, form, args)


def _run(model, args):
    with picklehooks.record() as log:
        out = model(*args)
        out.float().sum().backward()
    return log, out.detach()


def _supported(name: str, form: str) -> bool:
    # Embedding indices are data; tracing them is fine. MHA can't be FX-traced symbolically.
    return not (name == "Attention" and form == "fx")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", odd.NAMES)
def test_records_and_outputs(name, form):
    """Same records as plain hooks; outputs and .grads bitwise those of the un-instrumented model in this form."""
    if not _supported(name, form):
        pytest.skip(f"{form} can't take {name} even un-instrumented")
    args = odd.inputs(name)
    reference = odd.build(name)
    want, _, _ = plain_records(copy.deepcopy(reference), args)
    plain = copy.deepcopy(reference)
    plain_out = _form(plain, form, args)(*args)
    plain_out.float().sum().backward()
    plain_grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}

    model = copy.deepcopy(reference)
    # TorchScript types hooks positionally: scriptable=True leaves out (and names) modules called otherwise.
    options = {"scriptable": True, "example_inputs": args} if form == "script" else {}
    handle = picklehooks.instrument(model, capture=CAPTURE, mode="tensor", **options)
    log, out = _run(_form(model, form, args), args)
    want = {k: v for k, v in want.items() if k[0] not in handle.skipped or k[1] == "param_grad"}
    if form == "script":  # TorchScript hooks see positional arguments only
        assert all("positionally" in handle.skipped[n] for n in odd.KEYWORD_CALLED.get(name, ()))

    assert torch.equal(out, plain_out.detach()), "instrumenting changed the model's output"
    got_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got_grads.keys() == plain_grads.keys()
    for n, g in got_grads.items():
        assert torch.equal(g, plain_grads[n]), f"instrumenting changed {n}.grad"

    got = {r.key: r.tensor for r in log.records if r.tensor is not None}
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        # Compiled kernels may round differently from eager: 1e-5 relative is far below any real change.
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_two_calls_stay_two_records(form):
    """f(a) + f(b) records grad_output for both calls, as plain hooks on the caller's views see them."""
    args = odd.inputs("SameGradient")
    plain, want = odd.build("SameGradient"), {}

    def post(m, inputs, output):
        view = output.view_as(output)
        view.register_hook(lambda g, call=post.calls: want.__setitem__(("lin", "grad_output", "", call), g.clone()))
        post.calls += 1
        return view

    post.calls = 0
    plain.lin.register_forward_hook(post)
    plain(*args).sum().backward()
    assert len(want) == 2

    _assert_same(_grad_outputs("SameGradient", form, args), want)


def _grad_outputs(name: str, form: str, args: tuple) -> dict:
    """{key: tensor} of the grad_output records of odd model ``name`` run in ``form`` (fwd + bwd)."""
    model = odd.build(name)
    picklehooks.instrument(model, capture="grad_output", mode="tensor",
                           **({"scriptable": True, "example_inputs": args} if form == "script" else {}))
    run = _form(model, form, args)
    with picklehooks.record() as log:
        run(*args).sum().backward()
    return {r.key: r.tensor for r in log.records}


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("form", ["eager", "script", "fx"])
def test_another_threads_gradients_stay_out(form):
    """A thread that isn't recording runs forward and backward while another records: nothing of it lands there."""
    import threading

    args = odd.inputs("SameGradient")
    model = odd.build("SameGradient")
    picklehooks.instrument(model, capture=("output", "grad_output", "param_grad"),
                           **({"scriptable": True, "example_inputs": args} if form == "script" else {}))
    run = _form(model, form, args)
    recording, other_done = threading.Event(), threading.Event()

    def other():
        recording.wait(10)
        run(*args).sum().backward()
        other_done.set()

    worker = threading.Thread(target=other)
    worker.start()
    with picklehooks.record() as log:
        recording.set()
        other_done.wait(30)
    worker.join(30)
    assert other_done.is_set() and len(log) == 0, [r.key for r in log.records]


def test_remove_takes_the_gradient_hooks_and_owner_names_away():
    """After remove(), a tied weight carries no owner names and records nothing; a second handle keeps its own."""
    args = odd.inputs("Tied")
    model = odd.build("Tied")
    first = picklehooks.instrument(model, modules=["emb"], capture="param_grad")
    second = picklehooks.instrument(model, modules=["head"], capture="param_grad")
    first.remove()
    assert model.emb.weight.__dict__.get("_picklehooks_owners") == (("head", "weight"),)
    with picklehooks.record() as log:
        model(*args).sum().backward()
    assert [r.key for r in log.records] == [("head", "param_grad", "weight", 0)]
    second.remove()
    assert "_picklehooks_owners" not in model.emb.weight.__dict__
    with picklehooks.record() as log:
        model(*args).sum().backward()
    assert len(log) == 0


@pytest.mark.parametrize("form", FORMS)
def test_grad_output_of_an_output_changed_in_place_later(form):
    """grad_output is the gradient of the value the module returned, also when the caller changes it in place.

    Ground truth: a plain tensor hook on each output of an un-instrumented copy
    (hooks registered before an in-place change see the gradient of the value
    before it). The Identity returns its input: its grad_output is only what
    flows through its own output, not the input's other uses.
    """
    args = odd.inputs("ChangedAfter")
    plain, want = odd.build("ChangedAfter"), {}

    def post(m, inputs, output, name):
        if output is inputs[0]:  # Identity: hook a view, so that only this use is seen
            output = output.view_as(output)
        output.register_hook(lambda g: want.__setitem__((name, "grad_output", "", 0), g.clone()))
        return output

    for name in ("a", "same", "b"):
        getattr(plain, name).register_forward_hook(lambda m, i, o, name=name: post(m, i, o, name))
    plain(*args).sum().backward()
    assert len(want) == 3

    _assert_same(_grad_outputs("ChangedAfter", form, args), want)


@pytest.mark.parametrize("form", ["eager", "script", "compile", "export"])
def test_gradient_of_the_only_call_that_needs_one_keeps_its_call(form):
    """A module called twice, the second time without autograd: the gradient belongs to call 0.

    (FX and jit.trace don't keep ``no_grad`` blocks. A compiled forward runs
    without autograd: there tracing tells the ops which values get a gradient.)
    """
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.lin(x)
            with torch.no_grad():
                b = self.lin(x)
            return a * b

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(3, 4, requires_grad=True)
    plain = copy.deepcopy(model)
    grads = []
    plain.lin.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].clone()))
    plain(x).sum().backward()
    assert len(grads) == 1

    picklehooks.instrument(model, capture=("output", "grad_output"), mode="tensor",
                           **({"scriptable": True, "example_inputs": (x,)} if form == "script" else {}))
    run = _form(model, form, (x,))
    with picklehooks.record() as log:
        run(x).sum().backward()
    got = {r.key: r.tensor for r in log.records if r.kind == "grad_output"}
    assert list(got) == [("lin", "grad_output", "", 0)]
    torch.testing.assert_close(got[("lin", "grad_output", "", 0)], grads[0])


class _SameTensor(torch.nn.Module):
    """Computes something else when its arguments are one tensor (as MultiheadAttention does)."""

    def forward(self, q, k, v):
        return q * 2 if q is k and k is v else q * 3


class _CallsSame(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.same = torch.nn.Linear(4, 4), _SameTensor()

    def forward(self, x):
        h = self.lin(x)
        return self.same(h, h, v=h) + self.same(h, k=h.sin(), v=h)


@pytest.mark.parametrize("form", ["eager", "trace", "fx", "compile", "export"])
def test_a_tensor_passed_twice_stays_one_tensor(form):
    """attn(x, x, x) with grad_input captured: the module still sees one tensor; values at every position.

    (TorchScript can't compare tensors with ``is``, so its forms don't apply.)
    """
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plain = _CallsSame()
    model = copy.deepcopy(plain)
    want = plain(x)
    picklehooks.instrument(model, capture=("input", "grad_input"), mode="tensor")
    run = _form(model, form, (x,))
    with picklehooks.record() as log:
        out = run(x)
        out.sum().backward()
    assert torch.equal(out.detach(), want.detach())
    inputs = {r.key: r.tensor for r in log.records if r.module == "same" and r.kind == "input"}
    h = plain.lin(x).detach()
    # call counts per (module, kind, path): "k" first appears in the second call.
    assert sorted(inputs) == sorted(("same", "input", p, c) for p, c in
                                    [("0", 0), ("1", 0), ("v", 0), ("0", 1), ("k", 0), ("v", 1)])
    for key, tensor in inputs.items():
        torch.testing.assert_close(tensor, h.sin() if key[2] == "k" else h)
    # The first call's one tensor gets its whole gradient at its first position.
    grads = {r.key: r.tensor for r in log.records if r.module == "same" and r.kind == "grad_input"}
    assert ("same", "grad_input", "0", 0) in grads and ("same", "grad_input", "1", 0) not in grads
    torch.testing.assert_close(grads[("same", "grad_input", "0", 0)], torch.full((3, 4), 2.0))


def test_grad_output_under_functorch_transforms():
    """The aliasing Function also runs under torch.func (grad of a model whose output gradients are hooked)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    model = copy.deepcopy(plain)
    picklehooks.instrument(model, capture="grad_output")
    x = torch.randn(5, 4)
    want = torch.func.grad(lambda v: plain(v).sum())(x)
    with picklehooks.record():
        got = torch.func.grad(lambda v: model(v).sum())(x)
    torch.testing.assert_close(got, want)


def test_traced_and_saved_model_records_param_grad_in_a_fresh_process(tmp_path):
    """jit.trace keeps one watch op per parameter, so a traced model loaded elsewhere records param_grad."""
    import json

    from tests.testutils import run_fresh

    args = odd.inputs("Tied")
    plain = odd.build("Tied")
    plain(*args).sum().backward()
    want = {f"{m}.{n}": p.grad.double().norm().item()
            for m, mod in plain.named_modules() if m for n, p in mod.named_parameters(recurse=False)}
    model = odd.build("Tied")
    picklehooks.instrument(model, capture="param_grad")
    torch.jit.save(torch.jit.trace(model, args, check_trace=False), str(tmp_path / "traced.pt"))
    torch.save(args, tmp_path / "args.pt")
    out = run_fresh(f"""
        import json, torch, picklehooks
        model = torch.jit.load({str(tmp_path / "traced.pt")!r})
        args = torch.load({str(tmp_path / "args.pt")!r})
        with picklehooks.record() as log:
            model(*args).sum().backward()
        print(json.dumps({{r.module + "." + r.path: r.stats["norm"] for r in log.records}}))
    """)
    got = json.loads(out)
    # Tied: one weight, recorded under both of its owners.
    assert sorted(got) == sorted(want)
    for key, norm in want.items():
        assert got[key] == pytest.approx(norm, rel=1e-6), key


class _Tree(torch.nn.Module):
    """Calls itself: the inner call starts after the outer one and ends before it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, depth: int = 2):
        h = torch.tanh(self.lin(x))
        if depth > 0:
            h = h + self(h * 0.5, depth - 1)
        return h


class _HoldsTree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tree = _Tree()

    def forward(self, x):
        return self.tree(x)


@pytest.mark.parametrize("form", ["eager", "trace", "fx", "compile", "export"])
def test_a_module_that_calls_itself_pairs_input_and_output_of_one_invocation(form):
    """Input call k and output call k are the same invocation (TorchScript can't compile recursion)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plain = _HoldsTree()
    model = copy.deepcopy(plain)
    # Ground truth: plain hooks that pair each invocation's input and output with a stack.
    started, stack, want = [], [], {}

    def pre(m, args):
        stack.append(len(started))
        started.append(args[0].detach().clone())
        want[("tree", "input", "0", stack[-1])] = started[-1]

    def post(m, args, out):
        want[("tree", "output", "", stack.pop())] = out.detach().clone()

    plain.tree.register_forward_pre_hook(pre)
    plain.tree.register_forward_hook(post)
    plain(x)
    assert len(started) == 3

    picklehooks.instrument(model, modules=["tree"], capture=("input", "output"), mode="tensor")
    run = _form(model, form, (x,))
    with picklehooks.record() as log:
        run(x)
    _assert_same({r.key: r.tensor for r in log.records if r.tensor is not None}, want)  # not depth's repr


class _TwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, index_source: torch.Tensor):
        h = self.lin(x)
        return h * 2 + index_source.argmax(-1, keepdim=True).float(), h * 3


class _UsesOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = _TwoOut()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.two(x, x * 5)  # b is never used; x * 5 only feeds argmax
        return a.sum()


@pytest.mark.parametrize("form", FORMS)
def test_no_gradient_records_where_no_gradient_flows(form):
    """An unused output and an input that only feeds a non-differentiable op get no gradient record
    in any form (a compiled graph must not record zeros).

    Ground truth: plain tensor hooks on views of each input and output, which
    fire only where a gradient flows. (``register_full_backward_hook`` would
    report zeros for such an input: it wraps all inputs in one autograd node,
    which materialises the missing gradients.)
    """
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    plain = _UsesOne()
    model = copy.deepcopy(plain)
    want = {}

    def hooked(value, kind, path):
        value = value.view_as(value)
        value.register_hook(lambda g: want.__setitem__(("two", kind, path, 0), g.clone()))
        return value

    plain.two.register_forward_pre_hook(lambda m, args: tuple(hooked(v, "grad_input", str(i))
                                                              for i, v in enumerate(args)))
    plain.two.register_forward_hook(lambda m, args, out: tuple(hooked(v, "grad_output", str(i))
                                                               for i, v in enumerate(out)))
    plain(x).backward()
    assert sorted(want) == [("two", "grad_input", "0", 0), ("two", "grad_output", "0", 0)]

    picklehooks.instrument(model, modules=["two"], capture=("grad_input", "grad_output"), mode="tensor",
                           **({"scriptable": True, "example_inputs": (x,)} if form == "script" else {}))
    run = _form(model, form, (x,))
    with picklehooks.record() as log:
        run(x).backward()
    _assert_same({r.key: r.tensor for r in log.records}, want)
