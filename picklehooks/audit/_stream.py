"""The byte stream under the machine: opcode arguments, text lines, PROTO and FRAMEs.

FRAMEs: ``pickle.loads`` reads its buffer straight through, so a FRAME only
groups opcodes. The C unpickler reading a *file* (``pickle.load``, and
``torch.load``, which reads ``data.pkl`` through ``BytesIO``) reads a frame
as one buffer (``_Unpickler_ReadImpl``): an argument that runs past the
frame's end is read again from the stream after the frame, and the rest of
the frame is dropped; a text line likewise (``_Unpickler_Readline``); only
``BINBYTES``-like data continues across (``_Unpickler_ReadInto``); after a
STOP the next pickle starts at the frame's end. A buffered file (``open()``)
takes a small frame from its own buffer instead, which reads in place. So
wherever a FRAME's declared length does not end on an opcode boundary, the
readers differ: the machine records each such FRAME (:attr:`Reading.irregular`)
and, at each point where they differ, takes the branch its :class:`Reading`
says, so that the caller can read the part each way.

:class:`Stream` is the machine's base class: where it is in the buffer, the
FRAMEs around that point, and the reads of arguments and lines that respect
them. It knows nothing of the stack or of what the opcodes mean.

Limits: one :class:`Reading` is one way through the part; which way a
buffered file goes depends on its buffer's size, so it is up to the caller
to read the part each way (:mod:`._contents`). Lengths come from the file
and are checked against the bytes there before anything is sliced, so a
forged length allocates nothing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

from ._limits import Limits, show

if TYPE_CHECKING:
    from ._machine import Machine, Parsed

_HIGHEST_PROTOCOL = 5  # a real load refuses higher
NO_END = sys.maxsize  # no FRAME end ahead


class Malformed(Exception):
    """The bytes are not a pickle a real load would get through; ``partial`` holds what was read."""

    def __init__(self, message: str, partial: "Parsed | None" = None) -> None:
        super().__init__(message)
        self.partial = partial


class Reading:
    """How a file reader takes the FRAMEs of one part of a file, and what it found in them.

    At each *point* where readers differ (an argument, line or FRAME that runs
    past the end of a frame, a STOP inside one) the machine either reads on in
    place (``pickle.loads``, and a buffered file whose buffer holds the frame)
    or drops the rest of the frame (a file reader that read the frame as its
    buffer). ``exact`` takes every point as a file reader without a buffer of
    its own (``BytesIO``: ``torch.load``'s ``data.pkl``) does; otherwise
    ``choices`` gives the branch at the first points, in order (True: drop),
    and the rest read in place. ``taken`` records every point's branch,
    ``first_drop`` the index of the pickle where the reading first dropped
    bytes, and ``irregular`` a message per FRAME that does not end on an
    opcode boundary.
    """

    def __init__(self, choices: tuple[bool, ...] = (), exact: bool = False) -> None:
        self.choices, self.exact = choices, exact
        self.taken: list[bool] = []
        self.first_drop: int | None = None
        self.irregular: dict[int, str] = {}

    @property
    def primary(self) -> bool:
        """Whether this is ``pickle.loads``' reading (every point read in place)."""
        return not self.exact and not any(self.choices)


class Stream:
    """The bytes of one buffer (bytes or mmap) between ``start`` and ``end``, read as a file reader of ``reading`` does."""

    def __init__(self, buf: Any, start: int, end: int, limits: Limits, what: str, reading: Reading | None = None) -> None:
        self.buf, self.pos, self.end = buf, start, end
        self.limits, self.what = limits, what
        self.reading = reading if reading is not None else Reading()
        # FRAMEs whose end lies ahead, innermost (nearest end) last: (end, offset of the FRAME, its length).
        # They persist across pickles: a frame may run past a STOP.
        self.ends: list[tuple[int, int, int]] = []
        self.next_end = NO_END
        # The end of the buffer a file reader without one of its own holds (the frame it read last), or None.
        self.region: int | None = None
        self.pickles = 0  # pickles begun, for Reading.first_drop
        self.op = start  # offset of the opcode being read

    def resume(self) -> None:
        """Move to where a file reader reads on after a pickle: after its STOP, or at the end of the FRAME around it."""
        pos = self.pos
        for frame_end, _, _ in reversed(self.ends):
            if frame_end > pos and self._drop(frame_end):
                self.pos = frame_end
                break
        self.ends.clear()
        self.next_end, self.region = NO_END, None

    # ------------------------------------------------------------------
    # Reading arguments. Lengths come from the file: check them against
    # what is there before slicing, so a forged length allocates nothing.

    def _read(self, n: int, drops: bool = True) -> Any:
        """``n`` bytes of argument; ``drops=False`` for the data of BINBYTES and BYTEARRAY8, which
        ``_Unpickler_ReadInto`` reads on across a frame's end."""
        pos = self.pos
        if n < 0:
            raise Malformed(f"an argument at byte {pos} claims {show(n)} bytes")
        if pos + n > self.next_end:
            pos = self._cross(pos, pos + n, drops)
        if pos + n > self.end:
            raise Malformed(f"an argument at byte {pos} claims {show(n)} bytes, past the end of the pickle")
        self.pos = pos + n
        return self.buf[pos : pos + n]

    def _line(self) -> bytes:
        pos = self.pos
        nl = self.buf.find(b"\n", pos, self.end)
        if nl < 0:
            raise Malformed(f"a text argument at byte {pos} has no end of line")
        if nl >= self.next_end:
            # A dropping reader reads the line again from the frame's end: the same newline ends it.
            pos = self._cross(pos, nl + 1, True)
        self.pos = nl + 1
        return bytes(self.buf[pos:nl])

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._read(n), "little")

    def _int4(self) -> int:
        return int.from_bytes(self._read(4), "little", signed=True)

    # ------------------------------------------------------------------
    # FRAME ends.

    def _pass_ends(self, pos: int) -> None:
        ends = self.ends
        while ends and ends[-1][0] <= pos:
            if ends.pop()[0] == self.region:
                self.region = None
        self.next_end = ends[-1][0] if ends else NO_END

    def _cross(self, pos: int, stop: int, drops: bool) -> int:
        """A read from ``pos`` to ``stop`` runs past the end of FRAMEs: flag each; return where the read starts.

        That is ``pos``, or the end of a frame whose rest this reading drops.
        """
        self._pass_ends(pos)
        ends = self.ends
        while ends and ends[-1][0] < stop:
            frame_end, frame, length = ends.pop()
            if drops:
                how = (f"inside the opcode at byte {self.op}: a file reader drops the rest of the frame and reads "
                       f"its argument from byte {frame_end} on, pickle.loads in place")
            else:
                how = f"inside the bytes of the opcode at byte {self.op}"
            self._flag(frame, length, frame_end, how)
            dropped = drops and self._drop(frame_end)
            if frame_end == self.region:
                self.region = None
            if dropped:
                ends.clear()
                pos, self.region = frame_end, None
        self.next_end = ends[-1][0] if ends else NO_END
        return pos

    def _drop(self, frame_end: int) -> bool:
        """At a point where readers differ: whether this reading drops the rest of the frame ending at ``frame_end``."""
        reading = self.reading
        point = len(reading.taken)
        if reading.exact:
            drop = frame_end == self.region
        else:
            drop = point < len(reading.choices) and reading.choices[point]
        reading.taken.append(drop)
        if drop and reading.first_drop is None:
            reading.first_drop = self.pickles
        return drop

    def _flag(self, frame: int, length: int, frame_end: int, how: str) -> None:
        message = (f"FRAME at byte {frame} of {self.what} declares {length} bytes, which end at byte {frame_end}, "
                   f"not on an opcode boundary: {how}")
        self.reading.irregular.setdefault(frame, message)


def stream_opcodes(m: Machine) -> dict[str, Callable[[], Any]]:
    """The handlers of PROTO and FRAME, keyed by opcode."""

    def proto() -> None:
        m.proto = m._read(1)[0]
        if m.proto > _HIGHEST_PROTOCOL:
            raise Malformed(f"unsupported pickle protocol {m.proto}")

    def frame() -> None:
        at = m.op
        length = m._uint(8)
        pos = m.pos
        if pos + length > m.next_end:  # runs past the frame it sits in: a dropping reader reads it from there
            pos = m.pos = m._cross(pos, pos + length, True)
        if pos + length > m.end:
            raise Malformed(f"the FRAME at byte {at} declares {show(length)} bytes, past the end of the pickle")
        if m.region is None or pos + length > m.region:  # else a reader without a buffer has it already
            m.region = pos + length
        if length:
            m.ends.append((pos + length, at, length))
            m.next_end = pos + length

    return {"\x80": proto, "\x95": frame}
