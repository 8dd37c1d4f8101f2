"""Recording everything on a GPT-2-small-sized model on the device path stays within the pending
budget above the plain model's peak memory (#38).

Two fresh processes run the same three training steps of GPT-2 small (124M parameters, 2 x 128
tokens, forward, backward, ``zero_grad``) on the CPU with ``PICKLEHOOKS_NATIVE=0``, the path a GPU
takes: one plain, one instrumented with ``capture="all"`` (1035 records a step: inputs, outputs,
gradients, parameters, buffers, parameter gradients) recording and reading each step. The peak
resident set (``ru_maxrss``) of each is compared; glibc is told to map every allocation of 64 KiB
or more on its own and to return freed memory at once, so that the resident set follows what
tensors hold. Ground truth for "plain" is the same model without picklehooks imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

CHILD = """
import os, resource, sys
os.environ["PICKLEHOOKS_NATIVE"] = "0"
import torch, transformers
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
recording = sys.argv[1] == "recording"
if recording:
    import picklehooks
    from picklehooks.capture import pending
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="eager"))
model.config.use_cache = False
ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
if recording:
    picklehooks.instrument(model, capture="all")
records = []
for step in range(3):
    if recording:
        with picklehooks.record() as log:
            model(input_ids=ids, labels=ids).loss.backward()
        assert all(r.stats is not None for r in log.records if r.value is None)  # None: a non-tensor input
        records.append(len(log.records))
        del log
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
budget = pending.PENDING_BYTES if recording else 0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, budget, records)
"""


def _peak(mode: str) -> tuple[int, int, str]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    peak, budget, records = proc.stdout.split(maxsplit=2)
    return int(peak), int(budget), records


def test_recording_everything_stays_within_the_pending_budget_above_the_plain_peak():
    plain, _, _ = _peak("plain")
    recorded, budget, records = _peak("recording")
    assert records.strip() == "[1035, 1035, 1035]", records
    # picklehooks' modules, the records and Python's objects included (measured: 133 MiB above the
    # plain peak; 267 MiB when each record was copied, with its float64 working block).
    assert recorded - plain <= budget, (plain >> 20, recorded >> 20, budget >> 20)
