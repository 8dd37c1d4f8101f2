"""dead_units counts exactly the units planted dead (negative bias) or saturated (huge weights)."""

from __future__ import annotations

import pytest
import torch

import picklehooks
from picklehooks.diagnostics import dead_units
from tests.models.faults import dead_channels, dead_relu, saturated_tanh

G = torch.Generator().manual_seed(0)
BATCHES = [(torch.rand(32, 8, generator=G) * 2 - 1,) for _ in range(4)]  # inputs in [-1, 1]


def by_module(rows):
    return {row["module"]: row for row in rows}


@pytest.mark.parametrize("dead", [0, 3, 7])
def test_negative_bias_kills_exactly_those_units(dead):
    model = dead_relu(dead, units=16)
    row = by_module(dead_units(model, BATCHES))["1"]
    assert (row["type"], row["criterion"], row["units"], row["batches"]) == ("ReLU", "never active", 16, 4)
    assert row["dead"] == dead and row["dead_frac"] == dead / 16 and row["indices"] == list(range(dead))
    assert not any(hasattr(m, "_picklehooks_name") or m._forward_hooks for m in model.modules())


def test_channels_are_units_of_a_conv_output():
    batches = [(torch.randn(4, 3, 8, 8, generator=G),) for _ in range(2)]
    row = by_module(dead_units(dead_channels(2, channels=6), batches))["1"]
    assert (row["units"], row["dead"], row["indices"]) == (6, 2, [0, 1])


def test_tanh_saturation():
    rows = by_module(dead_units(saturated_tanh(5, units=16), BATCHES))
    tanh = rows["1"]
    assert (tanh["type"], tanh["criterion"], tanh["saturated"], tanh["indices"]) == ("Tanh", "always saturated", 5,
                                                                                     [0, 1, 2, 3, 4])
    assert tanh["saturated_frac"] == 5 / 16
    assert rows["3"]["type"] == "Sigmoid"  # also checked; its units vary with the input


def test_a_unit_alive_in_any_batch_is_not_dead():
    model = dead_relu(0, units=16)
    with torch.no_grad():  # unit 0 fires only when x[:, 0] > 0.5
        model[0].weight[0] = 0
        model[0].weight[0, 0], model[0].bias[0] = 1.0, -0.5
    quiet, firing = torch.zeros(4, 8), torch.zeros(1, 8)
    firing[0, 0] = 1.0
    assert 0 in by_module(dead_units(model, [(quiet,)]))["1"]["indices"]
    assert 0 not in by_module(dead_units(model, [(quiet,), (firing,)]))["1"]["indices"]


def test_modules_narrows_the_layers():
    rows = dead_units(saturated_tanh(5), BATCHES, modules=[torch.nn.Tanh])
    assert [row["module"] for row in rows] == ["1"]


def test_scripted_instrumented_model():
    model = dead_relu(4)
    picklehooks.instrument(model, capture="output", mode="tensor", example_inputs=BATCHES[0], scriptable=True)
    scripted = torch.jit.script(model)
    assert by_module(dead_units(scripted, BATCHES))["1"]["dead"] == 4


def test_stats_only_instrumentation_is_refused():
    model = dead_relu(4)
    picklehooks.instrument(model, capture="output", mode="stats")
    with pytest.raises(picklehooks.PicklehooksError, match="mode='tensor'"):
        dead_units(model, BATCHES)


def test_bad_batches():
    with pytest.raises(picklehooks.PicklehooksError, match="batch 0 is a str .*tuple.*dict.*single tensor"):
        dead_units(dead_relu(1), ["x"])
    with pytest.raises(picklehooks.PicklehooksError, match="iterable of batches, got one Tensor"):
        dead_units(dead_relu(1), torch.zeros(2, 8))
    with pytest.raises(picklehooks.PicklehooksError, match="no batches"):
        dead_units(dead_relu(1), [])
