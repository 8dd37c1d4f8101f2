"""The same records from every backend: eager, pickle, package, script, FX, compile, export.

Each test instruments a fresh model, runs it through one backend (in a
fresh process where the backend crosses one), and compares every record
(module, kind, path, call) and its statistics with eager mode.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
import torch._dynamo

import picklehooks
import picklehooks.package
from tests import models
from tests.recording import CAPTURE, run, summary
from tests.testutils import REPO

BACKENDS = ["pickle", "package", "script", "script_saveload", "fx", "compile", "export", "export_saveload"]


def instrumented(name: str):
    model = models.MODELS[name]()
    handle = picklehooks.instrument(model, capture=CAPTURE, example_inputs=models.inputs(name), scriptable=True)
    return model, handle


@pytest.fixture(scope="module")
def eager_summaries():
    """Eager-mode summaries, computed once per worker."""
    cache = {}

    def get(name):
        if name not in cache:
            model, _ = instrumented(name)
            cache[name] = summary(run(model, models.inputs(name)))
        return cache[name]

    return get


def child_summary(kind: str, path, tmp_path, inputs) -> dict:
    inputs_path = tmp_path / "inputs.pt"
    torch.save(inputs, inputs_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.recording", kind, str(path), str(inputs_path)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def backend_summary(backend: str, name: str, tmp_path) -> dict:
    model, _ = instrumented(name)
    x = models.inputs(name)
    if backend == "pickle":
        torch.save(model, tmp_path / "model.pt")
        return child_summary("pickle", tmp_path / "model.pt", tmp_path, x)
    if backend == "package":
        picklehooks.package.save(tmp_path / "model.pt", model)
        return child_summary("package", tmp_path / "model.pt", tmp_path, x)
    if backend in ("script", "script_saveload"):
        scripted = torch.jit.script(model)
        if backend == "script":
            return summary(run(scripted, x))
        torch.jit.save(scripted, tmp_path / "model.pt")
        return child_summary("script", tmp_path / "model.pt", tmp_path, x)
    if backend == "fx":
        return summary(run(torch.fx.symbolic_trace(model), x))
    if backend == "compile":
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="inductor")
        run(compiled, x)  # compile once, recording on
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(*x)  # recording off: must reuse the same graph
            return summary(run(compiled, x))
    if backend in ("export", "export_saveload"):
        program = torch.export.export(model, x)
        if backend == "export":
            return summary(run(program.module(), x))
        torch.export.save(program, tmp_path / "model.pt2")
        return child_summary("export", tmp_path / "model.pt2", tmp_path, x)
    raise ValueError(backend)


def assert_same_records(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got))[:8], sorted(set(got) - set(want))[:8])
    for key, expected in want.items():
        actual = got[key]
        assert actual[:2] == expected[:2], key  # shape, dtype
        for name, a, b in zip(picklehooks.log.STAT_NAMES, actual[2:], expected[2:]):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(a) and math.isnan(b)), (key, name, a, b)


@pytest.mark.parametrize("name", list(models.MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_records_as_eager(backend, name, tmp_path, eager_summaries):
    """Every backend records the same (module, kind, path, call) with the same statistics as eager."""
    want = eager_summaries(name)
    assert {k.split("|")[1] for k in want} >= {"input", "output", "grad_input", "grad_output", "param"}
    assert_same_records(backend_summary(backend, name, tmp_path), want)


def test_compile_has_no_graph_breaks():
    """fullgraph=True compiles the instrumented transformer in one graph (it would raise otherwise)."""
    model, _ = instrumented("transformer")
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*models.inputs("transformer"))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_eager_matches_an_uninstrumented_model():
    """Instrumentation doesn't change outputs or gradients."""
    plain, (model, handle) = models.transformer(), instrumented("transformer")
    x = models.inputs("transformer")
    with picklehooks.record():
        a = model(*x)
    b = plain(*x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert handle.skipped == {"block": handle.skipped["block"]}  # the kwarg-called block, for TorchScript
