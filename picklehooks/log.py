"""Records of the values that flowed through an instrumented model, and ``record()``.

``with picklehooks.record() as log:`` turns recording on for the current
thread (or asyncio task); instrumented models then add :class:`Record`\\ s to
``log``. Each recorded tensor is copied on its device; copies of one shape
and dtype are reduced together (:mod:`picklehooks._stats`) the first time
any record's ``stats`` is read, or when the copies pass
:data:`PENDING_BYTES`, and all statistics reach the host in one transfer
per device: no host synchronisation per hook.

``log.save(dir)`` writes an open format: ``records.json`` (every field and
statistic, strict JSON: non-finite statistics are the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``) and, when tensors were kept,
``tensors.safetensors`` (keys are record indices). :meth:`Log.load` reads it
back.

``record(sink=dir)`` streams instead, for runs of any length: the records
go to Parquet files in ``dir`` while the run goes on (:mod:`picklehooks._sink`
describes the files), and leave memory. They are written when a step ends
(:meth:`Log.next_step`) once :data:`FLUSH_ROWS` records (or
:data:`FLUSH_BYTES` of kept tensors) wait, when :meth:`Log.flush` is called,
and when ``record()`` exits, by an exception too. Writing reads the
statistics still pending on a device: one host sync per device per write.
``log.records`` then holds only the records not written yet;
``log.to_pandas()`` reads the written ones too, and ``Log.load(dir)`` reads
them all back, lazily.

Limits: non-tensor values are recorded by ``repr`` only where Python runs
the hook (eager mode); records written to a sink keep no autograd graph
(``keep_graph``: :meth:`Log.vjp` sees the records not written yet); a run
that never calls ``next_step()`` keeps its records in memory until it exits,
unless it calls ``flush()``; ``std`` is the population standard deviation. A
gradient's ``call`` is that of the latest forward call of the same module
whose gradient hasn't arrived yet, which is exact whenever each backward pass
follows its own forward (training loops, modules called several times).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

import torch

from . import _logfile, _native, _sink, _state
from ._native import stats as native_stats
from ._logfile import dtype_name
from ._jacobian import hutchinson
from ._ops import GRAD_NONE, GRAD_SURE, STATS, TENSOR
from ._stats import EMPTY, PAD, STAT_NAMES, finish, matrix_stats
from ._shim import PicklehooksError

__all__ = ["Record", "Log", "record", "STAT_NAMES"]

_COUNTS = ("nan", "inf")
#: Bytes of recorded copies a log keeps for batched statistics before reducing them.
PENDING_BYTES = 64 << 20
#: With a sink: records waiting in memory that make ``next_step()`` write them (a Parquet part of
#: about this many rows; a few MB of memory).
FLUSH_ROWS = 8192
#: With a sink: bytes of kept tensors (mode "tensor"/"both") that make ``next_step()`` write them.
FLUSH_BYTES = 64 << 20


class _Group:
    """Copies of recorded tensors of one (device, dtype, shape), in the rows of one preallocated matrix.

    Copying into a row allocates nothing, and the statistics of all rows come
    from a handful of row-wise reductions. Rows are padded with zeros to a
    multiple of :data:`~picklehooks._stats.PAD` elements, which makes zeros
    quick to count.
    """

    __slots__ = ("data", "views", "used", "table", "rows")

    def __init__(self, like: torch.Tensor, capacity: int) -> None:
        n = like.numel()
        self.data = torch.empty((capacity, n + -n % PAD), dtype=like.dtype, device=like.device)
        self.data[:, n:].zero_()
        # Every row as a tensor of the recorded shape, made in one call.
        self.views = self.data[:, :n].view(capacity, *like.shape).unbind(0)
        self.used = 0
        self.table: torch.Tensor | None = None  # on the device, once reduced
        self.rows: list[list[float]] | None = None  # on the host, once read

    @classmethod
    def of_table(cls, table: torch.Tensor) -> _Group:
        """A group of one row whose statistics were computed elsewhere (by a compiled graph)."""
        group = cls.__new__(cls)
        group.data = group.views = group.rows = None
        group.used, group.table = 1, table.view(1, -1)
        return group

    def reduce(self, *, exact: bool) -> torch.Tensor:
        """Compute the table (no sync), release the copies; return the matrix reduced."""
        n = self.views[0].numel()
        x = self.data[: self.used, :n]
        self.table = matrix_stats(x, exact=exact, padded=self.data[: self.used])
        self.data = self.views = None
        return x


class _Pending:
    """A log's statistics not yet computed or not yet read.

    Records point here and this points at no record, so a log, its records
    and its copies are freed by reference counting the moment they are
    dropped; a reference cycle would keep every copy until the garbage
    collector ran.
    """

    __slots__ = ("filling", "unreduced", "reduced", "seen", "bytes")

    def __init__(self) -> None:
        self.filling: dict[tuple, _Group] = {}  # the group taking new rows, per (device, dtype, shape)
        self.unreduced: list[_Group] = []  # every group holding copies
        self.reduced: list[_Group] = []  # with a table, not yet read
        self.seen: dict[tuple, int] = {}  # rows recorded per key
        self.bytes = 0

    def add(self, x: torch.Tensor) -> tuple[_Group, torch.Tensor]:
        """Copy ``x`` into a row; return its group and the row (as a tensor shaped like ``x``)."""
        key = (x.device, x.dtype, x.shape)
        group = self.filling.get(key)
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if group is None or group.used == len(group.views):
            size = x.numel() * x.element_size()
            # A model records the same shapes every step: size the group for what the
            # last log recorded, and grow fourfold while that isn't enough.
            capacity = max(_CAPACITY.get(key, 4), 4 * (len(group.views) if group else 0))
            group = self.filling[key] = _Group(x, max(1, min(capacity, PENDING_BYTES // size)))
            self.unreduced.append(group)
        row = group.views[group.used]
        row.copy_(x)
        group.used += 1
        if seen > _CAPACITY.get(key, 0):
            if len(_CAPACITY) >= 1024:  # e.g. a shape per sequence length: forget, don't grow
                _CAPACITY.clear()
            _CAPACITY[key] = seen
        self.bytes += x.numel() * x.element_size()
        if self.bytes > PENDING_BYTES:
            self.reduce(exact=True)
        return group, row

    def add_table(self, stats: torch.Tensor) -> _Group:
        """Keep statistics computed on the device (no copy of the value, no sync); read with the rest."""
        group = _Group.of_table(stats)
        self.reduced.append(group)
        return group

    def reduce(self, *, exact: bool) -> dict[int, torch.Tensor]:
        """Turn every group's copies into a table on its device (no sync); return the matrices by group id."""
        done = {id(group): group.reduce(exact=exact) for group in self.unreduced}
        self.reduced += self.unreduced
        self.filling, self.unreduced, self.bytes = {}, [], 0
        return done

    def read(self) -> None:
        """Bring every table to the host, one transfer per device; complete the fast rows."""
        matrices = self.reduce(exact=False)
        by_device: dict[torch.device, list[_Group]] = {}
        for group in self.reduced:
            by_device.setdefault(group.table.device, []).append(group)
        self.reduced = []
        for groups in by_device.values():
            rows = torch.cat([group.table for group in groups]).cpu().tolist()
            for group in groups:
                group.rows, rows = rows[: len(group.table)], rows[len(group.table):]
                if id(group) in matrices:  # reduced just now, on the fast path
                    finish(matrices[id(group)], group.rows)
                group.table = None


# Rows recorded per (device, dtype, shape) by the last log, to size the next log's groups.
_CAPACITY: dict[tuple, int] = {}


def _stats_dict(shape: tuple, dtype: str, values) -> dict:
    stats = dict(zip(STAT_NAMES, values))
    for name in _COUNTS:
        stats[name] = int(stats[name])
    return {"shape": shape, "dtype": dtype, **stats}


# A gradient record takes the call number of the forward call it flows back to (backward
# visits the latest call first). Not param_grad: a parameter's gradient is accumulated
# over every call of the step and delivered once per backward, so those are counted.
_FORWARD_OF = {"grad_output": "output", "grad_input": "input"}


_SURE, _MAYBE = 2, 1
_MAX_OPEN = 256  # invocations of one module open at once (recursion depth) that a log tracks
_MAYBE_KEPT = 4096
_MAYBE_TRIM = 2 * _MAYBE_KEPT


def _expects_grad(kind: str, x: torch.Tensor, flags: int = 0) -> int:
    """Whether a gradient will come back for this forward value: pairs it with its call.

    ``flags`` decide where they say (:data:`~picklehooks._ops.GRAD_SURE`: :data:`_SURE`,
    :data:`~picklehooks._ops.GRAD_NONE`: 0): ``torch.compile`` and ``torch.export``
    set them from what tracing saw (their forward runs without autograd), and
    the eager hooks, for a value that requires grad, from whether they hook its
    gradient. Otherwise :data:`_SURE` where the tensor requires grad, 0 where it
    doesn't with autograd on, and :data:`_MAYBE` with autograd off: a graph traced
    by an older version, and an eager forward under ``no_grad``, which reentrant
    checkpointing recomputes for backward; gradients pair with the sure calls first.
    """
    if kind not in _PAIRED:
        return 0
    if flags & (GRAD_SURE | GRAD_NONE):
        return _SURE if flags & GRAD_SURE else 0
    return _SURE if x.requires_grad else 0 if torch.is_grad_enabled() else _MAYBE


_PAIRED = frozenset(_FORWARD_OF.values())
# Log._add_tensor's common cases in one C call (see picklehooks._native.row_lane), or None.
_add_row = _native.row_lane(paired=_PAIRED, sure=_SURE, maybe=_MAYBE, none=0, stats_bit=STATS, tensor_bit=TENSOR,
                            sure_bit=GRAD_SURE, none_bit=GRAD_NONE, forward_of=_FORWARD_OF, maybe_trim=_MAYBE_TRIM,
                            maybe_kept=_MAYBE_KEPT)
# Layouts recorded as their dense values (Log._add_tensor); torch.strided and nested tensors are as they are.
_DENSIFIED = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc,
                        torch._mkldnn})


class _PendingRow(tuple):
    """``(pending, group, row)``: where a batched record's statistics will be (see :class:`_Pending`).

    A type of its own, so that a record's source tells it from the plain tuple
    of values a hook computed, which is what nearly every record holds.
    """

    __slots__ = ()


def _read_pending(src: _PendingRow) -> list[float]:
    """The statistics of a batched record; the first read of a log's brings all of
    its pending statistics to the host (one transfer per device)."""
    pending, group, row = src
    if group.rows is None:
        pending.read()
    return group.rows[row]


# Records read from a log's rows are built by _frow.build_records (picklehooks/_frecords.c), which fills the
# slots of a new instance without calling __init__: keep __init__ the one dataclass writes. The builder
# checks the fields and __post_init__ (picklehooks._native.record_builder), and tests/test_record_builder.py
# that it builds what __init__ builds.
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


# Log._records_now's loop in one C call (see picklehooks._native.record_builder), or None.
_build_records = _native.record_builder(Record, dtype_name)


def _current_rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class Log:
    """What one ``record()`` captured: ``log.records``, plus tables and files.

    ``sink``: a directory the records are streamed to (see :func:`record`).
    """

    def __init__(self, *, step: int = 0, keep_graph: bool = False, sink: str | os.PathLike | None = None,
                 append: bool = False, flush_rows: int | None = None) -> None:
        # What the hooks add: one tuple per record (see _add_tensor), built into Records when read.
        self._rows: list[tuple] = []
        self._records: list[Record] = []
        # Where written records are: a sink this log writes (they left memory), or a sink directory
        # it was loaded from (read into memory the first time ``records`` is).
        self._sink: _sink.Writer | None = None
        self._lazy: _sink.Reader | None = None
        self._tensor_bytes = 0  # of tensors kept in memory, towards FLUSH_BYTES
        self.flush_rows = FLUSH_ROWS
        #: Keep each recorded tensor's live (autograd-connected) original, for :meth:`vjp`.
        self.keep_graph = keep_graph
        self.step = step
        #: This process's torch.distributed rank, if a process group is up; every record carries it.
        self.rank = _current_rank()
        self._calls: dict[tuple[str, str, str], int] = {}
        # Per module: invocations whose inputs were recorded and outputs not yet, innermost last,
        # each (call, input paths, output paths); and the one whose outputs are being recorded.
        self._open: dict[str, list[tuple[int, set, set]]] = {}
        self._closing: dict[str, tuple[int, set, set]] = {}
        # Forward calls whose gradient hasn't arrived yet, per (module, kind, path):
        # backward handles the latest forward first, so gradients pop from the end;
        # from the calls that surely get one first (see _expects_grad).
        self._awaiting_grad: dict[tuple[str, str, str], list[int]] = {}
        self._maybe_grad: dict[tuple[str, str, str], list[int]] = {}
        self._pending = _Pending()
        self._set_sink(sink, append, flush_rows)  # last: it may create the directory

    def _set_sink(self, sink, append: bool, flush_rows: int | None) -> None:
        if flush_rows is not None:
            if not isinstance(flush_rows, int) or isinstance(flush_rows, bool) or flush_rows < 1:
                raise PicklehooksError(f"flush_rows={flush_rows!r}: give a number of records, 1 or more")
            self.flush_rows = flush_rows
        if sink is not None:
            if self._sink is not None:
                raise PicklehooksError(f"this log streams to {self._sink.path!r} already; it can't take sink={sink!r} too")
            self._sink = _sink.Writer(sink, append=append)

    @property
    def sink(self) -> str | None:
        """The directory this log streams its records to, or ``None``."""
        return None if self._sink is None else self._sink.path

    # -- adding (called by the ops and the eager hooks) ---------------------
    def _next_call(self, module: str, kind: str, path: str, expect: int = 0) -> int:
        """The ``call`` of a new record; ``expect``: whether a gradient of this forward value
        will follow (:data:`_SURE`), may follow (:data:`_MAYBE`), or won't (0)."""
        key = (module, kind, path)
        forward = _FORWARD_OF.get(kind)
        if forward is not None:
            fkey = (module, forward, path)
            for waiting in (self._awaiting_grad.get(fkey), self._maybe_grad.get(fkey)):
                if waiting:
                    return waiting.pop()
        calls = self._calls
        call = count = calls.get(key, 0)
        if kind == "input" or kind == "output" and self._open:  # (no inputs recorded: nothing to pair)
            call = self._invocation(module, kind, path, count)
            calls[key] = call + 1 if call >= count else count
        else:
            calls[key] = count + 1
        if expect:
            table = self._awaiting_grad if expect == _SURE else self._maybe_grad
            waiting = table.get(key)
            if waiting is None:
                table[key] = [call]
            else:
                waiting.append(call)
                if len(waiting) > _MAYBE_TRIM and expect == _MAYBE:  # inference loops: no gradient ever comes
                    del waiting[:-_MAYBE_KEPT]
        return call

    def _invocation(self, module: str, kind: str, path: str, call: int) -> int:
        """Pair an output with the inputs of the same invocation, also when a module calls itself.

        Inputs are recorded as an invocation starts and outputs as it ends, in
        program order (in graphs too: the ops are ordered effects), so each
        module keeps a stack of open invocations: an input whose path the top
        one already has opens a new one (a call from inside the call); the
        first output pops the top, and the outputs after it in the same hook
        (other paths) share its ``call``: the ``call`` of that invocation's
        first input. A module whose inputs aren't recorded counts outputs by
        themselves.
        """
        stack = self._open.get(module)
        if kind == "input":
            if stack is None:
                stack = self._open[module] = []
            if not stack or path in stack[-1][1]:
                stack.append((call, {path}, set()))
                if len(stack) > _MAX_OPEN:  # inputs recorded, outputs never: don't grow
                    del stack[0]
            else:
                stack[-1][1].add(path)
            return call
        closing = self._closing.get(module)
        if closing is not None and path not in closing[2]:
            closing[2].add(path)
            return closing[0]
        if not stack:
            return call
        closing = self._closing[module] = stack.pop()
        closing[2].add(path)
        return closing[0]

    def _note_call(self, module: str, kind: str, path: str, x: torch.Tensor | None = None, flags: int = 0) -> None:
        """Count a forward call whose value isn't recorded, so its gradient gets the right ``call``.

        Without ``x``, as the runtime copied into torch.package archives by earlier
        versions calls it, every such call awaits a gradient (as it did then).
        """
        expect = (_SURE if kind in _PAIRED else 0) if x is None else _expects_grad(kind, x, flags)
        self._next_call(module, kind, path, expect)

    def _add_tensor(self, module: str, kind: str, path: str, x: torch.Tensor, flags: int) -> None:
        """Record ``x`` as it is now: statistics are computed here or ``x`` is copied, never kept as is.

        A CPU tensor's statistics come from one native pass over its memory
        (:mod:`picklehooks._native`), before any later in-place op can change
        it: no copy. Otherwise (another device, another dtype, no extension)
        ``x`` is copied into a row of a batch that is reduced later, on its
        device (:class:`_Pending`), with no host sync either way.

        Most records (statistics of a CPU tensor, or a copy alone) take ``_add_row``,
        which does all of this in one C call; the rows are the same.
        """
        if _add_row is not None and _add_row(self, module, kind, path, x, flags):
            return
        call = self._next_call(module, kind, path, _expects_grad(kind, x, flags) if kind in _PAIRED else 0)
        live = x if self.keep_graph else None
        if x.layout in _DENSIFIED:
            # Sparse (an nn.Embedding(sparse=True) gradient) and mkldnn values are recorded as the
            # dense tensors they stand for: the statistics count the zeros they leave implicit.
            x = x.detach().to_dense()
        stats = src = tensor = None
        if flags & STATS:
            stats = native_stats(x)
            if stats is None and not x.numel():
                stats = EMPTY
            elif stats is None:
                x = x.detach()
                pending = self._pending  # once: flush() replaces it
                group, row = pending.add(x)
                src = _PendingRow((pending, group, group.used - 1))
                if flags & TENSOR:
                    tensor = row  # the batch's copy
        if flags & TENSOR and tensor is None:
            # A copy: the caller's tensor may change in place later (inplace ReLU,
            # optimizer steps, gradient accumulation). One memory pass, no sync.
            # detach() and memory_format= only where needed: together they cost more than the copy.
            value = x.detach() if x.requires_grad else x
            tensor = value.clone() if value.is_contiguous() else value.contiguous()
        if tensor is not None:
            self._tensor_bytes += x.nbytes
        self._rows.append((module, kind, path, call, self.step, x.shape, x.dtype, stats, src, tensor, live))

    def _add_stats(self, module: str, kind: str, path: str, stats: torch.Tensor, flags: int, shape: tuple,
                   dtype: torch.dtype) -> None:
        """Record the :data:`STAT_NAMES` values a compiled graph computed for a value (a float64
        tensor on its device; see :func:`picklehooks._stats.graph_stats`), read with the log's others.

        Tracing set ``GRAD_SURE``/``GRAD_NONE`` where gradients are captured; where they
        aren't, none will come to pair with.
        """
        expect = _SURE if kind in _PAIRED and flags & GRAD_SURE else 0
        call = self._next_call(module, kind, path, expect)
        # Not kept as it is: the graph reuses the buffer for later values once the op returns.
        if stats.is_cpu:
            values, src = tuple(stats.tolist()), None  # nine floats; no device to wait for
        else:
            pending = self._pending
            values, src = None, _PendingRow((pending, pending.add_table(stats.clone()), 0))  # no sync
        self._rows.append((module, kind, path, call, self.step, shape, dtype, values, src, None, None))

    def _add_value(self, module: str, kind: str, path: str, value: Any) -> None:
        self._records_now().append(Record(module, kind, path, self._next_call(module, kind, path), self.step,
                                          value=repr(value), rank=self.rank))

    def _records_now(self) -> list[Record]:
        """Build a Record for every row added since the last read; the records in memory."""
        records, rows = self._records, self._rows
        n = len(rows)  # a gradient hook on autograd's thread may append meanwhile: keep what comes after
        if n and _build_records is not None:
            records += _build_records(rows, n, self.rank)
            del rows[:n]
        elif n:
            rank = self.rank
            append = records.append
            for module, kind, path, call, step, shape, dtype, stats, src, tensor, live in rows[:n]:
                # Positional: Record's field order (module ... step, shape, dtype, tensor, value,
                # live, rank, _stats, _src); binding keywords costs more than the rest of the loop.
                append(Record(module, kind, path, call, step, tuple(shape), dtype_name(dtype), tensor, None, live,
                              rank, None, src if stats is None else stats))
            del rows[:n]
        return records

    @property
    def records(self) -> list[Record]:
        """Every record in memory, in the order recorded (built from the log's compact rows when read).

        That is every record, except in a log with a sink: there, those not
        written yet. A log loaded from a sink reads all of its records here
        the first time this is read.
        """
        if self._lazy is not None:
            self._records[:0] = self._from_sink(self._lazy)  # before any recorded into it since
            self._lazy = None
        return self._records_now()

    # -- reading --------------------------------------------------------------
    def __len__(self) -> int:
        if self._lazy is not None:  # without reading every record
            return self._lazy.count() + len(self._records) + len(self._rows)
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        sink = f", streaming to {self._sink.path!r}" if self._sink is not None else ""
        return f"<picklehooks.Log: {len(self)} records, step {self.step}{sink}>"

    def next_step(self) -> int:
        """Advance ``step`` (records made from now on carry the new value); return it.

        With a sink, write the records waiting once there are ``flush_rows`` of them
        (or :data:`FLUSH_BYTES` of tensors).
        """
        self.step += 1
        if self._sink is not None and (len(self._rows) + len(self._records) >= self.flush_rows
                                       or self._tensor_bytes >= FLUSH_BYTES):
            self.flush()
        return self.step

    def flush(self) -> int:
        """Write every record in memory to the sink as one Parquet part and drop it; return how many.

        Pending statistics are read first (one host sync per device). If
        writing fails, the records stay in memory and the error is raised.
        """
        if self._sink is None:
            raise PicklehooksError("this log has no sink to flush to; record with picklehooks.record(sink=DIR)")
        records, rows = self._records, self._rows
        m, n = len(records), len(rows)  # an autograd thread may append meanwhile: keep what comes after
        if not m + n:
            return 0
        columns, tensors = _columns(records[:m], rows[:n], self.rank)
        self._sink.write(columns, tensors, self.step)
        del records[:m], rows[:n]
        # A fresh batch of pending copies: the old one's counts would size new groups for the whole run.
        self._pending, self._tensor_bytes = _Pending(), 0
        return m + n

    def find(self, module: str | None = None, kind: str | None = None, path: str | None = None,
             call: int | None = None) -> list[Record]:
        """Records matching every field given (in a log loaded from a sink, read without reading the rest)."""
        if self._lazy is not None:
            filters = _filters(module=module, kind=kind, path=path, call=call)
            return self._from_sink(self._lazy, _sink.expression(filters)) + _matching(self._records_now(), filters)
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
        return self._vjp(out, inp, torch.ones_like(out) if v is None else v, True, (output_name, input_name))

    @staticmethod
    def _vjp(out: torch.Tensor, inp: torch.Tensor, v: torch.Tensor, retain: bool, names: tuple) -> torch.Tensor:
        (grad,) = torch.autograd.grad(out, inp, grad_outputs=v, retain_graph=retain, allow_unused=True)
        if grad is None:
            raise PicklehooksError(f"{names[0]!r} does not depend on {names[1]!r}: no path between them in the graph")
        return grad

    def jacobian_norm(self, output_name, input_name, *, samples: int = 64, seed: int = 0) -> tuple[float, float]:
        """Hutchinson estimate of ``||d(output)/d(input)||_F`` between two recorded intermediates.

        Returns ``(estimate, standard_error)`` from ``samples`` Rademacher
        probes, one backward pass each (see :mod:`picklehooks._jacobian`).
        Names as in :meth:`vjp`; needs ``record(keep_graph=True)``.
        """
        out, inp = self._one(output_name).live, self._one(input_name).live
        # retain_graph always: the log's graph stays usable for further vjp() calls.
        return hutchinson(out, lambda v, _: self._vjp(out, inp, v, True, (output_name, input_name)),
                          samples=samples, seed=seed)

    def to_pandas(self, module=None, kind=None, path=None, call=None, step=None, rank=None, *,
                  columns: list[str] | None = None):
        """The records as a ``pandas.DataFrame`` of :meth:`table` rows, those matching every filter given.

        Each filter is one value or a collection of values (``step=range(100, 200)``,
        ``kind=("output", "grad_output")``); ``columns`` picks columns. With a
        sink, this reads the records written there too (with ``append=True``,
        earlier runs' as well), reading from the files only the row groups and
        columns needed::

            frame = log.to_pandas(module="encoder.0", kind="output", step=range(1000, 2000))
        """
        try:
            import pandas
        except ImportError:
            raise PicklehooksError("Log.to_pandas() needs pandas: pip install 'picklehooks[log]'") from None
        filters = _filters(module=module, kind=kind, path=path, call=call, step=step, rank=rank)
        names = _table_columns(columns)
        stored = self._lazy if self._sink is None else _sink.Reader(self._sink.path, snapshot=False)
        if stored is None and not filters and columns is None:
            return pandas.DataFrame(self.table())  # as always
        frames = [pandas.DataFrame([r.row() for r in _matching(self._records_now(), filters)], columns=names)]
        if stored is not None:
            table = stored.table(_sink.expression(filters), columns=names)
            frame = table.to_pandas()
            if "shape" in frame:  # lists, as table() has them, not numpy arrays
                frame["shape"] = table.column("shape").to_pylist()
            frames = [f for f in (frame, frames[0]) if len(f)] or [frame]
        frame = pandas.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        if columns is None and frame["rank"].isna().all():
            frame = frame.drop(columns="rank")  # as in table(): a rank only where records have one
        return frame

    def to_tensorboard(self, writer, step: int | None = None, *, histograms: bool = True) -> int:
        """Write per-layer scalars and histograms to a ``SummaryWriter`` (``pip install 'picklehooks[tensorboard]'``)."""
        from .tensorboard import write
        return write(self, writer, step, histograms=histograms)

    def to_mlflow(self, *, step: int | None = None, run_id: str | None = None, client=None,
                  stats: tuple[str, ...] | None = None) -> int:
        """Log per-layer statistics as metrics of the active MLflow run (``pip install 'picklehooks[mlflow]'``).

        Returns the number of metrics written; see :func:`picklehooks.mlflow.log_metrics`.
        """
        from .mlflow import STATS, log_metrics
        return log_metrics(self, step=step, run_id=run_id, client=client, stats=STATS if stats is None else stats)

    # -- files ----------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write ``records.json`` (and ``tensors.safetensors`` if tensors were kept) into directory ``path``.

        A log already there is replaced completely; a directory holding anything else is refused.
        A log streaming to a sink is refused: its records are in the sink (``Log.load(sink).save(path)``).
        """
        if self._sink is not None:
            raise PicklehooksError(
                f"this log streams its records to {self._sink.path!r}, so it holds only the latest; call "
                f"log.flush() and read them all with Log.load({self._sink.path!r}) (which can save())")
        tensors = {i: r.tensor for i, r in enumerate(self.records) if r.tensor is not None}
        _logfile.save(path, self.table(), tensors, self.step)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Log:
        """Read a log written by :meth:`save`, or a sink ``record(sink=path)`` wrote, checking records
        against tensors.

        A sink is read lazily: the parts there now, none of them read until
        ``records`` (all of them) or :meth:`find`/:meth:`to_pandas` (the
        matching ones) are. ``step`` is the writing log's step at its last write.
        """
        if _sink.is_sink(path):
            reader = _sink.Reader(path)
            log = cls(step=reader.step())
            log._lazy = reader
            return log
        rows, tensors, step = _logfile.load(path)
        return cls.from_rows(rows, tensors, step=step)

    @staticmethod
    def _from_sink(reader: _sink.Reader, where=None) -> list[Record]:
        rows = reader.table(where).to_pylist()
        return [_record_from_row(row, tensor) for row, tensor in zip(rows, reader.tensors(rows))]

    @classmethod
    def from_rows(cls, rows: list[dict], tensors: list[torch.Tensor | None] | None = None, *, step: int = 0) -> Log:
        """Rebuild a log from :meth:`table` rows (and the records' tensors, in the same order)."""
        log = cls(step=step)
        tensors = tensors or [None] * len(rows)
        log.records.extend(_record_from_row(row, tensor) for row, tensor in zip(rows, tensors))
        return log


def _record_from_row(row: dict, tensor: torch.Tensor | None) -> Record:
    shape = tuple(row["shape"]) if row["shape"] is not None else None
    rec = Record(row["module"], row["kind"], row["path"], row["call"], row["step"], shape=shape,
                 dtype=row["dtype"], value=row["value"], rank=row.get("rank"), tensor=tensor)
    if row.get("mean") is not None or row.get("nan") is not None:
        rec._stats = {"shape": shape, "dtype": row["dtype"], **{n: row[n] for n in STAT_NAMES}}
    return rec


_NO_STATS = (None,) * len(STAT_NAMES)


def _columns(records: list[Record], rows: list[tuple], rank: int | None) -> tuple[dict[str, list], dict]:
    """Columns of a sink part (:data:`picklehooks._sink.COLUMNS`) from Records and from compact rows
    (the records first, as they were recorded first), and the kept tensors by row number."""
    columns: dict[str, list] = {name: [] for name in _sink.COLUMNS[:9]}
    stats, tensors = [], {}
    for i, r in enumerate(records):
        for name, value in zip(columns, (r.module, r.kind, r.path, r.call, r.step,
                                         None if r.shape is None else list(r.shape), r.dtype, r.value, r.rank)):
            columns[name].append(value)
        s = r.stats
        stats.append(_NO_STATS if s is None else tuple(s[name] for name in STAT_NAMES))
        if r.tensor is not None:
            tensors[i] = r.tensor
    if rows:
        module, kind, path, call, step, shape, dtype, row_stats, src, kept, _ = zip(*rows)
        for name, values in (("module", module), ("kind", kind), ("path", path), ("call", call), ("step", step)):
            columns[name] += values
        columns["shape"] += shape  # torch.Size is a tuple, which pyarrow takes as a list
        columns["dtype"] += map(dtype_name, dtype)
        columns["value"] += [None] * len(rows)
        columns["rank"] += [rank] * len(rows)
        for s, pending in zip(row_stats, src):
            if s is None and pending is not None:
                s = _read_pending(pending)
            stats.append(_NO_STATS if s is None else s)
        offset = len(records)
        tensors.update((offset + i, t) for i, t in enumerate(kept) if t is not None)
    for name, values in zip(STAT_NAMES, zip(*stats)):
        columns[name] = [None if v is None else int(v) for v in values] if name in _COUNTS else list(values)
    if not stats:
        columns.update((name, []) for name in STAT_NAMES)
    return columns, tensors


# Table columns, in order; "rank" only where some record has a rank.
_TABLE_COLUMNS = _sink.COLUMNS[:-2]
_FILTER_TYPES = {"module": str, "kind": str, "path": str, "call": int, "step": int, "rank": int}


def _table_columns(columns) -> list[str]:
    if columns is None:
        return list(_TABLE_COLUMNS)
    names = [columns] if isinstance(columns, str) else list(columns)
    bad = [c for c in names if c not in _TABLE_COLUMNS]
    if bad:
        raise PicklehooksError(f"columns={columns!r}: no column {bad[0]!r}; the columns are {', '.join(_TABLE_COLUMNS)}")
    return names


def _filters(**given) -> dict[str, tuple | range]:
    """The filters given (not None), each as the values wanted (a tuple, or a range as given), type-checked."""
    filters = {}
    for name, want in given.items():
        if want is None:
            continue
        kind = _FILTER_TYPES[name]
        if isinstance(want, range) and kind is int:
            values = want  # kept: a range filters as two comparisons, not a list of every value
        elif isinstance(want, (str, int)):
            values = (want,)
        else:
            values = tuple(want) if isinstance(want, (list, tuple, set, frozenset)) else ()
        typed = isinstance(values, range) or all(isinstance(v, kind) and not isinstance(v, bool) for v in values)
        if not values or not typed:
            raise PicklehooksError(
                f"{name}={want!r}: give a {kind.__name__} or a non-empty list, tuple, set"
                f"{' or range' if kind is int else ''} of them")
        filters[name] = values
    return filters


def _matching(records: list[Record], filters: dict[str, tuple | range]) -> list[Record]:
    if not filters:
        return records
    wanted = [(name, values if isinstance(values, range) else set(values)) for name, values in filters.items()]
    return [r for r in records if all(getattr(r, name) in values for name, values in wanted)]


@contextlib.contextmanager
def record(*, step: int = 0, keep_graph: bool = False, log: Log | None = None,
           sink: str | os.PathLike | None = None, append: bool = False,
           flush_rows: int | None = None) -> Iterator[Log]:
    """Record what instrumented models compute in this thread/context::

        with picklehooks.record() as log:
            model(x).sum().backward()
        print(log.table()[0])

    ``sink=dir`` streams the records to Parquet files in ``dir`` (``pip install
    'picklehooks[parquet]'``), so memory stays flat however long the run::

        with picklehooks.record(sink="runs/exp1") as log:
            for x in batches:
                model(x).sum().backward()
                log.next_step()          # writes once flush_rows records wait
        frame = picklehooks.Log.load("runs/exp1").to_pandas(module="head", step=range(100, 200))

    ``dir`` must be new or empty, or hold a sink of an earlier run and
    ``append=True``; anything else is refused. The records left are written on
    exit, whatever ends the block.
    """
    if log is None:
        log = Log(step=step, keep_graph=keep_graph, sink=sink, append=append, flush_rows=flush_rows)
    else:
        log._set_sink(sink, append, flush_rows)
    token = _state.push(log)
    try:
        yield log
    finally:
        _state.pop(log, token)
        if log._sink is not None:
            log.flush()
