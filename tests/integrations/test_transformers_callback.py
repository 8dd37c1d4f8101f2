"""``picklehooks.integrations.transformers.PicklehooksCallback`` under the real ``transformers.Trainer``.

Ground truth is a second Trainer run, same seed and data, of an un-instrumented copy of the model
with plain PyTorch hooks (float64); the gradient the optimizer used is read from plain SGD's
parameter update, ``(before - after) / lr``, never from picklehooks. A tiny GPT-2 (from its config,
no dropout) trains for a few steps with gradient accumulation 2 and clipping.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import picklehooks  # noqa: E402
from picklehooks import _state  # noqa: E402
from picklehooks.capture.instrument import _NAME_ATTR  # noqa: E402
from picklehooks.integrations.transformers import PicklehooksCallback  # noqa: E402

LR, CLIP, STEPS, ACCUM = 1.0, 0.05, 3, 2
LAYERS = ("transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.h.1.attn.c_proj")


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 100, (12,), generator=g), "labels": torch.randint(0, 100, (12,), generator=g)}
            for _ in range(n)]


def training_args(out, **overrides):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=ACCUM,
              max_steps=STEPS, max_grad_norm=CLIP, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
              report_to=[], logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def trainer_for(model, out, callbacks, **overrides):
    return transformers.Trainer(model=model, args=training_args(out, **overrides), train_dataset=dataset(),
                                callbacks=callbacks)


def train(model, out, callbacks, **overrides):
    trainer = trainer_for(model, out, callbacks, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


class PlainHooks(transformers.TrainerCallback):
    """Ground truth: forward/backward hooks in float64, per step (1-based, as the Trainer logs) and micro-batch,
    and the gradient the optimizer used, from SGD's update of each parameter."""

    def __init__(self, model, layers):
        self.model, self.layers = model, layers
        self.step, self.micro = 0, -1
        self.out, self.grad_out, self.used = {}, {}, {}
        for name in layers:
            module = model.get_submodule(name)
            module.register_forward_hook(self._forward(name))
            module.register_full_backward_hook(self._backward(name))

    def _forward(self, name):
        def hook(module, args, output):
            value = output[0] if isinstance(output, tuple) else output
            self.out[(self.step, name, self.micro)] = value.detach().double()
        return hook

    def _backward(self, name):
        def hook(module, grad_input, grad_output):
            self.grad_out[(self.step, name, self.micro)] = grad_output[0].detach().double()
        return hook

    def on_step_begin(self, args, state, control, **kw):
        self.step, self.micro = state.global_step + 1, 0
        self.before = {n: p.detach().double().clone() for n, p in self.model.named_parameters()}

    def on_substep_end(self, args, state, control, **kw):
        self.micro += 1

    def on_step_end(self, args, state, control, **kw):
        for n, p in self.model.named_parameters():
            self.used[(self.step, n)] = (self.before[n] - p.detach().double()) / LR


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One instrumented run (TensorBoard on) and one plain run, from the same initial weights."""
    model = tiny_gpt2()
    plain_model = copy.deepcopy(model)
    out = tmp_path_factory.mktemp("hf")
    callback = PicklehooksCallback(capture=("output", "grad_output", "param_grad"), mode="both", modules=list(LAYERS))
    train(model, out / "rec", [callback], report_to=["tensorboard"])
    plain = PlainHooks(plain_model, LAYERS)
    train(plain_model, out / "plain", [plain])
    return callback, plain, model, out / "rec"


def test_records_carry_the_trainers_step_and_micro_batches_as_calls(runs):
    callback, plain, model, _ = runs
    log = callback.recorded
    assert sorted({r.step for r in log}) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for name in LAYERS:
            outs = [r for r in log.find(module=name, kind="output") if r.step == step]
            assert [r.call for r in outs] == list(range(ACCUM)), (step, name)
            for r in outs:
                want = plain.out[(step, name, r.call)]
                assert torch.allclose(r.tensor.double(), want, rtol=1e-5, atol=1e-6), (step, name, r.call)
                assert math.isclose(r.stats["norm"], want.norm().item(), rel_tol=1e-5)
            grads = sorted((r for r in log.find(module=name, kind="grad_output") if r.step == step), key=lambda r: r.call)
            assert [r.call for r in grads] == list(range(ACCUM))
            for r in grads:
                assert torch.allclose(r.tensor.double(), plain.grad_out[(step, name, r.call)], rtol=1e-4, atol=1e-9)
    # The hooks are gone once training ends, and nothing records.
    assert not any(_NAME_ATTR in m.__dict__ for m in model.modules())
    assert _state.active() is None and not _state._ANYWHERE


def test_param_grad_is_the_accumulated_clipped_gradient_the_optimizer_used(runs):
    callback, plain, model, _ = runs
    log = callback.recorded
    for step in range(1, STEPS + 1):
        recs = [r for r in log.find(kind="param_grad") if r.step == step]
        assert recs and all(r.call == 0 for r in recs)
        assert len({(r.module, r.path) for r in recs}) == len(recs)  # once per parameter and step
        total = 0.0
        for r in recs:
            want = plain.used[(step, f"{r.module}.{r.path}")]
            assert torch.allclose(r.tensor.double(), want, rtol=1e-3, atol=1e-6), (step, r.module, r.path)
            total += r.stats["norm"] ** 2
        # Clipping was active: these layers' share of the clipped gradient is at most max_grad_norm.
        assert math.sqrt(total) <= CLIP * (1 + 1e-4)


def test_clipping_changed_the_gradient(tmp_path):
    """Without clipping the same step's gradient is larger: what was recorded is after clipping."""
    model = tiny_gpt2()
    plain = PlainHooks(model, ())
    train(model, tmp_path, [plain], max_grad_norm=0.0, max_steps=1)
    unclipped = math.sqrt(sum(v.norm().item() ** 2 for v in plain.used.values()))
    assert unclipped > 2 * CLIP


def test_summaries_reach_the_trainers_tensorboard_at_each_step(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback, plain, _, out = runs
    events = [os.path.join(root) for root, _, files in os.walk(out) if any(f.startswith("events.") for f in files)]
    assert len(events) == 1  # the Trainer's own writer, not one of ours
    acc = EventAccumulator(events[0], size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name in LAYERS:
        series = {e.step: e.value for e in acc.Scalars(f"picklehooks/output/norm/{name}")}
        assert sorted(series) == list(range(1, STEPS + 1))
        for step, value in series.items():
            want = math.sqrt(sum(plain.out[(step, name, k)].norm().item() ** 2 for k in range(ACCUM)))
            assert math.isclose(value, want, rel_tol=1e-5)
        if f"picklehooks/param_grad/norm/{name}" not in tags:
            assert name.endswith(".mlp")  # a block that holds no parameter of its own
            continue
        grad = {e.step: e.value for e in acc.Scalars(f"picklehooks/param_grad/norm/{name}")}
        assert sorted(grad) == list(range(1, STEPS + 1))
        for step, value in grad.items():
            want = math.sqrt(sum(v.norm().item() ** 2 for (s, n), v in plain.used.items()
                                 if s == step and n.rsplit(".", 1)[0] == name))
            assert math.isclose(value, want, rel_tol=1e-3)
    # The Trainer's own loss is logged at the same steps.
    assert sorted(e.step for e in acc.Scalars("train/loss")) == list(range(1, STEPS + 1))
    assert not any("nonfinite" in t for t in tags)


def logged_loss_steps(trainer) -> list[int]:
    """The steps the Trainer itself logged a training loss at (its log history)."""
    return sorted(e["step"] for e in trainer.state.log_history if "loss" in e)


@pytest.mark.parametrize("first", [False, True], ids=["interval", "logging_first_step"])
def test_the_recorded_steps_are_the_steps_the_trainer_logs(tmp_path, first):
    """every_n_steps == logging_steps: picklehooks records exactly the steps whose loss the Trainer logs."""
    callback = PicklehooksCallback(modules=list(LAYERS), capture=("output",), every_n_steps=3)
    trainer = train(tiny_gpt2(), tmp_path, [callback], max_steps=7, logging_steps=3, logging_first_step=first)
    logged = logged_loss_steps(trainer)
    assert len(logged) >= 2 and sorted({r.step for r in callback.recorded}) == logged


def test_every_n_steps_records_one_step_in_n_and_sinks_to_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    callback = PicklehooksCallback(modules=list(LAYERS), every_n_steps=2, sink=tmp_path / "sink")
    trainer = train(tiny_gpt2(), tmp_path / "out", [callback], max_steps=5, logging_steps=2)
    frame = picklehooks.Log.load(tmp_path / "sink").to_pandas()
    assert sorted(set(frame["step"])) == logged_loss_steps(trainer) and len(set(frame["step"])) == 5 // 2
    assert sorted(set(frame["kind"])) == ["grad_output", "output"]


def test_mlflow_run_gets_the_summaries(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "picklehooks-test")
    model = tiny_gpt2()
    plain_model = copy.deepcopy(model)
    callback = PicklehooksCallback(modules=list(LAYERS))
    train(model, tmp_path / "out", [callback], report_to=["mlflow"], max_steps=2)
    plain = PlainHooks(plain_model, LAYERS)
    train(plain_model, tmp_path / "plain", [plain], max_steps=2)
    client = mlflow.tracking.MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("picklehooks-test").experiment_id])[0]
    name = LAYERS[0]
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"picklehooks/output/norm/{name}")}
    assert sorted(history) == [1, 2]
    for step, value in history.items():
        want = math.sqrt(sum(plain.out[(step, name, k)].norm().item() ** 2 for k in range(ACCUM)))
        assert math.isclose(value, want, rel_tol=1e-6)


class PoisonAt(transformers.TrainerCallback):
    """Turns a weight into NaN when the given (0-based) optimizer step begins."""

    def __init__(self, model, index):
        self.model, self.index = model, index

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.index:
            with torch.no_grad():
                self.model.get_submodule("transformer.h.1.mlp.c_fc").weight.fill_(float("nan"))


@pytest.mark.parametrize("every_n_steps", [1, 3], ids=["recorded-step", "idle-step"])  # step 2: 2 % 3 != 0
def test_a_guard_stop_leaves_nothing_recording_and_is_in_the_log(tmp_path, every_n_steps):
    model = tiny_gpt2()
    callback = PicklehooksCallback(modules=list(LAYERS), on_nonfinite="raise", every_n_steps=every_n_steps)
    with pytest.raises(picklehooks.NonfiniteError) as info:
        train(model, tmp_path / "out", [callback, PoisonAt(model, 1)])
    assert info.value.module == "transformer.h.1.mlp"
    assert _state.active() is None and not _state._ANYWHERE
    assert not any(_NAME_ATTR in m.__dict__ for m in model.modules())  # hooks removed
    log = callback.recorded
    n = len(log)
    model(input_ids=torch.randint(0, 100, (1, 8)))  # an unrelated forward afterwards records nothing
    assert len(log) == n
    bad = [r for r in log if r.stats and (r.stats["n_nan"] or r.stats["n_inf"])]
    assert bad[0].module == "transformer.h.1.mlp" and bad[0].step == 2
    assert bad[0].stats["n_nan"] == info.value.nan > 0
    from picklehooks.diagnostics.report import write_report
    log_dir = tmp_path / "log"
    log.save(log_dir)
    write_report(log_dir, tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "No NaN or Inf" not in text and "transformer.h.1.mlp" in text


def test_an_exception_in_the_step_removes_everything(tmp_path):
    class Boom(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, model=None, **kw):
            model.transformer.h[0].mlp.register_forward_hook(self.fail)

        @staticmethod
        def fail(*_):
            raise RuntimeError("boom")

    model = tiny_gpt2()
    callback = PicklehooksCallback(modules=list(LAYERS))
    trainer = trainer_for(model, tmp_path, [callback, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert _state.active() is None and not _state._ANYWHERE
    assert not any(_NAME_ATTR in m.__dict__ for m in model.modules())
    assert "training_step" not in vars(trainer)  # the wrapper is gone
    assert len(callback.recorded) > 0  # what the step recorded before it failed is kept


def test_bad_arguments_are_named_before_training():
    with pytest.raises(picklehooks.PicklehooksError, match="every_n_steps=0"):
        PicklehooksCallback(every_n_steps=0)
    with pytest.raises(picklehooks.PicklehooksError, match="example_inputs"):
        PicklehooksCallback(example_inputs=(1,))
    with pytest.raises(picklehooks.PicklehooksError, match="'grads'"):
        PicklehooksCallback(capture=("grads",))
