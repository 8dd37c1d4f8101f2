"""picklehooks: PyTorch hooks that survive pickle, torch.save, torch.package and TorchScript.

>>> import picklehooks, torch
>>> handle = torch.nn.Linear(2, 2).register_forward_hook(picklehooks.portable(lambda m, i, o: o * 2))

The layers, bottom up (no module imports one above it; ``tests/test_layout.py``
checks it from the imports):

* pinned runtime, never moved or renamed because saved files, generated hook
  text and torch.package archives name it (the docs' wire-contract page):
  :mod:`picklehooks._shim` (the hub ``picklehooks._hub``: one file, stdlib + zstd,
  copied alone into archives), :mod:`picklehooks._hookrt` (what generated hook text
  calls) with :mod:`picklehooks._taps`, :mod:`picklehooks._ops` (the ``picklehooks::``
  ops) with :mod:`picklehooks._deliver`, :mod:`picklehooks._state`,
  :mod:`picklehooks._shards`, :mod:`picklehooks._stats`, :mod:`picklehooks._native`
  (the switch between the C extension ``picklehooks._speedups`` and its Python twin),
  :mod:`picklehooks._version`, :mod:`picklehooks._compat`;
* :mod:`picklehooks.serialize`: hook text as a name (codec), portable functions, torch.package;
* :mod:`picklehooks.capture`: ``instrument()``, generated hooks, ``record()``, ``Log``, ``Record``, log files,
  ``save_hooks``/``load_hooks``;
* :mod:`picklehooks.audit`: reading a file without loading it, ``safe_globals()``, and the
  one trust policy they and the shim follow (:mod:`picklehooks.audit.policy`);
* :mod:`picklehooks.diagnostics`: debugging workflows on the logs (NaN/Inf, dead units,
  gradient flow and conflict, comparisons, profiles, surgery, Jacobians, plots, reports);
* :mod:`picklehooks.integrations`: TensorBoard, MLflow, torch.distributed (each takes a ``Log``),
  and the ``transformers``/Lightning training callbacks;
* :mod:`picklehooks.__main__`: the command line (``demo``, ``inspect``, ``report``).

Old module paths (``picklehooks.log``, ``picklehooks.mlflow``, ...) still
import, with a ``DeprecationWarning``, for one release (:mod:`picklehooks._compat`).
"""

from __future__ import annotations

from ._shim import DecodeError, PicklehooksError
from ._version import __version__
from . import _compat
from . import _ops  # registers the picklehooks:: ops that instrumented models call
from ._ops import NonfiniteError
from .serialize import codec
from .capture.instrument import Instrumentation, instrument
from .capture.log import Log, Record, record
from .capture import batching as _batching  # noqa: F401 - sets up Inductor's record batching when a graph records
from .capture.hookfile import load_hooks, save_hooks
from .serialize.portable import is_portable, portable
from .audit.weights_only import safe_globals
from .diagnostics import compare, find_nonfinite

__all__ = [
    "portable",
    "is_portable",
    "instrument",
    "Instrumentation",
    "save_hooks",
    "load_hooks",
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

_compat.install()


def __getattr__(name: str):
    # picklehooks.log, picklehooks.mlflow, ...: the old paths, which import the moved module and warn.
    return _compat.moved_attribute(name)
