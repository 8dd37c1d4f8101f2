"""The record builder (csrc/records.c's build_records) builds the Records that Log._records_now's
Python loop builds.

Each case records real values into a log, then builds Records from the same
rows twice: through the builder of the implementation in use (the C
extension's, or with ``PICKLEHOOKS_NATIVE=0`` its Python twin's), and through
the Python loop (the builder switched off). Every field must be the same object or an equal one of the same
type, and the records must behave as dataclass instances made by ``__init__``
do (pickling, copying, weak references, ``dataclasses.replace``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import sys
import weakref

import pytest
import torch

import picklehooks
from picklehooks import Log, Record, _native, _ops
from picklehooks.capture import rows as rows_module

pytestmark = pytest.mark.skipif(rows_module._build_records is None,
                                reason="Record is no longer what _native.record_builder can build")
FIELDS = [f.name for f in dataclasses.fields(Record)]


def recorded_rows(**instrument_kwargs) -> tuple[Log, list[tuple]]:
    """A log of a small model's forward+backward with every kind of row, and a copy of its rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    picklehooks.instrument(model, capture=("input", "output", "grad_output", "param"), **instrument_kwargs)
    with picklehooks.record() as log:
        model(torch.randn(5, 4)).sum().backward()
        model[1](torch.arange(-4.0, 4.0).reshape(2, 4).half())  # float16 values
        log._add_tensor("ints", "output", "", torch.arange(6), _ops.VALUE | _ops.STATS)  # batched
        log._add_stats("compiled", "output", "", torch.arange(9.0, dtype=torch.float64), _ops.VALUE,
                       (3, 3), torch.float32)
    rows = list(log._rows)
    assert rows, "nothing was recorded"
    return log, rows


def python_records(rows: list[tuple], rank, monkeypatch, sources: dict) -> list[Record]:
    log = Log()
    log._rows[:] = rows
    log.rank = rank
    log._sources.update(sources)  # the recording log's: what each (module, call) was called from
    with monkeypatch.context() as patch:
        patch.setattr(rows_module, "_build_records", None)
        return list(log.records)


def assert_same(built: list[Record], expected: list[Record]) -> None:
    assert len(built) == len(expected)
    for b, e in zip(built, expected):
        assert type(b) is Record
        for name in FIELDS:
            bv, ev = getattr(b, name), getattr(e, name)
            assert type(bv) is type(ev), (name, bv, ev)
            if isinstance(ev, torch.Tensor) or name == "_src":
                assert bv is ev, name  # the row's own object: a copy, a live value, a pending slot
            else:
                assert bv == ev, (name, bv, ev)
        assert b.stats == e.stats
        assert repr(b) == repr(e)


@pytest.mark.parametrize("mode", ["stats", "tensor", "both"])
def test_builds_what_the_python_loop_builds(mode, monkeypatch):
    log, rows = recorded_rows(mode=mode)
    expected = python_records(rows, None, monkeypatch, log._sources)
    built = log.records
    assert not log._rows
    assert_same(built, expected)
    kinds = {r.kind for r in built}
    assert {"input", "output", "grad_output", "param"} <= kinds


def test_rank_and_live_values(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    picklehooks.instrument(model)
    with picklehooks.record(keep_graph=True) as log:
        model(torch.randn(4, 3, requires_grad=True)).sum().backward()
    rows = list(log._rows)
    assert any(row[10] is not None for row in rows), "keep_graph kept no live value"
    log.rank = 3
    expected = python_records(rows, 3, monkeypatch, log._sources)
    built = log.records
    assert_same(built, expected)
    assert all(r.rank == 3 for r in built) and any(r.live is not None for r in built)


def test_records_behave_as_dataclass_instances():
    log, _ = recorded_rows(mode="both")
    record = next(r for r in log.records if r.tensor is not None)
    assert gc.is_tracked(record)
    assert weakref.ref(record)() is record
    again = pickle.loads(pickle.dumps(record))
    assert again.key == record.key and torch.equal(again.tensor, record.tensor) and again.stats == record.stats
    assert copy.deepcopy(record).stats == record.stats
    changed = dataclasses.replace(record, call=7)
    assert changed.call == 7 and changed.module == record.module
    assert dataclasses.asdict(record)["shape"] == record.shape
    record.call = 9  # slots stay writable
    assert record.call == 9


def test_no_reference_is_leaked_or_lost():
    log, rows = recorded_rows()
    # The first row's statistics (a Stats object), or with the twin where it has none, its pending source.
    held = rows[0][7] if rows[0][7] is not None else rows[0][8]
    before = sys.getrefcount(held)
    records = rows_module._build_records(rows, len(rows), None)
    after = sys.getrefcount(held)  # (read before asserting: pytest's rewriting keeps what an assert reads)
    assert records[0]._src is held
    assert after == before + 1
    del records
    gc.collect()
    assert sys.getrefcount(held) == before


def test_bad_rows_raise_and_leave_the_log_as_it_was():
    log, rows = recorded_rows()
    log._rows.append(("m", "output", ""))  # not a row
    with pytest.raises(TypeError, match="not an 11-tuple"):
        log.records
    assert len(log._rows) == len(rows) + 1 and not log._records
    with pytest.raises(ValueError, match="at least n rows"):
        rows_module._build_records(rows, len(rows) + 1, None)
    with pytest.raises(TypeError):
        rows_module._build_records(rows, 1)


def test_declined_for_a_record_type_it_does_not_know():
    """Reading stays in Python unless the type is a slotted dataclass of exactly the thirteen fields."""
    assert _native.record_builder(dict, rows_module.dtype_name) is None

    @dataclasses.dataclass(slots=True)
    class Extra(Record):
        extra: int = 0

    assert _native.record_builder(Extra, rows_module.dtype_name) is None

    @dataclasses.dataclass(eq=False, slots=True)
    class Checked:
        module: str
        kind: str
        path: str
        call: int
        step: int
        shape: tuple | None = None
        dtype: str | None = None
        tensor: object = None
        value: str | None = None
        live: object = None
        rank: int | None = None
        _stats: dict | None = None
        _src: tuple | None = None

        def __post_init__(self):
            raise AssertionError("would be skipped")

    assert _native.record_builder(Checked, rows_module.dtype_name) is None


@pytest.mark.skipif(not _native.AVAILABLE, reason="the C fills slots; the twin calls Record(...) and needs none")
def test_configure_refuses_types_without_plain_slots():
    @dataclasses.dataclass  # no slots: fields live in __dict__
    class Plain:
        pass

    fields = tuple(FIELDS)
    with pytest.raises(TypeError, match="slots and no __dict__"):
        _native._speedups.configure_records(record=Plain, fields=fields, dtype_name=rows_module.dtype_name)

    class Props:
        __slots__ = tuple(f for f in fields if f != "_src")
        _src = property(lambda self: None)

    with pytest.raises(TypeError, match="'_src' is not a writable object slot"):
        _native._speedups.configure_records(record=Props, fields=fields, dtype_name=rows_module.dtype_name)
    # Record's own fields, without slots: record_builder leaves reading to the Python loop.
    unslotted = dataclasses.make_dataclass("Unslotted", [*FIELDS[:5], *((name, object, None) for name in FIELDS[5:])])
    assert _native.record_builder(unslotted, rows_module.dtype_name) is None
    # Still configured for Record: reading works.
    log, rows = recorded_rows()
    assert len(log.records) == len(rows)
