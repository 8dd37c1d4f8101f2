"""The step the frozen artifacts of tests/data/frozen_v3/ recorded, and how a process loads each one.

Shared by tests/data/make_frozen_v3.py (which recorded the expected records with it, in a fresh
process running the code being frozen) and tests/contract/test_frozen_v3.py (which runs it again,
in a fresh process, with the code of the day). Public API only. The model is called from
:func:`run_step`, in this file, so that the root's records name a line of a real file.
"""

import torch

import picklehooks

#: How a process loads each artifact: torch's own loaders.
LOADERS = {
    "trace": lambda path: torch.jit.load(path),
    "script": lambda path: torch.jit.load(path),
    "export": lambda path: torch.export.load(path).module(),
}


def run_step(model, x: torch.Tensor) -> list:
    """One forward and backward step under record(): ``[module, kind, path, call, source]`` per record."""
    with picklehooks.record() as log:
        output = model(x)  # the root's call site
        output.square().sum().backward()
    return [[*r.key, r.source] for r in log.records]


CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from tests.contract.frozen_v3_step import LOADERS, run_step
which, path = sys.argv[1:3]
x = torch.load(path + ".input.pt", weights_only=True)
print(json.dumps(run_step(LOADERS[which](path), x)))
"""
