"""Recording is an observer: PyTorch's own hook semantics hold on instrumented models.

Each case below exercises one thing PyTorch's ``test/nn/test_module_hooks.py``
checks (written here, not copied): forward, pre, full-backward and
backward-pre hooks, ``prepend``, ``with_kwargs``, ``always_call``, the global
``register_module_forward_(pre_)hook``, state-dict hooks, pickling and
deep copies of hooked modules, removal, warnings and errors. A case returns
everything it observed (hook calls and the tensors they saw, outputs,
gradients, warnings, errors). It runs on a plain model, which gives the
ground truth, and on instrumented ones (``capture="all"``, every module,
the root included): idle, recording, and instrumented then removed, with
``instrument()`` called before and after the case adds its own hooks. Every
variant must observe exactly what the plain model did.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import pickle
import warnings
from typing import Tuple

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.serialize.portable import module_text
from tests.models import hf, small

WHEN = ["before", "after"]
STATES = ["idle", "recording", "removed"]


class Harness:
    """What a case calls: ``model()`` when its model exists, ``ready()`` once its hooks are in,
    ``running()`` around what it runs. The variant decides what each does."""

    def __init__(self, when: str | None, state: str | None) -> None:
        self.when, self.state = when, state
        self.seen: list = []
        self.handles: list = []

    def _instrument(self, model: nn.Module) -> None:
        handle = picklehooks.instrument(model, modules=["", "*"], capture="all")
        if self.state == "removed":
            handle.remove()
        else:
            self.handles.append(handle)

    def model(self, model: nn.Module) -> nn.Module:
        if self.when == "before":
            self._instrument(model)
        return model

    def ready(self, model: nn.Module) -> nn.Module:
        if self.when == "after":
            self._instrument(model)
        return model

    @contextlib.contextmanager
    def running(self):
        if self.state == "recording":
            with picklehooks.record() as log:
                yield
            self.records = len(log)
        else:
            yield

    def note(self, *items) -> None:
        self.seen.append(tuple(_plain(i) for i in items))


def _plain(value):
    """A comparable copy of what a hook saw."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.detach().clone())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, nn.Module):
        return ("module", type(value).__name__)
    return value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.act = nn.Tanh()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.lin(x)))


class KwNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x) * scale
        return y if bias is None else y + bias


def _x(*shape) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(*shape or (2, 3), requires_grad=True)


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _step(h: Harness, m: nn.Module):
    """One forward and backward of ``Net`` as the variant runs it: what the caller and the model got."""
    x = _x()
    with h.running():
        y = m(x)
        y.sum().backward()
    return y.detach(), x.grad, _grads(m)


# -- the cases -------------------------------------------------------------------------------


def case_forward_hook_changes_output(h: Harness):
    m = h.model(Net())
    m.lin.register_forward_hook(lambda mod, args, out: (h.note("fwd", args, out), out * 2)[1])
    h.ready(m)
    return _step(h, m)


def case_pre_hook_changes_input(h: Harness):
    m = h.model(Net())
    m.lin.register_forward_pre_hook(lambda mod, args: (h.note("pre", args), (args[0] + 1,))[1])
    m.out.register_forward_pre_hook(lambda mod, args: args[0] * 3)  # a bare value is wrapped in a tuple
    h.ready(m)
    return _step(h, m)


def case_prepend_orders_hooks(h: Harness):
    m = h.model(Net())
    order = []
    m.lin.register_forward_hook(lambda *a: order.append("first"))
    m.lin.register_forward_hook(lambda *a: order.append("prepended"), prepend=True)
    m.lin.register_forward_pre_hook(lambda *a: order.append("pre first"))
    m.lin.register_forward_pre_hook(lambda *a: order.append("pre prepended"), prepend=True)
    m.lin.register_full_backward_hook(lambda *a: order.append("bw first"))
    m.lin.register_full_backward_hook(lambda *a: order.append("bw prepended"), prepend=True)
    h.ready(m)
    with h.running():
        m(_x()).sum().backward()
    return order


def case_with_kwargs(h: Harness):
    m = h.model(KwNet())

    def pre(mod, args, kwargs):
        h.note("pre_kw", args, kwargs)
        return args, {**kwargs, "scale": 2.0}

    def post(mod, args, kwargs, out):
        h.note("post_kw", args, kwargs, out)
        return out + kwargs["bias"]

    m.register_forward_pre_hook(pre, with_kwargs=True)
    m.register_forward_hook(post, with_kwargs=True)
    h.ready(m)
    x, bias = _x(), torch.ones(3, requires_grad=True)
    with h.running():
        y = m(x, bias=bias)
        y.sum().backward()
    return y.detach(), x.grad, bias.grad, _grads(m)


def case_always_call(h: Harness):
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    m = h.model(nn.Sequential(nn.Linear(3, 3), Fails()))
    m[1].register_forward_hook(lambda mod, args, out: h.note("always", args, out), always_call=True)
    m[1].register_forward_hook(lambda mod, args, out: h.note("not always", args, out))
    h.ready(m)
    with h.running(), pytest.raises(ValueError, match="boom"):
        m(_x())
    return None


def case_full_backward_hook(h: Harness):
    m = h.model(Net())

    def bw(mod, grad_input, grad_output):
        h.note("bw", grad_input, grad_output)
        return (grad_input[0] * 0.5,)

    m.act.register_full_backward_hook(bw)
    m.out.register_full_backward_hook(lambda mod, gi, go: h.note("bw out", gi, go))
    h.ready(m)
    x = _x()
    with h.running():
        m(x).pow(2).sum().backward()
    return x.grad, _grads(m)


def case_backward_pre_hook(h: Harness):
    m = h.model(Net())

    def bw_pre(mod, grad_output):
        h.note("bw_pre", grad_output)
        return (grad_output[0] * 3,)

    m.out.register_full_backward_pre_hook(bw_pre)
    h.ready(m)
    x = _x()
    with h.running():
        m(x).sum().backward()
    return x.grad, _grads(m)


def case_backward_hook_without_grad_inputs_warns(h: Harness):
    m = h.model(Net())
    m.lin.register_full_backward_hook(lambda mod, gi, go: h.note("bw", gi, go))
    h.ready(m)
    x = torch.randn(2, 3)  # requires no grad: the hook fires from the outputs, with a warning
    with h.running(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m(x).sum().backward()
    return [str(w.message) for w in caught if "backward hook" in str(w.message).lower()], _grads(m)


def case_backward_hook_wrong_arity_raises(h: Harness):
    m = h.model(Net())
    m.act.register_full_backward_hook(lambda mod, gi, go: (gi[0], gi[0]))
    h.ready(m)
    with h.running(), pytest.raises(RuntimeError, match="invalid number of grad_input") as err:
        m(_x()).sum().backward()
    return str(err.value)


def case_pre_hook_kwargs_bad_return_raises(h: Harness):
    m = h.model(KwNet())
    m.register_forward_pre_hook(lambda mod, args, kwargs: "nonsense", with_kwargs=True)
    h.ready(m)
    with h.running(), pytest.raises(RuntimeError, match="forward pre-hook must return None or a tuple") as err:
        m(_x())
    return str(err.value).split(",")[0]


def case_global_module_hooks(h: Harness):
    m = h.model(Net())
    handles = []
    try:
        handles.append(nn.modules.module.register_module_forward_pre_hook(lambda mod, args: h.note("gpre", mod, args)))
        handles.append(nn.modules.module.register_module_forward_hook(lambda mod, args, out: h.note("gpost", mod, out)))
        handles.append(nn.modules.module.register_module_full_backward_hook(
            lambda mod, gi, go: h.note("gbw", mod, gi, go)))
        h.ready(m)
        x = _x()
        with h.running():
            y = m(x)
            y.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return y.detach(), x.grad, _grads(m)


def case_removal(h: Harness):
    m = h.model(Net())
    keep = m.lin.register_forward_hook(lambda mod, args, out: h.note("kept", out))
    gone = m.lin.register_forward_hook(lambda mod, args, out: h.note("removed", out))
    bw = m.out.register_full_backward_hook(lambda mod, gi, go: h.note("bw removed", go))

    class Once:
        def __call__(self, mod, args, out):
            h.note("once", out)
            self.handle.remove()

    once = Once()
    once.handle = m.act.register_forward_hook(once)
    h.ready(m)
    gone.remove()
    bw.remove()
    with h.running():
        m(_x()).sum().backward()
        m(_x(2, 3) * 2).sum().backward()
    keep.remove()
    with h.running():
        m(_x())
    return _grads(m)


def case_state_dict_hooks(h: Harness):
    m = h.model(Net())
    m.lin.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: h.note("sd pre", prefix, keep_vars))

    def post(mod, state, prefix, local_metadata):
        h.note("sd post", prefix, sorted(state))
        state[prefix + "extra"] = torch.ones(1)

    m.lin._register_state_dict_hook(post)

    def load_pre(mod, state, prefix, *rest):
        h.note("load pre", prefix, sorted(state))
        state.pop(prefix + "extra", None)

    m.lin._register_load_state_dict_pre_hook(load_pre, with_module=True)
    m.register_load_state_dict_post_hook(lambda mod, keys: h.note("load post", sorted(keys.missing_keys),
                                                                  sorted(keys.unexpected_keys)))
    h.ready(m)
    with h.running():
        sd = m.state_dict()
        result = m.load_state_dict(sd)
    return sorted(sd), {k: v.clone() for k, v in sd.items()}, result.missing_keys, result.unexpected_keys


class _Scale:
    """A picklable hook (a closure isn't)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, mod, args, out):
        return out * self.factor


def case_pickle_and_deepcopy_keep_hooks(h: Harness):
    m = h.model(Net())
    m.lin.register_forward_hook(_Scale(3.0))
    h.ready(m)
    x = _x()
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(m)), copy.deepcopy(m)]
    with h.running():
        outs = [c(x).detach() for c in copies]
    return outs, [sorted(type(v).__name__ for v in c.lin._forward_hooks.values() if isinstance(v, _Scale))
                  for c in copies]


def case_deepcopy_of_a_self_removing_hook(h: Harness):
    m = h.model(Net())

    class Once:
        calls = 0

        def __call__(self, mod, args, out):
            self.calls += 1
            self.handle.remove()

    once = Once()
    once.handle = m.lin.register_forward_hook(once)
    h.ready(m)
    twin = copy.deepcopy(m)
    twin_hook = next(v for v in twin.lin._forward_hooks.values() if isinstance(v, Once))
    with h.running():
        twin(_x())
        twin(_x())
    return twin_hook.calls, once.calls, len([v for v in twin.lin._forward_hooks.values() if isinstance(v, Once)])


def case_legacy_backward_hook(h: Harness):
    class Triple(nn.Module):
        def forward(self, x):
            return x * 3

    m = h.model(nn.Sequential(nn.Linear(3, 3), Triple()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m[1].register_backward_hook(lambda mod, gi, go: h.note("legacy", gi, go))
    h.ready(m)
    x = _x()
    with h.running(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(x).sum().backward()
    return x.grad, _grads(m)


def case_global_legacy_backward_hook(h: Harness):
    m = h.model(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = nn.modules.module.register_module_backward_hook(lambda mod, gi, go: h.note("glegacy", mod, gi, go))
    try:
        h.ready(m)
        x = _x()
        with h.running(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(x).pow(2).sum().backward()
    finally:
        handle.remove()
        # torch keeps the kind of the last global backward hook after its removal, and then
        # refuses a global hook of the other kind: forget it, for the cases that follow.
        nn.modules.module._global_is_full_backward_hook = None
    return x.grad, _grads(m)


def case_hook_sees_module_state(h: Harness):
    m = h.model(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5)))
    m[1].register_forward_hook(lambda mod, args, out: h.note("bn", mod.running_mean, mod.num_batches_tracked))
    h.ready(m)
    torch.manual_seed(3)
    with h.running():
        y = m(_x(4, 3))
        y.sum().backward()
    return y.detach(), _grads(m), m[1].running_var.clone()


# Cases in which no instrumented forward completes: state-dict hooks run none; a pre-hook added
# before picklehooks' raises before it runs.
RECORD_NOTHING = {"state_dict_hooks", "pre_hook_kwargs_bad_return_raises"}
CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("case", sorted(CASES))
def test_instrumented_model_keeps_pytorch_hook_semantics(case, when, state):
    plain = Harness(None, None)
    torch.manual_seed(0)  # the same weights for models the case builds itself
    want = CASES[case](plain)
    variant = Harness(when, state)
    try:
        torch.manual_seed(0)
        got = CASES[case](variant)
    finally:
        for handle in variant.handles:
            handle.remove()
    assert _same(plain.seen, variant.seen), f"{case}: the hooks saw other values or ran in another order"
    assert _same(want, got), f"{case}: the model or its caller computed something else"
    if state == "recording" and case not in RECORD_NOTHING:
        assert variant.records > 0, "nothing was recorded: the variant didn't exercise recording"


# -- each reproduced case of issue 25, on its own ------------------------------------------------


class ViewNet(nn.Module):
    def forward(self, x):
        return x.view(-1)


@pytest.mark.parametrize("make", [lambda: nn.Flatten(0), ViewNet], ids=["Flatten", "view"])
def test_caller_changing_a_view_output_in_place_gets_plain_gradients(make):
    """The output views the input: an in-place change to it must still reach the input's history."""
    def run(instrumented: bool):
        m = make()
        if instrumented:
            picklehooks.instrument(m, modules=[""])
        leaf = torch.ones(2, 3, requires_grad=True)
        y = leaf * 1
        with picklehooks.record():
            out = m(y)
            out.mul_(2)
            y.sum().backward()
        return leaf.grad, out._is_view()

    assert _same(run(True), run(False))


def test_a_view_output_records_the_gradient_plain_hooks_see():
    m = nn.Flatten(0)
    picklehooks.instrument(m, modules=[""], mode="tensor")
    leaf = torch.randn(2, 3, requires_grad=True)
    with picklehooks.record() as log:
        out = m(leaf * 1)
        assert out._is_view()
        (out * torch.arange(6.0)).sum().backward()
    (grad,) = [r.tensor for r in log.records if r.kind == "grad_output"]
    assert torch.equal(grad, torch.arange(6.0))  # d(sum(out * w))/d(out) = w


class FillsList(nn.Module):
    def forward(self, x, cache: list):
        cache.append(x * 2)
        return x + 1


class FillsDict(nn.Module):
    def forward(self, x, state: dict):
        state["seen"] = x.sum()
        return x * 2


@dataclasses.dataclass
class Cache:
    items: list = dataclasses.field(default_factory=list)
    count: int = 0


class FillsDataclass(nn.Module):
    def forward(self, x, cache: Cache):
        cache.items.append(x)
        cache.count += 1
        return x - 1


class ReadsCounter(nn.Module):
    def forward(self, x, c):
        return x * len(c) + c["a"]


class ReturnsDefaultdict(nn.Module):
    def forward(self, x):
        out = collections.defaultdict(list)
        out["y"] = x * 2
        self.last = out
        return out


@pytest.mark.parametrize("capture", ["all", ("output", "grad_output")])
def test_container_arguments_and_outputs_are_the_callers_own(capture):
    def run(instrumented: bool):
        torch.manual_seed(0)
        models = [FillsList(), FillsDict(), FillsDataclass(), ReadsCounter(), ReturnsDefaultdict()]
        if instrumented:
            for m in models:
                picklehooks.instrument(m, modules=[""], capture=capture)
        x = torch.randn(3, requires_grad=True)
        cache, state, dc, counter = [], {}, Cache(), collections.Counter(a=3, b=1)
        with picklehooks.record():
            outs = [models[0](x, cache), models[1](x, state), models[2](x, dc), models[3](x, counter),
                    models[4](x)]
            (sum(o.sum() for o in outs[:4]) + outs[4]["y"].sum() + cache[0].sum()).backward()
        d = outs[4]
        return (outs[:4], len(cache), cache[0].detach(), sorted(state), dc.count, len(dc.items), x.grad,
                type(d).__name__, d.default_factory is list, d is models[4].last, counter == collections.Counter(a=3, b=1))

    assert _same(run(True), run(False))


def test_legacy_backward_hook_sees_the_modules_own_gradient():
    class Triple(nn.Module):
        def forward(self, x):
            return x * 3

    def run(instrumented: bool, before: bool):
        m, seen = Triple(), []
        if instrumented and before:
            picklehooks.instrument(m, modules=[""])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.register_backward_hook(lambda mod, gi, go: seen.append(gi[0].sum().item()))
            if instrumented and not before:
                picklehooks.instrument(m, modules=[""])
            with picklehooks.record():
                m(torch.ones(4, requires_grad=True)).sum().backward()
        return seen

    assert run(False, True) == [12.0]
    assert run(True, True) == [12.0] and run(True, False) == [12.0]


def test_deepcopy_of_a_hook_that_removes_itself_through_its_handle():
    class Once:
        calls = 0

        def __call__(self, mod, args, out):
            self.calls += 1
            self.handle.remove()

    def run(instrumented: bool, remove: bool):
        m = nn.Linear(2, 2)
        handle = picklehooks.instrument(m, modules=[""]) if instrumented else None
        once = Once()
        once.handle = m.register_forward_hook(once)
        if remove:
            handle.remove()
        twin = copy.deepcopy(m)
        twin_once = next(h for h in twin._forward_hooks.values() if isinstance(h, Once))
        with picklehooks.record():
            twin(torch.ones(2))
            twin(torch.ones(2))
        return twin_once.calls, once.calls

    assert run(False, False) == (1, 0)
    assert run(True, False) == (1, 0) and run(True, True) == (1, 0)


@pytest.fixture
def no_recompiles():
    """Fresh Dynamo caches; the test enters the returned context once it has run a step in each
    recording state (a compiled model has a graph for each), and from then on nothing recompiles."""
    torch._dynamo.reset()
    yield lambda: torch._dynamo.config.patch(error_on_recompile=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("capture", ["input", "all"])
def test_compiled_model_with_input_capture_compiles_once(capture, no_recompiles):
    m = nn.Sequential(nn.Linear(4, 4))
    picklehooks.instrument(m, capture=capture, example_inputs=(torch.randn(2, 4),))
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    counts = []
    with no_recompiles():
        for step in range(12):  # a new batch each call: the 9th recompile used to raise
            with picklehooks.record() as log:
                compiled(torch.randn(2, 4, requires_grad=True)).sum().backward()
            counts.append(len(log))
    assert counts[0] > 0 and len(set(counts)) == 1


@pytest.mark.parametrize("name", hf.NAMES)
def test_real_models_compile_once_across_batches_and_recording_toggles(name, no_recompiles):
    """Steady state: fresh batches, recording on and off, ``capture="all"``: one compile.

    Dynamo's guards decide recompiles whatever the backend, so the ``eager``
    backend keeps this fast (the matrix compiles with Inductor).
    """
    pytest.importorskip("transformers")
    model = hf.build(name)
    picklehooks.instrument(model, capture="all")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    counts = []

    def step(recording: bool, seed: int) -> None:
        with picklehooks.record() if recording else contextlib.nullcontext() as log:
            hf.step_loss(compiled(**hf.inputs(name, seed=seed))).backward()
        if recording:
            counts.append(len(log))

    step(False, 0), step(True, 1)  # a graph for each recording state
    with no_recompiles():
        for seed in range(2, 6):
            step(seed % 2 == 1, seed)
    assert counts[0] > 0 and len(set(counts)) == 1


def _full_backward_grad_inputs(model: nn.Module) -> dict:
    """(module, "grad_input", "0", 0) -> the gradient ``register_full_backward_hook`` sees."""
    seen = {}
    for name, module in model.named_modules():
        if name and type(module).forward is not nn.Module.forward:  # as instrument() chooses
            module.register_full_backward_hook(
                lambda m, gi, go, name=name: seen.__setitem__((name, "grad_input", "0", 0), gi[0].clone())
                if gi[0] is not None else None)
    return seen


class _LinearLayerNorm(nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
        self.act = nn.LeakyReLU(0.2, inplace=inplace)

    def forward(self, x):
        return self.act(self.block(x))


class _LinearRelu(nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x):
        return self.relu(self.lin(x))


@pytest.mark.parametrize("make", [_LinearRelu, _LinearLayerNorm, hf.TinyResNet],
                         ids=["Linear-ReLU", "Linear-LayerNorm-LeakyReLU", "ResNet"])
def test_in_place_modules_record_grad_input(make):
    """Ground truth: full backward hooks on the same model without in-place activations."""
    reference = make(inplace=False)
    want = _full_backward_grad_inputs(reference)
    x = torch.randn(2, 3, 8, 8) if make is hf.TinyResNet else torch.randn(4, 3)
    out = reference(x.clone().requires_grad_())
    (out["logits"] if isinstance(out, dict) else out).pow(2).sum().backward()

    model = make(inplace=True)
    picklehooks.instrument(model, capture=("grad_input",), mode="tensor")
    with picklehooks.record() as log:
        out = model(x.clone().requires_grad_())
        (out["logits"] if isinstance(out, dict) else out).pow(2).sum().backward()
    got = {r.key: r.tensor for r in log.records if r.kind == "grad_input"}
    inplace = [n for n, m in model.named_modules() if getattr(m, "inplace", False)]
    assert inplace and all((n, "grad_input", "0", 0) in got for n in inplace), sorted(got)
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")


def test_portable_hook_importing_in_its_body_scripts(tmp_path):
    """Body imports move to the hook text's header: TorchScript compiles no import statement."""
    import picklehooks.serialize.package
    from tests.testutils import run_without_picklehooks

    def hook(module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        import math
        from torch.nn import functional as F

        return F.relu(output) * math.pi

    text = module_text(hook)
    body = text[text.index("def hook"):]
    assert "import" not in body and "import math" in text, text
    model = nn.Linear(2, 2)
    model.register_forward_hook(picklehooks.portable(hook))
    path = tmp_path / "model.pt"
    picklehooks.serialize.package.save(path, model)
    out = run_without_picklehooks(
        """
        import torch
        from torch.package import PackageImporter
        model = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
        print(torch.jit.script(model)(torch.ones(2)).tolist())
        """,
        str(path),
    )
    assert out.strip() == str(model(torch.ones(2)).tolist())


class _UsesLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(3, 3)) for _ in range(2)])
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(3))})
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x @ self.ws[0] @ self.ws[1] * self.pd["a"])


class _HoldsLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _UsesLists()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("form", ["eager", "script", "trace", "fx", "compile", "export"])
def test_parameter_list_and_dict_parameters_are_recorded_at_their_owners_call(form):
    """A ParameterList/ParameterDict is never called: its owner's call records its parameters, under the
    list's own name (module "inner.ws", path "0"), as their param_grad is named; the values are the plain ones."""
    torch.manual_seed(0)
    model, x = _HoldsLists(), torch.randn(2, 3)
    plain = copy.deepcopy(model)
    plain(x).sum().backward()
    lists = {"inner.ws": plain.inner.ws, "inner.pd": plain.inner.pd}
    handle = picklehooks.instrument(model, capture="all", scriptable=form == "script", example_inputs=(x,))
    assert not any("'param' records" in handle.skipped[n] for n in lists), handle.skipped
    run = {"eager": lambda: model, "script": lambda: torch.jit.script(model),
           "trace": lambda: torch.jit.trace(model, (x,)), "fx": lambda: torch.fx.symbolic_trace(model),
           "compile": lambda: torch.compile(model, fullgraph=True),
           "export": lambda: torch.export.export(model, (x,)).module()}[form]()
    with picklehooks.record() as log:
        run(x).sum().backward()
    got = {(r.module, r.kind, r.path): r.stats for r in log.records if r.module in lists}
    want = {(name, kind, n): p if kind == "param" else p.grad
            for name, owner in lists.items() for n, p in owner.named_parameters() for kind in ("param", "param_grad")}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key]["shape"] == tuple(value.shape), key
        assert got[key]["mean"] == pytest.approx(value.double().mean().item(), rel=1e-6, abs=1e-7), key
        assert got[key]["norm"] == pytest.approx(value.double().norm().item(), rel=1e-6, abs=1e-7), key


def test_a_parameter_list_whose_owner_has_no_hooks_names_the_fix():
    """The root owns the list and isn't chosen by default: the list's skip reason says how to get its records."""
    model = _UsesLists()
    handle = picklehooks.instrument(model, capture="all")
    assert "modules=[..., '']" in handle.skipped["ws"] and "0, 1" in handle.skipped["ws"], handle.skipped
    handle.remove()
    handle = picklehooks.instrument(model, modules=["", "*"], capture="all")
    assert "'param' records" not in handle.skipped["ws"], handle.skipped
    with picklehooks.record() as log:
        model(torch.randn(2, 3)).sum().backward()
    assert {(r.path, r.kind) for r in log.records if r.module == "ws"} == {
        (n, kind) for n in ("0", "1") for kind in ("param", "param_grad")}


def test_global_hooks_registered_first_see_no_probe_and_keep_idle_hooks_free():
    """The once-per-process probe of :func:`picklehooks.capture.hookdict.works` runs no user hook, and a
    global hook present then doesn't make it conclude that idle hook dictionaries can't work."""
    from tests.testutils import run_fresh

    out = run_fresh(
        """
        import json, torch
        seen = []
        torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
        import picklehooks
        from picklehooks.capture import hookdict as _hookdict
        model = torch.nn.Linear(2, 2)
        picklehooks.instrument(model, modules=[""])
        print(json.dumps([seen, _hookdict.works()]))
        """
    )
    assert out.strip() == '[[], true]'


class _ScriptedRNN(small.RNN):  # calls nn.LSTM(x, (h0, c0))
    """Scripted by one test only: see test_scripting_a_model_whose_overloaded_module_is_instrumented_names_the_fix."""


class _PlainScriptedRNN(small.RNN):
    """Its plain twin, of a type of its own."""


def test_scripting_a_model_whose_overloaded_module_is_instrumented_names_the_fix():
    # Every scripted module's first call is compared with the plain one's first call: TorchScript shares a
    # compiled forward, and its executor, among the modules of one type, and a later call runs the optimized
    # graph, which may differ from the first (profiling) run in the last bit. So the plain module has a type
    # of its own, and no other test scripts these types.
    model = _ScriptedRNN()
    args = (torch.randn(2, 5, 4), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
    plain = torch.jit.script(_PlainScriptedRNN())(*args)
    handle = picklehooks.instrument(model)
    with picklehooks.record() as log:
        model(*args)
    assert any(r.module == "lstm" for r in log.records)  # eager records it
    with pytest.raises(RuntimeError, match=r"'lstm' \(LSTM\).*scriptable=True"):
        torch.jit.script(model)
    twin = pickle.loads(pickle.dumps(model))  # the refusal travels with the hooks
    with pytest.raises(RuntimeError, match="scriptable=True"):
        torch.jit.script(twin)
    handle.remove()
    assert "__prepare_scriptable__" not in model.lstm.__dict__
    assert torch.equal(torch.jit.script(model)(*args), plain)
    handle = picklehooks.instrument(model, scriptable=True)
    assert "lstm" in handle.skipped
    assert torch.equal(torch.jit.script(model)(*args), plain)


class _SharedOnTwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.shared(self.a(x)) + self.shared(self.b(x)) * 2


@pytest.mark.parametrize("capture", [("input", "output", "grad_output"), ("grad_output",)])
def test_compiled_gradients_pair_with_their_own_call(capture, no_recompiles):
    """Inductor orders the backward as it likes: each call's gradient still gets that call's number."""
    def records(compiled: bool) -> dict:
        model = _SharedOnTwoBranches()
        picklehooks.instrument(model, capture=capture, mode="tensor")
        run = torch.compile(model, fullgraph=True) if compiled else model
        torch.manual_seed(1)
        with picklehooks.record() as log:
            run(torch.randn(2, 3, requires_grad=True)).sum().backward()
        return {r.key: r.tensor for r in log.records if r.module == "shared"}

    want, got = records(False), records(True)
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
