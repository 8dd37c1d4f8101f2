"""compare finds the layer a transformation changed, and measures backends and quantization."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.diagnostics import compare, record_forward
from tests.models.faults import compare_mlp

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
LAYERS = ["0", "1", "2", "3", "4"]


def instrumented(mode="tensor"):
    model = compare_mlp()
    picklehooks.instrument(model, capture=("output",), mode=mode, example_inputs=(X,), scriptable=True)
    return model


@pytest.mark.parametrize("k", [0, 2, 4])
def test_perturbed_bias_is_the_first_divergence(k):
    model = instrumented()
    changed = copy.deepcopy(model)  # the hooks come along
    with torch.no_grad():
        changed[k].bias += 0.1
    result = compare(record_forward(model, X), record_forward(changed, X))
    assert result.basis == "tensor" and result.missing == result.extra == []
    assert [row["module"] for row in result.rows] == LAYERS
    assert result.first_divergence["module"] == str(k)
    for row in result.rows[:k]:
        assert (row["max_abs"], row["rel_err"], row["sqnr_db"], row["cosine"], row["diverged"]) == (
            0.0, 0.0, math.inf, 1.0, False)
    row = result.rows[k]
    assert row["max_abs"] == pytest.approx(0.1, rel=1e-5) and 0 < row["sqnr_db"] < math.inf


def test_plain_models_are_instrumented_for_the_call():
    model, changed = compare_mlp(), compare_mlp()
    with torch.no_grad():
        changed[2].bias += 0.1
    result = compare(record_forward(model, X), record_forward(changed, X))
    assert result.first_divergence["module"] == "2"
    assert not any(m._forward_hooks for m in model.modules())


def test_eager_script_fx_compile_agree():
    """Scripted, FX-traced and compiled versions of the instrumented model match eager layer by layer."""
    model = instrumented()
    eager = record_forward(model, X)
    compiled = torch.compile(model, fullgraph=True)
    for other in (torch.jit.script(model), torch.fx.symbolic_trace(model), compiled):
        result = compare(eager, record_forward(other, X))
        assert len(result.rows) == 5 and result.first_divergence is None
        # Inductor may fuse and reorder float operations, so allow rounding-level differences.
        assert all(row["max_abs"] <= 1e-5 and row["rel_err"] <= 1e-5 for row in result.rows)


def test_dynamic_quantization():
    """quantize_dynamic swaps Linear modules (copying their hooks but not their names, so instrument the copy)."""
    model = compare_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated; it still works
        quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    result = compare(record_forward(model, X), record_forward(quantized, X), tol=1e-4)
    assert [row["module"] for row in result.rows] == LAYERS and result.first_divergence["module"] == "0"
    for row in result.rows:
        assert 0 < row["max_abs"] < 0.1 and 10 < row["sqnr_db"] < math.inf and row["cosine"] > 0.99


def test_stats_only_logs_are_compared_by_statistics():
    model = instrumented(mode="stats")
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed[2].bias += 0.1
    result = compare(record_forward(model, X), record_forward(changed, X))
    assert result.basis == "stats" and result.first_divergence["module"] == "2"
    assert all(row["rel_err"] == 0 for row in result.rows[:2]) and result.rows[2]["mean_diff"] == pytest.approx(0.1)
    # The bound holds (up to the float32 statistics): it never exceeds the true relative error.
    exact = compare(record_forward(compare_mlp(), X), record_forward(changed_plain(), X))
    assert all(s["rel_err"] <= t["rel_err"] * (1 + 1e-5) for s, t in zip(result.rows, exact.rows))


def changed_plain():
    model = compare_mlp()
    with torch.no_grad():
        model[2].bias += 0.1
    return model


def test_missing_and_extra_records():
    longer = nn.Sequential(*compare_mlp(), nn.ReLU())
    result = compare(record_forward(compare_mlp(), X), record_forward(longer, X))
    assert result.missing == [] and result.extra == [("5", "output", "", 0)] and result.first_divergence is None
    result = compare(record_forward(longer, X), record_forward(compare_mlp(), X))
    assert result.missing == [("5", "output", "", 0)] and len(result.rows) == 5


def test_shape_mismatch_diverges():
    other = compare_mlp()
    other[4] = nn.Linear(16, 3)
    result = compare(record_forward(compare_mlp(), X), record_forward(other, X))
    assert result.first_divergence["module"] == "4" and "shape" in result.first_divergence["note"]


def test_saved_logs(tmp_path):
    record_forward(compare_mlp(), X).save(tmp_path / "a")
    record_forward(changed_plain(), X).save(tmp_path / "b")
    result = compare(picklehooks.Log.load(tmp_path / "a"), picklehooks.Log.load(tmp_path / "b"))
    assert result.basis == "tensor" and result.first_divergence["module"] == "2"


def test_errors():
    log = record_forward(compare_mlp(), X)
    with pytest.raises(picklehooks.PicklehooksError, match="'outputs'"):
        compare(log, log, kinds=("outputs",))
    with pytest.raises(picklehooks.PicklehooksError, match="no tensor records"):
        compare(log, log, kinds=("input",))
