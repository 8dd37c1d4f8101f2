"""The framework-free core of the training callbacks (``picklehooks.integrations._training``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from picklehooks import _state
from picklehooks.integrations._training import StepRecorder, summaries


def test_a_failing_cleanup_never_hides_the_training_error(monkeypatch):
    core = StepRecorder(modules=["0"])
    model = nn.Sequential(nn.Linear(2, 2))
    core.start(model)
    core.begin_step(0, True)
    core.activate()
    model(torch.randn(1, 2))

    def broken():
        raise OSError("disk full")

    monkeypatch.setattr(core, "finish", broken)
    error = RuntimeError("boom")
    core.fail(error, 0)  # must not raise: the trainer re-raises the user's error
    assert any("disk full" in note for note in error.__notes__)
    assert _state.active() is None and not _state._ANYWHERE


def test_summaries_pool_a_steps_calls_per_layer_and_kind():
    core = StepRecorder(modules=["0"], capture=("output",))
    model = nn.Sequential(nn.Linear(3, 3))
    core.start(model)
    core.begin_step(5, True)
    xs = [torch.randn(2, 3), torch.randn(4, 3)]
    core.activate()
    for x in xs:
        model(x)
    values = core.end_step()
    outs = [nn.functional.linear(x, model[0].weight, model[0].bias).double() for x in xs]
    assert values["picklehooks/output/norm/0"] == pytest.approx(
        torch.cat([o.reshape(-1) for o in outs]).norm().item(), rel=1e-6)
    assert values["picklehooks/output/absmax/0"] == pytest.approx(
        max(o.abs().max().item() for o in outs), rel=1e-6)
    assert summaries([]) == {}
    core.finish()
