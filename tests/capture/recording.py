"""Run a model under record() and summarise the log, in this process or a child.

Used by the backend matrix: every backend's summary is compared with eager.
"""

from __future__ import annotations

import json
import sys

import torch

import picklehooks

#: Every capture kind.
CAPTURE = ("input", "output", "grad_input", "grad_output", "param", "buffer", "param_grad")


def run(model, inputs) -> picklehooks.Log:
    """One training step's forward and backward under record() (gradients zeroed first, so param_grad is this step's)."""
    model.zero_grad(set_to_none=True)
    with picklehooks.record() as log:
        out = model(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() for o in outs).backward()
    return log


def summary(log: picklehooks.Log) -> dict:
    """{"module|kind|path|call": [stats...]} for every tensor record."""
    result = {}
    for rec in log.records:
        if rec.stats is None:
            continue
        key = "|".join(map(str, rec.key))
        assert key not in result, f"duplicate record {key}"
        result[key] = [list(rec.stats["shape"]), rec.stats["dtype"]] + [rec.stats[n] for n in picklehooks.capture.log.STAT_NAMES]
    return result


def load(kind: str, path: str):
    if kind == "pickle":
        return torch.load(path, weights_only=False)
    if kind == "package":
        from torch.package import PackageImporter

        return PackageImporter(path).load_pickle("model", "model.pkl")
    if kind == "script":
        return torch.jit.load(path)
    if kind == "export":
        return torch.export.load(path).module()
    raise ValueError(kind)


if __name__ == "__main__":
    # python -m tests.capture.recording KIND MODEL_PATH INPUTS_PATH: print the summary as JSON.
    kind, path, inputs_path = sys.argv[1:4]
    print(json.dumps(summary(run(load(kind, path), torch.load(inputs_path)))))
