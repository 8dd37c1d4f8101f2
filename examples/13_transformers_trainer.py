"""Debug a Hugging Face ``Trainer`` run with one callback: per-layer records at the Trainer's steps.

Shows:

1. ``PicklehooksCallback(...)`` added to a real ``transformers.Trainer``: it
   instruments the model when training begins and removes the hooks when it ends.
2. Gradient accumulation: records carry the Trainer's global step, and ``call``
   is the micro-batch within the step.
3. ``param_grad``: the accumulated gradient the optimizer used, after clipping
   (so its norm is at most ``max_grad_norm``).
4. The same per-layer summaries in the Trainer's own TensorBoard run, tagged
   ``picklehooks/<kind>/<statistic>/<layer>``.

Needs ``pip install 'picklehooks[transformers,tensorboard,log]'``. A tiny GPT-2
built from its config (no download), CPU, a few seconds.
"""

from __future__ import annotations

import math
import tempfile
import warnings

import torch
import transformers

from picklehooks.integrations.transformers import PicklehooksCallback

torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                 bos_token_id=0, eos_token_id=0)
model = transformers.GPT2LMHeadModel(config)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 100, (32, 16))]

callback = PicklehooksCallback(modules=["transformer.h.*"], capture=("output", "grad_output", "param_grad"),
                               every_n_steps=2)
with tempfile.TemporaryDirectory() as out:
    args = transformers.TrainingArguments(
        out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4, max_grad_norm=0.5,
        report_to=["tensorboard"], logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's own notices about this tiny set-up
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

frame = callback.recorded.to_pandas()
print("recorded steps (every 2nd):", sorted(set(frame["step"])))
mlp = frame[(frame["module"] == "transformer.h.1.mlp") & (frame["kind"] == "output")]
print("transformer.h.1.mlp outputs, one per micro-batch:")
print(mlp[["step", "call", "absmax", "norm"]].to_string(index=False))
grads = frame[frame["kind"] == "param_grad"].groupby("step")["norm"].apply(lambda s: math.sqrt((s ** 2).sum()))
print("param_grad norm of the recorded layers, after clipping to 0.5:")
print(grads.to_string())
assert (grads <= 0.5 * (1 + 1e-4)).all()
