"""Records of traced and scripted programs name the line of code that called their module (issue 39,
item 1): ``jit.trace``, ``torch.export`` and ``jit.script`` (also saved and loaded in a fresh
process) and FX.

A traced graph carries each call's site (a ``picklehooks::call_site`` op, found while tracing); a
scripted program's sites are read off its graphs (the source ranges of its ``forward`` calls); the
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
    if form == "script":
        return torch.jit.script(model)
    if form == "trace":
        if kwargs:
            return torch.jit.trace(model, example_kwarg_inputs=kwargs, strict=False, check_trace=False)
        return torch.jit.trace(model, args)
    return torch.export.export(model, args, kwargs).module()


def _two_three_places() -> tuple:
    """Two ``ThreePlaces`` with the same weights: the plain one (for the ground truth) and one to instrument."""
    torch.manual_seed(0)
    plain, model = small.ThreePlaces(), small.ThreePlaces()
    model.load_state_dict(plain.state_dict())
    return plain, model


@pytest.mark.parametrize("form", ["trace", "export", "script"])
def test_three_places_each_call_has_its_line(form):
    """One Identity called from three lines (one in a loop), blocks called in a loop: every record of
    the traced program has its call's line, the root's the line that calls the program."""
    plain, model = _two_three_places()
    want = _expected(plain, _three_places_step)
    picklehooks.instrument(model, modules=["", "*"], capture=CAPTURE, scriptable=form == "script")
    run = _in_form(model, form, small.inputs("mlp"))
    if form != "script":  # one op per module call, in the graph (jit.trace: a method per module)
        graph = str(run.inlined_graph) if form == "trace" else run.code
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
    plain, model = _two_three_places()
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
    plain, model = _two_three_places()
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


@pytest.mark.parametrize("name", sorted(small.MODELS))
def test_scripted_models_record_eager_sources(name):
    """The small models (an MLP, a CNN, a transformer encoder layer: torch's own modules calling
    theirs; a module called twice), instrumented ``scriptable=True`` and scripted: every record."""
    torch.manual_seed(0)
    plain = small.MODELS[name]()
    model = small.MODELS[name]()
    model.load_state_dict(plain.state_dict())
    x = small.inputs(name)

    def step(m):
        out = m(*x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    want = _expected(plain, step)
    picklehooks.instrument(model, capture=("input", "output", "grad_output"), example_inputs=x, scriptable=True)
    with picklehooks.record() as log:
        step(torch.jit.script(model))
    _check(log, want)
    assert None not in _sources_by_key(log).values()


class _Looped(torch.nn.Module):
    """A layer called in a ``range`` loop (``prim::Loop`` in TorchScript, where the count is the
    data's) and another called once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, n: int = 2) -> torch.Tensor:
        for _ in range(n):
            x = self.lin(x)
        return self.out(x)


def test_a_scripted_module_called_in_a_loop_has_no_source_rather_than_a_wrong_one():
    torch.manual_seed(0)
    plain, model = _Looped(), _Looped()
    model.load_state_dict(plain.state_dict())
    x = small.inputs("mlp")
    want = _expected(plain, lambda m: m(*x).sum().backward())
    picklehooks.instrument(model, capture=("output",), example_inputs=x, scriptable=True)
    with picklehooks.record() as log:
        torch.jit.script(model)(*x).sum().backward()
    got = _sources_by_key(log)
    assert {k[0] for k in got} == {"lin", "out"}
    assert all(v is None for k, v in got.items() if k[0] == "lin")
    assert got[("out", "output", "", 0)] == want[("out", 0)]


_SCRIPT_CHILD = """
import json, sys, torch
sys.path.insert(0, {repo!r})
from tests.contract.frozen_v3_step import run_step  # (not the model's module: the program names it)
model = torch.jit.load(sys.argv[1])
x = torch.load(sys.argv[2], weights_only=True)
assert "tests.models.small" not in sys.modules
print(json.dumps(run_step(model, x)))
"""


def test_a_scripted_program_loaded_in_a_fresh_process_records_the_same_sources(tmp_path):
    """``torch.jit.save`` then ``torch.jit.load`` in a process that never imports the model's module:
    the program's graphs and type names carry the sites, files and classes."""
    import warnings

    from tests.contract.frozen_v3_step import run_step

    plain, model = _two_three_places()
    (x,) = small.inputs("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (run_step's record() sees nothing on the plain model)
        want = _expected(plain, lambda m: run_step(m, x))
    picklehooks.instrument(model, modules=["", "*"], capture=("output", "grad_output"), scriptable=True)
    torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    out = run_fresh(_SCRIPT_CHILD.format(repo=REPO), str(tmp_path / "model.pt"), str(tmp_path / "x.pt"), cwd=REPO)
    got = json.loads(out.strip().splitlines()[-1])
    assert got and all(source == want[(module, call)] for module, _, _, call, source in got), got


@pytest.mark.parametrize("form", ["trace", "export"])
def test_a_packaged_model_traced_there_records_eager_sources(form, tmp_path):
    """Loaded from a torch.package archive (whose modules are ``<torch_package_N>.…``, and whose copy
    of the hook runtime makes the texts while tracing), then traced or exported: the same files."""
    from torch.package import PackageImporter

    import picklehooks.serialize.package

    plain, model = _two_three_places()
    want = _expected(plain, _three_places_step)
    picklehooks.instrument(model, modules=["", "*"], capture=("output", "grad_output"))
    picklehooks.serialize.package.save(tmp_path / "model.pt", model)
    loaded = PackageImporter(tmp_path / "model.pt").load_pickle("model", "model.pkl")
    assert type(loaded).__module__.startswith("<torch_package_")
    run = _in_form(loaded, form, small.inputs("mlp"))
    with picklehooks.record() as log:
        _three_places_step(run)
    _check(log, want)
    assert None not in _sources_by_key(log).values()
