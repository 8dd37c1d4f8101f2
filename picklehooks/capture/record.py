"""``Record``: one recorded value, as the log's reading side hands it out.

Records are built lazily from the compact rows the hooks add
(:mod:`picklehooks.capture.rows`); a record's statistics are read from its
batch (:mod:`picklehooks.capture.pending`) the first time they are asked for.
"""

from __future__ import annotations

import dataclasses

import torch

from .._stats import STAT_NAMES
from .pending import _PendingRow, _read_pending

__all__ = ["Record", "STAT_NAMES"]

_COUNTS = ("nan", "inf")


def _stats_dict(shape: tuple, dtype: str, values) -> dict:
    stats = dict(zip(STAT_NAMES, values))
    for name in _COUNTS:
        stats[name] = int(stats[name])
    return {"shape": shape, "dtype": dtype, **stats}



@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)  # slots: built per record when read
class Record:
    """One recorded value.

    ``module`` is the qualified name (``""`` for the root), ``kind`` one of
    ``input output grad_input grad_output param buffer param_grad``,
    ``path`` the position inside a nested value (``""``, ``"0"``,
    ``"logits"``, ``"0/1"``), ``call`` which call of the module in this
    log, ``step`` the log's step when recorded.
    """

    module: str
    kind: str
    path: str
    call: int
    step: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    tensor: torch.Tensor | None = None
    value: str | None = None  # repr of a non-tensor value
    live: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # record(keep_graph=True)
    rank: int | None = None
    _stats: dict | None = dataclasses.field(default=None, repr=False)
    # Until read: the values computed in the hook, or a batched statistic's _PendingRow.
    _src: tuple | None = dataclasses.field(default=None, repr=False)

    @property
    def stats(self) -> dict | None:
        """``shape, dtype`` and :data:`STAT_NAMES`; ``None`` for non-tensor values or ``mode="tensor"``.

        The first read brings every pending statistic of the log to the host at once.
        """
        if self._stats is None and self._src is not None:
            values = _read_pending(self._src) if type(self._src) is _PendingRow else self._src
            self._stats, self._src = _stats_dict(self.shape, self.dtype, values), None
        return self._stats

    @property
    def key(self) -> tuple[str, str, str, int]:
        """``(module, kind, path, call)``: what identifies a record across runs and backends."""
        return (self.module, self.kind, self.path, self.call)

    def row(self) -> dict:
        """This record as a flat dict (one row of :meth:`Log.table`)."""
        row = {
            "module": self.module,
            "kind": self.kind,
            "path": self.path,
            "call": self.call,
            "step": self.step,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "value": self.value,
        }
        if self.rank is not None:
            row["rank"] = self.rank
        stats = self.stats or {}
        row.update({name: stats.get(name) for name in STAT_NAMES})
        return row


def _record_from_row(row: dict, tensor: torch.Tensor | None) -> Record:
    shape = tuple(row["shape"]) if row["shape"] is not None else None
    rec = Record(row["module"], row["kind"], row["path"], row["call"], row["step"], shape=shape,
                 dtype=row["dtype"], value=row["value"], rank=row.get("rank"), tensor=tensor)
    if row.get("mean") is not None or row.get("nan") is not None:
        rec._stats = {"shape": shape, "dtype": row["dtype"], **{n: row[n] for n in STAT_NAMES}}
    return rec

