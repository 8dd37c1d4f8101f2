"""Records of traced programs name the line of code that called their module (issue 39, item 1):
``jit.trace``, ``torch.export`` (also saved and loaded in a fresh process) and FX.

The graph carries each call's site (a ``picklehooks::call_site`` op, found while tracing); the
root's line is the one that calls the program. Ground truth: ``inspect.stack()`` in plain pre-hooks
on an un-instrumented copy run in eager mode (``tests.capture.test_sources._expected``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import picklehooks
from tests.capture.test_sources import _check, _expected, _sources_by_key, _three_places_step
from tests.models import small
from tests.testutils import run_fresh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPTURE = ("input", "output", "grad_output", "param")


def _in_form(model, form: str, args: tuple = (), kwargs: dict | None = None):
    if form == "trace":
        if kwargs:
            return torch.jit.trace(model, example_kwarg_inputs=kwargs, strict=False, check_trace=False)
        return torch.jit.trace(model, args)
    return torch.export.export(model, args, kwargs).module()


@pytest.mark.parametrize("form", ["trace", "export"])
def test_three_places_each_call_has_its_line(form):
    """One Identity called from three lines (one in a loop), blocks called in a loop: every record of
    the traced program has its call's line, the root's the line that calls the program."""
    torch.manual_seed(0)
    plain = small.ThreePlaces()
    model = small.ThreePlaces()
    model.load_state_dict(plain.state_dict())
    want = _expected(plain, _three_places_step)
    picklehooks.instrument(model, modules=["", "*"], capture=CAPTURE)
    run = _in_form(model, form, small.inputs("mlp"))
    graph = str(run.inlined_graph) if form == "trace" else run.code  # (jit.trace: a method per module)
    assert graph.count("picklehooks.call_site" if form == "export" else "picklehooks::call_site") == len(want)
    for _ in range(2):
        with picklehooks.record() as log:
            _three_places_step(run)
        _check(log, want)
        assert {r.kind for r in log.records} >= {"input", "output", "grad_output", "param"}
        assert None not in _sources_by_key(log).values()


@pytest.mark.parametrize("form", ["trace", "export"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5", "vit", "resnet"])
def test_real_models_in_traced_forms_record_eager_sources(name, form):
    """The real-model matrix, every module, called with keyword arguments: the traced program's
    records name what plain hooks in eager mode see as each call's line."""
    pytest.importorskip("transformers")
    from tests.models import hf

    batch = hf.inputs(name)

    def step(model):
        hf.step_loss(model(**batch)).backward()

    try:
        _in_form(hf.build(name), form, (), batch)
    except Exception as exc:  # the forms a model supports are the model's business, not ours
        pytest.skip(f"{name} doesn't run as {form} even un-instrumented: {type(exc).__name__}")
    want = _expected(hf.build(name), step)
    model = hf.build(name)
    picklehooks.instrument(model, modules=["", "*"], capture=("input", "output", "grad_output"))
    run = _in_form(model, form, (), batch)
    with picklehooks.record() as log:
        step(run)
    _check(log, want)
    assert None not in _sources_by_key(log).values()


_CHILD = """
import json, sys, torch, picklehooks
sys.path.insert(0, {repo!r})
from tests.capture.test_sources import _three_places_step
form, path = sys.argv[1:3]
model = torch.jit.load(path) if form == "trace" else torch.export.load(path).module()
with picklehooks.record() as log:
    _three_places_step(model)  # the same calling line as in the parent
print(json.dumps(sorted(["|".join(map(str, r.key)), r.source] for r in log.records)))
"""


@pytest.mark.parametrize("form", ["trace", "export"])
def test_a_saved_program_loaded_in_a_fresh_process_records_the_same_sources(form, tmp_path):
    """Carried by the saved program (its ops' arguments), not looked up where it loads: the child
    has no instrumented model, only the file."""
    torch.manual_seed(0)
    plain = small.ThreePlaces()
    model = small.ThreePlaces()
    model.load_state_dict(plain.state_dict())
    want = _expected(plain, _three_places_step)
    picklehooks.instrument(model, modules=["", "*"], capture=("output", "grad_output"))
    x = small.inputs("mlp")
    path = tmp_path / ("model.pt" if form == "trace" else "model.pt2")
    if form == "trace":
        torch.jit.save(torch.jit.trace(model, x), path)
    else:
        torch.export.save(torch.export.export(model, x), path)
    got = json.loads(run_fresh(_CHILD.format(repo=REPO), form, str(path), cwd=REPO).strip().splitlines()[-1])
    assert got and all(source == want[(key.split("|")[0], int(key.split("|")[3]))] for key, source in got)


def test_fx_names_the_calls_it_traces_through_and_no_other():
    """FX traces through a user's module (its hooks run while tracing: the graph gets their sites) and
    calls torch.nn's leaf modules from the ``forward`` it generates, keeping no line for them: those
    records have no source, rather than a wrong one."""
    torch.manual_seed(0)
    plain = small.ThreePlaces()
    model = small.ThreePlaces()
    model.load_state_dict(plain.state_dict())
    want = _expected(plain, _three_places_step)
    picklehooks.instrument(model, capture=("input", "output"))
    traced = torch.fx.symbolic_trace(model)
    with picklehooks.record() as log:
        _three_places_step(traced)
    got = _sources_by_key(log)
    traced_through = {k: v for k, v in got.items() if k[0] in ("stages.0", "stages.1")}
    assert len(traced_through) == 4
    assert all(v == want[(k[0], k[3])] for k, v in traced_through.items())
    assert all(v is None for k, v in got.items() if k not in traced_through)
