"""The log as a table: rows for ``table()``/``to_pandas()``, sink columns, and filters.

Filters take one value or a collection (``step=range(100, 200)``); reading a
sink reads only the row groups and columns a filter needs.
"""

from __future__ import annotations


from .._shim import PicklehooksError
from . import sink as _sink
from .logfile import dtype_name
from .record import _COUNTS, _NO_GRADIENT, NO_GRADIENT_NOTE, STAT_NAMES, Record, _record_from_row, _resolve

_NO_STATS = (None,) * len(STAT_NAMES)


def _columns(records: list[Record], rows: list[tuple], rank: int | None, sources: dict | None = None
             ) -> tuple[dict[str, list], dict]:
    """Columns of a sink part (:data:`picklehooks.capture.sink.COLUMNS`) from Records and from compact rows
    (the records first, as they were recorded first), and the kept tensors by row number. ``sources``:
    the log's ``(module, call) -> source`` (see :mod:`picklehooks.capture.sources`), for the rows."""
    columns: dict[str, list] = {name: [] for name in _sink.COLUMNS[:_sink.COLUMNS.index("rank") + 1]}
    stats, tensors = [], {}
    for i, r in enumerate(records):
        for name, value in zip(columns, (r.module, r.kind, r.path, r.call, r.step,
                                         None if r.shape is None else list(r.shape), r.dtype, r.value, r.source,
                                         r.note, r.rank)):
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
        get = (sources or {}).get
        columns["source"] += [get((m, c)) for m, c in zip(module, call)]
        columns["rank"] += [rank] * len(rows)
        notes = columns["note"]
        for s, pending in zip(row_stats, src):
            if s is None and pending is not None:
                s = _resolve(pending)
            notes.append(NO_GRADIENT_NOTE if s is _NO_GRADIENT else None)
            stats.append(_NO_STATS if s is None or s is _NO_GRADIENT else s)
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



def from_sink(reader: _sink.Reader, where=None) -> list[Record]:
    """The records a sink holds (those ``where`` matches), with their tensors."""
    rows = reader.table(where).to_pylist()
    return [_record_from_row(row, tensor) for row, tensor in zip(rows, reader.tensors(rows))]


def to_pandas(log, filters: dict, columns: list[str] | None):
    """``log``'s records matching ``filters`` as a ``pandas.DataFrame`` (see :meth:`Log.to_pandas`)."""
    try:
        import pandas
    except ImportError:
        raise PicklehooksError("Log.to_pandas() needs pandas: pip install 'picklehooks[log]'") from None
    names = _table_columns(columns)
    stored = log._lazy if log._sink is None else _sink.Reader(log._sink.path, snapshot=False)
    if stored is None and not filters and columns is None:
        return pandas.DataFrame(log.table())  # as always
    frames = [pandas.DataFrame([r.row() for r in _matching(log._records_now(), filters)], columns=names)]
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

