"""gradient_conflict: opposite tasks have cosine -1, tasks on disjoint features of a shared trunk cosine 0."""

from __future__ import annotations

import math

import pytest
import torch

import picklehooks
from picklehooks.diagnostics import gradient_conflict
from tests.models.faults import two_heads

X = (torch.randn(16, 4, generator=torch.Generator().manual_seed(0)),)
A = lambda out: out[0].pow(2).mean()  # noqa: E731
B = lambda out: out[1].pow(2).mean()  # noqa: E731


def test_opposite_tasks():
    report = gradient_conflict(two_heads(), X, {"a": A, "neg_a": lambda out: -A(out)})
    assert report.tasks == ["a", "neg_a"]
    assert report.matrix[0][1] == report.matrix[1][0] == pytest.approx(-1.0, abs=1e-12)
    assert report.norms["a"] == pytest.approx(report.norms["neg_a"]) and report.losses["neg_a"] == -report.losses["a"]
    # Only task a's parameters are touched by both: the trunk feeding head a, and head a.
    assert report.params == ["trunk.weight", "trunk.bias", "head_a.weight", "head_a.bias"]


def test_disjoint_heads_on_a_shared_trunk_are_orthogonal():
    """Head a reads trunk features 0-1, head b features 2-3: their trunk gradients have disjoint rows."""
    report = gradient_conflict(two_heads(), X, {"a": A, "b": B})
    assert report.params == ["trunk.weight", "trunk.bias"]  # the heads are not shared
    assert report.matrix == [[1.0, 0.0], [0.0, 1.0]]
    assert report.rows == [{"task_a": "a", "task_b": "b", "cosine": 0.0,
                            "norm_a": report.norms["a"], "norm_b": report.norms["b"]}]
    assert [row["module"] for row in report.layers] == ["trunk"]


def test_three_tasks_and_chosen_params():
    model = two_heads()
    losses = {"a": A, "b": B, "both": lambda out: A(out) + B(out)}
    report = gradient_conflict(model, X, losses, params=[model.trunk.weight])
    assert report.params == ["trunk.weight"] and len(report.rows) == 3
    cos = {(r["task_a"], r["task_b"]): r["cosine"] for r in report.rows}
    assert cos[("a", "b")] == 0.0 and 0 < cos[("a", "both")] < 1 and 0 < cos[("b", "both")] < 1
    # "both" = a + b with a ⟂ b: its squared norm is the sum of theirs.
    assert report.norms["both"] ** 2 == pytest.approx(report.norms["a"] ** 2 + report.norms["b"] ** 2)


def test_a_task_without_gradient_has_nan_cosine():
    report = gradient_conflict(two_heads(), X, {"a": A, "b": B, "zero": lambda out: out[0].sum() * 0},
                               params=["trunk.weight"])
    assert report.norms["zero"] == 0 and math.isnan(report.matrix[2][2]) and math.isnan(report.matrix[0][2])


def test_scripted_and_instrumented_models_agree_with_eager():
    eager = gradient_conflict(two_heads(), X, {"a": A, "b": lambda out: out[1].mean() - A(out)})
    model = two_heads()
    picklehooks.instrument(model, capture="all", example_inputs=X, scriptable=True)
    scripted = gradient_conflict(torch.jit.script(model), X, {"a": A, "b": lambda out: out[1].mean() - A(out)})
    assert scripted.params == eager.params
    assert scripted.matrix[0][1] == pytest.approx(eager.matrix[0][1], abs=1e-6) and eager.matrix[0][1] < 0


def test_errors():
    with pytest.raises(picklehooks.PicklehooksError, match="two or more"):
        gradient_conflict(two_heads(), X, {"a": A})
    with pytest.raises(picklehooks.PicklehooksError, match="'nope' is not a trainable parameter"):
        gradient_conflict(two_heads(), X, {"a": A, "b": B}, params=["nope"])
    with pytest.raises(picklehooks.PicklehooksError, match="share nothing"):
        gradient_conflict(two_heads(), X, {"a": lambda out: out[0].sum() * 0, "b": B})
    with pytest.raises(picklehooks.PicklehooksError, match="scalar"):
        gradient_conflict(two_heads(), X, {"a": lambda out: out[0], "b": B})
