"""Records of the values that flowed through an instrumented model, and ``record()``.

``with picklehooks.record() as log:`` turns recording on for the current
thread (or asyncio task); instrumented models then add :class:`Record`\\ s to
``log``. Statistics are computed on the tensor's device when recorded, as one
small tensor per record, and copied to the host all at once the first time
any record's ``stats`` is read: no host synchronisation per hook.

``log.save(dir)`` writes an open format: ``records.json`` (every field and
statistic, readable by any JSON reader) and, when tensors were kept,
``tensors.safetensors`` (keys are record indices). :meth:`Log.load` reads it
back.

Limits: non-tensor values are recorded by ``repr`` only where Python runs
the hook (eager mode); ``std`` is the population standard deviation; ``call``
numbers backward records by matching them, in reverse, to the forward calls
of the same module, which is exact for one backward pass per forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Iterator

import torch

from . import _state
from ._ops import STATS, TENSOR
from ._shim import PicklehooksError

__all__ = ["Record", "Log", "record", "STAT_NAMES"]

#: The statistics each record carries, in addition to ``shape`` and ``dtype``.
STAT_NAMES = ("mean", "std", "min", "max", "absmax", "norm", "nan", "inf", "zero_frac")
_COUNTS = ("nan", "inf")
_LIVE_KINDS = frozenset({"param", "buffer", "param_grad"})
_FORWARD_OF = {"grad_output": "output", "grad_input": "input", "param_grad": "param"}


def _stats_tensor(x: torch.Tensor) -> torch.Tensor:
    """All of :data:`STAT_NAMES` as one float64 tensor on ``x``'s device (no sync)."""
    if x.numel() == 0:
        return torch.full((len(STAT_NAMES),), math.nan, dtype=torch.float64, device=x.device)
    v = x.detach()
    if v.is_complex():
        v = v.abs()
    v = v.to(torch.float64)
    lo, hi = torch.aminmax(v)
    return torch.stack(
        [
            v.mean(),
            v.std(correction=0),
            lo,
            hi,
            v.abs().max(),
            torch.linalg.vector_norm(v),
            torch.isnan(v).sum().to(torch.float64),
            torch.isinf(v).sum().to(torch.float64),
            (v == 0).sum().to(torch.float64) / v.numel(),
        ]
    )


@dataclasses.dataclass(eq=False)
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
    rank: int | None = None
    _raw_stats: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    _stats: dict | None = dataclasses.field(default=None, repr=False)
    _log: Any = dataclasses.field(default=None, repr=False)

    @property
    def stats(self) -> dict | None:
        """``shape, dtype`` and :data:`STAT_NAMES`; ``None`` for non-tensor values or ``mode="tensor"``."""
        if self._stats is None and self._raw_stats is not None and self._log is not None:
            self._log._materialise()
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


class Log:
    """What one ``record()`` captured: ``log.records``, plus tables and files."""

    def __init__(self, *, step: int = 0) -> None:
        self.records: list[Record] = []
        self.step = step
        self._calls: dict[tuple[str, str, str], int] = {}
        self._pending: list[Record] = []

    # -- adding (called by the ops and the eager hooks) ---------------------
    def _next_call(self, module: str, kind: str, path: str) -> int:
        key = (module, kind, path)
        seen = self._calls.get(key, 0)
        self._calls[key] = seen + 1
        forward = _FORWARD_OF.get(kind)
        if forward is None:
            return seen
        # Backward runs calls in reverse: the first gradient belongs to the last call.
        calls = self._calls.get((module, forward, path), 0)
        return calls - 1 - seen if calls > seen else seen

    def _add_tensor(self, module: str, kind: str, path: str, x: torch.Tensor, flags: int) -> None:
        rec = Record(module, kind, path, self._next_call(module, kind, path), self.step,
                     shape=tuple(x.shape), dtype=str(x.dtype).replace("torch.", ""), _log=self)
        if flags & TENSOR:
            # Parameters, buffers and .grad change in place later; activations don't.
            rec.tensor = x.clone() if kind in _LIVE_KINDS else x
        if flags & STATS or not flags & TENSOR:
            rec._raw_stats = _stats_tensor(x)
            self._pending.append(rec)
        self.records.append(rec)

    def _add_value(self, module: str, kind: str, path: str, value: Any) -> None:
        self.records.append(Record(module, kind, path, self._next_call(module, kind, path), self.step,
                                   value=repr(value), _log=self))

    def _materialise(self) -> None:
        """Copy every pending statistic to the host in one transfer per device."""
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[Record]] = {}
        for rec in pending:
            by_device.setdefault(rec._raw_stats.device, []).append(rec)
        for recs in by_device.values():
            rows = torch.stack([r._raw_stats for r in recs]).cpu().tolist()
            for rec, values in zip(recs, rows):
                stats = dict(zip(STAT_NAMES, values))
                for name in _COUNTS:
                    stats[name] = int(stats[name])
                rec._stats = {"shape": rec.shape, "dtype": rec.dtype, **stats}
                rec._raw_stats = None

    # -- reading --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"<picklehooks.Log: {len(self.records)} records, step {self.step}>"

    def next_step(self) -> int:
        """Advance ``step`` (records made from now on carry the new value); return it."""
        self.step += 1
        return self.step

    def find(self, module: str | None = None, kind: str | None = None, path: str | None = None,
             call: int | None = None) -> list[Record]:
        """Records matching every field given."""
        return [r for r in self.records
                if (module is None or r.module == module) and (kind is None or r.kind == kind)
                and (path is None or r.path == path) and (call is None or r.call == call)]

    def table(self) -> list[dict]:
        """One dict per record: fields and statistics (no tensors)."""
        return [r.row() for r in self.records]

    def to_pandas(self):
        """:meth:`table` as a ``pandas.DataFrame`` (``pip install pandas``)."""
        try:
            import pandas
        except ImportError:
            raise PicklehooksError("Log.to_pandas() needs pandas: pip install 'picklehooks[log]'") from None
        return pandas.DataFrame(self.table())

    # -- files ----------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write ``records.json`` (and ``tensors.safetensors`` if tensors were kept) into directory ``path``."""
        os.makedirs(path, exist_ok=True)
        tensors = {str(i): r.tensor.detach().cpu().contiguous() for i, r in enumerate(self.records)
                   if r.tensor is not None}
        if tensors:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise PicklehooksError(
                    "saving recorded tensors needs safetensors: pip install 'picklehooks[log]' "
                    "(or record with mode='stats')") from None
            save_file(tensors, os.path.join(path, "tensors.safetensors"))
        document = {"format": "picklehooks-log", "version": 1, "step": self.step, "stat_names": list(STAT_NAMES),
                    "records": self.table()}
        with open(os.path.join(path, "records.json"), "w") as f:
            json.dump(document, f, indent=1, allow_nan=True)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Log:
        """Read a log written by :meth:`save`."""
        try:
            with open(os.path.join(path, "records.json")) as f:
                document = json.load(f)
        except FileNotFoundError:
            raise PicklehooksError(f"{os.fspath(path)!r} holds no records.json; is it a directory Log.save() wrote?") from None
        if document.get("format") != "picklehooks-log":
            raise PicklehooksError(f"{os.fspath(path)!r}: records.json is not a picklehooks log")
        tensors = {}
        tensor_file = os.path.join(path, "tensors.safetensors")
        if os.path.exists(tensor_file):
            from safetensors.torch import load_file

            tensors = load_file(tensor_file)
        log = cls(step=document["step"])
        for index, row in enumerate(document["records"]):
            shape = tuple(row["shape"]) if row["shape"] is not None else None
            rec = Record(row["module"], row["kind"], row["path"], row["call"], row["step"], shape=shape,
                         dtype=row["dtype"], value=row["value"], rank=row.get("rank"),
                         tensor=tensors.get(str(index)), _log=log)
            if row.get("mean") is not None or row.get("nan") is not None:
                rec._stats = {"shape": shape, "dtype": row["dtype"], **{n: row[n] for n in STAT_NAMES}}
            log.records.append(rec)
        return log


@contextlib.contextmanager
def record(*, step: int = 0, log: Log | None = None) -> Iterator[Log]:
    """Record what instrumented models compute in this thread/context::

        with picklehooks.record() as log:
            model(x).sum().backward()
        print(log.table()[0])
    """
    log = Log(step=step) if log is None else log
    token = _state.push(log)
    try:
        yield log
    finally:
        _state.pop(log, token)
