"""A log streamed to a directory of Parquet files while it records: ``record(sink=PATH)``.

A sink directory holds::

    _picklehooks.json                   marks the directory as a sink (format, version)
    part-000000.parquet                 the records of one flush, in the order recorded
    part-000001.parquet
    _tensors/part-000001.safetensors    tensors that records of part 1 kept (mode="tensor"/"both")

Every part has the columns of :meth:`picklehooks.Log.table`: ``module kind
path call step shape dtype value rank`` and the statistics
(:data:`~picklehooks.capture.record.STAT_NAMES`; ``n_nan`` and ``n_inf`` as
int64, the rest float64, null where a record has none), then ``tensor_file`` and
``tensor_key``: where a record's tensor is (a path relative to the directory,
a key inside that safetensors file), or null. So other tools read a sink
without picklehooks::

    pandas.read_parquet("run")                       # pyarrow skips names starting with _ and .
    duckdb.sql("SELECT * FROM read_parquet('run/*.parquet')")
    polars.scan_parquet("run/*.parquet")            # polars and DuckDB need the glob

Writing (:class:`Writer`): a part and its tensors file are written under
hidden temporary names (``.part-*.tmp``, which every reader above skips) and
then hard-linked to their final names, which must not exist yet. So a
crash, even ``kill -9``, leaves complete parts and at most a temporary file,
and a second writer on the same directory gets an error instead of
overwriting parts. Nothing is fsynced: what a process wrote survives the
process, but a power cut may lose the last parts.

A directory holding anything a sink doesn't is refused, so nothing of the
user's is mixed in or overwritten; one that already holds parts is refused
unless ``append=True``, which numbers new parts after the last one.

Format 1 named the counts ``nan`` and ``inf``; format 2 names them ``n_nan``
and ``n_inf``. :class:`Reader` reads parts of both, even in one directory
(appending to a format-1 sink marks it format 2 and adds format-2 parts).

Limits: one writer per directory (several processes, such as the ranks of a
distributed job, each need their own: ``f"run/rank{rank}"``; pyarrow and
DuckDB read them together through ``run/*/*.parquet``). pyarrow is imported
only when a sink is used (``pip install 'picklehooks[parquet]'``); without
it nothing is created. Part numbers are zero-padded to six digits and keep
counting beyond; :class:`Reader` orders parts by number, but tools that sort
file names see ``part-1000000`` before ``part-999999``: order by ``step``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile

import torch

from .logfile import dtype_name
from .._shim import PicklehooksError
from .record import RENAMED_STATS, STAT_NAMES

MANIFEST, TENSOR_DIR = "_picklehooks.json", "_tensors"
FORMAT, VERSION = "picklehooks-sink", 4  # 4: note; 3: source; 2: n_nan, n_inf (were nan, inf)
#: Columns of a part, in order (``table()``'s, then where the tensor is).
COLUMNS = ("module", "kind", "path", "call", "step", "shape", "dtype", "value", "source", "note", "rank", *STAT_NAMES,
           "tensor_file", "tensor_key")
_PART = re.compile(r"part-(\d+)\.parquet")
_TENSORS = re.compile(r"part-(\d+)\.safetensors")
_TEMP = re.compile(r"\.part-.*\.tmp")
_INSTALL = "pip install 'picklehooks[parquet]'"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.dataset
        import pyarrow.parquet
    except ImportError:
        raise PicklehooksError(f"a log sink writes and reads Parquet through pyarrow: {_INSTALL}") from None
    return pyarrow


@functools.lru_cache(maxsize=None)
def schema():
    """The Arrow schema of every part."""
    pa = _pyarrow()
    types = {"call": pa.int64(), "step": pa.int64(), "shape": pa.list_(pa.int64()), "rank": pa.int64(),
             "n_nan": pa.int64(), "n_inf": pa.int64()}
    required = {"module", "kind", "path", "call", "step"}
    return pa.schema([pa.field(name, types.get(name, pa.float64() if name in STAT_NAMES else pa.string()),
                               nullable=name not in required) for name in COLUMNS])


@functools.lru_cache(maxsize=None)
def _read_schema():
    """:func:`schema` plus the columns format 1 had instead (``nan``, ``inf``): what a part lacks reads as null."""
    pa = _pyarrow()
    return pa.schema([*schema(), *(pa.field(old, pa.int64()) for old in RENAMED_STATS)])


def is_sink(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory that a sink wrote (it holds the marker file)."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def _part_numbers(where: str) -> list[int]:
    """Numbers of the parts in a sink directory, ascending."""
    return sorted(int(m.group(1)) for name in os.listdir(where) if (m := _PART.fullmatch(name)))


def _check_manifest(where: str) -> int:
    """The format version of the sink at ``where``, one this picklehooks reads."""
    file = os.path.join(where, MANIFEST)
    try:
        with open(file) as f:
            document = json.load(f)
    except (OSError, ValueError) as exc:
        raise PicklehooksError(f"{file!r} is not readable JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PicklehooksError(f"{file!r} does not mark a picklehooks sink (format {FORMAT!r})")
    if document.get("version") not in (1, 2, 3, VERSION):
        raise PicklehooksError(
            f"{file!r} is sink format {document.get('version')!r}; this picklehooks reads 1 to {VERSION}, "
            "so it was written by a newer picklehooks")
    return document["version"]


def _write_file(final: str, write) -> None:
    """Call ``write(temporary path)``, then give that file the name ``final``, which must be free.

    The temporary file is hidden (``.part-*.tmp``) and removed whatever happens.
    """
    fd, temp = tempfile.mkstemp(prefix=".part-", suffix=".tmp", dir=os.path.dirname(final))
    os.close(fd)
    try:
        write(temp)
        try:
            os.link(temp, final)  # atomic, and unlike rename never replaces an existing file
        except FileExistsError:
            raise PicklehooksError(
                f"{final!r} appeared while this log was writing it: another process writes to the same sink; "
                "give each writer (each rank) its own directory") from None
        except OSError:  # a file system without hard links: check, then rename
            if os.path.exists(final):
                raise PicklehooksError(f"{final!r} exists already: another process writes to the same sink") from None
            os.rename(temp, final)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _write_json(document: dict):
    def write(file: str) -> None:
        with open(file, "w") as f:
            json.dump(document, f)
    return write


class Writer:
    """A sink directory open for adding parts; opening checks and prepares the directory."""

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise PicklehooksError(f"sink={path!r}: give a directory path (str or os.PathLike)")
        _pyarrow()  # before anything is created
        self.path = where = os.path.abspath(os.fspath(path))
        if os.path.lexists(where) and not os.path.isdir(where):
            raise PicklehooksError(f"can't use {where!r} as a log sink: it exists and is not a directory")
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as exc:
            raise PicklehooksError(f"can't create the log sink directory {where!r}: {exc.strerror}") from None
        names = set(os.listdir(where))
        foreign = sorted(n for n in names if n not in (MANIFEST, TENSOR_DIR)
                         and not _PART.fullmatch(n) and not _TEMP.fullmatch(n))
        tensor_dir = os.path.join(where, TENSOR_DIR)
        if TENSOR_DIR in names:
            if not os.path.isdir(tensor_dir):
                foreign.append(TENSOR_DIR)
            else:
                foreign += [f"{TENSOR_DIR}/{n}" for n in sorted(os.listdir(tensor_dir))
                            if not _TENSORS.fullmatch(n) and not _TEMP.fullmatch(n)]
        if names - {MANIFEST} and MANIFEST not in names:
            foreign = foreign or sorted(names)  # parts without the marker: some other tool's
        if foreign:
            hint = " (a log that Log.save() wrote)" if "records.json" in foreign else ""
            raise PicklehooksError(
                f"can't use {where!r} as a log sink: it holds {', '.join(map(repr, foreign[:5]))}{hint}, which a "
                "sink doesn't; stream into a new or empty directory")
        version = _check_manifest(where) if MANIFEST in names else None
        parts = _part_numbers(where)
        if parts and not append:
            raise PicklehooksError(
                f"{where!r} already holds {len(parts)} parts of an earlier run (part-{parts[0]:06d}.parquet to "
                f"part-{parts[-1]:06d}.parquet); pass append=True to add to them, or choose a new directory")
        # After the last part, and after any tensors file a crash left without its part.
        taken = parts + ([int(m.group(1)) for n in os.listdir(tensor_dir) if (m := _TENSORS.fullmatch(n))]
                         if os.path.isdir(tensor_dir) else [])
        self.next = max(taken, default=-1) + 1
        manifest = {"format": FORMAT, "version": VERSION, "columns": list(COLUMNS)}
        if MANIFEST not in names:
            try:
                _write_file(os.path.join(where, MANIFEST), _write_json(manifest))
            except PicklehooksError:
                _check_manifest(where)  # another writer made it first; its parts will clash, not this
        elif version != VERSION:  # formats 1 and 2: their parts stay as they are (Reader reads every format)
            fd, temp = tempfile.mkstemp(prefix=".part-", suffix=".tmp", dir=where)
            os.close(fd)
            try:
                _write_json(manifest)(temp)
                os.replace(temp, os.path.join(where, MANIFEST))
            finally:
                if os.path.exists(temp):
                    os.unlink(temp)

    def write(self, columns: dict[str, list], tensors: dict[int, torch.Tensor], step: int) -> str:
        """Write one part: ``columns`` (every column of :data:`COLUMNS` but the tensor ones) and the
        tensors of some of its rows, by row number. Returns the part's path."""
        pa = _pyarrow()
        number, n = self.next, len(columns["module"])
        # Used up even if writing fails: its tensors file may be out already.
        self.next = number + 1
        name = f"part-{number:06d}"
        columns["tensor_file"] = columns["tensor_key"] = [None] * n
        if tensors:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise PicklehooksError(f"a sink keeps recorded tensors in safetensors files: {_INSTALL} "
                                       "(or record with mode='stats')") from None
            file = f"{TENSOR_DIR}/{name}.safetensors"
            columns["tensor_file"] = [file if i in tensors else None for i in range(n)]
            columns["tensor_key"] = [str(i) if i in tensors else None for i in range(n)]
            os.makedirs(os.path.join(self.path, TENSOR_DIR), exist_ok=True)
            # Copies: safetensors refuses tensors that share memory, as rows of one batch do.
            stored = {str(i): t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
                      for i, t in tensors.items()}
            _write_file(os.path.join(self.path, file), functools.partial(save_file, stored))
        table = pa.Table.from_pydict(columns, schema=schema().with_metadata(
            {"picklehooks": json.dumps({"format": FORMAT, "version": VERSION, "step": step})}))
        final = os.path.join(self.path, f"{name}.parquet")
        _write_file(final, functools.partial(pa.parquet.write_table, table))
        return final


class Reader:
    """The parts of a sink directory, read with filters pushed down to the files.

    ``snapshot=True`` reads the parts present now and no later ones (a loaded
    log); otherwise every call lists the directory again (a recording log's own sink).
    """

    def __init__(self, path: str | os.PathLike, *, snapshot: bool = True) -> None:
        self.path = where = os.path.abspath(os.fspath(path))
        if not is_sink(where):
            raise PicklehooksError(f"{where!r} holds no {MANIFEST}; is it a directory that record(sink=) wrote?")
        _check_manifest(where)
        _pyarrow()
        self._parts = _part_numbers(where) if snapshot else None

    def parts(self) -> list[str]:
        """The part files, in the order they were written."""
        numbers = self._parts if self._parts is not None else _part_numbers(self.path)
        return [os.path.join(self.path, f"part-{i:06d}.parquet") for i in numbers]

    def _scan(self, how, *args):
        pa = _pyarrow()
        try:
            return how(pa.dataset.dataset(self.parts(), schema=_read_schema(), format="parquet"), *args)
        except (pa.ArrowException, OSError) as exc:
            raise PicklehooksError(f"{self.path!r}: a part is not Parquet of a picklehooks sink: {exc}") from None

    def count(self, where=None) -> int:
        """Rows matching the filter expression ``where`` (all rows: read from the files' footers only)."""
        return self._scan(lambda d: d.count_rows(filter=where))

    def table(self, where=None, columns: list[str] | None = None):
        """A ``pyarrow.Table`` of the matching rows, in the order written; the counts of format-1
        parts (``nan``, ``inf``) under their names now (``n_nan``, ``n_inf``)."""
        pa = _pyarrow()
        if columns is not None:
            columns = [*columns, *(old for old, new in RENAMED_STATS.items() if new in columns)]
        table = self._scan(lambda d: d.to_table(filter=where, columns=columns))
        for old, new in RENAMED_STATS.items():
            if old in table.column_names:
                if new in table.column_names:  # a part has one or the other: the other is null
                    merged = pa.compute.coalesce(table.column(new), table.column(old))
                    table = table.set_column(table.column_names.index(new), new, merged)
                table = table.select([name for name in table.column_names if name != old])
        return table

    def step(self) -> int:
        """The writing log's ``step`` when it wrote the last part (0 for a sink without parts)."""
        parts = self.parts()
        if not parts:
            return 0
        pa = _pyarrow()
        try:
            meta = pa.parquet.read_schema(parts[-1]).metadata or {}
            return int(json.loads(meta[b"picklehooks"])["step"])
        except (pa.ArrowException, OSError, KeyError, ValueError, TypeError) as exc:
            raise PicklehooksError(f"{parts[-1]!r} is not a part a picklehooks sink wrote: {exc!r}") from None

    def tensors(self, rows: list[dict]) -> list[torch.Tensor | None]:
        """The tensor of each row (``None`` where it kept none), read from the safetensors files and
        checked against the row's shape and dtype."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        by_file: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if row.get("tensor_file") is not None:
                by_file.setdefault(row["tensor_file"], []).append(i)
        if not by_file:
            return out
        try:
            from safetensors import safe_open
        except ImportError:
            raise PicklehooksError(f"reading recorded tensors needs safetensors: {_INSTALL}") from None
        for name, indices in by_file.items():
            file = os.path.join(self.path, name)
            if not _TENSORS.fullmatch(os.path.basename(name)) or os.path.dirname(name) != TENSOR_DIR:
                raise PicklehooksError(f"{self.path!r}: a record names tensor file {name!r}, outside {TENSOR_DIR}/")
            try:
                with safe_open(file, framework="pt") as f:
                    keys = set(f.keys())
                    for i in indices:
                        row = rows[i]
                        if row["tensor_key"] not in keys:
                            raise PicklehooksError(
                                f"{file!r} lacks tensor {row['tensor_key']!r} of record "
                                f"({row['module']!r}, {row['kind']!r}, {row['path']!r}, {row['call']}) at step {row['step']}")
                        tensor = f.get_tensor(row["tensor_key"])
                        if row["shape"] != list(tensor.shape) or row["dtype"] != dtype_name(tensor.dtype):
                            raise PicklehooksError(
                                f"{file!r}: tensor {row['tensor_key']!r} is {dtype_name(tensor.dtype)}"
                                f"{list(tensor.shape)}, but its record ({row['module']!r} {row['kind']}) says "
                                f"{row['dtype']}{row['shape']}")
                        out[i] = tensor
            except PicklehooksError:
                raise
            except Exception as exc:  # a missing file, or safetensors' own error types for corruption
                raise PicklehooksError(f"{file!r} is not a readable safetensors file: {exc}") from None
        return out


def expression(filters: dict[str, tuple | range]):
    """A pyarrow filter: every named column holds one of the values given (``None``: all rows).

    A range of step 1 becomes two comparisons, which the files' row-group
    statistics (min and max per column) can answer without reading the rows.
    """
    ds = _pyarrow().dataset
    where = None
    for name, values in filters.items():
        field = ds.field(name)
        if isinstance(values, range) and values.step == 1:
            term = (field >= values.start) & (field < values.stop)
        else:
            term = field == values[0] if len(values) == 1 else field.isin(list(values))
        where = term if where is None else where & term
    return where
