"""The same records from every backend: eager, pickle, package, script, trace, FX, compile, export.

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
import picklehooks.serialize.package
from tests.models import small
from tests.capture.recording import CAPTURE, run, summary
from tests.testutils import REPO, run_fresh

BACKENDS = ["pickle", "package", "script", "script_saveload", "trace", "fx", "compile", "export", "export_saveload"]


def instrumented(name: str, mode: str = "stats"):
    model = small.MODELS[name]()
    handle = picklehooks.instrument(
        model, capture=CAPTURE, example_inputs=small.inputs(name), scriptable=True, mode=mode
    )
    return model, handle


# A value within this fraction of its tensor's absmax is at the level of float32
# rounding in these small models (a sum of a few hundred terms errs by about
# 1e-7 of them), so another backend may compute it as exactly zero or as a
# tiny non-zero. The k-part of the attention's qkv bias gradient is such a
# value: softmax ignores a shift of the keys, so it is 0 in exact arithmetic,
# and eager computes 0.0 and 1e-8 where compile computes only 1e-8.
ROUNDING_LEVEL = 1e-5


def zero_frac_tolerance(tensor: torch.Tensor) -> float:
    """How far another backend's zero_frac may be from this eager tensor's.

    The values within rounding of zero (0 < |x| <= ROUNDING_LEVEL * absmax)
    may become exact zeros; if there are any, the tensor is the result of
    cancellation and its exact zeros may become tiny non-zeros too. A tensor
    with no such values has only structural zeros (ReLU, masks): tolerance 0.
    """
    x = tensor.detach().double().abs().flatten()
    if x.numel() == 0 or not torch.isfinite(x).all():
        return 0.0
    tiny = ROUNDING_LEVEL * x.max().item()
    near = ((x > 0) & (x <= tiny)).sum().item()
    return (near + (x == 0).sum().item()) / x.numel() if near else 0.0


@pytest.fixture(scope="module")
def eager_summaries():
    """Eager-mode summaries, computed once per worker, with each record's zero_frac tolerance."""
    cache = {}

    def get(name):
        if name not in cache:
            model, _ = instrumented(name)
            want = summary(run(model, small.inputs(name)))
            model, _ = instrumented(name, mode="both")  # the same run again, keeping the tensors
            tolerance = {"|".join(map(str, r.key)): zero_frac_tolerance(r.tensor)
                         for r in run(model, small.inputs(name)).records if r.tensor is not None}
            cache[name] = want, tolerance
        return cache[name]

    return get


def child_summary(kind: str, path, tmp_path, inputs) -> dict:
    inputs_path = tmp_path / "inputs.pt"
    torch.save(inputs, inputs_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.capture.recording", kind, str(path), str(inputs_path)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def backend_summary(backend: str, name: str, tmp_path) -> dict:
    model, _ = instrumented(name)
    x = small.inputs(name)
    if backend == "pickle":
        torch.save(model, tmp_path / "model.pt")
        return child_summary("pickle", tmp_path / "model.pt", tmp_path, x)
    if backend == "package":
        picklehooks.serialize.package.save(tmp_path / "model.pt", model)
        return child_summary("package", tmp_path / "model.pt", tmp_path, x)
    if backend in ("script", "script_saveload"):
        scripted = torch.jit.script(model)
        if backend == "script":
            return summary(run(scripted, x))
        torch.jit.save(scripted, tmp_path / "model.pt")
        return child_summary("script", tmp_path / "model.pt", tmp_path, x)
    if backend == "trace":
        return summary(run(torch.jit.trace(model, x), x))
    if backend == "fx":
        return summary(run(torch.fx.symbolic_trace(model), x))
    if backend == "compile":
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="inductor")
        run(compiled, x)  # the graph that records
        compiled(*x)  # the idle graph
        with torch._dynamo.config.patch(error_on_recompile=True):  # from now on: one of the two
            run(compiled, x)
            compiled(*x)
            return summary(run(compiled, x))
    if backend in ("export", "export_saveload"):
        program = torch.export.export(model, x)
        if backend == "export":
            return summary(run(program.module(), x))
        torch.export.save(program, tmp_path / "model.pt2")
        return child_summary("export", tmp_path / "model.pt2", tmp_path, x)
    raise ValueError(backend)


def assert_same_records(got: dict, want: dict, zero_frac_tol: dict | None = None) -> None:
    """Same keys, shapes, dtypes and statistics; zero_frac within the eager tensor's rounding tolerance."""
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got))[:8], sorted(set(got) - set(want))[:8])
    for key, expected in want.items():
        actual = got[key]
        assert actual[:2] == expected[:2], key  # shape, dtype
        for name, a, b in zip(picklehooks.capture.log.STAT_NAMES, actual[2:], expected[2:]):
            if name == "zero_frac":
                # Counts of exact zeros: equal, but for values within rounding of zero.
                tol = (zero_frac_tol or {}).get(key, 0.0)
                assert abs(a - b) <= tol + 1e-12, (key, name, a, b, tol)
                continue
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(a) and math.isnan(b)), (key, name, a, b)


@pytest.mark.parametrize("name", list(small.MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_records_as_eager(backend, name, tmp_path, eager_summaries):
    """Every backend records the same (module, kind, path, call) with the same statistics as eager."""
    want, zero_frac_tol = eager_summaries(name)
    assert {k.split("|")[1] for k in want} >= {"input", "output", "grad_input", "grad_output", "param"}
    assert set(zero_frac_tol) == set(want)
    assert_same_records(backend_summary(backend, name, tmp_path), want, zero_frac_tol)


def test_compile_has_no_graph_breaks():
    """fullgraph=True compiles the instrumented transformer in one graph (it would raise otherwise)."""
    model, _ = instrumented("transformer")
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*small.inputs("transformer"))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_eager_matches_an_uninstrumented_model():
    """Instrumentation doesn't change outputs or gradients."""
    plain, (model, handle) = small.transformer(), instrumented("transformer")
    x = small.inputs("transformer")
    with picklehooks.record():
        a = model(*x)
    b = plain(*x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert handle.skipped == {"block": handle.skipped["block"]}  # the kwarg-called block, for TorchScript


class TestZeroFracTolerance:
    def test_structural_zeros_must_match_exactly(self):
        """A tensor whose zeros come from ReLU or a mask (nothing near zero) gets no tolerance."""
        x = torch.relu(torch.randn(100, generator=torch.Generator().manual_seed(0)))
        assert (x == 0).any() and zero_frac_tolerance(x) == 0.0
        want = {"m|output||0": [[100], "float32", *[0.0] * 8, 0.5]}
        with pytest.raises(AssertionError):
            assert_same_records({"m|output||0": [[100], "float32", *[0.0] * 8, 0.49]}, want, {"m|output||0": 0.0})

    def test_values_within_rounding_of_zero_allow_their_fraction(self):
        """Exact zeros beside values at float32 rounding level (cancellation) may each go either way."""
        x = torch.tensor([0.0, 1e-8, -2e-8, 0.5, -1.0, 2.0])
        assert zero_frac_tolerance(x) == pytest.approx(3 / 6)


# Run in a fresh process: picklehooks chooses how its eager hooks ask "tracing?" once, at import,
# from what torch.compiler and torch.fx offer (see _hookrt._inline_checks).
OLD_TORCH_CHECKS = """
import json, sys, tempfile, types
import torch

hidden = torch.compiler.is_dynamo_compiling
del torch.compiler.is_dynamo_compiling  # as on a torch without it, while picklehooks imports
try:
    import picklehooks
    from picklehooks import _hookrt
    from picklehooks.capture import hookdict as _hookdict
finally:
    torch.compiler.is_dynamo_compiling = hidden
assert _hookrt._dynamo_compiling is _hookrt._tracing, _hookrt._dynamo_compiling
assert isinstance(_hookrt._compiler, types.SimpleNamespace) and _hookdict._compiler is _hookrt._compiler

from tests.models import small
from tests.capture.recording import run, summary
from tests.capture.test_backends import backend_summary, instrumented

name = sys.argv[1]
model, handle = instrumented(name)
x = small.inputs(name)
hooked = [m for m in handle.modules.values() if len(m._forward_hooks)]  # idle, a HookDict is falsy
assert hooked and all(isinstance(m._forward_hooks, _hookdict.HookDict) for m in hooked)
# Idle, an eager hook skips and nn.Module finds no hooks to run; recording, neither.
assert _hookrt.skip() and not any(bool(m._forward_hooks) for m in hooked)
with picklehooks.record():
    assert not _hookrt.skip() and all(bool(m._forward_hooks) for m in hooked)
summaries = {"eager": summary(run(model, x))}
with tempfile.TemporaryDirectory() as tmp:
    for backend in sys.argv[2:]:
        summaries[backend] = backend_summary(backend, name, tmp)
print(json.dumps(summaries))
"""


def test_same_records_where_torch_lacks_the_inline_tracing_checks(eager_summaries):
    """On a torch without is_dynamo_compiling (or the compiling and FX flags), the eager hooks ask
    _tracing() instead, and eager mode and every tracer still record what the usual path records."""
    import types

    from picklehooks import _hookrt

    assert _hookrt._inline_checks(torch.compiler, torch.fx._symbolic_trace)[0] is torch.compiler.is_dynamo_compiling
    lacking = _hookrt._inline_checks(types.SimpleNamespace(is_dynamo_compiling=None), torch.fx._symbolic_trace)
    assert lacking[0] is _hookrt._tracing and not lacking[1]._is_compiling_flag and not lacking[2]._is_fx_tracing_flag

    name, backends = "transformer", ["fx", "trace", "compile", "export"]
    got = json.loads(run_fresh(OLD_TORCH_CHECKS, name, *backends, cwd=REPO, timeout=480).strip().splitlines()[-1])
    want, zero_frac_tol = eager_summaries(name)
    assert sorted(got) == sorted(["eager", *backends])
    for backend, records in got.items():
        assert_same_records(records, want, zero_frac_tol)
