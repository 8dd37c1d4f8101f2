"""The row-writing path: what the ops and the eager hooks call on the active log, per value.

Each record is one compact tuple appended to ``log._rows`` (module, kind,
path, call, step, shape, dtype, statistics, pending source, kept copy, live
value), built into :class:`~picklehooks.capture.record.Record`\\ s only when
read. A CPU tensor's statistics come from one native pass over its memory;
anything else is copied into a batch reduced later on its device
(:mod:`picklehooks.capture.pending`), with no host sync either way.

The method names here (``_add_tensor``, ``_add_stats``, ``_add_value``,
``_note_call``) are part of the wire contract: the runtime that torch.package
archives carry calls them on the host's log (see the docs' wire-contract page).
The attribute names are read by the native row lane and record builder
(:mod:`picklehooks._native`): ``_rows``, ``_tensor_bytes``, ``keep_graph``, ``step``
here, and :class:`~picklehooks.capture.pairing.CallPairing`'s ``_calls``, ``_open``,
``_awaiting_grad`` and ``_maybe_grad``. They are the internal interface the lanes'
tests (``tests/runtime/``) hold the C and the Python paths to; anything else reads a log
through its public side or :func:`picklehooks.capture.log.held`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _native
from .._native import stats as native_stats
from .._ops import COMPILED, GRAD_NONE, GRAD_SURE, STATS, TENSOR
from .._shim import PicklehooksError
from .._stats import EMPTY
from .logfile import dtype_name
from .pairing import _FORWARD_OF, _MAYBE, _MAYBE_KEPT, _MAYBE_TRIM, _PAIRED, _SURE, CallPairing, _expects_grad
from .pending import _Pending, _PendingRow
from .record import Record, _ZerosIfNone
from .sources import Sources

# Log._add_tensor's common cases in one C call (see picklehooks._native.row_lane), or None.
_add_row = _native.row_lane(sure=_SURE, maybe=_MAYBE, stats_bit=STATS, tensor_bit=TENSOR, sure_bit=GRAD_SURE,
                            none_bit=GRAD_NONE, forward_of=_FORWARD_OF, maybe_trim=_MAYBE_TRIM, maybe_kept=_MAYBE_KEPT)
# Layouts recorded as their dense values (Log._add_tensor); torch.strided and nested tensors are as they are.
_DENSIFIED = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc,
                        torch._mkldnn})


# Log._records_now's loop in one C call (see picklehooks._native.record_builder), or None.
_build_records = _native.record_builder(Record, dtype_name)


def _current_rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class Rows(CallPairing, Sources):
    """A log's write side: rows as the hooks add them, and the records built from them."""

    def __init__(self, *, step: int = 0, keep_graph: bool = False) -> None:
        CallPairing.__init__(self)
        Sources.__init__(self)
        # What the hooks add: one tuple per record (see _add_tensor), built into Records when read.
        self._rows: list[tuple] = []
        self._records: list[Record] = []
        self._tensor_bytes = 0  # of tensors kept in memory, towards FLUSH_BYTES
        #: Keep each recorded tensor's live (autograd-connected) original, for :meth:`vjp`.
        self.keep_graph = keep_graph
        self.step = step
        #: This process's torch.distributed rank, if a process group is up; every record carries it.
        self.rank = _current_rank()
        self._pending = _Pending()

    def _begin_step(self, step: int) -> None:
        """Records made from now on carry ``step``, and calls are counted from 0 again (a training step)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise PicklehooksError(f"step={step!r}: give the step as an int")
        self._restart_calls()
        self._restart_sources()
        self.step = step

    def _add_tensor(self, module: str, kind: str, path: str, x: torch.Tensor, flags: int) -> None:
        """Record ``x`` as it is now: statistics are computed here, or batched on ``x``'s device.

        A CPU tensor's statistics come from one native pass over its memory
        (:mod:`picklehooks._native`), before any later in-place op can change
        it: no copy. Otherwise (another device, another dtype, no extension)
        ``x`` is batched with the rest and reduced later on its device
        (:class:`_Pending`): kept by reference with its version counter, or
        copied where its site's values get changed in place; no host sync either way.

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
                pending = self._pending  # once: flush() replaces it
                if flags & TENSOR:
                    group, tensor = pending.add(x.detach())  # the batch's copy is the kept tensor
                else:
                    # A compiled graph's buffer may be reused once the op returns: copied (see _ops.COMPILED).
                    group = pending.add_value(x, (module, kind, path), copy=bool(flags & COMPILED))
                src = _PendingRow((pending, group, group.used - 1))
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
            values, src = None, _PendingRow((pending, *pending.add_graph_stats(stats)))  # no sync
        self._rows.append((module, kind, path, call, self.step, shape, dtype, values, src, None, None))

    def _lend(self) -> None:
        """A compiled graph's ``record_batch`` kernel starts (called by it, by name): the values and
        statistics it hands over stay valid until :meth:`_give_back` (see :meth:`_Pending.lend`)."""
        self._lender = self._pending
        self._lender.lend()

    def _give_back(self) -> None:
        """The ``record_batch`` kernel returns: what it lent is reduced now, or stacked (no sync)."""
        lender, self._lender = self._lender, None
        lender.give_back()

    def _mark_zeros_if_none(self, module: str, kind: str, path: str) -> None:
        """The gradient just recorded at this site came from a ``torch.compile`` backward, which gets
        zeros where no gradient came (:data:`picklehooks._ops.COMPILED`): if it is all zeros,
        it is read as no statistics and a note (:class:`~picklehooks.capture.record._ZerosIfNone`).
        Called by ``tap_grad``'s kernel right after the row was added, on the same thread."""
        rows = self._rows
        if not rows:
            return
        row = rows[-1]
        if row[0] != module or row[1] != kind or row[2] != path or (row[7] is None and row[8] is None):
            return  # not this site's row (a kept tensor alone has no statistics to withhold)
        stats = row[7] if row[7] is not None else row[8]
        rows[-1] = (*row[:7], None, _ZerosIfNone(stats, (module, kind, path)), *row[9:])

    def _add_value(self, module: str, kind: str, path: str, value: Any) -> None:
        call = self._next_call(module, kind, path)
        self._records_now().append(Record(module, kind, path, call, self.step, value=repr(value), rank=self.rank,
                                          source=self._sources.get((module, call))))

    def _records_now(self) -> list[Record]:
        """Build a Record for every row added since the last read; the records in memory."""
        records, rows = self._records, self._rows
        n = len(rows)  # a gradient hook on autograd's thread may append meanwhile: keep what comes after
        start = len(records)
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
        if n and self._sources:
            sources = self._sources
            for record in records[start:]:
                record.source = sources.get((record.module, record.call))
        return records
