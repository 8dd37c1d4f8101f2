"""Tar files: ``torch.save``'s legacy tar format, and the same bytes read as a pickle stream.

``torch.load``'s ``_legacy_load`` reads the pickles of the ``storages``,
``tensors`` and ``pickle`` members, skipping the raw storage and tensor
records between them. ``pickle.load`` reads the file from its first byte
whatever else it is, so a tar is read both ways: a crafted file can be both
(a pickle whose first 512 bytes happen to be a valid tar header, or a tar
whose first member's name is a pickle). A tar without the ``pickle`` member
of torch's format (which ``torch.load`` fails on) or unreadable past its
first header (which it reads as pickles) is read only the second way.

Limits: at most :data:`._limits.MAX_MEMBERS` members, each no larger than
the file (a tar is not compressed). The size of a legacy storage's element
comes from torch's own table, so reading ``storages`` imports torch.
"""

from __future__ import annotations

import tarfile
from typing import Any, Callable

from ._contents import Contents, every_reading, one_pickle
from ._limits import MAX_MEMBERS, AuditError, Limits, exceeded, show
from ._machine import Machine, Malformed, Parsed, Reading


def opens_as_tar(f: Any) -> bool:
    """Whether ``tarfile`` opens ``f``: what torch's ``_legacy_load`` tries first on a file that is not a zip."""
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


def read_tar(path: str, limits: Limits) -> Contents | None:
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
            reader = one_pickle(data, 0, limits, what) if name == "pickle" else _records(data, name, limits, what)
            every_reading(reader, name, contents)
    return contents


def tar_and_stream(tar: Contents | None, buf: Any, limits: Limits) -> Contents:
    """A tar's members (``tar``, from :func:`read_tar`) and its bytes read as pickles.

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
    every_reading(read_one, "", stream)
    found = [r for r in stream.resources if r.parsed]
    if tar is None and not found:
        raise AuditError("a tar archive, but not in torch.save's legacy tar format (no readable 'pickle' "
                         f"member), and not a pickle either ({failures[0]})")
    contents = tar if tar is not None else Contents()
    contents.resources += found
    contents.problems += stream.problems
    contents.irregular += stream.irregular
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
