"""``picklehooks.integrations.lightning.PicklehooksCallback`` under a real ``lightning.Trainer`` on CPU.

Ground truth is a second fit, same data, of an un-instrumented copy with plain PyTorch hooks
(float64); the gradient the optimizer used is read from plain SGD's update, ``(before - after) / lr``.
Gradient accumulation 2 and clipping throughout.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

import picklehooks  # noqa: E402
from picklehooks import _state  # noqa: E402
from picklehooks.capture.instrument import _NAME_ATTR  # noqa: E402
from picklehooks.integrations.lightning import PicklehooksCallback  # noqa: E402

LR, CLIP, STEPS, ACCUM = 1.0, 0.05, 3, 2
LAYERS = ("model.0", "model.2")


class Net(L.LightningModule):
    def __init__(self, poison_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.poison_at = poison_at

    def training_step(self, batch, batch_idx):
        if self.poison_at is not None and self.trainer.global_step == self.poison_at:
            with torch.no_grad():
                self.model[0].weight.fill_(float("nan"))
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), 3 * torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(module, root, callbacks, *, steps=STEPS, logger=True):
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, callbacks=callbacks,
                        default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, accelerator="cpu", devices=1, enable_checkpointing=False,
                        logger=logger)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader())
    return trainer


class PlainHooks(L.Callback):
    """Ground truth: forward/backward hooks in float64 per (step, layer, micro-batch), and SGD's update."""

    def __init__(self, module):
        self.out, self.grad_out, self.used = {}, {}, {}
        self.key = (0, 0)
        for name in LAYERS:
            sub = module.get_submodule(name)
            sub.register_forward_hook(lambda m, a, o, name=name: self.out.__setitem__((*self.key, name),
                                                                                     o.detach().double()))
            sub.register_full_backward_hook(lambda m, gi, go, name=name: self.grad_out.__setitem__(
                (*self.key, name), go[0].detach().double()))
        self.micro = 0
        self.step = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step != self.step:
            self.step, self.micro = trainer.global_step, 0
            self.before = {n: p.detach().double().clone() for n, p in module.named_parameters()}
        else:
            self.micro += 1
        self.key = (self.step, self.micro)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            for n, p in module.named_parameters():
                self.used[(self.step, n)] = (self.before[n] - p.detach().double()) / LR


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pl")
    module, plain_module = Net(), Net()
    callback = PicklehooksCallback(modules=list(LAYERS), capture=("output", "grad_output", "param_grad"), mode="both")
    fit(module, root / "rec", [callback])
    plain = PlainHooks(plain_module)
    fit(plain_module, root / "plain", [plain], logger=False)
    return callback, plain, module, root / "rec"


def test_steps_micro_batches_and_values_match_plain_hooks(runs):
    callback, plain, module, _ = runs
    log = callback.recorded
    assert sorted({r.step for r in log}) == list(range(STEPS))
    for step in range(STEPS):
        for name in LAYERS:
            outs = sorted((r for r in log.find(module=name, kind="output") if r.step == step), key=lambda r: r.call)
            assert [r.call for r in outs] == list(range(ACCUM))
            for r in outs:
                assert torch.allclose(r.tensor.double(), plain.out[(step, r.call, name)], rtol=1e-6, atol=1e-7)
            for r in (r for r in log.find(module=name, kind="grad_output") if r.step == step):
                assert torch.allclose(r.tensor.double(), plain.grad_out[(step, r.call, name)], rtol=1e-5, atol=1e-9)
    assert not any(_NAME_ATTR in m.__dict__ for m in module.modules())
    assert _state.active() is None and not _state._ANYWHERE


def test_param_grad_is_what_the_optimizer_used_after_clipping(runs):
    callback, plain, _, _ = runs
    for step in range(STEPS):
        recs = [r for r in callback.recorded.find(kind="param_grad") if r.step == step]
        assert sorted((r.module, r.path) for r in recs) == sorted(
            (name, p) for name in LAYERS for p in ("weight", "bias"))
        for r in recs:
            want = plain.used[(step, f"{r.module}.{r.path}")]
            assert torch.allclose(r.tensor.double(), want, rtol=1e-4, atol=1e-7), (step, r.module, r.path)
        total = math.sqrt(sum(r.stats["norm"] ** 2 for r in recs))
        assert math.isclose(total, CLIP, rel_tol=1e-4)  # every parameter is here: clipped to the limit


def test_summaries_reach_the_loggers_at_the_steps_of_selflog(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback, plain, _, root = runs
    events = [r for r, _, files in os.walk(root) if any(f.startswith("events.") for f in files)]
    acc = EventAccumulator(events[0], size_guidance={"scalars": 0})
    acc.Reload()
    loss_steps = sorted(e.step for e in acc.Scalars("loss"))
    for name in LAYERS:
        series = {e.step: e.value for e in acc.Scalars(f"picklehooks/output/norm/{name}")}
        assert sorted(series) == loss_steps == list(range(STEPS))
        for step, value in series.items():
            want = math.sqrt(sum(plain.out[(step, k, name)].norm().item() ** 2 for k in range(ACCUM)))
            assert math.isclose(value, want, rel_tol=1e-5)


class LoggedSteps(L.pytorch.loggers.Logger):
    """A logger that keeps the steps Lightning logged the training loss at."""

    def __init__(self):
        super().__init__()
        self.steps = []

    name, version = "steps", 0

    def log_metrics(self, metrics, step=None):
        if "loss" in metrics:
            self.steps.append(step)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("every_n_steps", [2, 3])
def test_the_recorded_steps_are_the_steps_lightning_logs(tmp_path, every_n_steps):
    """every_n_steps == log_every_n_steps: picklehooks records exactly the steps whose loss Lightning logs."""
    callback, logger = PicklehooksCallback(modules=list(LAYERS), capture=("output",), every_n_steps=every_n_steps), \
        LoggedSteps()
    trainer = L.Trainer(max_steps=7, accumulate_grad_batches=ACCUM, callbacks=[callback], logger=logger,
                        log_every_n_steps=every_n_steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), loader())
    assert len(logger.steps) >= 2 and sorted({r.step for r in callback.recorded}) == sorted(logger.steps)


@pytest.mark.parametrize("every_n_steps", [1, 3], ids=["recorded-step", "idle-step"])  # step 1: (1 + 1) % 3 != 0
def test_an_exception_leaves_nothing_recording_and_the_guard_hit_is_logged(tmp_path, every_n_steps):
    module = Net(poison_at=1)
    callback = PicklehooksCallback(modules=list(LAYERS), on_nonfinite="raise", every_n_steps=every_n_steps)
    with pytest.raises(picklehooks.NonfiniteError) as info:
        fit(module, tmp_path, [callback], logger=False)
    assert info.value.module == "model.0"
    assert _state.active() is None and not _state._ANYWHERE
    assert not any(_NAME_ATTR in m.__dict__ for m in module.modules())
    log = callback.recorded
    n = len(log)
    module.model(torch.randn(2, 4))
    assert len(log) == n
    bad = [r for r in log if r.stats and r.stats["n_nan"]]
    assert bad[0].module == "model.0" and bad[0].step == 1 and bad[0].stats["n_nan"] == info.value.nan
