"""Zip archives: ``torch.save`` checkpoints (since 1.6), ``torch.package`` archives and ``.npz`` files.

Every ``.pkl`` member is read as the one pickle a load reads from it; a
member that starts with NumPy's magic is read as a ``.npy`` file
(``numpy.load`` reads any member so), the pickle behind its header included
where the dtype may hold objects. A ``torch.package`` archive's bundled
``.py`` modules run when the archive imports them: each is listed, and
picklehooks' own are compared with this version's.

Limits: a member is read in 1 MiB chunks and refused past the member bound
(:class:`._limits.Limits`), whatever size it declares, and at most
:data:`._limits.MAX_MEMBERS` members. ``.pkl`` files are what is read of a
zip, so a ``torch.package`` resource pickled under another suffix is not
audited.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

from ._contents import Bundled, Contents, every_reading, one_pickle
from ._limits import MAX_MEMBERS, AuditError, Limits, exceeded
from ._numpy import NUMPY_MAGIC, NotNumpy, numpy_header, numpy_objects

# A zip starts with a local file header, or (when it has no entries) with its end record.
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_CHUNK = 1 << 20


# RuntimeError: an encrypted member; NotImplementedError: an unknown compression
_MEMBER_ERRORS = (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError, EOFError, ValueError, zlib.error)


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits, used: list[int], upto: int | None = None) -> bytes:
    """A member's bytes (its first ``upto``, if given), refused past the member bound whatever size it declares."""
    left = limits.member_bytes - used[0]
    what = f"zip member {info.filename!r}"
    bound = f"the bound of {limits.member_bytes} bytes read from a {limits.file_size}-byte file"
    if upto is not None and upto > left:
        raise exceeded(what, f"its NumPy header declares {upto} bytes, which exceeds {bound}")
    if upto is None and info.file_size > left:
        raise exceeded(what, f"it declares {info.file_size} bytes, which exceeds {bound}")
    chunks, total = [], 0
    with archive.open(info) as member:
        while chunk := member.read(_CHUNK if upto is None else min(_CHUNK, upto - total)):
            total += len(chunk)
            if total > left:
                raise exceeded(what, f"it holds more than {left} bytes, which exceeds {bound}")
            chunks.append(chunk)
    used[0] += total
    return b"".join(chunks)


def read_zip(path: str, limits: Limits) -> Contents:
    try:
        archive = zipfile.ZipFile(path)
    # NotImplementedError: a zip version or feature zipfile doesn't support
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError, ValueError) as exc:
        raise AuditError(f"unreadable zip archive: {exc}") from None
    contents = Contents()
    used = [0]
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_MEMBERS:
            raise exceeded("the zip archive", f"it has {len(infos)} members, more than the bound of {MAX_MEMBERS}")
        is_package = any(i.filename.endswith("/.data/extern_modules") or i.filename == ".data/extern_modules" for i in infos)
        found = 0
        for info in infos:
            if info.is_dir():
                continue
            what = f"zip member {info.filename!r}"
            try:
                with archive.open(info) as member:
                    head = member.read(12)  # NumPy's magic, version and header length
                if head.startswith(NUMPY_MAGIC):
                    found += 1
                    _read_numpy_member(archive, info, limits, used, head, contents)
                elif info.filename.endswith(".pkl"):
                    found += 1
                    data = _read_member(archive, info, limits, used)
                    every_reading(one_pickle(data, 0, limits, what), info.filename, contents)  # a load reads one pickle
            except _MEMBER_ERRORS as exc:
                raise AuditError(f"{what} is unreadable: {exc}") from None
        if not found:
            raise AuditError("a zip archive without .pkl pickles or NumPy arrays (not a torch.save checkpoint, "
                             "torch.package archive or .npz file)")
        if is_package:
            _read_bundled(archive, infos, limits, used, contents)
    return contents


def _read_numpy_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits, used: list[int], head: bytes,
                       contents: Contents) -> None:
    """A member that starts like a .npy file: ``numpy.load`` of the zip reads it as one when asked for it."""
    what = f"zip member {info.filename!r}"
    try:
        start, length, encoding = numpy_header(head, what)
        header = _read_member(archive, info, limits, used, start + length)
        if len(header) < start + length:
            raise NotNumpy(f"{what} ends inside its NumPy header")
        if not numpy_objects(header[start:], encoding, what):
            return  # plain data: no pickle
    except NotNumpy as exc:  # numpy.load refuses it too; what it reads may still be something else's
        contents.problems.append(f"could not read {what} as a NumPy array: {exc}; treat as unsafe")
        return
    data = _read_member(archive, info, limits, used)
    every_reading(one_pickle(data, start + length, limits, what), info.filename, contents)


def _read_bundled(archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], limits: Limits, used: list[int], contents: Contents) -> None:
    """List the modules a torch.package archive carries; compare picklehooks' own with this version's."""
    from .. import _shim

    here = Path(_shim.__file__).parent  # this picklehooks' folder
    for info in infos:
        name = info.filename
        if not name.endswith(".py") or "/.data/" in f"/{name}":
            continue
        # Members sit below the archive's root folder: "<root>/pkg/mod.py".
        relative = name.split("/", 1)[1] if "/" in name else name
        module = relative[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        status = "code"
        if module.split(".")[0] == "picklehooks":
            if module == _shim.HUB_NAME:
                expected = _shim.PACKAGE_HUB_SOURCE
            elif module == _shim.SHIM_NAME:
                # What prepare_exporter() writes, read at run time from this version's loader.
                expected = _shim.__loader__.get_source(_shim.__name__)
            else:
                own = here.joinpath(*relative.split("/")[1:])
                expected = own.read_text(encoding="utf-8") if own.is_file() else None
            try:
                data = _read_member(archive, info, limits, used)
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError, EOFError, ValueError, zlib.error) as exc:
                contents.problems.append(f"could not read zip member {name!r}: {exc}; treat as unsafe")
                data = None
            status = "same" if data is not None and expected is not None and data == expected.encode("utf-8") else "differs"
        contents.bundled.append(Bundled(module, name, status))
