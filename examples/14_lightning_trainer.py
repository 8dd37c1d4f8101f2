"""Debug a Lightning fit with one callback: records at Lightning's steps, summaries in its logger.

Shows:

1. ``PicklehooksCallback(...)`` added to a real ``lightning.Trainer``: it
   instruments the ``LightningModule`` when fitting starts and removes the
   hooks when it ends (module names are relative to it: ``net.0``).
2. ``accumulate_grad_batches=2``: ``call`` is the micro-batch within the step.
3. ``on_nonfinite="raise"``: a guard stops the run at the first NaN; nothing
   keeps recording, and the log holds the bad value, so a report names it.

Needs ``pip install 'picklehooks[lightning,log]'``. CPU, a few seconds.
"""

from __future__ import annotations

import tempfile
import warnings

import lightning
import torch
from torch import nn

import picklehooks
from picklehooks.integrations.lightning import PicklehooksCallback


class Regressor(lightning.LightningModule):
    def __init__(self, explode_at: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.explode_at = explode_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.explode_at:
            x = x * float("inf")  # a corrupt batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(module, callback, root):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = lightning.Trainer(max_steps=6, accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=[callback],
                                default_root_dir=root, accelerator="cpu", enable_progress_bar=False,
                                enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notices about this tiny set-up
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))


with tempfile.TemporaryDirectory() as root:
    callback = PicklehooksCallback(capture=("output", "grad_output", "param_grad"), every_n_steps=3)
    fit(Regressor(), callback, root)
    frame = callback.recorded.to_pandas(module="net.0", kind="output")
    print("net.0 outputs at the steps Lightning logs with log_every_n_steps=3 (2 and 5), one per micro-batch:")
    print(frame[["step", "call", "mean", "absmax"]].to_string(index=False))

    guarded = PicklehooksCallback(on_nonfinite="raise")
    try:
        fit(Regressor(explode_at=4), guarded, root)
    except picklehooks.NonfiniteError as exc:
        print("stopped:", exc)
    hit = [r for r in guarded.recorded if r.stats and r.stats["n_inf"] + r.stats["n_nan"]][0]
    print(f"the log names it too: module {hit.module!r}, step {hit.step}, {hit.stats['n_inf']} Inf")
    assert picklehooks._state.active() is None  # nothing records after the stop
