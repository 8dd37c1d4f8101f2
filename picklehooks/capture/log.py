"""Records of the values that flowed through an instrumented model, and ``record()``.

``with picklehooks.record() as log:`` turns recording on for the current
thread (or asyncio task); instrumented models then add :class:`Record`\\ s to
``log``. A CPU tensor's statistics are computed in the hook (the native pass);
any other tensor is copied on its device, and copies of one dtype are
reduced together, a fixed number of kernels for all of them
(:mod:`picklehooks.capture.pending`), the first time any record's ``stats``
is read, or when the copies pass :data:`PENDING_BYTES`; all statistics
reach the host in one transfer per device: no host synchronisation per hook.

``log.save(dir)`` writes an open format: ``records.json`` (every field and
statistic, strict JSON: non-finite statistics are the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``) and, when tensors were kept,
``tensors.safetensors`` (keys are record indices). :meth:`Log.load` reads it
back.

``record(sink=dir)`` streams instead, for runs of any length: the records
go to Parquet files in ``dir`` while the run goes on (:mod:`picklehooks.capture.sink`
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

import os
import warnings
from typing import Iterator, NamedTuple

import torch

from .. import _state
from .._shim import PicklehooksError
from . import logfile as _logfile, sink as _sink, table as _table, tree as _tree
from .pending import PENDING_BYTES, _Pending
from .record import STAT_NAMES, Record, _record_from_row
from .exports import Exports
from .rows import Rows

__all__ = ["Record", "Log", "record", "Recording", "held", "Held", "STAT_NAMES", "PENDING_BYTES", "FLUSH_ROWS", "FLUSH_BYTES"]

#: With a sink: records waiting in memory that make ``next_step()`` write them (a Parquet part of
#: about this many rows; a few MB of memory).
FLUSH_ROWS = 8192
#: With a sink: bytes of kept tensors (mode "tensor"/"both") that make ``next_step()`` write them.
FLUSH_BYTES = 64 << 20


class Log(Exports, Rows):
    """What one ``record()`` captured: ``log.records``, plus tables and files.

    ``sink``: a directory the records are streamed to (see :func:`record`).
    The rows the hooks add come in through :class:`~picklehooks.capture.rows.Rows`;
    this class reads them.
    """

    def __init__(self, *, step: int = 0, keep_graph: bool = False, sink: str | os.PathLike | None = None,
                 append: bool = False, flush_rows: int | None = None) -> None:
        super().__init__(step=step, keep_graph=keep_graph)
        # Where written records are: a sink this log writes (they left memory), or a sink directory
        # it was loaded from (read into memory the first time ``records`` is).
        self._sink: _sink.Writer | None = None
        self._lazy: _sink.Reader | None = None
        self.flush_rows = FLUSH_ROWS
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

    @property
    def records(self) -> list[Record]:
        """Every record in memory, in the order recorded (built from the log's compact rows when read).

        That is every record, except in a log with a sink: there, those not
        written yet. A log loaded from a sink reads all of its records here
        the first time this is read.
        """
        if self._lazy is not None:
            self._records[:0] = _table.from_sink(self._lazy)  # before any recorded into it since
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
        _flush_if_due(self)
        return self.step

    def begin_step(self, step: int) -> None:
        """Start training step ``step``: records carry it, and ``call`` counts from 0 again.

        So ``call`` is the call within the step: micro-batch ``k`` of gradient accumulation is
        ``call == k`` for a module run once per forward, in every form of the model. Every gradient
        of the previous step must have arrived. With a sink, writes what waits, as :meth:`next_step`.
        """
        self._begin_step(step)
        _flush_if_due(self)

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
        columns, tensors = _table._columns(records[:m], rows[:n], self.rank, self._sources)
        self._sink.write(columns, tensors, self.step)
        del records[:m], rows[:n]
        # A fresh batch of pending copies: the old one's counts would size new groups for the whole run.
        self._pending, self._tensor_bytes = _Pending(), 0
        return m + n

    def find(self, module: str | None = None, kind: str | None = None, path: str | None = None,
             call: int | None = None) -> list[Record]:
        """Records matching every field given (in a log loaded from a sink, read without reading the rest)."""
        if self._lazy is not None:
            filters = _table._filters(module=module, kind=kind, path=path, call=call)
            return _table.from_sink(self._lazy, _sink.expression(filters)) + _table._matching(self._records_now(), filters)
        return [r for r in self.records
                if (module is None or r.module == module) and (kind is None or r.kind == kind)
                and (path is None or r.path == path) and (call is None or r.call == call)]

    def table(self) -> list[dict]:
        """One dict per record: fields and statistics (no tensors)."""
        return [r.row() for r in self.records]


    # -- thin delegations to the layers above (imported when called) ---------
    def vjp(self, output_name, input_name, v: torch.Tensor | None = None) -> torch.Tensor:
        """``v^T d(output)/d(input)`` between two recorded intermediates (needs ``record(keep_graph=True)``).

        See :func:`picklehooks.diagnostics.jacobian.recorded_vjp`.
        """
        from ..diagnostics.jacobian import recorded_vjp
        return recorded_vjp(self, output_name, input_name, v)

    def jacobian_norm(self, output_name, input_name, *, samples: int = 64, seed: int = 0) -> tuple[float, float]:
        """Hutchinson estimate ``(estimate, standard_error)`` of ``||d(output)/d(input)||_F`` (``keep_graph=True``).

        See :func:`picklehooks.diagnostics.jacobian.recorded_jacobian_norm`.
        """
        from ..diagnostics.jacobian import recorded_jacobian_norm
        return recorded_jacobian_norm(self, output_name, input_name, samples=samples, seed=seed)

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

    @classmethod
    def from_rows(cls, rows: list[dict], tensors: list[torch.Tensor | None] | None = None, *, step: int = 0) -> Log:
        """Rebuild a log from :meth:`table` rows (and the records' tensors, in the same order)."""
        log = cls(step=step)
        tensors = tensors or [None] * len(rows)
        log.records.extend(_record_from_row(row, tensor) for row, tensor in zip(rows, tensors))
        return log



def _flush_if_due(log: Log) -> None:
    """At a step's start: with a sink, write what waits once there are ``flush_rows`` records or
    :data:`FLUSH_BYTES` of tensors."""
    if log._sink is not None and (len(log._rows) + len(log._records) >= log.flush_rows
                                  or log._tensor_bytes >= FLUSH_BYTES):
        log.flush()


class Held(NamedTuple):
    """What a log holds in memory at one moment (see :func:`held`)."""

    records: int  #: records built (``log.records``) and not written to a sink
    rows: int  #: rows the hooks added, not built into records yet
    copies: list  #: the buffers of batched copies, and the values kept by reference or watched, not reduced yet
    batches: int  #: dtypes batched since the last write, plus arenas of statistics not read yet
    unread_sink: bool  #: a log loaded from a sink whose records haven't been read into memory


def held(log: Log) -> Held:
    """What ``log`` holds in memory now, without building or reading anything.

    For memory checks (a sink's log should hold next to nothing between
    steps) and for tests, instead of the log's private attributes.
    """
    pending = log._pending
    return Held(len(log._records), len(log._rows), [t for g in pending.unreduced for t in g.buffers()] + [w[0] for w in pending.watched],
                len(pending.unreduced) + len(pending.reduced) + len(pending.seen), log._lazy is not None)


def record(*, step: int = 0, keep_graph: bool = False, log: Log | None = None,
           sink: str | os.PathLike | None = None, append: bool = False,
           flush_rows: int | None = None) -> Recording:
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

    Leaving the block by any exception (a :class:`~picklehooks.NonfiniteError`
    included), or by the close of a generator it sits in, stops recording. The
    returned :class:`Recording` can also be entered and left by hand (a
    training callback's ``__enter__()`` at one event and ``__exit__()`` at
    another); one entered and never left records until the interpreter exits,
    where nothing runs and nothing is reported.
    """
    if log is None:
        log = Log(step=step, keep_graph=keep_graph, sink=sink, append=append, flush_rows=flush_rows)
    else:
        log._set_sink(sink, append, flush_rows)
    return Recording(log)


class Recording:
    """What :func:`record` returns: a context manager that makes ``log`` record while entered.

    A class, not a generator: an abandoned one (entered, never left, as a
    callback's may be when training dies) has no finaliser to run against a
    half-torn-down interpreter at exit. Entering checks the instrumented
    models for surgery (:mod:`picklehooks.capture.tree`); leaving a block in
    which nothing was recorded warns (a model whose hooks a loader dropped, or one that
    captures only gradients run without a backward pass).
    """

    __slots__ = ("log", "_token", "_mark")

    def __init__(self, log: Log) -> None:
        self.log = log
        self._token = self._mark = None

    @property
    def active(self) -> bool:
        """Whether this recording is entered and not left yet."""
        return self._token is not None

    def __enter__(self) -> Log:
        if self._token is not None:
            raise PicklehooksError("this record() is active already; leave it before entering it again")
        _tree.check()
        self._mark = _made(self.log)
        self._token = _state.push(self.log)
        return self.log

    def __exit__(self, exc_type, *exc_info) -> None:
        token, self._token = self._token, None
        if token is None:  # left already: nothing to undo
            return
        log = self.log
        try:
            _state.pop(log, token)
        finally:
            if log._sink is not None:
                log.flush()
        if exc_type is None and _made(log) == self._mark:
            warnings.warn(
                "nothing was recorded in this record() block: no instrumented module recorded a value in it. "
                "A model made by from_pretrained() or torch.load of a state dict has none of the hooks the "
                "saved model had; attach them with picklehooks.load_hooks(model, path, trust=...) or "
                "picklehooks.instrument(model, spec=...). A model that captures only gradients records "
                "nothing in a block without a backward pass (a forward under no_grad, say). A torch.compile'd "
                "model runs the graph Dynamo compiled for a model of its class without these hooks (a plain copy, "
                "compiled before or after it), because Dynamo doesn't guard on module hooks by default: set "
                "torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling either, or call "
                "torch._dynamo.reset() before compiling the instrumented model and compile no plain copy after it",
                UserWarning, stacklevel=2)


def _made(log: Log) -> tuple:
    """What a log holds and wrote: changes whenever a record is made."""
    return len(log._rows) + len(log._records), None if log._sink is None else log._sink.next
