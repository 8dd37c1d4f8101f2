"""PEFT surgery on an instrumented model (issue 29): records carry current names, one warning, ``refresh()``.

``get_peft_model`` moves each target ``Linear`` to ``….q_proj.base_layer``
under a LoRA wrapper; ``merge_and_unload`` puts it back. Ground truth: plain
forward hooks (values compared in float64) on an un-instrumented twin, built
and operated on with the same seeds, so that its LoRA weights are equal.
Also here: ``handle.spec`` round trips and its errors, and the warning for a
``record()`` block in which no instrumented module ran.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import gc
import json
import warnings

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks import PicklehooksError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# get_peft_model reads a transformers attribute that transformers 5 deprecates: not this file's concern.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SURGERY = "changed since instrument()"
NOTHING = "nothing was recorded in this record() block"
IDS = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
TARGETS = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"]
Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def no_stale_models():
    """For tests that count warnings: instrumented models of earlier tests that only a reference cycle
    keeps alive are still checked for surgery at each record(); collect them, so no warning is theirs."""
    gc.collect()


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config.use_cache = False  # no DynamicCache among LlamaModel's outputs
    return model


def lora(model: nn.Module) -> nn.Module:
    """``get_peft_model`` on ``model``, the same LoRA weights each time; B (zero-initialised) made nonzero."""
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))
    return peft_model.eval()


@contextlib.contextmanager
def caught():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def said(caught: list, text: str) -> list[str]:
    """The caught warnings' messages that contain ``text`` (transformers warns about other things)."""
    return [str(w.message) for w in caught if text in str(w.message)]


def leaves(value, path: str = "") -> dict[str, torch.Tensor]:
    """The tensors in a module's output by record path (``""``, ``"0"``, ``"last_hidden_state"``)."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
    out = {}
    for key, v in items:
        out.update(leaves(v, f"{path}/{key}" if path else str(key)))
    return out


def selected(root: nn.Module, patterns: list[str] | None) -> list[str]:
    """What a name-pattern selection means, written out: every submodule but the root for ``None``."""
    return [n for n, _ in root.named_modules()
            if (n != "" if patterns is None else any(fnmatch.fnmatchcase(n, p) for p in patterns))]


def plain_outputs(root: nn.Module, names, call=None) -> dict[tuple, torch.Tensor]:
    """{(module, path, call): float64 copy of each tensor returned}, from plain forward hooks on ``root``'s
    modules ``names``, when ``call`` (default ``root``) runs on IDS."""
    seen, calls, handles = {}, collections.Counter(), []

    def hook(module, args, output, name):
        for path, tensor in leaves(output).items():
            seen[(name, path, calls[name])] = tensor.detach().double().clone()
        calls[name] += 1

    for name in names:
        handles.append(root.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: hook(m, a, o, name)))
    try:
        with torch.no_grad():
            (call or root)(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    return seen


def recorded(call: nn.Module) -> dict[tuple, torch.Tensor]:
    """{(module, path, call): float64 recorded tensor} of one record() around ``call`` on IDS."""
    with picklehooks.record() as log, torch.no_grad():
        call(input_ids=IDS)
    return {(r.module, r.path, r.call): r.tensor.double() for r in log.records
            if r.kind == "output" and r.tensor is not None}


def modules_of(values: dict) -> set[str]:
    return {module for module, _, _ in values}


def assert_equal_values(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.usefixtures("no_stale_models")
class TestInstrumentedBeforeLora:
    """instrument() on the base model, then get_peft_model: hooks stay on the moved Linears, under their new names."""

    @pytest.mark.parametrize("patterns", [["*q_proj", "*v_proj"], None], ids=["q_v", "all"])
    def test_records_follow_the_moved_modules_until_refresh(self, patterns):
        """One warning names the moves; records match plain hooks on the same names; refresh() re-selects."""
        model, plain = llama(), llama()
        handle = picklehooks.instrument(model, modules=patterns, capture="output", mode="both")
        spec = handle.spec
        lora(model), lora(plain)

        with caught() as w:
            first, second = recorded(model), recorded(model)
        [message] = said(w, SURGERY)  # once per change, not once per record()
        assert f"moved: {Q0} -> {Q0}.base_layer" in message
        assert f"new, without hooks: {Q0}" in message  # the LoRA wrapper, which the spec chooses now
        assert "handle.refresh()" in message
        assert not said(w, NOTHING)

        tree = dict(model.named_modules())
        assert modules_of(first) <= tree.keys()
        assert {f"{n}.base_layer" for n in TARGETS} <= modules_of(first)
        assert not modules_of(first) & set(TARGETS)  # the wrappers have no hooks yet
        # The modules instrumented before, under their names now: hook them on the plain copy.
        before = [f"{n}.base_layer" if n in TARGETS else n for n in selected(llama(), patterns)]
        want = plain_outputs(plain, before)
        assert_equal_values(first, want)
        assert_equal_values(second, want)

        assert handle.refresh() is handle
        assert handle.spec == spec
        with caught() as w:
            after = recorded(model)
        assert not said(w, SURGERY) and not said(w, NOTHING)
        assert modules_of(after) <= dict(model.named_modules()).keys()
        assert set(TARGETS) <= modules_of(after)
        assert set(handle.modules) | set(handle.skipped) == set(selected(plain, patterns))
        if patterns is None:
            assert {f"{Q0}.lora_A.default", f"{Q0}.lora_B.default", f"{Q0}.base_layer"} <= modules_of(after)
        else:
            assert modules_of(after) == set(TARGETS)
        assert_equal_values(after, plain_outputs(plain, selected(plain, patterns)))
        # LoRA matters: the wrapper's output is not its base layer's.
        assert not torch.allclose(after[(Q0, "", 0)], first[(f"{Q0}.base_layer", "", 0)])

    def test_watched_parameters_follow_the_moved_modules(self):
        """param_grad records of a moved Linear carry its new name and equal the plain copy's .grad."""
        model, plain = llama(), llama()
        # The handle is dropped: the instrumented modules keep it, so the model is still checked for surgery.
        picklehooks.instrument(model, modules=["*q_proj"], capture=["param_grad"], mode="both")
        gc.collect()
        for m in (model, plain):
            lora(m)
            for name, p in m.named_parameters():  # PEFT freezes the base layers; train these ones too
                if name.endswith("q_proj.base_layer.weight"):
                    p.requires_grad_(True)
        with caught() as w, picklehooks.record() as log:
            model(input_ids=IDS).logits.double().sum().backward()
        assert len(said(w, SURGERY)) == 1, [str(x.message) for x in w]
        plain(input_ids=IDS).logits.double().sum().backward()
        got = {(r.module, r.path): r.tensor for r in log.records if r.kind == "param_grad"}
        names = [f"model.layers.{i}.self_attn.q_proj.base_layer" for i in range(2)]
        assert sorted(got) == [(n, "weight") for n in names]
        for name in names:
            torch.testing.assert_close(got[(name, "weight")].double(),
                                       plain.get_submodule(name).weight.grad.double())


@pytest.mark.usefixtures("no_stale_models")
class TestInstrumentedPeftModelMerged:
    """instrument() on the PeftModel, then merge_and_unload(): the base Linears move back to ….q_proj."""

    @pytest.mark.parametrize("patterns", [None, ["*self_attn.[qv]_proj*"]], ids=["all", "q_v"])
    def test_no_stale_names_then_refresh_then_instrument_the_merged_model(self, patterns):
        """Merged: no record names a ….base_layer that is gone; refresh() and instrument(merged, spec=) both work."""
        model, plain = llama(), llama()
        peft_model, plain_peft = lora(model), lora(plain)
        handle = picklehooks.instrument(peft_model, modules=patterns, capture="output", mode="both")
        with caught() as w:
            before = recorded(peft_model)
        assert not said(w, SURGERY) and not said(w, NOTHING)
        assert f"base_model.model.{Q0}.base_layer" in modules_of(before)
        assert_equal_values(before, plain_outputs(plain_peft, selected(plain_peft, patterns)))

        merged, plain_merged = peft_model.merge_and_unload(), plain_peft.merge_and_unload()
        # merge_and_unload returns the (changed) LlamaForCausalLM, which the PeftModel still holds.
        assert merged is not handle.model and merged is handle.model.base_model.model
        with caught() as w:
            got = recorded(merged)
        [message] = said(w, SURGERY)
        assert f"moved: base_model.model.{Q0}.base_layer -> base_model.model.{Q0}" in message
        assert "no longer in the model: " in message and f"{Q0}.lora_A.default" in message
        assert "handle.refresh()" in message
        assert not any(m.endswith(".base_layer") for m in modules_of(got))
        assert modules_of(got) <= dict(peft_model.named_modules()).keys()
        assert {f"base_model.model.{n}" for n in TARGETS} <= modules_of(got)
        # After the merge the spec's selection is exactly the modules that kept hooks, under their names now.
        assert_equal_values(got, plain_outputs(plain_peft, selected(plain_peft, patterns), plain_merged))

        # refresh() works on the handle's model, the PeftModel, with its names (base_model.model.…).
        handle.refresh()
        with caught() as w:
            got = recorded(merged)
        assert not said(w, SURGERY) and not said(w, NOTHING)
        assert set(handle.modules) | set(handle.skipped) == set(selected(plain_peft, patterns))
        assert not any("lora" in m or "base_layer" in m for m in handle.modules)
        assert_equal_values(got, plain_outputs(plain_peft, selected(plain_peft, patterns), plain_merged))

        # To record the merged model under its own names, instrument it with the same spec; its modules
        # carry the PeftModel handle's hooks until that handle is removed.
        with pytest.raises(PicklehooksError, match="already instrumented; call remove"):
            picklehooks.instrument(merged, spec=handle.spec)
        handle.remove()
        again = picklehooks.instrument(merged, spec=handle.spec)
        with caught() as w:
            got = recorded(merged)
        assert not said(w, SURGERY) and not said(w, NOTHING)
        assert set(TARGETS) <= modules_of(got) <= dict(merged.named_modules()).keys()
        assert set(again.modules) | set(again.skipped) == set(selected(plain_merged, patterns))
        assert_equal_values(got, plain_outputs(plain_merged, selected(plain_merged, patterns)))


    def test_remove_cleans_modules_that_left_the_tree(self):
        """The LoRA wrapper merge_and_unload drops, whose name the base Linear takes: remove() still cleans it."""
        peft_model = lora(llama())
        wrapper = peft_model.get_submodule(f"base_model.model.{Q0}")
        handle = picklehooks.instrument(peft_model, capture="output")
        assert "_picklehooks_name" in wrapper.__dict__
        merged = peft_model.merge_and_unload()
        with caught():
            recorded(merged)  # the check: the base Linear moves into the wrapper's name
        handle.remove()
        assert "_picklehooks_name" not in wrapper.__dict__ and not len(wrapper._forward_hooks)
        picklehooks.instrument(nn.Sequential(wrapper), modules=["0"]).remove()  # no "already instrumented"
        assert not any("_picklehooks_name" in m.__dict__ for m in peft_model.modules())


class Scaled(nn.Linear):
    """A Linear subclass nobody registered anywhere: a type in a spec matches it by its base class's name."""


class TestSpec:
    """handle.spec is plain JSON that instrument(model, spec=...) applies again by the same rule."""

    def test_survives_json_and_chooses_the_same_modules(self):
        """A spec through json.dumps/loads (or as the JSON text) chooses the same names on an identical model."""
        model = llama()
        handle = picklehooks.instrument(model, modules=["*q_proj", nn.Embedding, "lm_head"],
                                        capture=("grad_output", "output"), mode="both")
        spec = handle.spec
        assert json.loads(json.dumps(spec)) == spec
        assert spec["modules"] == ["*q_proj", {"type": "torch.nn.modules.sparse.Embedding"}, "lm_head"]
        want = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head"]
        assert list(handle.modules) == want
        for given in (json.loads(json.dumps(spec)), json.dumps(spec)):
            other_model = llama()
            other = picklehooks.instrument(other_model, spec=given)
            assert list(other.modules) == want
            assert other.spec == spec

    def test_a_type_is_stored_by_name_and_matches_subclasses(self):
        """{"type": "torch.nn.modules.linear.Linear"} chooses Linear subclasses, not PEFT's LoRA wrapper."""
        spec = picklehooks.instrument(llama(), modules=[nn.Linear]).spec
        assert spec["modules"] == [{"type": "torch.nn.modules.linear.Linear"}]

        seq = nn.Sequential(Scaled(2, 2), nn.ReLU(), nn.Linear(2, 2))
        assert list(picklehooks.instrument(seq, spec=json.loads(json.dumps(spec))).modules) == ["0", "2"]

        # PEFT's lora.Linear derives from nn.Module and LoraLayer, not nn.Linear: the spec chooses the
        # Linears inside it (base_layer, lora_A.default, lora_B.default), not the wrapper itself.
        assert not issubclass(peft.tuners.lora.Linear, nn.Linear)
        peft_model = lora(llama())
        chosen = picklehooks.instrument(peft_model, spec=spec).modules
        assert list(chosen) == [n for n, m in peft_model.named_modules() if isinstance(m, nn.Linear)]
        assert f"base_model.model.{Q0}.lora_A.default" in chosen and f"base_model.model.{Q0}" not in chosen

    @pytest.mark.parametrize("change, error", [
        ({"picklehooks_spec": 2}, "version 2"),
        ({"colour": "red"}, "unknown fields ['colour']"),
        ({"modules": [3]}, "modules: 3 is neither"),
        ({"modules": [{"type": 1}]}, "modules: {'type': 1} is neither"),
        ({"modules": "everything"}, "modules='everything'"),
        ({"capture": "output"}, "capture='output'"),
        ({"scriptable": "yes"}, "scriptable='yes'"),
    ])
    def test_a_bad_spec_names_the_problem(self, change, error):
        """A wrong version, an unknown field or a bad modules entry raise PicklehooksError quoting it."""
        spec = {**picklehooks.instrument(llama(), modules=["lm_head"]).spec, **change}
        with pytest.raises(PicklehooksError) as info:
            picklehooks.instrument(llama(), spec=spec)
        assert error in str(info.value)

    @pytest.mark.parametrize("spec, error", [({}, "not an instrumentation spec"), ("{", "not JSON")])
    def test_not_a_spec(self, spec, error):
        """Something that is no spec at all says so."""
        with pytest.raises(PicklehooksError, match=error):
            picklehooks.instrument(llama(), spec=spec)

    def test_spec_and_settings_together(self):
        """spec= beside capture= is refused, naming the setting."""
        spec = picklehooks.instrument(llama(), modules=["lm_head"]).spec
        with pytest.raises(PicklehooksError, match=r"spec= and \['capture'\]"):
            picklehooks.instrument(llama(), spec=spec, capture="all")


@pytest.mark.usefixtures("no_stale_models")
class TestNothingRecorded:
    """A record() block in which no instrumented module ran warns: a loaded model lost its hooks."""

    def test_an_uninstrumented_model_warns_once(self):
        """A fresh copy without hooks: one warning, pointing at load_hooks; the instrumented one: none."""
        model = llama()
        picklehooks.instrument(model)
        fresh = llama()
        with caught() as w:
            with picklehooks.record() as log:
                fresh(input_ids=IDS)
        assert len(log.records) == 0
        [message] = said(w, NOTHING)
        assert "picklehooks.load_hooks(" in message
        with caught() as w:
            with picklehooks.record() as log:
                model(input_ids=IDS)
        assert len(log.records) > 0 and not said(w, NOTHING)

    def test_a_gradient_only_model_without_backward_is_told_why(self):
        """Hooks that ran but had nothing to record (gradients only, a no_grad forward): the warning
        names that case too, and a backward in the block records without one."""
        model = llama()
        picklehooks.instrument(model, capture="grad_output")
        with caught() as w:
            with torch.no_grad(), picklehooks.record() as log:
                model(input_ids=IDS)
        assert len(log.records) == 0
        [message] = said(w, NOTHING)
        assert "captures only gradients" in message and "no_grad" in message
        with caught() as w:
            with picklehooks.record() as log:
                model(input_ids=IDS, labels=IDS).loss.backward()
        assert len(log.records) > 0 and not said(w, NOTHING)

    def test_a_block_left_by_an_exception_does_not_warn(self):
        """The exception says what went wrong; no warning is added to it."""
        with caught() as w, pytest.raises(ZeroDivisionError):
            with picklehooks.record():
                1 / 0
        assert not said(w, NOTHING)
