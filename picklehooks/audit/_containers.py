"""Reading containers: every pickle ``torch.load`` (or ``pickle.load``) would read from a file.

* a zip (``torch.save``'s format since 1.6, and ``torch.package``): every
  ``.pkl`` member, plus the ``.py`` modules a package bundles (they run when
  the archive imports them);
* a tar (``torch.save``'s legacy tar format, read by ``_legacy_load``): the
  pickles of its ``storages``, ``tensors`` and ``pickle`` members, skipping
  the raw storage and tensor records between them as torch does;
* a NumPy ``.npy`` file, and each member of a zip (``.npz``) that starts
  like one: the header (``numpy.lib.format``: magic, version, header
  length, a dict literal), and the pickle behind it where the ``descr`` may
  hold objects (``'|O'``), which ``numpy.load(allow_pickle=True)`` runs; an
  array of plain data holds no pickle;
* anything else: pickles one after another (a legacy ``torch.save`` file is
  five pickles and then raw storage bytes; a log file may hold many).

Every part is read once as ``pickle.loads`` reads it and, where one of its
FRAMEs does not end on an opcode boundary, again as file readers may read
it (see :mod:`._machine`): a reader without a buffer of its own (``BytesIO``,
as ``torch.load`` reads ``data.pkl``), then each mix of the two at the
points where they differ, up to :data:`MAX_READINGS`. Such FRAMEs are
listed in :attr:`Contents.irregular`; what the other readings find is added
as a further resource, named "<part>, read frame by frame".

A tar is read both ways: its members, as ``torch.load`` reads them, and its
bytes from the start as a pickle stream, as ``pickle.load`` reads them. A
crafted file can be both (a pickle whose first 512 bytes happen to be a valid
tar header, or a tar whose first member's name is a pickle); a tar without
the ``pickle`` member of torch's format (which ``torch.load`` fails on) or
unreadable past its first header (which it reads as pickles) only the second
way.

Limits: a zip member is read in 1 MiB chunks and refused past the member
bound (:class:`._limits.Limits`), whatever size it declares; ``.pkl`` files
are what is read of a zip, so a ``torch.package`` resource pickled under
another suffix is not audited. A zip is audited as a zip only (its first
bytes, ``PK``, are a persistent id that a plain ``pickle.load`` refuses).
A zip member is read as a NumPy array when it starts with NumPy's magic
(``numpy.load`` reads any member so), else as a pickle when it is a ``.pkl``.
"""

from __future__ import annotations

import ast
import mmap
import os
import re
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ._limits import MAX_MEMBERS, AuditError, Limits, exceeded, show
from ._machine import Machine, Malformed, Parsed, Reading

# torch.save's legacy format starts with a pickle of this number...
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# ...followed by the protocol version, sys_info, the object and the storage
# keys; raw storage bytes come after those five pickles.
_LEGACY_PICKLES = 5
# A zip starts with a local file header, or (when it has no entries) with its end record.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_CHUNK = 1 << 20
# Readings of one part, at most, where its FRAMEs let readers differ (each one reads the part again,
# within the opcode bound): pickle.loads', a reader without a buffer, then mixes of the two.
MAX_READINGS = 16
# numpy.lib.format: the magic, and per version the width of the header length and the header's encoding.
_NUMPY_MAGIC = b"\x93NUMPY"
_NUMPY_VERSIONS = {(1, 0): (2, "latin1"), (2, 0): (4, "latin1"), (3, 0): (4, "utf8")}
# A dtype string of plain data (no Python objects): numpy.dtype() of anything else may hold objects.
_PLAIN_DTYPE = re.compile(r"[<>|=]?(?:[?bBhHiIlLqQpPefdgFDG]|[biufcSUVa][0-9]*|[mM]8(?:\[[0-9]*[A-Za-z]+\])?)")


@dataclass
class Resource:
    """The pickles read from one part of the file (``name`` "" for a plain file)."""

    name: str
    parsed: list[Parsed] = field(default_factory=list)


@dataclass
class Bundled:
    """A Python module a ``torch.package`` archive carries: importing it runs it.

    ``status`` is ``"same"`` (a picklehooks module identical to this
    version's), ``"differs"`` (a picklehooks module that isn't) or ``"code"``
    (anything else).
    """

    module: str
    member: str
    status: str


@dataclass
class Contents:
    """What was read, what could not be (one message each), and bundled code."""

    resources: list[Resource] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bundled: list[Bundled] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)  # FRAMEs readers read differently, one message each


class Unreadable(AuditError):
    """The file (or its first pickle) can't be read; ``partial`` holds what a load would have run first."""

    def __init__(self, message: str, partial: Parsed | None = None) -> None:
        super().__init__(message)
        self.partial = partial


class NotNumpy(AuditError):
    """A part starts like a NumPy file, but ``numpy.load`` would refuse its header."""


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
            head = f.read(len(_NUMPY_MAGIC))
            if head[:4] in _ZIP_MAGICS:
                return _read_zip(path, limits), limits
            is_tar = _is_tar(f)
            tar = _read_tar(path, limits) if is_tar else None
            # Mapped, not read: a legacy torch.save file is mostly storage
            # bytes after its pickles, which are never touched.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if is_tar:
                    return _tar_and_stream(tar, mapped, limits), limits
                contents = Contents()
                if head == _NUMPY_MAGIC:
                    _read_numpy(mapped, limits, contents, "", "the NumPy file")
                else:
                    _every_reading(lambda reading: _read_stream(mapped, limits, "the file", reading), "", contents)
                return contents, limits
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None


def _every_reading(read_one: Callable[[Reading], tuple[list[Parsed], list[str]]], name: str, contents: Contents) -> None:
    """Add to ``contents`` what ``read_one`` finds in a part, read each way readers may take its FRAMEs.

    ``read_one(reading)`` returns the part's pickles and its "could not read" problems. The first
    reading is pickle.loads'; only where it meets a FRAME that does not end on an opcode boundary
    are there others: a reader without a buffer of its own, then each mix of dropping and reading
    in place at the points where they differ (a buffered file mixes them), breadth first.
    """
    first = Reading()
    parsed, problems = read_one(first)
    contents.resources.append(Resource(name, parsed))
    contents.problems += problems
    irregular = dict(first.irregular)
    queue = [Reading(exact=True)] if first.irregular else []
    queue += [Reading((False,) * point + (True,)) for point in range(len(first.taken))]
    taken = [tuple(first.taken)]
    readings = 1
    while queue:
        reading = queue.pop(0)
        choices = reading.choices
        if not reading.exact and any(t[: len(choices)] == choices and not any(t[len(choices):]) for t in taken):
            continue  # read already: every point after the choices in place
        if readings == MAX_READINGS:
            contents.problems.append(
                f"could not read {name or 'the file'} every way a file reader may take its FRAMEs "
                f"(read {MAX_READINGS} ways); treat as unsafe"
            )
            break
        readings += 1
        parsed, problems = read_one(reading)
        taken.append(tuple(reading.taken))
        queue += [Reading(tuple(reading.taken[:point]) + (True,))
                  for point in range(len(choices), len(reading.taken)) if not reading.taken[point]]
        irregular.update(reading.irregular)
        if reading.first_drop is not None:  # the pickles before it read as in the first reading
            contents.resources.append(Resource(f"{name or 'the file'}, read frame by frame", parsed[reading.first_drop :]))
            contents.problems += [p for p in problems if p not in contents.problems]
    contents.irregular += irregular.values()


def _one_pickle(buf: Any, start: int, limits: Limits, what: str) -> Callable[[Reading], tuple[list[Parsed], list[str]]]:
    """A reader of the one pickle a load reads from ``start`` (a zip member, a NumPy array's data)."""

    def read_one(reading: Reading) -> tuple[list[Parsed], list[str]]:
        machine = Machine(buf, start, len(buf), limits, what, reading)
        try:
            return [machine.run()], []
        except Malformed as exc:
            return [exc.partial] if exc.partial is not None else [], [f"could not read {what}: {exc}; treat as unsafe"]

    return read_one


def _tar_and_stream(tar: Contents | None, buf: Any, limits: Limits) -> Contents:
    """A tar's members (``tar``, from :func:`_read_tar`) and its bytes read as pickles.

    ``pickle.load`` reads a file from its first byte whatever else it is: the pickles there are
    read one after another, as in a plain file, up to the first that fails. A failing pickle
    counts only where it names a global before it fails (what a load would have run); a real
    tar's header is no pickle at all, and adds nothing.
    """
    failures: list[Malformed] = []

    def read_one(reading: Reading) -> tuple[list[Parsed], list[str]]:
        machine = Machine(buf, 0, len(buf), limits, "the file", reading)
        parsed, problems = [], []
        while machine.pos < len(buf):
            start = machine.pos
            try:
                parsed.append(machine.run())
            except Malformed as exc:
                failures.append(exc)
                if exc.partial is not None and exc.partial.globals:
                    parsed.append(exc.partial)
                    problems.append(f"could not read the file as pickles from byte {start} on: {exc}; treat as unsafe")
                break
            machine.resume()
        return parsed, problems

    stream = Contents()
    _every_reading(read_one, "", stream)
    found = [r for r in stream.resources if r.parsed]
    if tar is None and not found:
        raise AuditError("a tar archive, but not in torch.save's legacy tar format (no readable 'pickle' "
                         f"member), and not a pickle either ({failures[0]})")
    contents = tar if tar is not None else Contents()
    contents.resources += found
    contents.problems += stream.problems
    contents.irregular += stream.irregular
    return contents


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


# --------------------------------------------------------------------------
# NumPy: .npy files, and .npz members.


def _numpy_header(head: bytes, what: str) -> tuple[int, int, str]:
    """From a .npy file's first 12 bytes: where its header starts, its length and encoding."""
    version = tuple(head[6:8])
    if version not in _NUMPY_VERSIONS:
        raise NotNumpy(f"{what} has the NumPy format version {version}, which numpy.load refuses")
    width, encoding = _NUMPY_VERSIONS[version]
    if len(head) < 8 + width:
        raise NotNumpy(f"{what} ends inside its NumPy header")
    return 8 + width, int.from_bytes(head[8 : 8 + width], "little"), encoding


def _numpy_objects(header: bytes, encoding: str, what: str) -> bool:
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


def _read_numpy(buf: Any, limits: Limits, contents: Contents, name: str, what: str) -> None:
    """A .npy file (or member): its header, and the pickle behind it when it holds objects."""
    start, length, encoding = _numpy_header(bytes(buf[:12]), what)
    if start + length > len(buf):
        raise NotNumpy(f"{what} ends inside its NumPy header")
    if _numpy_objects(bytes(buf[start : start + length]), encoding, what):
        _every_reading(_one_pickle(buf, start + length, limits, what), name, contents)


# --------------------------------------------------------------------------
# Zip: torch.save checkpoints and torch.package archives.


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


def _read_zip(path: str, limits: Limits) -> Contents:
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
                if head.startswith(_NUMPY_MAGIC):
                    found += 1
                    _read_numpy_member(archive, info, limits, used, head, contents)
                elif info.filename.endswith(".pkl"):
                    found += 1
                    data = _read_member(archive, info, limits, used)
                    _every_reading(_one_pickle(data, 0, limits, what), info.filename, contents)  # a load reads one pickle
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
        start, length, encoding = _numpy_header(head, what)
        header = _read_member(archive, info, limits, used, start + length)
        if len(header) < start + length:
            raise NotNumpy(f"{what} ends inside its NumPy header")
        if not _numpy_objects(header[start:], encoding, what):
            return  # plain data: no pickle
    except NotNumpy as exc:  # numpy.load refuses it too; what it reads may still be something else's
        contents.problems.append(f"could not read {what} as a NumPy array: {exc}; treat as unsafe")
        return
    data = _read_member(archive, info, limits, used)
    _every_reading(_one_pickle(data, start + length, limits, what), info.filename, contents)


def _read_bundled(archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], limits: Limits, used: list[int], contents: Contents) -> None:
    """List the modules a torch.package archive carries; compare picklehooks' own with this version's."""
    import picklehooks
    from .. import _shim

    here = Path(picklehooks.__file__).parent
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


# --------------------------------------------------------------------------
# Tar: torch.save's legacy tar format.


def _is_tar(f: Any) -> bool:
    # What torch's _legacy_load tries first on a file that is not a zip.
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:"):
            return True
    except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeDecodeError):
        return False
    finally:
        f.seek(0)


def _storage_sizes() -> dict[str, int]:
    """Bytes per element of each legacy storage type, from torch's own table."""
    import torch

    return {name: dtype.itemsize for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def _read_tar(path: str, limits: Limits) -> Contents | None:
    """The pickles of a legacy torch.save tar's members; None where torch.load can't read it as one.

    That is an unreadable tar (torch.load then reads the file as pickles) or one without the
    'pickle' member (torch.load fails on it, finding no member it reads).
    """
    try:
        archive = tarfile.open(path, mode="r:")
    except (tarfile.TarError, EOFError, OSError, ValueError):
        return None
    contents = Contents()
    with archive:
        members: dict[str, tarfile.TarInfo] = {}
        try:
            for count, member in enumerate(archive, 1):
                if count > MAX_MEMBERS:
                    raise exceeded("the tar archive", f"it has more than {MAX_MEMBERS} members, the bound")
                members.setdefault(member.name, member)
        except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeDecodeError):
            return None
        if "pickle" not in members:
            return None
        for name in ("storages", "tensors", "pickle"):
            member = members.get(name)
            what = f"tar member {name!r}"
            if member is None or not member.isfile():
                contents.problems.append(f"could not read {what}: it is missing or not a file; treat as unsafe")
                continue
            if member.size > limits.file_size:  # a tar is not compressed: a member can't be larger
                raise exceeded(what, f"it declares {member.size} bytes in a {limits.file_size}-byte file")
            try:
                with archive.extractfile(member) as f:
                    data = f.read(member.size)
            except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
                raise AuditError(f"{what} is unreadable: {exc}") from None
            reader = _one_pickle(data, 0, limits, what) if name == "pickle" else _records(data, name, limits, what)
            _every_reading(reader, name, contents)
    return contents


def _records(data: bytes, name: str, limits: Limits, what: str) -> Callable[[Reading], tuple[list[Parsed], list[str]]]:
    """``storages``/``tensors``: a count, then per record a pickle and raw bytes, as ``legacy_load`` reads them."""

    def read_one(reading: Reading) -> tuple[list[Parsed], list[str]]:
        machine = Machine(data, 0, len(data), limits, what, reading)
        parsed: list[Parsed] = []
        try:
            _read_records(machine, data, name, parsed)
        except Malformed as exc:
            if exc.partial is not None:
                parsed.append(exc.partial)
            return parsed, [f"could not read {what}: {exc}; treat as unsafe"]
        return parsed, []

    return read_one


def _read_records(machine: Machine, data: bytes, name: str, parsed: list[Parsed]) -> None:
    first = machine.run()
    parsed.append(first)
    machine.resume()
    count = first.root
    if type(count) is not int or count < 0:
        raise Malformed(f"the record count is {show(count)}, not a count")
    sizes = _storage_sizes() if name == "storages" else {}
    for index in range(count):  # each record takes bytes, so this ends with the member
        record = machine.run()
        parsed.append(record)
        machine.resume()  # the raw bytes start where the file reader stopped
        args = record.root
        pos = machine.pos
        if name == "storages":
            kind = args[2] if isinstance(args, tuple) and len(args) == 3 else None
            element = sizes.get(getattr(kind, "name", None))
            if element is None:
                raise Malformed(f"storage record {index} names the storage type {show(getattr(kind, 'path', kind))}, which torch doesn't know")
            numel = int.from_bytes(data[pos : pos + 8], "little", signed=True)
            skip = 8 + numel * element
        else:
            ndim = int.from_bytes(data[pos : pos + 4], "little", signed=True)
            skip = 8 + 16 * ndim + 8
        if skip < 0 or pos + skip > len(data):
            raise Malformed(f"{name} record {index} at byte {pos} runs past the end of the member")
        machine.pos = pos + skip
    if name == "storages":
        parsed.append(machine.run())  # the storage views
