"""NumPy files: a ``.npy`` file's header, and the pickle behind it where ``numpy.load`` runs one.

The header is read as ``numpy.lib.format`` reads it (magic, version, header
length, a dict literal), without numpy. The data behind it is a pickle
where the ``descr`` may hold objects (``'|O'``), which
``numpy.load(allow_pickle=True)`` runs; an array of plain data holds no
pickle. Zip members that start like a ``.npy`` file (``.npz``) are read by
:mod:`._zip` with the same header functions.

Limits: a ``descr`` that is not plainly data (a dtype string this module
does not recognise, a malformed field list) is taken to hold objects, so its
data is read as a pickle. A header ``numpy.load`` would refuse raises
:class:`NotNumpy` (the file is not audited; a zip member is reported as
not read) and nothing behind it is read.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from ._contents import Contents, every_reading, one_pickle
from ._limits import AuditError, Limits

# numpy.lib.format: the magic, and per version the width of the header length and the header's encoding.
NUMPY_MAGIC = b"\x93NUMPY"
_NUMPY_VERSIONS = {(1, 0): (2, "latin1"), (2, 0): (4, "latin1"), (3, 0): (4, "utf8")}
# A dtype string of plain data (no Python objects): numpy.dtype() of anything else may hold objects.
_PLAIN_DTYPE = re.compile(r"[<>|=]?(?:[?bBhHiIlLqQpPefdgFDG]|[biufcSUVa][0-9]*|[mM]8(?:\[[0-9]*[A-Za-z]+\])?)")


class NotNumpy(AuditError):
    """A part starts like a NumPy file, but ``numpy.load`` would refuse its header."""


def numpy_header(head: bytes, what: str) -> tuple[int, int, str]:
    """From a .npy file's first 12 bytes: where its header starts, its length and encoding."""
    version = tuple(head[6:8])
    if version not in _NUMPY_VERSIONS:
        raise NotNumpy(f"{what} has the NumPy format version {version}, which numpy.load refuses")
    width, encoding = _NUMPY_VERSIONS[version]
    if len(head) < 8 + width:
        raise NotNumpy(f"{what} ends inside its NumPy header")
    return 8 + width, int.from_bytes(head[8 : 8 + width], "little"), encoding


def numpy_objects(header: bytes, encoding: str, what: str) -> bool:
    """Whether ``numpy.load`` reads the data after this header as a pickle (the dtype may hold objects).

    The header is a dict literal, read as ``numpy.lib.format.read_array_header`` reads it (with
    ``ast.literal_eval``; Python 2's ``3L`` in versions 1 and 2); numpy refuses anything else.
    """
    try:
        text = header.decode(encoding)
        try:
            value = ast.literal_eval(text)
        except SyntaxError:
            value = ast.literal_eval(re.sub(r"\b([0-9]+)L\b", r"\1", text))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise NotNumpy(f"{what} has a NumPy header numpy.load can't read ({type(exc).__name__})") from None
    if not isinstance(value, dict) or set(value) != {"descr", "fortran_order", "shape"}:
        raise NotNumpy(f"{what} has a NumPy header numpy.load refuses (not a dict of descr, fortran_order, shape)")
    return _may_hold_objects(value["descr"])


def _may_hold_objects(descr: Any) -> bool:
    """Whether ``numpy.lib.format.descr_to_dtype(descr)`` may hold Python objects (``'|O'``)."""
    if isinstance(descr, str):
        return _PLAIN_DTYPE.fullmatch(descr) is None
    if isinstance(descr, tuple) and descr:  # a subarray: (dtype, shape)
        return _may_hold_objects(descr[0])
    if isinstance(descr, list):  # a structured dtype: (name, dtype[, shape]) per field
        return any(not isinstance(f, tuple) or len(f) not in (2, 3) or _may_hold_objects(f[1]) for f in descr)
    return True


def read_numpy(buf: Any, limits: Limits, contents: Contents, name: str, what: str) -> None:
    """A .npy file (or member): its header, and the pickle behind it when it holds objects."""
    start, length, encoding = numpy_header(bytes(buf[:12]), what)
    if start + length > len(buf):
        raise NotNumpy(f"{what} ends inside its NumPy header")
    if numpy_objects(bytes(buf[start : start + length]), encoding, what):
        every_reading(one_pickle(buf, start + length, limits, what), name, contents)
