"""The hook lane (csrc/hooks.c) records what ``_hookrt``'s Python records.

Each scenario runs twice on deep copies of one instrumented model: with the
lanes of the implementation in use (``use_lanes``: the C extension's, the
default; or with ``PICKLEHOOKS_NATIVE=0`` its Python twin's, which decline
what the C would take, so the Python path runs behind them) and with them
switched off (``use_python_lanes``: the Python hook runtime and
``Log._add_tensor``, the same statistics). The rows, call numbers and gradient
bookkeeping must be the same, and so must errors. ``tests/test_faithful_*``
hold the default (lane) path to plain PyTorch; one test here does too, for the
cases only this lane takes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import picklehooks
from picklehooks import Log, _hookrt, _native, _ops, _taps
from tests import testutils
from tests.runtime.test_record_lane import assert_same_logs
from tests.testutils import plain_stats, recording_in_another_thread, use_python_lanes

# The lanes of the implementation in use; with the twin, _native.hook_lane hands out none (they only
# decline), so use_lanes puts them where the C's go.
forward_lane, GradRecorder = _native._impl.forward_lane, _native._impl.GradRecorder
C = _native.AVAILABLE


def use_lanes(monkeypatch) -> None:
    """The implementation's row and hook lanes where the callers look for them (the C's are there already)."""
    testutils.use_lanes(monkeypatch, _native._impl.add_row, forward_lane, GradRecorder)


class Block(torch.nn.Module):
    """Linear + LayerNorm + GELU, a module called twice, one returning a tuple, one returning its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.act = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()
        self.same = torch.nn.Identity()
        self.split = Split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.lin(x)))
        h = self.act(h) + self.same(h)
        a, b = self.split(h)
        return a * b


class Split(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :4], x[:, 4:]


class Checkpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.inner, self.head = Block(), torch.nn.Linear(4, 2)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=self.use_reentrant))


def run(model: torch.nn.Module, x: torch.Tensor, backward: bool, log: Log | None = None) -> Log:
    with picklehooks.record(log=log) as log:
        if backward:
            model(x).pow(2).sum().backward()
        else:
            with torch.no_grad():
                model(x)
                model(x)
    return log


def both_ways(monkeypatch, make, instrument_kwargs: dict, backward: bool, log_kwargs: dict | None = None):
    torch.manual_seed(0)
    model = make()
    picklehooks.instrument(model, **instrument_kwargs)
    x = torch.randn(3, 8, requires_grad=backward)
    lane_model, python_model = copy.deepcopy(model), copy.deepcopy(model)
    with monkeypatch.context() as patch:
        use_lanes(patch)
        with_lane = run(lane_model, x, backward, Log(**(log_kwargs or {})))
    with monkeypatch.context() as patch:
        use_python_lanes(patch)
        without = run(python_model, x, backward, Log(**(log_kwargs or {})))
    return with_lane, without


SCENARIOS = {
    "stats": {},
    "tensor": {"mode": "tensor"},
    "both": {"mode": "both"},
    "inputs and params": {"capture": ["input", "output", "param", "grad_output", "grad_input", "param_grad"]},
    "outputs only": {"capture": "output"},
    "guard": {"on_nonfinite": "raise"},
}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_lane_records_what_python_records(monkeypatch, scenario, backward):
    a, b = both_ways(monkeypatch, Block, SCENARIOS[scenario], backward)
    assert len(a._rows) > 0
    assert_same_logs(a, b)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoints_recomputation_records_as_in_python(monkeypatch, use_reentrant):
    a, b = both_ways(monkeypatch, lambda: Checkpointed(use_reentrant), {}, True)
    assert {r[1] for r in a._rows} == {"output", "grad_output"}
    assert_same_logs(a, b)


def test_a_log_keeping_live_values_records_as_in_python(monkeypatch):
    a, b = both_ways(monkeypatch, Block, {}, True, {"keep_graph": True})
    assert all(row[10] is not None for row in a._rows if row[1] == "output")
    assert [r[:8] for r in a._rows] == [r[:8] for r in b._rows]


def test_recorded_statistics_are_those_of_plain_hooks():
    """Ground truth for what only the lane takes (plain tensor outputs, plain gradients): float64
    statistics of clones taken by plain hooks on an un-instrumented copy."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(3, 8)
    plain = copy.deepcopy(model)
    want = {}
    for name in ("lin", "norm"):
        def post(m, i, o, name=name):
            want[(name, "output")] = o.detach().clone()
            o.register_hook(lambda g: want.__setitem__((name, "grad_output"), g.clone()))
        getattr(plain, name).register_forward_hook(post)
    plain(x).pow(2).sum().backward()
    picklehooks.instrument(model, modules=["lin", "norm"])
    with picklehooks.record() as log:
        model(x).pow(2).sum().backward()
    got = {(r.module, r.kind): r.stats for r in log.records}
    assert got.keys() == want.keys()
    for key, value in want.items():
        ref = plain_stats(value)
        for stat, v in ref.items():
            assert got[key][stat] == pytest.approx(v, rel=1e-6, abs=1e-12), (key, stat)


def test_nonfinite_values_raise_as_in_python(monkeypatch):
    """A guard is Python's: the lane hands it over, forward and backward alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    picklehooks.instrument(model, on_nonfinite="raise")
    bad = torch.full((2, 4), float("nan"))
    for lanes in (True, False):
        with monkeypatch.context() as patch:
            (use_lanes if lanes else use_python_lanes)(patch)
            with pytest.raises(_ops.NonfiniteError, match="non-finite output in module '0'"):
                model(bad)


def test_forward_lane_declines_what_it_does_not_take():
    """NotImplemented, with nothing recorded or counted, for every case the Python body handles."""
    lane = forward_lane
    module = torch.nn.GELU()
    module._picklehooks_name = "g"
    unnamed = torch.nn.GELU()
    x = torch.randn(2, 3)
    value = _ops.VALUE | _ops.STATS
    with picklehooks.record() as log:
        cases = {
            "a tuple": (module, (x,), value),
            "a subclass": (module, x.as_subclass(torch.nn.Parameter), value),
            "a guard": (module, x, value | _ops.GUARD),
            "no value asked for": (module, x, _ops.GRAD | _ops.STATS),
            "a gradient hook needed": (module, x.clone().requires_grad_(), value | _ops.GRAD),
            "no name": (unnamed, x, value),
        }
        for case, args in cases.items():
            assert lane(*args) is NotImplemented, case
        assert not log._rows and not log._calls
        # What the C takes: recorded once, numbered once; the twin takes nothing.
        assert lane(module, x, value) is (None if C else NotImplemented)
        assert [(r[0], r[1], r[3]) for r in log._rows] == ([("g", "output", 0)] if C else [])
    # Nothing records: done at once, nothing recorded anywhere.
    assert lane(module, x, value) is None
    assert len(log._rows) == (1 if C else 0)


class Custom(torch.nn.Module):  # not one of torch.nn's own: it might use its output after returning it
    def forward(self, x):
        return x * 2


def _grad_cases():
    """(module, output, inputs) the lane must leave to Python although a gradient flows and GRAD is
    asked for; each output fresh and hookless, so only the named condition differs."""
    def named(module):
        module._picklehooks_name = "m"
        return module

    x = torch.randn(2, 3, requires_grad=True)
    made = lambda: x * 1  # noqa: E731 -- a new non-leaf output
    with_parent = named(torch.nn.Sequential(torch.nn.GELU()))
    legacy = named(torch.nn.GELU())
    legacy.register_backward_hook(lambda *args: None)  # its hooks attach to the output's grad_fn
    hooked = made()
    hooked.register_hook(lambda g: None)
    passed_on = made()  # a new non-leaf, handed back as it came in (not a leaf, not a view)
    return {
        "no inputs (an old generated hook)": (named(torch.nn.GELU()), made(), None),
        "not torch.nn's own module": (named(Custom()), made(), (x,)),
        "a module with submodules": (with_parent, made(), (x,)),
        "a legacy backward hook": (legacy, made(), (x,)),
        "the output is an input": (named(torch.nn.Identity()), passed_on, (passed_on,)),
        "a leaf": (named(torch.nn.GELU()), torch.randn(3, requires_grad=True), (x,)),
        "a view": (named(torch.nn.GELU()), made()[0], (x,)),
        "hooks already": (named(torch.nn.GELU()), hooked, (x,)),
    }


@pytest.mark.skipif(not C, reason="the twin's lane takes nothing")
def test_forward_lane_hooks_a_gradient_where_eager_tap_hooks_the_output_directly():
    """A torch.nn leaf module's new output: recorded, expecting its gradient for sure, and hooked
    itself, as ``_eager_tap(direct=True)`` does; everything else is declined untouched."""
    flags = _ops.VALUE | _ops.GRAD | _ops.STATS
    with picklehooks.record() as log:
        for case, (module, output, inputs) in _grad_cases().items():
            hooks = output._backward_hooks
            assert forward_lane(module, output, flags, inputs) is NotImplemented, case
            assert output._backward_hooks is hooks, case
        assert not log._rows and not log._calls and not log._awaiting_grad
        module = torch.nn.GELU()
        module._picklehooks_name = "g"
        x = torch.randn(2, 3, requires_grad=True)
        out = module(x)
        assert forward_lane(module, out, flags, (x,)) is None
        assert [(r[0], r[1], r[3]) for r in log._rows] == [("g", "output", 0)]
        assert list(log._awaiting_grad) == [("g", "output", "")]
        (recorder,) = out._backward_hooks.values()
        assert (recorder.name, recorder.kind, recorder.path, recorder.flags) == ("g", "grad_output", "", flags)
        out.sum().backward()
    assert [(r.module, r.kind, r.call) for r in log.records] == [("g", "output", 0), ("g", "grad_output", 0)]
    assert log.records[1].stats["mean"] == 1.0 and not any(log._awaiting_grad.values())  # paired


@pytest.mark.skipif(not C, reason="the twin's lane takes nothing")
def test_forward_lane_leaves_global_backward_hooks_and_torch_function_modes_to_python():
    module = torch.nn.GELU()
    module._picklehooks_name = "g"
    x = torch.randn(2, 3, requires_grad=True)
    flags = _ops.VALUE | _ops.GRAD | _ops.STATS
    with picklehooks.record() as log:
        module_globals = torch.nn.modules.module
        kind = module_globals._global_is_full_backward_hook  # which kind of global hook may be added
        handle = module_globals.register_module_full_backward_hook(lambda *args: None)
        try:
            assert forward_lane(module, x * 1, flags, (x,)) is NotImplemented
        finally:
            handle.remove()
            module_globals._global_is_full_backward_hook = kind  # removing the hook doesn't reset it

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        out = x * 1
        with Mode():
            assert forward_lane(module, out, flags, (x,)) is NotImplemented
        assert not log._rows and out._backward_hooks is None
        assert forward_lane(module, out, flags, (x,)) is None  # and without them, taken


def test_forward_lane_records_nothing_for_a_thread_that_does_not_record():
    """Another thread's log records; this thread's outputs aren't its."""
    module = torch.nn.GELU()
    module._picklehooks_name = "g"
    with recording_in_another_thread() as log:
        assert forward_lane(module, torch.randn(2), _ops.VALUE | _ops.STATS) is (None if C else NotImplemented)
        _hookrt.forward(module, torch.randn(2), _ops.VALUE | _ops.STATS)  # nor the Python body behind it
    assert not log._rows


def test_grad_recorder_checks_its_arguments_and_hands_over_the_rest():
    recorder = GradRecorder("m", "grad_output", "", _ops.GRAD | _ops.STATS)
    assert (recorder.name, recorder.kind, recorder.path, recorder.flags) == ("m", "grad_output", "",
                                                                              _ops.GRAD | _ops.STATS)
    with pytest.raises(TypeError):
        recorder()
    with pytest.raises(TypeError):
        recorder(torch.randn(2), torch.randn(2))
    with pytest.raises(TypeError):
        GradRecorder("m", "grad_output", "", "7")
    recorder(torch.randn(2))  # no log records: nothing happens, nothing raises
    with picklehooks.record() as log:
        recorder(torch.randn(2).as_subclass(torch.nn.Parameter))  # not a plain tensor: Python's path
        recorder(torch.randn(3))
    assert [(r.module, r.kind, r.shape) for r in log.records] == [("m", "grad_output", (2,)),
                                                                   ("m", "grad_output", (3,))]


def test_errors_in_recording_reach_the_caller(monkeypatch):
    """A failure inside the log is the model's caller's to see, from the forward hook (its lane, or the
    Python body behind it) and the recorder alike."""
    use_lanes(monkeypatch)
    module = torch.nn.GELU()
    module._picklehooks_name = "g"

    def broken(self, *args):
        raise KeyError("broken log")

    x = torch.randn(2, 3)
    with picklehooks.record() as log:
        monkeypatch.setattr(Log, "_add_tensor", broken)
        monkeypatch.setattr(log, "keep_graph", True)  # the row lane declines: Log._add_tensor is called
        with pytest.raises(KeyError, match="broken log"):
            _hookrt.forward(module, x, _ops.VALUE | _ops.STATS)
        with pytest.raises(KeyError, match="broken log"):
            GradRecorder("g", "grad_output", "", _ops.GRAD | _ops.STATS)(x)
        if C:  # numbering fails inside the row lane itself (in Python, _next_call fails its own way)
            monkeypatch.setattr(log, "_calls", None)
            monkeypatch.setattr(log, "keep_graph", False)
            with pytest.raises(TypeError, match="_calls is not a dict"):
                _hookrt.forward(module, x, _ops.VALUE | _ops.STATS)


class Product(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


def _nothing_waits(log: Log) -> bool:
    return not any(log._awaiting_grad.values()) and not any(log._maybe_grad.values())


@pytest.mark.parametrize("lanes", ["lanes", "Python"])
@pytest.mark.parametrize("case", ["outputs only", "guard only", "repeated input"])
def test_values_whose_gradients_nobody_hooks_await_none(monkeypatch, lanes, case):
    """A value that requires grad awaits a gradient only where the eager hooks hook it: training
    loops that record outputs but not their gradients, guards without gradients, and the later
    positions of a tensor given twice (hooked at its first) used to leave a call waiting per
    record, in lists that are never cut back."""
    (use_python_lanes if lanes == "Python" else use_lanes)(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    if case == "repeated input":
        model = torch.nn.Sequential(Product())
        picklehooks.instrument(model, capture=("input", "grad_input"))
        step = lambda: model[0](x, x).sum().backward()  # noqa: E731
    else:
        model = Block()
        kwargs = {"capture": "output"} if case == "outputs only" else {"capture": "output", "on_nonfinite": "raise"}
        picklehooks.instrument(model, **kwargs)
        step = lambda: model(x).pow(2).sum().backward()  # noqa: E731
    with picklehooks.record() as log:
        for _ in range(3):
            step()
    assert log.records and _nothing_waits(log)
    if case == "repeated input":  # both positions recorded; the gradient (the sum) at the first
        assert {(r.kind, r.path) for r in log.records} == {("input", "0"), ("input", "1"), ("grad_input", "0")}
        assert sorted(r.call for r in log.records if r.kind == "grad_input") == [0, 1, 2]


@pytest.mark.parametrize("lanes", ["lanes", "Python"])
@pytest.mark.parametrize("scenario", ["stats", "tensor"])
def test_a_training_step_after_inference_pairs_with_its_own_calls(monkeypatch, lanes, scenario):
    """Calls under no_grad may still get their gradient (reentrant checkpointing recomputes such a
    forward in backward: tests/integrations/test_fsdp.py), so they wait as "maybe"; a later training step's
    gradients pair with that step's own calls first."""
    (use_python_lanes if lanes == "Python" else use_lanes)(monkeypatch)
    torch.manual_seed(0)
    model = Block()
    picklehooks.instrument(model, **SCENARIOS[scenario])
    x = torch.randn(3, 8)
    with picklehooks.record() as log:
        with torch.no_grad():
            for _ in range(3):
                model(x)
        inference = len(log.records)
        model(x).pow(2).sum().backward()
    training = log.records[inference:]
    outputs = {(r.module, r.path, r.call) for r in training if r.kind == "output"}
    grads = [(r.module, r.path, r.call) for r in training if r.kind == "grad_output"]
    assert outputs and min(call for _, _, call in outputs) >= 3  # every module ran 3 times before
    assert len(grads) == len(outputs) and set(grads) <= outputs
    assert not any(log._awaiting_grad.values())
