"""A log's directory on disk: ``records.json`` and, if tensors were kept, ``tensors.safetensors``.

:func:`save` writes the whole directory under a temporary name beside the
target and renames it into place, so a directory that held an older log is
replaced completely (its ``tensors.safetensors`` can't survive and be
attached to the new records), and a crash leaves either the old log or the
new one. It refuses a target that holds anything a log doesn't, so nothing of
the user's is deleted.

:func:`load` checks what it reads: the JSON document's fields, every record's
fields, and that the tensors match the records that kept one (count, shape,
dtype). Any mismatch raises :class:`PicklehooksError` naming the file and the
record. Format 2 lists which records kept a tensor; format 1 (before) didn't,
so there the tensor count can only be checked against the record count.
Format 3 renamed the statistics ``nan`` and ``inf`` to ``n_nan`` and ``n_inf``
(:data:`~picklehooks.capture.record.RENAMED_STATS`); rows of formats 1 and 2
are read under the new names.

Limits: the swap is two renames, so for an instant the target path doesn't
exist; readers see the old log or the new one, never a mix.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile

import torch

from .._shim import PicklehooksError
from .record import STAT_NAMES, _renamed

RECORDS, TENSORS = "records.json", "tensors.safetensors"
FORMAT, VERSION = "picklehooks-log", 5  # 5: note; 4: source; 3: n_nan, n_inf (were nan, inf); 2: the "tensors" list
_OWN_FILES = frozenset({RECORDS, TENSORS})
# Strict JSON has no NaN or Infinity; they are written as these strings.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Field -> the JSON types a record row may hold there.
_FIELDS = {
    "module": (str,), "kind": (str,), "path": (str,), "call": (int,), "step": (int,),
    "shape": (list, type(None)), "dtype": (str, type(None)), "value": (str, type(None)),
}


def _json_float(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _from_json_float(value):
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    """How records name a dtype: ``"float32"``."""
    return str(dtype).replace("torch.", "")


def save(path: str | os.PathLike, rows: list[dict], tensors: dict[int, torch.Tensor], step: int) -> None:
    """Write a log directory at ``path``: ``rows`` (:meth:`Log.table`) and the tensors of some of them."""
    target = os.path.abspath(os.fspath(path))
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise PicklehooksError(f"can't save a log to {target!r}: it exists and is not a directory")
        foreign = sorted(set(os.listdir(target)) - _OWN_FILES)
        if foreign:
            raise PicklehooksError(
                f"can't save a log to {target!r}: it holds {', '.join(map(repr, foreign[:5]))}, which a log "
                "doesn't; saving replaces the whole directory, so save into a new or empty directory"
            )
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.saving-", dir=parent)
    try:
        if tensors:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise PicklehooksError(
                    "saving recorded tensors needs safetensors: pip install 'picklehooks[log]' "
                    "(or record with mode='stats')") from None
            # Cloned: safetensors refuses tensors that share memory, as one value recorded twice does.
            save_file({str(i): t.detach().cpu().clone().contiguous() for i, t in tensors.items()},
                      os.path.join(staging, TENSORS))
        document = {"format": FORMAT, "version": VERSION, "step": step, "stat_names": list(STAT_NAMES),
                    "tensors": sorted(tensors), "records": [{k: _json_float(v) for k, v in r.items()} for r in rows]}
        with open(os.path.join(staging, RECORDS), "w") as f:
            json.dump(document, f, indent=1, allow_nan=False)
        _swap_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_into_place(staging: str, target: str) -> None:
    if not os.path.exists(target):
        os.rename(staging, target)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
    os.rmdir(old)  # only its unique name is wanted
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)  # put the old log back
        raise
    shutil.rmtree(old, ignore_errors=True)


def load(path: str | os.PathLike) -> tuple[list[dict], list[torch.Tensor | None], int]:
    """Read and check a log directory; return (rows, one tensor or None per row, step)."""
    where = os.fspath(path)
    records_file = os.path.join(where, RECORDS)
    try:
        with open(records_file) as f:
            document = json.load(f)
    except FileNotFoundError:
        raise PicklehooksError(f"{where!r} holds no {RECORDS}; is it a directory that Log.save() or "
                               "record(sink=) wrote?") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise PicklehooksError(f"{records_file!r} is not readable JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PicklehooksError(f"{records_file!r} is not a picklehooks log")
    if document.get("version") not in (1, 2, 3, 4, VERSION):
        raise PicklehooksError(
            f"{records_file!r} is log format {document.get('version')!r}; this picklehooks reads 1 to {VERSION}, "
            "so it was written by a newer picklehooks")
    step, raw_rows = document.get("step"), document.get("records")
    if not isinstance(step, int) or not isinstance(raw_rows, list):
        raise PicklehooksError(f"{records_file!r}: 'step' must be an int and 'records' a list")
    rows = [_check_row(records_file, i, row) for i, row in enumerate(raw_rows)]
    tensors = _load_tensors(where, rows, document.get("tensors") if document.get("version") != 1 else None)
    return rows, tensors, step


def _check_row(file: str, i: int, row) -> dict:
    if not isinstance(row, dict):
        raise PicklehooksError(f"{file!r}: record {i} is a {type(row).__name__}, not an object")
    for field, types in _FIELDS.items():
        if field not in row or not isinstance(row[field], types) or isinstance(row[field], bool):
            raise PicklehooksError(
                f"{file!r}: record {i} has {field}={row.get(field)!r}; expected {' or '.join(t.__name__ for t in types)}")
    for field in ("source", "note"):  # (since formats 4 and 5; absent before)
        if not isinstance(row.get(field), (str, type(None))):
            raise PicklehooksError(f"{file!r}: record {i} has {field}={row[field]!r}; expected str or None")
    shape = row["shape"]
    if shape is not None and not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PicklehooksError(f"{file!r}: record {i} has shape {shape!r}, not a list of sizes")
    out = dict(_renamed(row))  # nan, inf: formats 1 and 2
    for name in STAT_NAMES:
        value = _from_json_float(out.get(name))
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise PicklehooksError(f"{file!r}: record {i} has {name}={out.get(name)!r}, not a number")
        out[name] = value
    return out


def _load_tensors(where: str, rows: list[dict], listed) -> list[torch.Tensor | None]:
    tensor_file = os.path.join(where, TENSORS)
    if listed is not None and (not isinstance(listed, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(rows) for i in listed)):
        raise PicklehooksError(f"{os.path.join(where, RECORDS)!r}: 'tensors' must list record numbers below {len(rows)}")
    if not os.path.exists(tensor_file):
        if listed:
            raise PicklehooksError(f"{where!r}: records {listed[:5]} kept tensors, but {TENSORS} is missing")
        return [None] * len(rows)
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise PicklehooksError("reading recorded tensors needs safetensors: pip install 'picklehooks[log]'") from None
    try:
        stored = load_file(tensor_file)
    except Exception as exc:  # safetensors reports corruption with its own error types
        raise PicklehooksError(f"{tensor_file!r} is not a readable safetensors file: {exc}") from None
    wanted = {str(i) for i in listed} if listed is not None else None
    unknown = sorted(set(stored) - (wanted if wanted is not None else {str(i) for i in range(len(rows))}))
    if unknown:
        raise PicklehooksError(f"{tensor_file!r} holds tensors {unknown[:5]} that no record of {where!r} kept")
    if wanted is not None and wanted - set(stored):
        missing = sorted(wanted - set(stored), key=int)
        raise PicklehooksError(f"{tensor_file!r} lacks the tensors of records {missing[:5]}")
    tensors: list[torch.Tensor | None] = [None] * len(rows)
    for key, tensor in stored.items():
        i, row = int(key), rows[int(key)]
        if row["shape"] != list(tensor.shape) or row["dtype"] != dtype_name(tensor.dtype):
            raise PicklehooksError(
                f"{tensor_file!r}: the tensor of record {i} ({row['module']!r} {row['kind']}) is "
                f"{dtype_name(tensor.dtype)}{list(tensor.shape)}, but the record says {row['dtype']}{row['shape']}")
        tensors[i] = tensor
    return tensors
