"""``save_hooks``/``load_hooks``: hooks and instrumentation as text in config.json and safetensors metadata.

Saved in this process, loaded in fresh ones (``from_pretrained`` / ``safetensors.torch.load_model``);
ground truth is the un-instrumented model with the same hook functions registered as plain hooks.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import picklehooks  # noqa: E402
from picklehooks.serialize import codec, hookdoc  # noqa: E402
from tests.testutils import REPO, run_fresh  # noqa: E402

LAYERS = ("transformer.h.0", "transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.h.1.mlp.c_proj")


# The user's hooks: portable() turns each into text. Plain copies of the same functions are the ground truth.
def shift_pre(module, args, kwargs):
    return (args[0] + 0.25,) + tuple(args[1:]), kwargs


def double(module, args, output):
    return output * 2


def halve_grad(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def noted(module, args, output):
    return None


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def add_hooks(model, wrap, record_hook=None):
    """The same hooks in the same order; ``record_hook`` stands where instrument()'s hooks go."""
    mlp0, mlp1, proj = (model.get_submodule(n) for n in ("transformer.h.0.mlp", "transformer.h.1.mlp",
                                                        "transformer.h.1.mlp.c_proj"))
    mlp0.register_forward_pre_hook(wrap(shift_pre), with_kwargs=True)  # before the instrumentation's hooks
    if record_hook is not None:
        record_hook()
    mlp1.register_forward_hook(wrap(double))
    model.get_submodule("transformer.h.0").register_forward_hook(wrap(noted), always_call=True)
    proj.register_full_backward_hook(wrap(halve_grad))


IDS = torch.arange(16).reshape(2, 8) % 100


def plain_truth():
    """Outputs, a gradient and float64 output norms of LAYERS, from plain hooks on an un-instrumented model."""
    model = tiny_gpt2()
    norms = {}

    def recorders():
        for name in LAYERS:
            def rec(module, args, output, name=name):
                value = output[0] if isinstance(output, tuple) else output
                norms[name] = value.detach().double().norm().item()
            model.get_submodule(name).register_forward_hook(rec)

    add_hooks(model, lambda fn: fn, recorders)
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), model.transformer.h[1].mlp.c_fc.weight.grad.clone(), norms


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An instrumented tiny GPT-2 with portable user hooks, saved both ways; the truth beside it."""
    root = tmp_path_factory.mktemp("hooks")
    model = tiny_gpt2()
    handle = None

    def instrument():
        nonlocal handle
        handle = picklehooks.instrument(model, modules=list(LAYERS), capture=("input", "output", "grad_output"))

    add_hooks(model, picklehooks.portable, instrument)
    model.save_pretrained(root / "hf")
    doc = picklehooks.save_hooks(model, root / "hf")
    safetensors_torch.save_model(model, str(root / "model.safetensors"), metadata={"note": "kept"})
    before = safetensors_torch.load_file(str(root / "model.safetensors"))
    picklehooks.save_hooks(model, root / "model.safetensors")
    after = safetensors_torch.load_file(str(root / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with picklehooks.record() as log:
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
    mine = {r.key: r.stats["norm"] if r.stats else r.value for r in log}
    return root, doc, (handle.spec, sorted(handle.modules)), mine, plain_truth()


CHILD = """
import json, sys, warnings
import torch, transformers, safetensors.torch, picklehooks
from picklehooks.serialize import hookdoc
where, how, out = sys.argv[1:4]
torch.manual_seed(0)
if how == "hf":
    model = transformers.GPT2LMHeadModel.from_pretrained(where).eval()
    trust = True
else:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    safetensors.torch.load_model(model, where)
    trust = [hookdoc.fingerprint(h["name"]) for h in hookdoc.read(where)["hooks"]]
loaded = picklehooks.load_hooks(model, where, trust=trust)
ids = torch.arange(16).reshape(2, 8) % 100
with picklehooks.record() as log:
    result = model(input_ids=ids, labels=ids)
    result.loss.backward()
torch.save({"logits": result.logits.detach(), "grad": model.transformer.h[1].mlp.c_fc.weight.grad,
            "records": {r.key: r.stats["norm"] if r.stats else r.value for r in log}, "modules": sorted(loaded.instrumentation.modules)},
           out)
"""


@pytest.mark.parametrize("how", ["hf", "safetensors"])
def test_a_fresh_process_records_what_the_saving_one_did(saved, how, tmp_path):
    root, doc, handle, mine, (logits, grad, norms) = saved  # handle: (spec, module names)
    where = root / "hf" if how == "hf" else root / "model.safetensors"
    run_fresh(CHILD, str(where), how, str(tmp_path / "out.pt"), cwd=REPO)
    got = torch.load(tmp_path / "out.pt")
    assert torch.allclose(got["logits"], logits, rtol=1e-5, atol=1e-6)  # the user hooks ran, in their order
    assert torch.allclose(got["grad"], grad, rtol=1e-5, atol=1e-8)  # the backward hook too
    assert got["modules"] == handle[1]
    assert got["records"].keys() == mine.keys()
    for key, value in got["records"].items():
        assert value == (pytest.approx(mine[key], rel=1e-5) if isinstance(value, float) else mine[key])
        if key[1] == "output":
            assert value == pytest.approx(norms[key[0]], rel=1e-5)


def test_the_document_names_every_hook_and_the_spec(saved):
    root, doc, handle, _, _ = saved
    assert doc["spec"] == handle[0]
    assert json.loads(json.dumps(doc)) == doc  # plain JSON
    kinds = {(h["module"], h["kind"]): h for h in doc["hooks"]}
    assert set(kinds) == {("transformer.h.0.mlp", "forward_pre"), ("transformer.h.1.mlp", "forward"),
                          ("transformer.h.0", "forward"), ("transformer.h.1.mlp.c_proj", "backward")}
    pre = kinds[("transformer.h.0.mlp", "forward_pre")]
    assert pre["with_kwargs"] and pre["prepend"]  # it ran before the instrumentation's pre-hook
    assert not kinds[("transformer.h.1.mlp", "forward")]["prepend"]
    assert kinds[("transformer.h.0", "forward")]["always_call"]
    assert codec.decode(pre["name"]).startswith("def shift_pre(")
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["picklehooks"] == doc and config["n_layer"] == 2  # the config's own keys kept
    assert hookdoc.safetensors_metadata(root / "model.safetensors")["note"] == "kept"


NO_TRUST = """
import sys, torch, transformers, picklehooks
from picklehooks._shim import hub
from picklehooks.serialize import hookdoc
where = sys.argv[1]
model = transformers.GPT2LMHeadModel.from_pretrained(where)
before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in model.named_modules()}
try:
    picklehooks.load_hooks(model, where)
except picklehooks.PicklehooksError as exc:
    print("refused:", exc)
names = [h["name"] for h in hookdoc.read(where)["hooks"]]
assert not any(name in vars(hub()) for name in names), "a hook was decoded"
after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in model.named_modules()}
assert before == after, "something was attached"
assert not any(hasattr(m, "_picklehooks_name") for m in model.modules())
spec_only = picklehooks.load_hooks(model, where, trust=False)
print("spec only:", len(spec_only.hooks), sorted(spec_only.instrumentation.modules))
assert not any(name in vars(hub()) for name in names), "a hook was decoded"
"""


def test_without_trust_nothing_is_decoded_or_attached(saved):
    root, _, handle, _, _ = saved
    out = run_fresh(NO_TRUST, str(root / "hf"), cwd=REPO)
    assert "refused:" in out and "python -m picklehooks inspect" in out and "trust=True" in out
    assert f"spec only: 0 {handle[1]}" in out


def test_trust_false_names_every_hook_it_leaves_off(saved, tmp_path):
    """trust=False applies the spec alone and says so: which hooks were not attached, why, and how to attach them."""
    root, doc, handle, _, _ = saved
    model = transformers.GPT2LMHeadModel.from_pretrained(root / "hf")
    with pytest.warns(UserWarning, match=r"trust=False\) attached none") as caught:
        loaded = picklehooks.load_hooks(model, root / "hf", trust=False)
    message = " ".join(str(w.message) for w in caught)
    assert f"none of the {len(doc['hooks'])} hooks" in message
    for hook in doc["hooks"]:
        assert f"{hook['kind']} hook on {hook['module']} (fingerprint {hookdoc.fingerprint(hook['name'])})" in message
    assert "python -m picklehooks inspect" in message and "trust=True" in message
    assert loaded.hooks == [] and sorted(loaded.instrumentation.modules) == handle[1]
    attached = {getattr(fn, "__name__", None) for m in model.modules()
                for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for fn in hooks.values()}
    assert attached and attached.isdisjoint(h["name"] for h in doc["hooks"])  # the spec's hooks only
    loaded.remove()
    # A file with a spec and no hooks leaves nothing off: nothing to say.
    spec_only = tiny_gpt2()
    picklehooks.instrument(spec_only, modules=list(LAYERS))
    spec_only.save_pretrained(tmp_path)
    assert picklehooks.save_hooks(spec_only, tmp_path)["hooks"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        picklehooks.load_hooks(tiny_gpt2(), tmp_path, trust=False).remove()


def test_trust_must_name_every_hook(saved):
    root, doc, _, _, _ = saved
    model = transformers.GPT2LMHeadModel.from_pretrained(root / "hf")
    first = doc["hooks"][0]["name"]
    with pytest.raises(picklehooks.PicklehooksError, match="doesn't name 3 of the hooks"):
        picklehooks.load_hooks(model, root / "hf", trust=[first])
    assert not any(hasattr(m, "_picklehooks_name") for m in model.modules())
    assert not any(len(m._forward_hooks) for m in model.modules())


def test_inspect_lists_the_hooks_of_config_json_and_safetensors(saved):
    root, doc, _, _, _ = saved
    for where in (root / "hf", root / "model.safetensors"):
        proc = subprocess.run([sys.executable, "-m", "picklehooks", "inspect", str(where)], capture_output=True,
                              text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{len(doc['hooks'])} picklehooks hooks" in proc.stdout
        for hook in doc["hooks"]:
            assert f"fingerprint {hookdoc.fingerprint(hook['name'])}" in proc.stdout
        assert "def shift_pre(module, args, kwargs):" in proc.stdout and "instrumentation spec" in proc.stdout


HOSTILE = {
    "import": "import os\ndef evil(module, args, output):\n    os.system('touch {marker}')\n",
    "default": "def evil(module, args, output, _=__import__('os').system('touch {marker}')):\n    return output\n",
    "decorator": "@__import__('os').system('touch {marker}')\ndef evil(module, args, output):\n    return output\n",
}


@pytest.mark.parametrize("form", sorted(HOSTILE))
def test_a_hostile_hook_in_config_json_runs_nothing(tmp_path, form):
    marker = tmp_path / "ran"
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "hf")
    name = codec.encode(HOSTILE[form].format(marker=marker))
    hookdoc.write(tmp_path / "hf", {"format": hookdoc.FORMAT, "version": hookdoc.VERSION, "spec": None, "hooks": [
        {"module": "transformer.h.0", "kind": "forward", "order": 0, "name": name, "with_kwargs": False,
         "prepend": False, "always_call": False}]})
    proc = subprocess.run([sys.executable, "-m", "picklehooks", "inspect", str(tmp_path / "hf")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert "def evil" in proc.stdout and "1 picklehooks hook" in proc.stdout
    code = f"""
import sys, transformers, picklehooks
model = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1])
for trust in (None, True):
    try:
        picklehooks.load_hooks(model, sys.argv[1], trust=trust)
    except picklehooks.PicklehooksError as exc:
        print(trust, type(exc).__name__)
assert not any(len(m._forward_hooks) for m in model.modules()), "attached"
import torch
model(input_ids=torch.zeros(1, 4, dtype=torch.long))
"""
    out = run_fresh(code, str(tmp_path / "hf"), cwd=REPO)
    assert "None PicklehooksError" in out and "True DecodeError" in out
    assert not marker.exists()


def test_bad_documents_and_paths_are_named(tmp_path):
    model = tiny_gpt2()
    with pytest.raises(picklehooks.PicklehooksError, match="no config.json"):
        picklehooks.save_hooks(model, tmp_path)
    with pytest.raises(picklehooks.PicklehooksError, match="give an HF model directory"):
        picklehooks.save_hooks(model, tmp_path / "model.bin")
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(picklehooks.PicklehooksError, match="holds no picklehooks hooks"):
        picklehooks.load_hooks(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["picklehooks"] = {"format": hookdoc.FORMAT, "version": 1, "spec": None, "hooks": [{"module": 3}]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(picklehooks.PicklehooksError, match="hook 0"):
        picklehooks.load_hooks(model, tmp_path / "hf", trust=True)


def test_hooks_that_cannot_be_written_are_named(tmp_path):
    model = tiny_gpt2()
    model.save_pretrained(tmp_path)
    model.transformer.h[0].register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match="can't write 1 hooks that aren't portable"):
        doc = picklehooks.save_hooks(model, tmp_path)
    assert doc["hooks"] == [] and doc["spec"] is None


def test_a_spec_survives_json_and_chooses_the_same_modules():
    model = tiny_gpt2()
    handle = picklehooks.instrument(model, modules=["transformer.h.*.mlp", torch.nn.LayerNorm], capture="all",
                                    mode="both")
    spec = json.loads(json.dumps(handle.spec))
    assert {"type": "torch.nn.modules.normalization.LayerNorm"} in spec["modules"]
    other_model = copy.deepcopy(tiny_gpt2())  # held: a handle holds its model weakly
    other = picklehooks.instrument(other_model, spec=spec)
    assert sorted(other.modules) == sorted(handle.modules) and other.spec == handle.spec
    with pytest.raises(picklehooks.PicklehooksError, match="spec= and"):
        picklehooks.instrument(tiny_gpt2(), spec=spec, capture="output")


def test_the_spec_survives_an_instrumentation_dropped_without_remove(tmp_path):
    """instrument(model) without keeping the handle: save_hooks still finds its spec (the model keeps it)."""
    model = tiny_gpt2()
    picklehooks.instrument(model, modules=["transformer.h.0.mlp"])
    model.save_pretrained(tmp_path)
    import gc
    gc.collect()
    doc = picklehooks.save_hooks(model, tmp_path)
    assert doc["spec"]["modules"] == ["transformer.h.0.mlp"]
    assert os.path.exists(tmp_path / "config.json")
