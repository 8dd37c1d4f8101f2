"""Per-module time from a ``torch.profiler`` run of a model instrumented with ``profile=True``.

``instrument(model, profile=True)`` opens a profiler range named
``module:<qualified name>`` around each module's forward, so traces (Chrome trace,
TensorBoard) and ``prof.key_averages()`` show module names; this turns those
ranges into a table.

Limits: times are the profiler's own (host-side CPU time, plus device time
when the profiler records a device); a module's total includes its children;
the ranges cover forward only (backward runs outside module calls). In a
scripted, traced or compiled model a range opens when the module's first
tensor argument is ready and closes when its output is; a compiled graph may
fuse work across module boundaries, so there ranges are approximate.
"""

from __future__ import annotations

from torch import nn

from .._ops import RANGE_PREFIX
from ..capture.instrument import _NAME_ATTR

__all__ = ["module_times", "RANGE_PREFIX"]



def module_times(prof, model: nn.Module | None = None) -> list[dict]:
    """One row per profiled module, slowest first::

        with torch.profiler.profile() as prof:
            model(x)
        for row in module_times(prof, model): print(row)

    Rows: ``module``, ``calls``, ``total_ms`` (including children),
    ``self_ms`` (excluding them), ``mean_ms``. With ``model``, only its
    instrumented modules are listed; otherwise every module range in the profile.
    """
    names = None
    if model is not None:
        names = {getattr(m, _NAME_ATTR) for m in model.modules() if hasattr(m, _NAME_ATTR)}
    rows = []
    for event in prof.key_averages():
        if not event.key.startswith(RANGE_PREFIX):
            continue
        key = event.key[len(RANGE_PREFIX):]
        if names is not None and key not in names:
            continue
        total = event.cpu_time_total / 1000
        rows.append({
            "module": key,
            "calls": event.count,
            "total_ms": total,
            "self_ms": event.self_cpu_time_total / 1000,
            "mean_ms": total / event.count if event.count else 0.0,
        })
    return sorted(rows, key=lambda r: -r["total_ms"])
