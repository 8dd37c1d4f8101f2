"""What the audit reads out of a file, and reading one part of it every way its FRAMEs allow.

:class:`Contents` collects, per part of a file (a zip or tar member, a
NumPy array's data, the file itself), the pickles read from it
(:class:`Resource`), what could not be read, the modules a
``torch.package`` archive bundles (:class:`Bundled`), and the FRAMEs that
file readers read differently.

Every part is read once as ``pickle.loads`` reads it and, where one of its
FRAMEs does not end on an opcode boundary, again as file readers may read
it (see :mod:`._stream`): a reader without a buffer of its own
(``BytesIO``, as ``torch.load`` reads ``data.pkl``), then each mix of the
two at the points where they differ. Such FRAMEs are listed in
:attr:`Contents.irregular`; what the other readings find is added as a
further resource, named "<part>, read frame by frame".

Limits: at most :data:`MAX_READINGS` readings per part; a part that needs
more is reported as not read every way ("treat as unsafe").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ._limits import Limits
from ._machine import Machine, Malformed, Parsed, Reading

# Readings of one part, at most, where its FRAMEs let readers differ (each one reads the part again,
# within the opcode bound): pickle.loads', a reader without a buffer, then mixes of the two.
MAX_READINGS = 16


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


def every_reading(read_one: Callable[[Reading], tuple[list[Parsed], list[str]]], name: str, contents: Contents) -> None:
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


def one_pickle(buf: Any, start: int, limits: Limits, what: str) -> Callable[[Reading], tuple[list[Parsed], list[str]]]:
    """A reader of the one pickle a load reads from ``start`` (a zip member, a NumPy array's data)."""

    def read_one(reading: Reading) -> tuple[list[Parsed], list[str]]:
        machine = Machine(buf, start, len(buf), limits, what, reading)
        try:
            return [machine.run()], []
        except Malformed as exc:
            return [exc.partial] if exc.partial is not None else [], [f"could not read {what}: {exc}; treat as unsafe"]

    return read_one
