"""The diagnostics on a model in its other forms: compiled, and loaded from a checkpoint.

Each answer is compared with the same workflow on the eager model (the
scripted forms are tested next to each workflow). ``aot_eager`` keeps the
compile quick: it runs the same Dynamo capture and AOTAutograd graphs as
Inductor, which is what hooks and ops have to survive.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import picklehooks
from picklehooks.diagnostics import dead_units, gradient_conflict, gradient_flow
from tests.diagnostics import test_conflict, test_gradflow, test_units
from tests.models.faults import dead_relu, deep_mlp, two_heads


def compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend="aot_eager")


def reloaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


FORMS = {"compiled": compiled, "checkpoint": reloaded}


@pytest.mark.parametrize("form", FORMS)
def test_dead_units(form):
    model = dead_relu(4)
    picklehooks.instrument(model, capture="output", mode="tensor")
    rows = test_units.by_module(dead_units(FORMS[form](model), test_units.BATCHES))
    assert rows["1"]["dead"] == 4


@pytest.mark.parametrize("form", FORMS)
def test_gradient_flow(form):
    batches = test_gradflow.BATCHES
    want = test_gradflow.flags(gradient_flow(deep_mlp(12, 1e-3, torch.nn.Sigmoid), batches, F.mse_loss, n_inputs=1))
    model = deep_mlp(12, 1e-3, torch.nn.Sigmoid)
    picklehooks.instrument(model, capture=("grad_output",))
    flow = gradient_flow(FORMS[form](model), batches, F.mse_loss, n_inputs=1)
    assert test_gradflow.flags(flow) == want and "vanishing" in want.values()


@pytest.mark.parametrize("form", FORMS)
def test_gradient_conflict(form):
    tasks = {"a": test_conflict.A, "b": lambda out: out[1].mean() - test_conflict.A(out)}
    eager = gradient_conflict(two_heads(), test_conflict.X, tasks)
    model = two_heads()
    picklehooks.instrument(model, capture="all")
    got = gradient_conflict(FORMS[form](model), test_conflict.X, tasks)
    assert got.params == eager.params  # eager names, also for the compiled model
    assert got.matrix[0][1] == pytest.approx(eager.matrix[0][1], abs=1e-6) and eager.matrix[0][1] < 0
