"""A parameter whose module never runs gets its ``param_grad`` in every form (issue 40, item 5).

MaxViT reads its relative-position modules through ``get_bias()``, never through
their forward, and ``nn.MultiheadAttention`` reads ``out_proj``'s parameters
without calling it: their pre-hooks never run. ``instrument()`` watches every chosen
module's parameters itself, but a model loaded in another process (pickle,
torch.package, a saved trace, script or export, a compiled copy of a loaded
model) only has what its hooks attach: there the nearest chosen ancestor's
pre-hook watches them. Each form runs in a fresh process, where nothing
``instrument()`` attached is left, and is compared with the ``.grad`` of an
un-instrumented copy in plain PyTorch; ``param`` records stay those of the
modules that run (plain pre-hooks on the same copy), as eager records them.
"""

from __future__ import annotations

import pickle

import pytest
import torch

import picklehooks
import picklehooks.serialize.package
from tests.models import odd
from tests.testutils import REPO, run_fresh

FORMS = ["eager", "pickle", "package", "trace", "script", "compile", "export"]
CAPTURE = ("param", "param_grad")

# Loads the artifact, runs one step under record(); saves {(module, kind, path, call): tensor} and the .grads.
CHILD = """
import os, sys, tempfile, torch, picklehooks
form, path, out = sys.argv[1:4]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
if form in ("pickle", "compile"):
    model = torch.load(path, weights_only=False)
    run = torch.compile(model, fullgraph=True) if form == "compile" else model
elif form == "package":
    from torch.package import PackageImporter
    run = model = PackageImporter(path).load_pickle("model", "model.pkl")
elif form in ("trace", "script"):
    run = model = torch.jit.load(path)
else:
    run = model = torch.export.load(path).module()
x = torch.load(sys.argv[4])
with picklehooks.record() as log:
    run(x).sum().backward()
torch.save({"records": {r.key: r.tensor for r in log.records},
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}, out)
"""


#: (model, the module that never runs): odd.UnrunOwner is MaxViT's pattern.
CASES = {"UnrunOwner": "attn.rel_pos", "Attention": "attn.out_proj"}


def _plain(case: str, x: torch.Tensor) -> tuple[dict, dict]:
    """Ground truth from an un-instrumented copy: the ``param`` records plain pre-hooks see (the modules
    that run) and each parameter's ``.grad`` under its module's name, as ``param_grad`` records name it."""
    model, seen = odd.build(case), {}
    for name, module in model.named_modules():
        if name:
            module.register_forward_pre_hook(lambda m, args, name=name: seen.update(
                {(name, "param", n, 0): p.detach().clone() for n, p in m.named_parameters(recurse=False)}))
    model(x).sum().backward()
    grads = {(name, "param_grad", n, 0): p.grad.clone()
             for name, module in model.named_modules() if name for n, p in module.named_parameters(recurse=False)}
    unrun = CASES[case]
    assert not any(k[0] == unrun for k in seen) and any(k[0] == unrun for k in grads)  # the case
    return seen, grads


def _artifact(model: torch.nn.Module, form: str, x: torch.Tensor, path) -> None:
    if form in ("pickle", "compile"):
        torch.save(model, path)
    elif form == "package":
        picklehooks.serialize.package.save(path, model)
    elif form == "trace":
        torch.jit.save(torch.jit.trace(model, (x,), check_trace=False), str(path))
    elif form == "script":
        torch.jit.save(torch.jit.script(model), str(path))
    else:
        torch.export.save(torch.export.export(model, (x,)), str(path))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_parameter_whose_module_never_runs_records_its_grad(case, form, tmp_path):
    """Every form records the unrun module's ``param_grad`` once, equal to ``.grad``; ``param`` records
    only for modules that run (``attn.qkv`` is watched by its own hook and by its owner's: one record)."""
    if case == "Attention" and form == "script":
        pytest.skip("scriptable=True leaves out nn.MultiheadAttention (overloaded forward): no hook to watch from")
    x = odd.inputs(case)[0]
    want_params, want_grads = _plain(case, x)
    model = odd.build(case)
    # TorchScript types hooks from the calls an example forward shows (rel_pos's never comes).
    options = {"scriptable": True, "example_inputs": (x,)} if form == "script" else {}
    picklehooks.instrument(model, capture=CAPTURE, mode="tensor", **options)
    if form == "eager":  # instrument() watched every parameter itself
        with picklehooks.record() as log:
            model(x).sum().backward()
        got = {r.key: r.tensor for r in log.records}
        grads = {n: p.grad for n, p in model.named_parameters()}
    else:
        _artifact(model, form, x, tmp_path / "model.pt")
        torch.save(x, tmp_path / "x.pt")
        run_fresh(CHILD, form, str(tmp_path / "model.pt"), str(tmp_path / "out.pt"), str(tmp_path / "x.pt"),
                  cwd=REPO, timeout=600)
        result = torch.load(tmp_path / "out.pt", weights_only=False)
        got, grads = result["records"], result["grads"]
    want = {**want_params, **want_grads}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    for (module, _, n, _), value in want_grads.items():  # the loaded model's own .grad agrees as well
        torch.testing.assert_close(grads[f"{module}.{n}"], value, rtol=1e-5, atol=1e-6)


def test_a_loaded_models_ancestor_watches_once_per_process(monkeypatch):
    """Eager: the owner's pre-hook watches the unrun module's parameter at its first call, not at every call."""
    model = odd.build("UnrunOwner")
    picklehooks.instrument(model, capture="param_grad", mode="tensor")
    loaded = pickle.loads(pickle.dumps(model))  # new parameters: nothing instrument() attached is on them
    calls = []
    watch = picklehooks._ops.watch_grads
    monkeypatch.setattr(picklehooks._ops, "watch_grads", lambda module, *args, **kw: (
        calls.append(module), watch(module, *args, **kw))[1])
    x = odd.inputs("UnrunOwner")[0]
    for _ in range(3):
        loaded.zero_grad()
        with picklehooks.record() as log:
            loaded(x).sum().backward()
        got = [r for r in log.records if r.module == "attn.rel_pos"]
        assert [(r.kind, r.path) for r in got] == [("param_grad", "table")]
        torch.testing.assert_close(got[0].tensor, loaded.attn.rel_pos.table.grad)
    assert calls.count("attn.rel_pos") == 1, calls


@pytest.mark.parametrize(("case", "added", "added_without"),
                         [("KeywordCalls", set(), {"block"}), ("UnrunOwner", {"attn"}, {"attn"})])
def test_example_inputs_limit_the_owners_watch_to_modules_that_did_not_run(case, added, added_without):
    """With example_inputs, a module gets a pre-hook for its children's param_grad only where one of them
    didn't run in the example forward: an ordinary model pays nothing per call for it. Without them,
    any child might not run, so its owner watches it too."""
    args = odd.inputs(case)
    own = {n for n, m in odd.build(case).named_modules() if n and next(m.parameters(recurse=False), None) is not None}
    model = odd.build(case)
    picklehooks.instrument(model, capture="param_grad", example_inputs=args)
    assert {n for n, m in model.named_modules() if len(m._forward_pre_hooks)} == own | added
    model = odd.build(case)
    picklehooks.instrument(model, capture="param_grad")
    assert {n for n, m in model.named_modules() if len(m._forward_pre_hooks)} == own | added_without
