"""gradient_flow flags the layers of a network built to vanish, or to explode, and nothing in a healthy one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import picklehooks
from picklehooks.diagnostics import flow_from_log, gradient_flow
from tests.models.faults import NaNGrad, deep_mlp, mlp_with

G = torch.Generator().manual_seed(0)
BATCHES = [(torch.randn(8, 16, generator=G), torch.randn(8, 16, generator=G)) for _ in range(3)]


def flags(flow):
    return {row["module"]: row["flag"] for row in flow.rows}


def test_vanishing():
    """12 x (Linear with weights x 1e-3, Sigmoid): the gradient shrinks ~1e-4 per layer on its way down."""
    flow = gradient_flow(deep_mlp(12, 1e-3, torch.nn.Sigmoid), BATCHES, F.mse_loss, n_inputs=1)
    got = flags(flow)
    assert flow.layers == [str(i) for i in range(24)] and flow.reference == "23" and flow.steps == 3
    assert all(got[str(i)] == "vanishing" for i in range(12))  # the early layers
    assert got["23"] is None and got["22"] is None
    assert {row["flag"] for row in flow.flagged} == {"vanishing"}


def test_exploding():
    """8 x Linear with weights x 10: the gradient grows ~6x per layer on its way down."""
    flow = gradient_flow(deep_mlp(8, 10.0), BATCHES, F.mse_loss, n_inputs=1)
    got = flags(flow)
    assert got["0"] == got["1"] == "exploding" and got["7"] is None
    assert {row["flag"] for row in flow.flagged} == {"exploding"}
    assert flow.rows[0]["ratio"] > 1e3


def test_healthy_network_has_no_flags():
    flow = gradient_flow(deep_mlp(4, 1.0, torch.nn.Tanh), BATCHES, F.mse_loss, n_inputs=1)
    assert flow.flagged == []


def test_nonfinite_gradient_is_flagged():
    batches = [(torch.randn(3, 4, generator=G),)]
    flow = gradient_flow(mlp_with(NaNGrad(), 3), batches, lambda out: out.pow(2).mean())
    got = flags(flow)
    assert got["2"] == got["0"] == "non-finite" and got["5"] is None


def test_optimizer_trains_and_no_optimizer_leaves_grads_alone():
    model = deep_mlp(3, 1.0, torch.nn.Tanh)
    before = [p.detach().clone() for p in model.parameters()]
    gradient_flow(model, BATCHES, F.mse_loss, n_inputs=1)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    flow = gradient_flow(model, BATCHES * 10, F.mse_loss, n_inputs=1,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert flow.losses[-3] < flow.losses[0] and len(flow.norms["0"]) == 30  # the same batch, 9 epochs later


def test_from_a_scripted_model_and_from_its_log():
    model = deep_mlp(12, 1e-3, torch.nn.Sigmoid)
    picklehooks.instrument(model, capture=("grad_output",), example_inputs=BATCHES[0][:1], scriptable=True)
    scripted = torch.jit.script(model)
    flow = gradient_flow(scripted, BATCHES, F.mse_loss, n_inputs=1)
    assert flags(flow) == flags(gradient_flow(model, BATCHES, F.mse_loss, n_inputs=1))
    with picklehooks.record() as log:
        for x, y in BATCHES:
            F.mse_loss(scripted(x), y).backward()
            log.next_step()
    assert flags(flow_from_log(log)) == flags(flow)


def test_errors():
    model = deep_mlp(2, 1.0)
    picklehooks.instrument(model, capture="output")
    with pytest.raises(picklehooks.PicklehooksError, match="grad_output"):
        gradient_flow(model, BATCHES, F.mse_loss, n_inputs=1)
    with pytest.raises(picklehooks.PicklehooksError, match="vanish=-1"):
        gradient_flow(deep_mlp(2, 1.0), BATCHES, F.mse_loss, n_inputs=1, vanish=-1)
    with pytest.raises(picklehooks.PicklehooksError, match="scalar"):
        gradient_flow(deep_mlp(2, 1.0), BATCHES, lambda out, y: out - y, n_inputs=1)
