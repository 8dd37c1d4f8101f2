"""Reading containers: every pickle ``torch.load`` (or ``pickle.load``) would read from a file.

:func:`read` tells the kinds of file apart and hands each to its reader:

* a zip (``torch.save``'s format since 1.6, ``torch.package``, ``.npz``):
  :mod:`._zip`;
* a tar (``torch.save``'s legacy tar format): :mod:`._tar`, which also reads
  its bytes as a pickle stream, as ``pickle.load`` would;
* a NumPy ``.npy`` file: :mod:`._numpy`;
* anything else: pickles one after another, here (a legacy ``torch.save``
  file is five pickles and then raw storage bytes; a log file may hold
  many).

Each part is read every way file readers may take its FRAMEs
(:mod:`._contents`), and the result is one :class:`Contents`.

Limits: only regular, non-empty files are read (a FIFO or device could
block or never end). A zip is audited as a zip only (its first bytes,
``PK``, are a persistent id that a plain ``pickle.load`` refuses). A plain
file is mapped, not read, and of a legacy ``torch.save`` file only the
five pickles are read, not the storage bytes after them. Each reader
states its own limits.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Any

from ._contents import MAX_READINGS, Bundled, Contents, Resource, every_reading
from ._limits import AuditError, Limits
from ._machine import Machine, Malformed, Parsed, Reading
from ._numpy import NUMPY_MAGIC, NotNumpy, read_numpy
from ._tar import opens_as_tar, read_tar, tar_and_stream
from ._zip import ZIP_MAGICS, read_zip

__all__ = ["read", "Contents", "Resource", "Bundled", "Unreadable", "NotNumpy", "MAX_READINGS"]

# torch.save's legacy format starts with a pickle of this number...
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# ...followed by the protocol version, sys_info, the object and the storage
# keys; raw storage bytes come after those five pickles.
_LEGACY_PICKLES = 5


class Unreadable(AuditError):
    """The file (or its first pickle) can't be read; ``partial`` holds what a load would have run first."""

    def __init__(self, message: str, partial: Parsed | None = None) -> None:
        super().__init__(message)
        self.partial = partial


def _check_regular_file(path: str) -> int:
    """The size of ``path``; AuditError for anything that isn't an existing, non-empty regular file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise AuditError("no such file") from None
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None
    if stat.S_ISDIR(info.st_mode):
        raise AuditError("is a directory")
    if not stat.S_ISREG(info.st_mode):  # a FIFO or /dev/zero could block or never end
        raise AuditError("not a regular file")
    if info.st_size == 0:
        raise AuditError("empty file")
    return info.st_size


def read(path: str) -> tuple[Contents, Limits]:
    """Read every pickle of the file at ``path``; raise :class:`AuditError` if there is none."""
    size = _check_regular_file(path)
    limits = Limits(size)
    try:
        with open(path, "rb") as f:
            head = f.read(len(NUMPY_MAGIC))
            if head[:4] in ZIP_MAGICS:
                return read_zip(path, limits), limits
            is_tar = opens_as_tar(f)
            tar = read_tar(path, limits) if is_tar else None
            # Mapped, not read: a legacy torch.save file is mostly storage
            # bytes after its pickles, which are never touched.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if is_tar:
                    return tar_and_stream(tar, mapped, limits), limits
                contents = Contents()
                if head == NUMPY_MAGIC:
                    read_numpy(mapped, limits, contents, "", "the NumPy file")
                else:
                    every_reading(lambda reading: _read_stream(mapped, limits, "the file", reading), "", contents)
                return contents, limits
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None


def _read_stream(buf: Any, limits: Limits, what: str, reading: Reading) -> tuple[list[Parsed], list[str]]:
    """Parse pickles one after another until the bytes run out (or a legacy file's five)."""
    machine = Machine(buf, 0, len(buf), limits, what, reading)
    parsed: list[Parsed] = []
    problems: list[str] = []
    limit: int | None = None
    while machine.pos < len(buf) and (limit is None or len(parsed) < limit):
        start = machine.pos
        try:
            parsed.append(machine.run())
        except Malformed as exc:
            if not parsed and reading.primary and not reading.irregular:  # else other readings may read it
                raise Unreadable(f"not a pickle, torch.save checkpoint or torch.package archive ({exc})", exc.partial) from None
            if exc.partial is not None:
                parsed.append(exc.partial)
            problems.append(f"could not read {what} from byte {start} on: {exc}; treat as unsafe")
            return parsed, problems
        machine.resume()  # torch.load reads the next pickle where its file reader stopped
        root = parsed[0].root
        if len(parsed) == 1 and type(root) is int and root == _LEGACY_MAGIC:
            limit = _LEGACY_PICKLES  # what follows is storage bytes, not pickles
    if limit is not None and len(parsed) < limit:
        problems.append(
            f"could not read {what}: a legacy torch.save file has {limit} pickles, this one {len(parsed)}; treat as unsafe"
        )
    return parsed, problems
