"""Reading containers: every pickle ``torch.load`` (or ``pickle.load``) would read from a file.

* a zip (``torch.save``'s format since 1.6, and ``torch.package``): every
  ``.pkl`` member, plus the ``.py`` modules a package bundles (they run when
  the archive imports them);
* a tar (``torch.save``'s legacy tar format, read by ``_legacy_load``): the
  pickles of its ``storages``, ``tensors`` and ``pickle`` members, skipping
  the raw storage and tensor records between them as torch does;
* anything else: pickles one after another (a legacy ``torch.save`` file is
  five pickles and then raw storage bytes; a log file may hold many).

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
"""

from __future__ import annotations

import mmap
import os
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._limits import MAX_MEMBERS, AuditError, Limits, exceeded, show
from ._machine import Machine, Malformed, Parsed

# torch.save's legacy format starts with a pickle of this number...
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# ...followed by the protocol version, sys_info, the object and the storage
# keys; raw storage bytes come after those five pickles.
_LEGACY_PICKLES = 5
# A zip starts with a local file header, or (when it has no entries) with its end record.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_CHUNK = 1 << 20


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
            head = f.read(4)
            if head in _ZIP_MAGICS:
                return _read_zip(path, limits), limits
            is_tar = _is_tar(f)
            tar = _read_tar(path, limits) if is_tar else None
            # Mapped, not read: a legacy torch.save file is mostly storage
            # bytes after its pickles, which are never touched.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if is_tar:
                    return _tar_and_stream(tar, mapped, limits), limits
                contents = Contents([Resource("")])
                _read_stream(mapped, limits, contents, "the file")
                return contents, limits
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None


def _tar_and_stream(tar: Contents | None, buf: Any, limits: Limits) -> Contents:
    """A tar's members (``tar``, from :func:`_read_tar`) and its bytes read as pickles.

    ``pickle.load`` reads a file from its first byte whatever else it is: the pickles there are
    read one after another, as in a plain file, up to the first that fails. A failing pickle
    counts only where it names a global before it fails (what a load would have run); a real
    tar's header is no pickle at all, and adds nothing.
    """
    machine = Machine(buf, 0, len(buf), limits, "the file")
    stream, problems, failure = Resource(""), [], None
    while machine.pos < len(buf):
        start = machine.pos
        try:
            stream.parsed.append(machine.run())
        except Malformed as exc:
            failure = exc
            if exc.partial is not None and exc.partial.globals:
                stream.parsed.append(exc.partial)
                problems.append(f"could not read the file as pickles from byte {start} on: {exc}; treat as unsafe")
            break
    if tar is None and not stream.parsed:
        raise AuditError("a tar archive, but not in torch.save's legacy tar format (no readable 'pickle' "
                         f"member), and not a pickle either ({failure})")
    contents = tar if tar is not None else Contents()
    if stream.parsed:
        contents.resources.append(stream)
        contents.problems += problems
    return contents


def _read_stream(buf: Any, limits: Limits, contents: Contents, what: str) -> None:
    """Parse pickles one after another until the bytes run out (or a legacy file's five)."""
    machine = Machine(buf, 0, len(buf), limits, what)
    parsed = contents.resources[0].parsed
    limit: int | None = None
    while machine.pos < len(buf) and (limit is None or len(parsed) < limit):
        start = machine.pos
        try:
            parsed.append(machine.run())
        except Malformed as exc:
            if not parsed:
                raise Unreadable(f"not a pickle, torch.save checkpoint or torch.package archive ({exc})", exc.partial) from None
            if exc.partial is not None:
                parsed.append(exc.partial)
            contents.problems.append(f"could not read {what} from byte {start} on: {exc}; treat as unsafe")
            return
        root = parsed[0].root
        if len(parsed) == 1 and type(root) is int and root == _LEGACY_MAGIC:
            limit = _LEGACY_PICKLES  # what follows is storage bytes, not pickles
    if limit is not None and len(parsed) < limit:
        contents.problems.append(
            f"could not read {what}: a legacy torch.save file has {limit} pickles, this one {len(parsed)}; treat as unsafe"
        )


# --------------------------------------------------------------------------
# Zip: torch.save checkpoints and torch.package archives.


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits, used: list[int]) -> bytes:
    """A member's bytes, refused past the member bound whatever size it declares."""
    left = limits.member_bytes - used[0]
    what = f"zip member {info.filename!r}"
    bound = f"the bound of {limits.member_bytes} bytes read from a {limits.file_size}-byte file"
    if info.file_size > left:
        raise exceeded(what, f"it declares {info.file_size} bytes, which exceeds {bound}")
    chunks, total = [], 0
    with archive.open(info) as member:
        while chunk := member.read(_CHUNK):
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
        pickles = [i for i in infos if i.filename.endswith(".pkl") and not i.is_dir()]
        if not pickles:
            raise AuditError("a zip archive without .pkl pickles (not a torch.save checkpoint or torch.package archive)")
        is_package = any(i.filename.endswith("/.data/extern_modules") or i.filename == ".data/extern_modules" for i in infos)
        for info in pickles:
            what = f"zip member {info.filename!r}"
            try:
                data = _read_member(archive, info, limits, used)
            # RuntimeError: an encrypted member; NotImplementedError: an unknown compression
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError, EOFError, ValueError, zlib.error) as exc:
                raise AuditError(f"{what} is unreadable: {exc}") from None
            resource = Resource(info.filename)
            contents.resources.append(resource)
            machine = Machine(data, 0, len(data), limits, what)
            try:
                resource.parsed.append(machine.run())  # a load reads one pickle per member
            except Malformed as exc:
                if exc.partial is not None:
                    resource.parsed.append(exc.partial)
                contents.problems.append(f"could not read {what}: {exc}; treat as unsafe")
        if is_package:
            _read_bundled(archive, infos, limits, used, contents)
    return contents


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
            resource = Resource(name)
            contents.resources.append(resource)
            machine = Machine(data, 0, len(data), limits, what)
            try:
                if name == "pickle":
                    resource.parsed.append(machine.run())
                else:
                    _read_records(machine, data, name, resource)
            except Malformed as exc:
                if exc.partial is not None:
                    resource.parsed.append(exc.partial)
                contents.problems.append(f"could not read {what}: {exc}; treat as unsafe")
    return contents


def _read_records(machine: Machine, data: bytes, name: str, resource: Resource) -> None:
    """``storages``/``tensors``: a count, then per record a pickle and raw bytes, as ``legacy_load`` reads them."""
    first = machine.run()
    resource.parsed.append(first)
    count = first.root
    if type(count) is not int or count < 0:
        raise Malformed(f"the record count is {show(count)}, not a count")
    sizes = _storage_sizes() if name == "storages" else {}
    for index in range(count):  # each record takes bytes, so this ends with the member
        record = machine.run()
        resource.parsed.append(record)
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
        resource.parsed.append(machine.run())  # the storage views
