"""The diagnostics take what Hugging Face models take: dict batches, keyword arguments, ``lambda out: out.loss``.

Each answer on a tiny GPT-2 and Llama (real transformers code, built from
configs) is compared with the same diagnostic given the equivalent
positional form, and with ground truth from plain PyTorch hooks on an
un-instrumented copy. Also here: ``dead_units`` on transformers' own
activation classes, its error for a module that isn't one, the errors for
batches of the wrong type, and the progress bar (a terminal only).
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import picklehooks
from picklehooks.diagnostics import (compare, dead_units, find_nonfinite, gradient_conflict, gradient_flow,
                                     record_forward)
from picklehooks.diagnostics.jacobian import hutchinson_jacobian_norm, vjp
from tests.models.faults import NaNGrad, dead_relu

transformers = pytest.importorskip("transformers")
from transformers.activations import NewGELUActivation, SiLUActivation  # noqa: E402

VOCAB = 100


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama}


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding, so the mask matters
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def causal_lm_loss(out, labels):
    """The loss HF computes for a causal LM, written out: the positional form's ``loss_fn(output, *rest)``."""
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))


def tensors(value):
    """The tensors of a module's output (a tensor, a tuple, a ModelOutput), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for v in value for t in tensors(v)] if isinstance(value, (tuple, list)) else []


class TestFindNonfinite:
    """find_nonfinite(model, **batch) finds what plain forward/backward hooks find."""

    @staticmethod
    def first_bad_output(model, kwargs) -> str | None:
        """Ground truth: the first module (in forward-hook order, i.e. by when it returned) with a non-finite output."""
        order = []
        handles = [m.register_forward_hook(lambda m, i, o, n=n: order.append((n, o))) for n, m in
                   model.named_modules() if n]
        try:
            with torch.no_grad():
                model(**kwargs)
        finally:
            for h in handles:
                h.remove()
        return next((n for n, o in order if any(not torch.isfinite(t).all() for t in tensors(o)
                                                 if t.is_floating_point())), None)

    @pytest.mark.parametrize("name", MODELS)
    def test_clean_model_keywords_and_dict(self, name):
        model = MODELS[name]()
        assert find_nonfinite(model, **batch()) is None
        assert find_nonfinite(model, **batch(), loss_fn=lambda out: out.loss) is None

    @pytest.mark.parametrize("name, layer", [("gpt2", "transformer.h.1.mlp.c_fc"),
                                             ("llama", "model.layers.1.mlp.down_proj")])
    def test_planted_nan_forward(self, name, layer):
        model = MODELS[name]()
        with torch.no_grad():
            model.get_submodule(layer).weight[0, 0] = float("nan")
        truth = self.first_bad_output(copy.deepcopy(model), batch())
        assert truth == layer
        report = find_nonfinite(model, **batch())
        assert (report.module, report.kind, report.phase) == (layer, "output", "forward")

    def test_backward_of_out_loss_without_loss_fn(self):
        """With labels and no loss_fn, the output's .loss is differentiated: a backward-only fault is found."""
        model = gpt2()
        model.transformer.h[1].mlp.act = torch.nn.Sequential(NewGELUActivation(), NaNGrad())
        reference = copy.deepcopy(model)
        order = []  # ground truth: full backward hooks, in the order backward reaches them
        for n, m in reference.named_modules():  # the blocks: their inputs need grad, their outputs are tensors
            if n.startswith("transformer.h.") and not isinstance(m, torch.nn.Dropout):
                m.register_full_backward_hook(lambda m, gin, gout, n=n: order.append(
                    (n, all(torch.isfinite(g).all() for g in gin if g is not None))))
        grads = torch.autograd.grad(reference(**batch()).loss, [p for p in reference.parameters()],
                                    allow_unused=True)
        assert any(g is not None and not torch.isfinite(g).all() for g in grads)
        truth = next(n for n, finite in order if not finite)
        assert truth == "transformer.h.1.mlp.act.1"
        for report in (find_nonfinite(model, **batch()), find_nonfinite(model, **batch(), loss_fn=lambda out: out.loss),
                       find_nonfinite(model, batch()["input_ids"], labels=batch()["labels"])):
            assert (report.module, report.kind, report.phase) == (truth, "grad_input", "backward")
        assert find_nonfinite(model, input_ids=batch()["input_ids"]) is None  # no labels, no loss: forward only


class TestGradientFlow:
    """gradient_flow over dict batches matches its positional form and plain tensor hooks."""

    @staticmethod
    def plain_norms(model, batches) -> dict[str, list[float]]:
        """Ground truth: per module and batch, the norm of the gradients arriving at its output tensors."""
        norms: dict[str, list[float]] = {}
        step = {}

        def keep(name):
            def hook(module, inputs, output):
                outs = [t for t in tensors(output) if t.requires_grad]
                if any(o is i for o in outs for i in tensors(inputs)):
                    return  # an identity (eval dropout) hands its input through: not its own value
                for t in outs:
                    t.register_hook(lambda g: step.__setitem__(name, step.get(name, 0.0) + float(g.norm()) ** 2))
            return hook

        for n, m in model.named_modules():
            if n:
                m.register_forward_hook(keep(n))
        for b in batches:
            step.clear()
            loss = model(**b).loss
            torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
            for n, sq in step.items():
                norms.setdefault(n, []).append(math.sqrt(sq))
        return norms

    @pytest.mark.parametrize("name", MODELS)
    def test_dict_batches_match_plain_hooks_and_positional_form(self, name):
        model = MODELS[name]()
        batches = [batch(0), batch(1)]
        truth = self.plain_norms(copy.deepcopy(model), batches)
        layers = [n for n in truth if n.endswith(("mlp", "c_fc", "down_proj", "q_proj", "c_attn", "lm_head"))]
        assert len(layers) >= 4
        flows = {
            "out.loss": gradient_flow(model, batches, lambda out: out.loss),
            "no loss_fn": gradient_flow(model, batches),
            # the positional form: the model takes input_ids, loss_fn(output, labels) the rest
            "positional": gradient_flow(model, [(b["input_ids"], b["labels"]) for b in batches],
                                        causal_lm_loss, n_inputs=1),
        }
        for form in ("out.loss", "no loss_fn"):
            for layer in layers:
                assert flows[form].norms[layer] == pytest.approx(truth[layer], rel=1e-4), (form, layer)
        # The positional form has no attention mask: it is the dict form without one.
        unmasked = gradient_flow(model, [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batches])
        assert flows["positional"].layers == unmasked.layers
        for layer in unmasked.layers:
            assert flows["positional"].norms[layer] == pytest.approx(unmasked.norms[layer], rel=1e-4), layer
        assert flows["positional"].norms != flows["out.loss"].norms  # the mask mattered: the check has teeth
        with torch.no_grad():
            assert flows["out.loss"].losses == pytest.approx([float(model(**b).loss) for b in batches])

    def test_one_argument_loss_fn_gets_the_output_alone(self):
        """loss_fn taking one argument gets the output, even when the tuple batch leaves items for the loss."""
        model = gpt2()
        ids = batch()["input_ids"]
        tuple_form = gradient_flow(model, [(ids, ids)], lambda out: out.logits.pow(2).mean(), n_inputs=1)
        tensor_form = gradient_flow(model, [ids], lambda out: out.logits.pow(2).mean())
        dict_form = gradient_flow(model, [{"input_ids": ids}], lambda out: out.logits.pow(2).mean())
        assert tuple_form.norms == tensor_form.norms == dict_form.norms

    def test_no_loss_anywhere_is_a_clear_error(self):
        with pytest.raises(picklehooks.PicklehooksError, match=r"carries no loss.*loss_fn="):
            gradient_flow(gpt2(), [{"input_ids": batch()["input_ids"]}])
        with pytest.raises(picklehooks.PicklehooksError, match="n_inputs=1 splits tuple batches"):
            gradient_flow(gpt2(), [batch()], n_inputs=1)


def plain_dead(model, batches, types) -> dict[str, list[int]]:
    """Ground truth: per activation module of ``types``, the last-dimension units never > 0 in any batch."""
    alive = {}
    handles = [m.register_forward_hook(lambda m, i, y, n=n: alive.__setitem__(
        n, alive.get(n, False) | (y > 0).reshape(-1, y.shape[-1]).any(0)))
        for n, m in model.named_modules() if isinstance(m, types)]
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in handles:
        h.remove()
    return {n: (~a).nonzero().flatten().tolist() for n, a in alive.items()}


class TestDeadUnits:
    """dead_units knows transformers' activations, and matches plain hooks."""

    @pytest.mark.parametrize("name", MODELS)
    def test_transformers_activations_match_plain_hooks(self, name):
        model = MODELS[name]()
        with torch.no_grad():  # plant dead units: a pre-activation that can never be positive
            if name == "gpt2":
                model.transformer.h[0].mlp.c_fc.bias[:5] = -1e3
                act = NewGELUActivation
            else:
                model.model.layers[0].mlp.gate_proj.weight[:3] = 0  # silu(0) = 0: never positive
                act = SiLUActivation
        batches = [batch(0), batch(1)]
        truth = plain_dead(copy.deepcopy(model), batches, act)
        assert len(truth) == 2 and len(next(iter(truth.values()))) in (5, 3)
        for rows in (dead_units(model, batches), dead_units(model, batches, modules=[act]),
                     dead_units(model, batches, modules="*.mlp.*")):
            assert {r["module"]: r["indices"] for r in rows} == truth
            assert {(r["type"], r["criterion"], r["batches"]) for r in rows} == {(act.__name__, "never active", 2)}
        positional = dead_units(model, [b["input_ids"] for b in batches])  # a single tensor per batch
        unmasked = [{"input_ids": b["input_ids"]} for b in batches]
        assert {r["module"]: r["indices"] for r in positional} == plain_dead(copy.deepcopy(model), unmasked, act)
        assert not any(m._forward_hooks for m in model.modules())

    @pytest.mark.parametrize("modules, named, hint", [
        (["transformer.h.0.mlp"], "'transformer.h.0.mlp' of class transformers.models.gpt2.modeling_gpt2.GPT2MLP",
         "activations inside it are 'transformer.h.0.mlp.act' (NewGELUActivation)"),
        (["transformer.h.0.mlp.c_fc"], "'transformer.h.0.mlp.c_fc' of class transformers.pytorch_utils.Conv1D", ""),
        ([torch.nn.Dropout], "of class torch.nn.modules.dropout.Dropout", ""),
    ])
    def test_a_named_module_that_isnt_an_activation(self, modules, named, hint):
        with pytest.raises(picklehooks.PicklehooksError) as info:
            dead_units(gpt2(), [batch()], modules=modules)
        message = str(info.value)
        assert named in message and "is not an activation" in message and "NewGELUActivation" in message
        assert hint in message and "subclasses" in message

    def test_wildcards_keep_the_activations_they_match(self):
        rows = dead_units(gpt2(), [batch()], modules="transformer.h.1.*")
        assert [r["module"] for r in rows] == ["transformer.h.1.mlp.act"]
        with pytest.raises(picklehooks.PicklehooksError, match="none of them an activation"):
            dead_units(gpt2(), [batch()], modules="transformer.h.1.attn.*")

    def test_a_model_without_activations(self):
        with pytest.raises(picklehooks.PicklehooksError, match="found no activation module .*NewGELUActivation"):
            dead_units(torch.nn.Sequential(torch.nn.Linear(8, 2)), [torch.randn(2, 8)])


class TestOtherDiagnostics:
    """record_forward, gradient_conflict and the Jacobian take dicts and keywords too."""

    def test_record_forward_keywords(self):
        model = gpt2()
        b = batch()
        seen = {}
        reference = copy.deepcopy(model)
        for n, m in reference.named_modules():
            if n.endswith(("c_fc", "mlp.act", "ln_f")):
                m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.detach()))
        with torch.no_grad():
            reference(**b)
        log = record_forward(model, **b)
        for n, want in seen.items():
            (rec,) = log.find(n, "output")
            assert torch.equal(rec.tensor, want), n
        ids_only = record_forward(model, input_ids=b["input_ids"])
        result = compare(ids_only, record_forward(model, b["input_ids"]))
        assert result.first_divergence is None and result.rows and not result.missing

    def test_gradient_conflict_dict_inputs(self):
        model = gpt2()
        b = batch()
        tasks = {"lm": lambda out: out.loss, "norm": lambda out: out.logits.pow(2).mean()}
        report = gradient_conflict(model, b, tasks)
        reference = copy.deepcopy(model)  # ground truth: the two tasks' gradients, plainly
        named = dict(reference.named_parameters())
        out = reference(**b)
        ga = torch.autograd.grad(out.loss, list(named.values()), retain_graph=True, allow_unused=True)
        gb = torch.autograd.grad(out.logits.pow(2).mean(), list(named.values()), allow_unused=True)
        shared = [i for i, (a, g) in enumerate(zip(ga, gb)) if a is not None and g is not None and a.any() and g.any()]
        assert report.params == [list(named)[i] for i in shared]
        a = torch.cat([ga[i].flatten().double() for i in shared])
        g = torch.cat([gb[i].flatten().double() for i in shared])
        assert report.matrix[0][1] == pytest.approx(float(a @ g / (a.norm() * g.norm())), rel=1e-5)
        ids = b["input_ids"]
        logits_tasks = {"a": lambda out: out.logits[..., :50].mean(), "b": lambda out: out.logits.pow(2).mean()}
        forms = [gradient_conflict(model, x, logits_tasks) for x in ({"input_ids": ids}, (ids,), ids)]
        assert forms[0].matrix == forms[1].matrix == forms[2].matrix

    @pytest.mark.parametrize("name, out_layer, in_layer", [("gpt2", "transformer.h.1.mlp", "transformer.h.0.mlp"),
                                                           ("llama", "model.layers.1.mlp", "model.layers.0.mlp")])
    def test_jacobian_dict_inputs(self, name, out_layer, in_layer):
        model = MODELS[name]()
        b = {k: v for k, v in batch().items() if k != "labels"}
        reference = copy.deepcopy(model)
        kept = {}
        for n in (out_layer, in_layer):
            reference.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: kept.__setitem__(n, o))
        reference(**b)
        (want,) = torch.autograd.grad(kept[out_layer], kept[in_layer], torch.ones_like(kept[out_layer]))
        assert torch.allclose(vjp(model, b, out_layer, in_layer), want, atol=1e-6)
        ids = {"input_ids": b["input_ids"]}
        assert torch.equal(vjp(model, ids, out_layer, in_layer), vjp(model, (b["input_ids"],), out_layer, in_layer))
        assert hutchinson_jacobian_norm(model, ids, out_layer, in_layer, samples=4) == \
            hutchinson_jacobian_norm(model, b["input_ids"], out_layer, in_layer, samples=4)


class TestBadBatches:
    """A batch of the wrong type is named, with the forms that work."""

    @pytest.mark.parametrize("bad", ["input_ids", 3])
    def test_gradient_flow_and_dead_units(self, bad):
        forms = r"tuple of positional arguments.*dict of keyword arguments.*single tensor"
        with pytest.raises(picklehooks.PicklehooksError, match=rf"batch 0 is a {type(bad).__name__} .*{forms}"):
            gradient_flow(gpt2(), [bad])
        with pytest.raises(picklehooks.PicklehooksError, match=rf"batch 1 is a {type(bad).__name__} .*{forms}"):
            dead_units(gpt2(), [batch(), bad])
        with pytest.raises(picklehooks.PicklehooksError, match=rf"inputs is a {type(bad).__name__} .*{forms}"):
            gradient_conflict(gpt2(), bad, {"a": lambda out: out.loss, "b": lambda out: out.loss})

    def test_one_batch_instead_of_a_list(self):
        with pytest.raises(picklehooks.PicklehooksError, match=r"iterable of batches, got one dict.*\[batch\]"):
            gradient_flow(gpt2(), batch())


class TestProgress:
    """Long loops show a tqdm bar when stderr is a terminal, and nothing otherwise."""

    RUNS = {
        "gradient_flow": lambda: gradient_flow(gpt2(), [batch(0), batch(1)]),
        "dead_units": lambda: dead_units(dead_relu(2), [torch.randn(4, 8), torch.randn(4, 8)]),
        "Jacobian norm": lambda: hutchinson_jacobian_norm(dead_relu(2), torch.randn(4, 8), "2", "0", samples=2),
        "compare": lambda: compare(record_forward(dead_relu(2), torch.ones(1, 8)),
                                   record_forward(dead_relu(2), torch.ones(1, 8))),
    }
    TOTALS = {"gradient_flow": "2/2", "dead_units": "2/2", "Jacobian norm": "2/2", "compare": "3/3"}  # 3 modules

    @pytest.mark.parametrize("desc", RUNS)
    def test_bar_in_a_terminal_only(self, desc, capsys, monkeypatch):
        pytest.importorskip("tqdm")
        self.RUNS[desc]()
        assert desc not in capsys.readouterr().err  # pytest's captured stderr is no terminal
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        self.RUNS[desc]()
        err = capsys.readouterr().err
        assert f"{desc}: 100%" in err and self.TOTALS[desc] in err

    def test_no_tqdm_no_bar_no_error(self, capsys, monkeypatch):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
        self.RUNS["dead_units"]()
        assert "dead_units" not in capsys.readouterr().err
