"""Every record names the line of code that called its module (issue 39, items 1 and 2).

Ground truth: ``inspect.stack()`` in a plain forward pre-hook on an un-instrumented copy, whose
calling frame is the first one above the hook that is neither ``nn.Module``'s call machinery
(``torch/nn/modules/module.py``) nor a module's own ``__call__``; the class part comes from
``inspect.getsourcelines``. Files are named by their module, so the sources of a model loaded in
a fresh process (``torch.load``, ``torch.package``) are compared with this process's as text.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import picklehooks
import picklehooks.serialize.package
from picklehooks.capture import sources as _sources
from tests.models import small
from tests.testutils import run_fresh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODULE_PY = os.path.abspath(torch.nn.modules.module.__file__)


def _file(module_name: str, filename: str) -> str:
    if os.path.basename(filename) == "__init__.py":
        return module_name.replace(".", "/") + "/__init__.py"
    return module_name.replace(".", "/") + ".py"


def _expected(plain: nn.Module, run) -> dict[tuple[str, int], str]:
    """``(module, call) -> source`` as plain pre-hooks see every module call of ``run(plain)``."""
    seen: dict[tuple[str, int], str] = {}
    calls: dict[str, int] = {}

    def pre(name):
        def hook(module, args):
            frames = inspect.stack()[1:]
            caller = next(f for f in frames if os.path.abspath(f.filename) != _MODULE_PY
                          and not (f.function == "__call__" and isinstance(f.frame.f_locals.get("self"), nn.Module)))
            call = calls[name] = calls.get(name, -1) + 1
            cls = type(module)
            line = inspect.getsourcelines(cls)[1]
            where = f"{_file(caller.frame.f_globals['__name__'], caller.filename)}:{caller.lineno}"
            seen[(name, call)] = (f"{where} in {caller.frame.f_code.co_qualname} "
                                  f"({cls.__qualname__}, {_file(cls.__module__, inspect.getfile(cls))}:{line})")
        return hook

    for name, module in plain.named_modules():
        module.register_forward_pre_hook(pre(name))
    run(plain)
    return seen


def _sources_by_key(log) -> dict[tuple, str | None]:
    return {r.key: r.source for r in log.records}


def _check(log, want: dict) -> None:
    got = _sources_by_key(log)
    assert got, "nothing recorded"
    for (module, kind, path, call), source in got.items():
        assert source == want[(module, call)], (module, kind, path, call)


def _three_places_step(model) -> None:
    model(*small.inputs("mlp")).sum().backward()


def test_each_call_of_a_module_has_its_own_line():
    """One Identity called from three lines (one in a loop), blocks called in a loop: each record's
    source is its call's line, in records, ``table()``, ``to_pandas()`` and ``records.json``."""
    torch.manual_seed(0)
    plain = small.ThreePlaces()
    model = copy.deepcopy(plain)
    want = _expected(plain, _three_places_step)
    assert len({want[("same", k)] for k in range(4)}) == 3  # three lines: calls 1 and 2 share the loop's
    picklehooks.instrument(model, modules=["", "*"], capture="all")
    with picklehooks.record() as log:
        _three_places_step(model)
    _check(log, want)
    assert {r.kind for r in log.records} >= {"input", "output", "grad_output", "param", "param_grad"}
    rows = log.table()
    assert [row["source"] for row in rows] == [r.source for r in log.records]
    pytest.importorskip("pandas")
    assert list(log.to_pandas()["source"]) == [r.source for r in log.records]


def test_sources_survive_the_log_file_and_a_parquet_sink(tmp_path):
    torch.manual_seed(0)
    model = small.ThreePlaces()
    picklehooks.instrument(model, capture=("output", "grad_output"))
    with picklehooks.record() as log:
        _three_places_step(model)
    want = _sources_by_key(log)
    log.save(tmp_path / "saved")
    assert _sources_by_key(picklehooks.Log.load(tmp_path / "saved")) == want
    pytest.importorskip("pyarrow")
    with picklehooks.record(sink=tmp_path / "sink") as streamed:
        _three_places_step(model)
    assert _sources_by_key(picklehooks.Log.load(tmp_path / "sink")) == want
    import pyarrow.parquet as pq

    part = next(p for p in os.listdir(tmp_path / "sink") if p.endswith(".parquet"))
    column = pq.ParquetFile(tmp_path / "sink" / part).metadata.row_group(0).column(
        list(picklehooks.capture.sink.COLUMNS).index("source"))
    assert "RLE_DICTIONARY" in str(column.encodings) or "PLAIN_DICTIONARY" in str(column.encodings)
    del streamed


def test_a_log_file_with_a_source_that_is_no_text_is_refused(tmp_path):
    torch.manual_seed(0)
    model = small.ThreePlaces()
    picklehooks.instrument(model, capture=("output",))
    with picklehooks.record() as log:
        _three_places_step(model)
    log.save(tmp_path / "log")
    file = tmp_path / "log" / "records.json"
    document = json.loads(file.read_text())
    document["records"][1]["source"] = 5
    file.write_text(json.dumps(document))
    with pytest.raises(picklehooks.PicklehooksError, match="record 1 has source=5; expected str or None"):
        picklehooks.Log.load(tmp_path / "log")


def test_a_training_loop_finds_each_call_site_once(monkeypatch):
    """The steady state walks no stack: each (module, call) is found once, then looked up."""
    walks = []
    real = _sources.caller_source
    monkeypatch.setattr(_sources, "caller_source", lambda cls, depth=1: walks.append(1) or real(cls, depth + 1))
    torch.manual_seed(0)
    model = small.ThreePlaces()
    picklehooks.instrument(model, capture=("output",))
    with picklehooks.record() as log:
        for step in range(3):
            log.begin_step(step)
            _three_places_step(model)
    calls = len({(r.module, r.call) for r in log.records})
    assert len(walks) == calls
    by_step = [[r.source for r in log.records if r.step == s] for s in range(3)]
    assert by_step[0] == by_step[1] == by_step[2] and None not in by_step[0]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5", "vit", "resnet", "albert"])
def test_real_models_sources_equal_the_plain_hooks_calling_frames(name):
    """The real-model matrix (and ALBERT, whose one shared layer is called twice), every module:
    forward and gradient records name their call's line."""
    pytest.importorskip("transformers")
    from tests.models import hf

    def build():
        if name != "albert":
            return hf.build(name)
        import transformers

        torch.manual_seed(0)
        return transformers.AlbertModel(transformers.AlbertConfig(
            num_hidden_layers=2, num_attention_heads=2, hidden_size=16, embedding_size=8, intermediate_size=32,
            vocab_size=50, max_position_embeddings=32, attn_implementation="eager")).eval()

    batch = hf.inputs("bert" if name == "albert" else name)

    def step(model):
        hf.step_loss(model(**batch)).backward()

    want = _expected(build(), step)
    model = build()
    picklehooks.instrument(model, modules=["", "*"], capture=("input", "output", "grad_output"))
    with picklehooks.record() as log:
        step(model)
    _check(log, want)
    if name == "albert":
        shared = [r.source for r in log.records if r.kind == "output" and r.module.endswith("albert_layer_groups.0")]
        assert len(shared) == 2 and shared[0] == shared[1] is not None  # one line, in a loop, called twice


_CHILD = """
import json, sys, torch, picklehooks
sys.path.insert(0, {repo!r})
from tests.capture.recording import load
from tests.capture.test_sources import _three_places_step
model = load(sys.argv[1], sys.argv[2])
with picklehooks.record() as log:
    _three_places_step(model)  # the same calling line as here
print(json.dumps(sorted(["|".join(map(str, r.key)), r.source] for r in log.records)))
"""


@pytest.mark.parametrize("kind", ["pickle", "package"])
def test_a_model_loaded_in_a_fresh_process_records_the_same_sources(kind, tmp_path):
    """Recorded there, not looked up: the child records with the model it loaded, whose code (from the
    archive, for torch.package) runs there; its files are named as here."""
    torch.manual_seed(0)
    model = small.ThreePlaces()
    picklehooks.instrument(model, modules=["", "*"], capture=("output", "grad_output"))
    path = tmp_path / "model.pt"
    if kind == "pickle":
        torch.save(model, path)
    else:
        picklehooks.serialize.package.save(path, model)
    with picklehooks.record() as log:
        _three_places_step(model)
    want = sorted(["|".join(map(str, r.key)), r.source] for r in log.records)
    got = json.loads(run_fresh(_CHILD.format(repo=REPO), kind, str(path), cwd=REPO).strip().splitlines()[-1])
    assert got == want
    assert all(source is not None for _, source in got)


def test_compare_names_the_line_a_modified_copy_changed(tmp_path):
    """``compare`` of a model against a copy whose one ``forward`` line changed names that line."""
    from picklehooks.diagnostics import compare, record_forward

    source = (
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.act, self.b = nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)\n\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        h = self.act(h)\n"
        "        return self.b(h)\n"
    )
    changed = source.replace("        h = self.act(h)\n", "        h = self.act(h * 1.5)\n")
    nets = []
    for i, text in enumerate((source, changed)):
        (tmp_path / f"net_{i}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        import net_0
        import net_1

        torch.manual_seed(0)
        a = net_0.Net()
        b = net_1.Net()
        b.load_state_dict(a.state_dict())
        for net in (a, b):
            picklehooks.instrument(net, capture=("output",), mode="tensor")
            nets.append(net)
        x = torch.randn(3, 4)
        result = compare(record_forward(a, x), record_forward(b, x))
    finally:
        sys.path.remove(str(tmp_path))
        for m in ("net_0", "net_1"):
            sys.modules.pop(m, None)
    first = result.first_divergence
    assert first["module"] == "act"
    assert first["source"].startswith("net_0.py:11 in Net.forward (Tanh, torch/nn/modules/activation.py:")
    assert "net_0.py:11 in Net.forward" in str(result)


def test_find_nonfinite_and_the_report_name_the_line(tmp_path):
    from picklehooks.diagnostics import find_nonfinite
    from picklehooks.diagnostics.report import write_report

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.log = nn.Linear(4, 4), nn.Identity()

        def forward(self, x):
            return self.log(self.a(x).log())  # NaN where a(x) < 0

    torch.manual_seed(0)
    model = Bad()
    picklehooks.instrument(model)
    report = find_nonfinite(model, torch.randn(3, 4))
    line = inspect.getsourcelines(Bad.forward)[1] + 1
    assert report.module == "log" and report.source.startswith(f"tests/capture/test_sources.py:{line} in ")
    assert f"first NaN: log {report.kind} (call 0), tests/capture/test_sources.py:{line}" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with picklehooks.record() as log:
            model(torch.randn(3, 4))
        log.save(tmp_path / "log")
        written = write_report(tmp_path / "log", tmp_path / "report")
    text = next(p for p in written if p.suffix == ".md").read_text()
    assert f"tests/capture/test_sources.py:{line}" in text


class _TwoActs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 8), nn.ReLU()

    def forward(self, x):
        h = self.act(self.lin(x))
        return self.act(-h)  # the same ReLU, from a second line


def test_dead_units_lists_each_line_that_called_the_layer():
    from picklehooks.diagnostics import dead_units

    torch.manual_seed(0)
    x = torch.randn(16, 4)
    want = _expected(_TwoActs(), lambda m: m(x))
    (row,) = dead_units(_TwoActs(), [(x,)], modules=["act"])
    assert row["sources"] == [want[("act", 0)], want[("act", 1)]]
    assert want[("act", 0)] != want[("act", 1)]


@pytest.mark.parametrize("name", ["three_places", "gpt2"])
def test_torch_compile_records_the_sources_eager_records(name):
    """``torch.compile(fullgraph=True)``: the submodules' records (in the graph) get the source tracing
    saw, the model's own (its hooks run in eager mode) the line that called the compiled model."""
    from tests.testutils import transformed

    if name == "gpt2":
        pytest.importorskip("transformers")
        from tests.models import hf

        batch = hf.inputs("gpt2")
        build, capture = (lambda: hf.build("gpt2")), ("input", "output", "grad_output")

        def step(model):
            hf.step_loss(model(**batch)).backward()
    else:
        build, capture, step = small.ThreePlaces, "all", _three_places_step
    torch.manual_seed(0)
    want = _expected(build(), step)
    sources = {}
    for form in ("eager", "compile"):
        torch.manual_seed(0)
        model = build()
        picklehooks.instrument(model, modules=["", "*"], capture=capture)
        run = transformed(model, form, ())
        for _ in range(2):  # and the cached graph's
            with picklehooks.record() as log:
                step(run)
        sources[form] = _sources_by_key(log)
        if form == "compile":  # tensor records: a graph records non-tensor inputs (None, flags) nowhere
            assert set(sources["compile"]) == {r.key for r in eager_records if r.shape is not None}
        else:
            eager_records = log.records
        _check(log, want)
    assert {k: sources["eager"][k] for k in sources["compile"]} == sources["compile"]
