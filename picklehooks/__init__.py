"""picklehooks: PyTorch hooks that survive pickle, torch.save, torch.package and TorchScript.

>>> import picklehooks, torch
>>> handle = torch.nn.Linear(2, 2).register_forward_hook(picklehooks.portable(lambda m, i, o: o * 2))

The layers, bottom up (no module imports one above it):

* :mod:`picklehooks._shim`: decodes a hook name into a function (stdlib + zstd only);
* :mod:`picklehooks.codec`: encodes source text into a name;
* :mod:`picklehooks.portable`: turns a Python function into portable source text;
* :mod:`picklehooks._ops`, :mod:`picklehooks._state`, :mod:`picklehooks._hookrt`: the
  recording ops, the recording switch, and the run-time half of generated hooks;
* :mod:`picklehooks._generate`: typed hook text from a module's call shape;
* :mod:`picklehooks.log`: ``record()``, ``Log`` and ``Record``;
* :mod:`picklehooks.instrument`: ``instrument(model)``;
* :mod:`picklehooks.package`: torch.package helpers;
* :mod:`picklehooks.weights_only`: ``safe_globals()`` for ``torch.load(weights_only=True)``;
* :mod:`picklehooks.diagnostics`: debugging workflows on the logs (NaN/Inf, dead units,
  gradient flow and conflict, comparisons, profiles, surgery, Jacobians, plots, reports);
* :mod:`picklehooks.audit`: lists the hooks in a file without loading it;
* :mod:`picklehooks.__main__`: the command line (``demo``, ``inspect``).
"""

from __future__ import annotations

from ._shim import DecodeError, PicklehooksError
from . import _ops  # registers the picklehooks:: ops that instrumented models call
from ._ops import NonfiniteError
from . import codec
from .instrument import Instrumentation, instrument
from .log import Log, Record, record
from .portable import is_portable, portable
from .weights_only import safe_globals
from .diagnostics import compare, find_nonfinite

__all__ = [
    "portable",
    "is_portable",
    "instrument",
    "Instrumentation",
    "record",
    "Log",
    "Record",
    "safe_globals",
    "find_nonfinite",
    "compare",
    "codec",
    "PicklehooksError",
    "DecodeError",
    "NonfiniteError",
]
__version__ = "0.1.0"
