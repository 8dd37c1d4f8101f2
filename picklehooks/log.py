"""Records of the values that flowed through an instrumented model, and ``record()``.

``with picklehooks.record() as log:`` turns recording on for the current
thread (or asyncio task); instrumented models then add :class:`Record`\\ s to
``log``. Statistics are computed on the tensor's device when recorded, as one
small tensor per record, and copied to the host all at once the first time
any record's ``stats`` is read: no host synchronisation per hook.

``log.save(dir)`` writes an open format: ``records.json`` (every field and
statistic, strict JSON: non-finite statistics are the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``) and, when tensors were kept,
``tensors.safetensors`` (keys are record indices). :meth:`Log.load` reads it
back.

Limits: non-tensor values are recorded by ``repr`` only where Python runs
the hook (eager mode); ``std`` is the population standard deviation. A
gradient's ``call`` is that of the latest forward call of the same module
whose gradient hasn't arrived yet, which is exact whenever each backward pass
follows its own forward (training loops, modules called several times).
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
from ._stats import STAT_NAMES, empty_row, exact_counts, matrix_stats
from ._shim import PicklehooksError

__all__ = ["Record", "Log", "record", "STAT_NAMES"]

_COUNTS = ("nan", "inf")
#: Bytes of recorded copies a log keeps for batched statistics before reducing them.
PENDING_BYTES = 64 << 20


class _Batch:
    """Copies of recorded tensors with one (device, dtype, size): the rows of one matrix.

    Copying into a preallocated row costs no allocation, and the statistics
    of all rows come from a handful of row-wise reductions.
    """

    __slots__ = ("data", "used", "wanting_stats")

    def __init__(self, like: torch.Tensor, rows: int) -> None:
        self.data = torch.empty((rows, like.numel()), dtype=like.dtype, device=like.device)
        self.used = 0
        self.wanting_stats: list[tuple[Record, int]] = []

    def add(self, x: torch.Tensor) -> int:
        row = self.used
        self.data[row].copy_(x.reshape(-1))
        self.used += 1
        return row
_FORWARD_OF = {"grad_output": "output", "grad_input": "input", "param_grad": "param"}


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
    live: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # record(keep_graph=True)
    rank: int | None = None
    _raw_stats: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    _stats: dict | None = dataclasses.field(default=None, repr=False)
    _log: Any = dataclasses.field(default=None, repr=False)

    @property
    def stats(self) -> dict | None:
        """``shape, dtype`` and :data:`STAT_NAMES`; ``None`` for non-tensor values or ``mode="tensor"``."""
        if self._stats is None and self._log is not None and self.shape is not None:
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


def _current_rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class Log:
    """What one ``record()`` captured: ``log.records``, plus tables and files."""

    def __init__(self, *, step: int = 0, keep_graph: bool = False) -> None:
        self.records: list[Record] = []
        #: Keep each recorded tensor's live (autograd-connected) original, for :meth:`vjp`.
        self.keep_graph = keep_graph
        self.step = step
        #: This process's torch.distributed rank, if a process group is up; every record carries it.
        self.rank = _current_rank()
        self._calls: dict[tuple[str, str, str], int] = {}
        # Forward calls whose gradient hasn't arrived yet, per (module, kind, path):
        # backward handles the latest forward first, so gradients pop from the end.
        self._awaiting_grad: dict[tuple[str, str, str], list[int]] = {}
        self._unmaterialised: list[Record] = []
        self._batches: dict[tuple, _Batch] = {}  # the batch being filled, per key
        self._full: list[_Batch] = []  # filled batches, not yet reduced
        self._batch_rows: dict[tuple, int] = {}
        self._pending_bytes = 0

    # -- adding (called by the ops and the eager hooks) ---------------------
    def _next_call(self, module: str, kind: str, path: str) -> int:
        key = (module, kind, path)
        forward = _FORWARD_OF.get(kind)
        if forward is not None:
            waiting = self._awaiting_grad.get((module, forward, path))
            if waiting:
                return waiting.pop()
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        if forward is None:
            self._awaiting_grad.setdefault(key, []).append(call)
        return call

    def _note_call(self, module: str, kind: str, path: str) -> None:
        """Count a forward call whose value isn't recorded, so its gradient gets the right ``call``."""
        self._next_call(module, kind, path)

    def _add_tensor(self, module: str, kind: str, path: str, x: torch.Tensor, flags: int) -> None:
        # Always a copy: the caller's tensor may change in place later (inplace
        # ReLU, optimizer steps, gradient accumulation). One memory pass, no sync.
        live, x = x, x.detach()
        rec = Record(module, kind, path, self._next_call(module, kind, path), self.step,
                     shape=tuple(x.shape), dtype=str(x.dtype).replace("torch.", ""), rank=self.rank, _log=self)
        self.records.append(rec)
        if self.keep_graph:
            rec.live = live
        wants_stats = bool(flags & STATS or not flags & TENSOR)
        if x.numel() == 0:
            rec.tensor = x.clone() if flags & TENSOR else None
            if wants_stats:
                rec._raw_stats = empty_row(x.device)
                self._unmaterialised.append(rec)
            return
        key = (x.device, x.dtype, x.numel())
        batch = self._batches.get(key)
        if batch is None or batch.used == len(batch.data):
            if batch is not None:
                self._full.append(batch)
            # Grow batches of a size seen often, up to the memory budget.
            rows = self._batch_rows.get(key, 16)
            self._batch_rows[key] = min(rows * 4, 1024, max(16, PENDING_BYTES // (x.numel() * x.element_size())))
            batch = self._batches[key] = _Batch(x, rows)
        row = batch.add(x)
        if flags & TENSOR:
            rec.tensor = batch.data[row].view(x.shape)
        if wants_stats:
            batch.wanting_stats.append((rec, row))
        self._pending_bytes += x.numel() * x.element_size()
        if self._pending_bytes > PENDING_BYTES:
            self._reduce_pending()

    def _add_value(self, module: str, kind: str, path: str, value: Any) -> None:
        self.records.append(Record(module, kind, path, self._next_call(module, kind, path), self.step,
                                   value=repr(value), rank=self.rank, _log=self))

    def _retire(self, batch: _Batch, *, exact: bool) -> None:
        """Compute a batch's statistics on its device (no sync) and hand them to its records."""
        if batch.wanting_stats:
            table = matrix_stats(batch.data[: batch.used], counts=exact)
            for rec, row in batch.wanting_stats:
                rec._raw_stats = table[row]
                self._unmaterialised.append(rec)

    def _reduce_pending(self, *, exact: bool = True) -> list[_Batch]:
        """Reduce every kept copy to statistics (no sync); return the batches, now released."""
        batches = [*self._full, *self._batches.values()]
        for batch in batches:
            self._retire(batch, exact=exact)
        self._full, self._batches, self._pending_bytes = [], {}, 0
        return batches

    def _materialise(self) -> None:
        """Copy every statistic not yet read to the host, one transfer per device.

        Reading syncs anyway, so the fast path leaves NaN/Inf counts unknown
        and they are counted here only for the tensors whose sums weren't finite.
        """
        kept = {id(rec): batch.data[row] for batch in self._reduce_pending(exact=False)
                for rec, row in batch.wanting_stats}
        unread, self._unmaterialised = self._unmaterialised, []
        by_device: dict[torch.device, list[Record]] = {}
        for rec in unread:
            by_device.setdefault(rec._raw_stats.device, []).append(rec)
        for recs in by_device.values():
            rows = torch.stack([r._raw_stats for r in recs]).cpu().tolist()
            for rec, values in zip(recs, rows):
                stats = dict(zip(STAT_NAMES, values))
                if math.isnan(stats["nan"]):  # unknown: zero unless the sums say otherwise
                    if math.isfinite(stats["mean"]) and math.isfinite(stats["norm"]):
                        stats["nan"] = stats["inf"] = 0
                    else:
                        stats["nan"], stats["inf"], stats["zero_frac"] = exact_counts(kept[id(rec)])
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

    def _one(self, name) -> Record:
        key = (name, "output", "", 0) if isinstance(name, str) else tuple(name)
        found = [r for r in self.records if r.key == key]
        if len(found) != 1:
            raise PicklehooksError(
                f"{name!r} names {len(found)} records; give a module name (its first output) or a "
                f"(module, kind, path, call) key such as {self.records[0].key if self.records else ('fc', 'output', '', 0)}"
            )
        if found[0].live is None:
            raise PicklehooksError(
                f"record {key} kept no autograd graph; record with picklehooks.record(keep_graph=True) "
                "(eager, FX or TorchScript models; compiled and exported graphs don't expose intermediates)"
            )
        return found[0]

    def vjp(self, output_name, input_name, v: torch.Tensor | None = None) -> torch.Tensor:
        """The vector-Jacobian product ``v^T d(output)/d(input)`` between two recorded intermediates.

        Names are module names (their first output) or ``(module, kind, path, call)`` keys;
        ``v`` defaults to ones. Needs ``record(keep_graph=True)``::

            with picklehooks.record(keep_graph=True) as log:
                model(x)
            g = log.vjp("head", "encoder.0")
        """
        out, inp = self._one(output_name).live, self._one(input_name).live
        v = torch.ones_like(out) if v is None else v
        (grad,) = torch.autograd.grad(out, inp, grad_outputs=v, retain_graph=True, allow_unused=True)
        if grad is None:
            raise PicklehooksError(f"{output_name!r} does not depend on {input_name!r}: no path between them in the graph")
        return grad

    def to_pandas(self):
        """:meth:`table` as a ``pandas.DataFrame`` (``pip install pandas``)."""
        try:
            import pandas
        except ImportError:
            raise PicklehooksError("Log.to_pandas() needs pandas: pip install 'picklehooks[log]'") from None
        return pandas.DataFrame(self.table())

    def to_tensorboard(self, writer, step: int | None = None, *, histograms: bool = True) -> int:
        """Write per-layer scalars and histograms to a ``SummaryWriter`` (``pip install 'picklehooks[tensorboard]'``)."""
        from .tensorboard import write
        return write(self, writer, step, histograms=histograms)

    # -- files ----------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write ``records.json`` (and ``tensors.safetensors`` if tensors were kept) into directory ``path``."""
        os.makedirs(path, exist_ok=True)
        # Cloned: safetensors refuses tensors that share memory, as one value recorded twice does.
        tensors = {str(i): r.tensor.detach().cpu().clone().contiguous() for i, r in enumerate(self.records)
                   if r.tensor is not None}
        if tensors:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise PicklehooksError(
                    "saving recorded tensors needs safetensors: pip install 'picklehooks[log]' "
                    "(or record with mode='stats')") from None
            save_file(tensors, os.path.join(path, "tensors.safetensors"))
        rows = [{k: _json_float(v) for k, v in row.items()} for row in self.table()]
        document = {"format": "picklehooks-log", "version": 1, "step": self.step, "stat_names": list(STAT_NAMES),
                    "records": rows}
        with open(os.path.join(path, "records.json"), "w") as f:
            json.dump(document, f, indent=1, allow_nan=False)

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
        rows = [{k: _from_json_float(v) if k in STAT_NAMES else v for k, v in row.items()}
                for row in document["records"]]
        return cls.from_rows(rows, [tensors.get(str(i)) for i in range(len(rows))], step=document["step"])

    @classmethod
    def from_rows(cls, rows: list[dict], tensors: list[torch.Tensor | None] | None = None, *, step: int = 0) -> Log:
        """Rebuild a log from :meth:`table` rows (and the records' tensors, in the same order)."""
        log = cls(step=step)
        tensors = tensors or [None] * len(rows)
        for row, tensor in zip(rows, tensors):
            shape = tuple(row["shape"]) if row["shape"] is not None else None
            rec = Record(row["module"], row["kind"], row["path"], row["call"], row["step"], shape=shape,
                         dtype=row["dtype"], value=row["value"], rank=row.get("rank"), tensor=tensor, _log=log)
            if row.get("mean") is not None or row.get("nan") is not None:
                rec._stats = {"shape": shape, "dtype": row["dtype"], **{n: row[n] for n in STAT_NAMES}}
            log.records.append(rec)
        return log


# Strict JSON has no NaN or Infinity; they are written as these strings.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _json_float(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _from_json_float(value):
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


@contextlib.contextmanager
def record(*, step: int = 0, keep_graph: bool = False, log: Log | None = None) -> Iterator[Log]:
    """Record what instrumented models compute in this thread/context::

        with picklehooks.record() as log:
            model(x).sum().backward()
        print(log.table()[0])
    """
    log = Log(step=step, keep_graph=keep_graph) if log is None else log
    token = _state.push(log)
    try:
        yield log
    finally:
        _state.pop(log, token)
