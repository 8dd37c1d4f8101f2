"""Under ``torch.compile``, a value the caller gives no gradient records none, as in eager mode (issue 40, item 3).

AOTAutograd hands a compiled backward zeros for a graph output that got no gradient, so a
``tap_grad`` inside that backward can't tell zeros from nothing. ``torch.compile(model)`` runs the
root's hooks as frames of their own; run as they are (``_hookrt._top_frames_eager``), they tap
the model's own inputs and outputs as eager mode does, and record exactly what it records. A
submodule's value that only leaves the graph is recorded inside it: an all-zero gradient there
gets no statistics and a ``note`` (never a zero presented as a gradient).

Ground truth: plain tensor hooks on views of the values, on an un-instrumented copy in eager
mode, which fire only where a gradient flows.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture.record import NO_GRADIENT_NOTE
from tests.testutils import plain_stats, transformed, use_pytorch_stats


class _DictOut(nn.Module):
    """``{"logits": b(h), "hidden": h, "aux": c(x)}``: the loss uses ``logits`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.a(x)
        return {"logits": self.b(h), "hidden": h, "aux": self.c(x)}


class _Masked(nn.Module):
    """The issue's case: ``mask`` requires grad but only feeds ``mask == 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x).masked_fill(mask == 0, 0.0)


def _hooked_root(model: nn.Module, want: dict) -> None:
    """Plain tensor hooks on views of ``model``'s inputs and outputs: the gradients that reach them."""

    def hooked(value, kind, path):
        value = value.view_as(value)
        value.register_hook(lambda g: want.__setitem__(("", kind, path), g.clone()))
        return value

    def pre(module, args):
        return tuple(hooked(v, "grad_input", str(i)) if v.requires_grad else v for i, v in enumerate(args))

    def post(module, args, out):
        if isinstance(out, dict):
            return {k: hooked(v, "grad_output", k) for k, v in out.items()}
        return hooked(out, "grad_output", "")

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)


def _inputs(name: str) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(3, 4, requires_grad=True)
    if name == "dict":
        return (x,)
    return x, torch.randint(0, 2, (3, 4)).float().requires_grad_()


def _loss(out) -> torch.Tensor:
    return (out["logits"] if isinstance(out, dict) else out).sum()


@pytest.mark.parametrize("form", ["eager", "compile"])
@pytest.mark.parametrize("name", ["dict", "masked"])
def test_the_models_own_values_that_get_no_gradient_record_none(name, form):
    torch.manual_seed(0)
    plain = _DictOut() if name == "dict" else _Masked()
    model = copy.deepcopy(plain)
    want: dict = {}
    _hooked_root(plain, want)
    _loss(plain(*_inputs(name))).backward()
    # Sanity: some of the model's values get no gradient (what this test is about).
    assert ("", "grad_output", "hidden") not in want and ("", "grad_input", "1") not in want
    assert ("", "grad_output", "logits") in want or ("", "grad_output", "") in want

    picklehooks.instrument(model, modules=[""], capture=("grad_input", "grad_output"), mode="tensor")
    run = transformed(model, form, _inputs(name))
    for _ in range(2):  # the second step runs the cached graph
        with picklehooks.record() as log:
            _loss(run(*_inputs(name))).backward()
    got = {(r.module, r.kind, r.path): r.tensor for r in log.records}
    assert sorted(got) == sorted(want)
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _submodule_run(form: str, device_path: bool, monkeypatch) -> list:
    if device_path:
        use_pytorch_stats(monkeypatch)
    torch.manual_seed(0)
    model = _DictOut()
    picklehooks.instrument(model, capture=("grad_input", "grad_output"))
    run = transformed(model, form, _inputs("dict"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with picklehooks.record() as log:
            _loss(run(*_inputs("dict"))).backward()
        records = log.records
        stats = {r.key: (r.stats, r.note) for r in records}
        table = {(row["module"], row["kind"], row["path"]): row for row in log.table()}
    return stats, table, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("device_path", [False, True], ids=["native", "device_path"])
def test_a_submodule_value_that_only_leaves_the_graph_is_marked_never_zero(device_path, monkeypatch):
    """``c``'s output is only returned (as ``aux``): eager records no gradient for it, and the
    compiled graph's all-zero one gets no statistics and a note, in records and in the table.
    The values that do get a gradient keep it, equal to plain hooks, with no note."""
    eager, _, _ = _submodule_run("eager", device_path, monkeypatch)
    compiled, table, warned = _submodule_run("compile", device_path, monkeypatch)
    unsure = {("c", "grad_output", "", 0), ("c", "grad_input", "0", 0)}
    assert not unsure & set(eager)
    assert set(compiled) == set(eager) | unsure
    for key in unsure:
        assert compiled[key] == (None, NO_GRADIENT_NOTE)
        assert table[key[:3]]["zero_frac"] is None and table[key[:3]]["norm"] is None
        assert any(f"{key[0]} {key[1]} (path {key[2]!r}) is all zeros" in w for w in warned)
    for key, (s, note) in eager.items():
        assert note is None and compiled[key][1] is None
        assert compiled[key][0]["norm"] == pytest.approx(s["norm"], rel=1e-5)

    # Ground truth for the gradients that flow: plain hooks on an un-instrumented copy.
    torch.manual_seed(0)
    plain, want = _DictOut(), {}
    def hook_output(name):
        def hook(module, args, out):
            out.register_hook(lambda g: want.__setitem__(name, g.clone()))
        return hook

    for name in ("a", "b"):
        getattr(plain, name).register_forward_hook(hook_output(name))
    _loss(plain(*_inputs("dict"))).backward()
    for name, g in want.items():
        assert compiled[(name, "grad_output", "", 0)][0]["norm"] == pytest.approx(plain_stats(g)["norm"], rel=1e-5)


def test_a_compiled_gradient_of_real_zeros_is_marked_too_not_dropped():
    """A gradient that is truly all zeros (the loss multiplies the output by 0) can't be told from
    none inside a compiled graph: it is kept, marked, never presented as the zero it may not be."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x)

    torch.manual_seed(0)
    model = Scaled()
    picklehooks.instrument(model, capture=("grad_output",))
    run = transformed(model, "compile", _inputs("dict"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with picklehooks.record() as log:
            (run(*_inputs("dict")) * 0).sum().backward()
        (record,) = log.records
        unread = pickle.loads(pickle.dumps(record))
        assert record.key == ("a", "grad_output", "", 0)
        assert record.stats is None and record.note == NO_GRADIENT_NOTE
        # Pickled before and after it was read, the record keeps its mark.
        for again in (unread, pickle.loads(pickle.dumps(record)), copy.deepcopy(record)):
            assert again.stats is None and again.note == NO_GRADIENT_NOTE


def test_hf_t5_encoder_last_hidden_state_the_loss_doesnt_use_records_no_gradient():
    """T5 returns ``encoder_last_hidden_state`` (as Whisper does) and ``logits`` beside its loss; the
    caller differentiates the loss only. Compiled, the model's own records equal eager's (which plain
    hooks on views of the outputs confirm: only ``loss`` gets a gradient)."""
    pytest.importorskip("transformers")
    from tests.models import hf

    torch.manual_seed(0)
    records = {}
    for form in ("eager", "compile"):
        model = hf.build("t5")
        picklehooks.instrument(model, modules=[""], capture=("grad_output",))
        run = transformed(model, form, ())
        with picklehooks.record() as log:
            run(**hf.inputs("t5")).loss.backward()
        records[form] = {r.key: r.stats["norm"] for r in log.records}

    plain, want = hf.build("t5"), {}
    plain.register_forward_hook(lambda m, a, out: _hook_outputs(out, want))
    plain(**hf.inputs("t5")).loss.backward()
    assert sorted(want) == ["loss"]
    assert sorted(records["eager"]) == [("", "grad_output", "loss", 0)]
    assert sorted(records["compile"]) == sorted(records["eager"])
    assert records["compile"][("", "grad_output", "loss", 0)] == pytest.approx(plain_stats(want["loss"])["norm"])


def _hook_outputs(out, want: dict):
    """The model's output with each tensor that requires grad replaced by a hooked view: the gradient
    of what the caller gets, through the caller's uses only."""
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            view = value.view_as(value)
            view.register_hook(lambda g, key=key: want.__setitem__(key, g.clone()))
            out[key] = view
    return out


def test_the_mark_survives_tables_log_files_and_sinks(tmp_path):
    """The note is data: ``table()`` and ``to_pandas()`` have it, a saved log and a Parquet sink keep it
    (read back in this process: the files are what carries it), and unmarked records have none."""
    pytest.importorskip("pyarrow")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    picklehooks.instrument(model, capture=("output", "grad_output"))
    run = transformed(model, "compile", _inputs("dict"))
    logs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for where in ("memory", "sink"):
            with picklehooks.record(**({"sink": tmp_path / "sink"} if where == "sink" else {})) as log:
                (run(*_inputs("dict")) * 0).sum().backward()
            logs[where] = log
        log = logs["memory"]
        log.save(tmp_path / "log")
        loaded = {"memory": log, "log file": picklehooks.Log.load(tmp_path / "log"),
                  "sink": picklehooks.Log.load(tmp_path / "sink")}
        for name, got in loaded.items():
            by_kind = {r.kind: r for r in got.records if r.module == "0"}
            assert by_kind["grad_output"].stats is None and by_kind["grad_output"].note == NO_GRADIENT_NOTE, name
            assert by_kind["output"].stats is not None and by_kind["output"].note is None, name
            rows = {row["kind"]: row for row in got.table() if row["module"] == "0"}
            assert rows["grad_output"]["note"] == NO_GRADIENT_NOTE and rows["grad_output"]["mean"] is None, name
            assert rows["output"]["note"] is None and rows["output"]["mean"] is not None, name
        pytest.importorskip("pandas")
        frame = loaded["sink"].to_pandas()
        assert list(frame.loc[frame["kind"] == "grad_output", "note"]) == [NO_GRADIENT_NOTE]
