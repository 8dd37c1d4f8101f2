"""Idle hooks cost nothing: instrumented modules take nn.Module's hook-free path while nothing records."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks import _hookrt
from picklehooks.capture import hookdict as _hookdict


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def skip_calls(monkeypatch) -> list:
    """Every call of the generated hooks' first step, ``_hookrt.skip``."""
    calls = []
    real = _hookrt.skip

    def counting(flags=0):
        calls.append(flags)
        return real(flags)

    monkeypatch.setattr(_hookrt, "skip", counting)
    return calls


def test_torch_skips_hooks_exactly_when_the_dict_is_falsy():
    # The private behaviour of nn.Module._call_impl this relies on; if torch changes it,
    # this fails and instrument() quietly keeps plain dictionaries.
    assert _hookdict.works()


def test_idle_hooks_are_not_called_and_recording_ones_are(skip_calls):
    model = _model()
    picklehooks.instrument(model, capture="all")
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert skip_calls == []
    with picklehooks.record() as log:
        model(x).sum().backward()
    assert skip_calls, "hooks did not run while recording"
    assert {r.module for r in log.records} == {"0", "1", "2"}


def test_a_users_hook_still_runs_while_idle():
    model = _model()
    seen = []
    before = model[0].register_forward_hook(lambda *_: seen.append("before"))
    picklehooks.instrument(model)
    after = model[2].register_forward_hook(lambda *_: seen.append("after"))
    pre = model[1].register_forward_pre_hook(lambda *_: seen.append("pre"))
    model(torch.randn(3, 4))
    assert seen == ["before", "pre", "after"]
    for h in (before, after, pre):
        h.remove()
    seen.clear()
    model(torch.randn(3, 4))
    assert seen == []


def test_guards_and_profiler_ranges_run_while_idle():
    model = _model()
    picklehooks.instrument(model, on_nonfinite="raise")
    with pytest.raises(picklehooks.NonfiniteError):
        model(torch.full((3, 4), float("nan")))
    model = _model()
    picklehooks.instrument(model, profile=True)
    with torch.profiler.profile() as prof:
        model(torch.randn(3, 4))
    assert any(e.name == "module:0" for e in prof.events())


def test_pickles_and_copies_as_plain_dicts_that_still_record():
    model = _model()
    picklehooks.instrument(model)
    assert isinstance(model[0]._forward_hooks, _hookdict.HookDict)
    data = pickle.dumps(model)
    assert b"_hookdict" not in data and b"HookDict" not in data
    for other in (pickle.loads(data), copy.deepcopy(model)):
        assert type(other[0]._forward_hooks) is OrderedDict
        buffer = io.BytesIO()
        torch.save(other, buffer)
        x = torch.randn(3, 4)
        with picklehooks.record() as log:
            other(x)
        expected = other[2](other[1](other[0](x)))
        out = log.find("2", "output")[0].stats
        assert out["mean"] == pytest.approx(expected.double().mean().item(), rel=1e-6, abs=1e-9)


def test_remove_restores_plain_dicts():
    model = _model()
    handle = picklehooks.instrument(model)
    handle.remove()
    for m in model:
        assert type(m._forward_hooks) is OrderedDict and not m._forward_hooks
        assert type(m._forward_pre_hooks) is OrderedDict


@pytest.mark.parametrize("compiled_while", ["idle", "recording"])
def test_compiled_model_records_and_does_not_recompile_when_recording_toggles(compiled_while):
    """A graph for each recording state, whichever was compiled first (while a log records,
    HookDict has no __bool__ of its own); after one call in each, toggling compiles nothing and
    it records every time it records."""
    torch._dynamo.reset()
    model = _model()
    picklehooks.instrument(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(3, 4)
    logs = []
    for recording in [compiled_while == "recording", compiled_while == "idle"]:
        with picklehooks.record() if recording else contextlib.nullcontext():
            compiled(x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for recording in ([False, True, False, True] if compiled_while == "idle" else [True, False, True]):
            if recording:
                with picklehooks.record() as log:
                    compiled(x)
                logs.append(log)
            else:
                compiled(x)
    assert [{r.module for r in log.records} for log in logs] == [{"0", "1", "2"}] * 2


def test_switch_turns_it_off():
    code = ("import torch, picklehooks\nfrom collections import OrderedDict\n"
            "m = torch.nn.Linear(2, 2)\npicklehooks.instrument(m, modules=[''])\n"
            "print(type(m._forward_hooks) is OrderedDict)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PICKLEHOOKS_IDLE_HOOKS": "0"})
    assert out.stdout.strip() == "True"


def test_idle_scripted_hooks_return_before_any_recording_op(monkeypatch):
    """A scripted model asks the ``active`` op first: while idle no record or tap op runs; recording, they do."""
    from picklehooks import _ops

    kernels = []  # every recording kernel looks for the log first: the record op, and the others
    real_active, real_deliver = _ops._active_log, _ops._deliver
    monkeypatch.setattr(_ops, "_active_log", lambda: kernels.append("record") or real_active())
    monkeypatch.setattr(_ops, "_deliver", lambda *args, **kwargs: kernels.append(args[2]) or real_deliver(*args, **kwargs))
    x = torch.randn(3, 4, requires_grad=True)
    model = _model()
    picklehooks.instrument(model, capture="all", scriptable=True, example_inputs=(x,))
    scripted = torch.jit.script(model)
    scripted(x).sum().backward()
    assert kernels == []
    with picklehooks.record() as log:
        scripted(x).sum().backward()
    assert "record" in kernels and "grad_output" in kernels
    assert {"0", "1", "2"} <= {r.module for r in log.records}
    assert {"input", "output", "param", "grad_output"} <= {r.kind for r in log.records}


def test_truth_is_tested_in_c_while_any_log_records():
    """While a log records anywhere, HookDict has no Python ``__bool__`` (three calls per module call
    saved); it comes back when the last log stops, also when a recorded forward raised, and idle
    hooks are skipped again."""
    model = _model()
    picklehooks.instrument(model)
    x = torch.randn(3, 4)
    assert "__bool__" in _hookdict.HookDict.__dict__ and not model[0]._forward_hooks
    with picklehooks.record():
        assert "__bool__" not in _hookdict.HookDict.__dict__ and model[0]._forward_hooks
        with picklehooks.record():  # nested: the outer one still records after the inner one stops
            pass
        assert "__bool__" not in _hookdict.HookDict.__dict__
        assert not _hookdict.HookDict(), "an empty dictionary must stay false"
    assert "__bool__" in _hookdict.HookDict.__dict__ and not model[0]._forward_hooks
    with pytest.raises(RuntimeError, match="boom"):
        with picklehooks.record():
            raise RuntimeError("boom")
    assert "__bool__" in _hookdict.HookDict.__dict__ and not model[0]._forward_hooks
    with picklehooks.record() as log:
        model(x)
    assert {r.module for r in log.records} == {"0", "1", "2"}


def test_dictionaries_left_empty_stay_plain():
    """A module whose pre-hooks aren't needed keeps a plain (C-tested) pre-hook dictionary."""
    model = _model()
    picklehooks.instrument(model)  # outputs and their gradients: forward hooks only
    for m in model:
        assert type(m._forward_pre_hooks) is OrderedDict and not m._forward_pre_hooks
        assert type(m._forward_hooks) is _hookdict.HookDict
    model = _model()
    picklehooks.instrument(model, capture="input")
    assert all(type(m._forward_pre_hooks) is _hookdict.HookDict for m in model)


def test_hooks_generated_by_earlier_versions_record_the_same():
    """Earlier versions' hook text asked ``_rt.skip`` before ``_rt.forward``/``_rt.pre_kw``; saved
    models still carry it. Hooks built from that text record what today's do."""
    from picklehooks.capture.instrument import _hook

    x = torch.randn(3, 4)
    logs = []
    for old in (False, True):
        model = _model()
        picklehooks.instrument(model, capture="all", example_inputs=(x,))
        if old:
            for m in model:
                for hooks in (m._forward_hooks, m._forward_pre_hooks):
                    for key, hook in list(hooks.items()):
                        text = picklehooks.serialize.codec.decode(hook.__name__)
                        head, call = text.split("return _rt.", 1)
                        flags = next(a for a in call.split("(", 1)[1].split(", ") if a.isdigit())
                        indent = head.rsplit("\n", 1)[1]
                        hooks[key] = _hook(f"{head}if _rt.skip({flags}):\n{indent}    return None\n"
                                           f"{indent}return _rt.{call}")
                        assert "_rt.skip(" in picklehooks.serialize.codec.decode(hooks[key].__name__)
        with picklehooks.record() as log:
            model(x).sum().backward()
        logs.append({r.key: r.stats for r in log.records})
    assert logs[0] and logs[0].keys() == logs[1].keys()
    for key, stats in logs[0].items():  # the same model, input and arithmetic: equal to rounding
        other = logs[1][key]
        assert {k: v for k, v in stats.items() if not isinstance(v, float)} == \
            {k: v for k, v in other.items() if not isinstance(v, float)}, key
        for name, value in stats.items():
            if isinstance(value, float):
                assert value == pytest.approx(other[name], rel=1e-6, abs=1e-9), (key, name)

