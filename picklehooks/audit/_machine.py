"""The symbolic pickle machine: reads opcodes as the C unpickler does, runs none of them.

Each opcode becomes a symbolic value (:mod:`._values`); no import, no call,
no ``__setstate__``. The stack, mark and memo discipline mirrors
``pickle._Unpickler``, so that what ends up where matches a real load.

:class:`Machine` owns one pickle's stack, mark stack and memo, and runs the
opcode loop; the rest is split by concern:

* :mod:`._stream`: its base class, which reads arguments and lines and
  follows FRAMEs the way ``pickle.loads`` or a file reader does (and
  :class:`Reading`, which says which), plus PROTO and FRAME;
* :mod:`._literals`: numbers, strings and bytes, read by ``_pickle.c``'s
  rules rather than :mod:`pickletools`' (which disagree);
* :mod:`._stack`: the stack, MARK, memo and container opcodes;
* :mod:`._calls`: globals, calls, BUILD, persistent ids and extension codes.

Limits: at most :data:`._limits.MAX_OPCODES` opcodes per file. The other
modules state their own (the bound on global paths, extension codes,
integers of a 64-bit ``long``, how FRAMEs are read).
"""

from __future__ import annotations

import struct
from typing import Any

from ._calls import PACKAGED_HOOK_LOADER, call_opcodes, packaged_hook_name, path_of
from ._limits import MAX_OPCODES, AuditError, Limits, exceeded
from ._literals import literal_opcodes
from ._stack import stack_opcodes
from ._stream import Malformed, Reading, Stream, stream_opcodes
from ._values import Global

__all__ = ["Machine", "Malformed", "Parsed", "Reading", "PACKAGED_HOOK_LOADER", "packaged_hook_name", "path_of"]


class Parsed:
    """One pickle's result: its root, values it built but dropped, the globals it names and calls."""

    __slots__ = ("root", "extras", "globals", "called", "end")

    def __init__(self, root: Any, extras: list[Any], globals_: list[Global], called: list[Global], end: int) -> None:
        self.root, self.extras, self.globals, self.called, self.end = root, extras, globals_, called, end


class Machine(Stream):
    """Interprets the pickles of one buffer (bytes or mmap) between ``start`` and ``end``."""

    def __init__(self, buf: Any, start: int, end: int, limits: Limits, what: str, reading: Reading | None = None) -> None:
        super().__init__(buf, start, end, limits, what, reading)
        self._global_cache: dict[tuple[str, str, str], Global] = {}
        self._table = self._dispatch()

    # ------------------------------------------------------------------
    # One pickle.

    def run(self) -> Parsed:
        """Interpret one pickle, up to and including its ``STOP``."""
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.dropped: list[Any] = []  # popped values and state applied to non-nodes: still audited
        self.globals: list[Global] = []
        self.called: list[Global] = []
        self.proto = 0
        buf, table, end = self.buf, self._table, self.end
        budget = self.limits.opcodes_left
        count = 0
        try:
            while True:
                pos = self.pos
                if pos >= self.next_end:  # a frame ended here, on an opcode boundary
                    self._pass_ends(pos)
                if pos >= end:
                    raise Malformed(f"pickle ends at byte {pos} before its STOP opcode")
                code = buf[pos]
                self.op = pos
                self.pos = pos + 1
                count += 1
                if count > budget:
                    self.limits.opcodes_left = 0
                    raise exceeded(self.what, f"it holds more than {MAX_OPCODES} pickle opcodes, the bound per file")
                handler = table.get(code)
                if handler is None:
                    raise Malformed(f"byte {pos} holds {bytes([code])!r}, which is no pickle opcode")
                if handler():
                    break
        except AuditError:  # a bound: the whole audit stops
            raise
        except Malformed as exc:
            self.limits.opcodes_left -= count
            raise Malformed(str(exc), self._parsed(None, pos)) from None
        except (ValueError, OverflowError, UnicodeDecodeError, struct.error, IndexError) as exc:
            self.limits.opcodes_left -= count
            message = f"byte {pos} ({bytes([buf[pos]])!r}) is not readable: {type(exc).__name__}: {str(exc)[:200]}"
            raise Malformed(message, self._parsed(None, pos)) from None
        finally:
            self.pickles += 1
        self.limits.opcodes_left -= count
        for frame_end, frame, length in self.ends:
            if frame_end > self.pos:
                self._flag(frame, length, frame_end, f"runs past the STOP at byte {pos}: a file reader starts what follows at byte {frame_end}, pickle.loads after the STOP")
        if not self.stack:
            raise Malformed(f"STOP with an empty stack at byte {pos}", self._parsed(None, pos))
        return self._parsed(self.stack[-1], self.pos, root_taken=True)

    def _parsed(self, root: Any, end: int, root_taken: bool = False) -> Parsed:
        # Every value built is now reachable from the root, from the rest of
        # the stack(s), or from `dropped`; the memo only holds more
        # references to them (and the walk skips what it has seen).
        rest = self.stack[:-1] if root_taken else list(self.stack)
        for frame in self.metastack:
            rest += frame
        rest += self.memo.values() if root is None else ()
        return Parsed(root, [*self.dropped, *rest], self.globals, self.called, end)

    # ------------------------------------------------------------------
    # The stack.

    def _push(self, value: Any) -> None:
        self.stack.append(value)

    def _pop(self) -> Any:
        if not self.stack:
            raise Malformed(f"stack underflow at byte {self.pos - 1}")
        return self.stack.pop()

    def _top(self) -> Any:
        if not self.stack:
            raise Malformed(f"empty stack at byte {self.pos - 1}")
        return self.stack[-1]

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise Malformed(f"no MARK to pop at byte {self.pos - 1}")
        items, self.stack = self.stack, self.metastack.pop()
        return items

    # ------------------------------------------------------------------
    # Opcodes.

    def _dispatch(self) -> dict[int, Any]:
        # Each family's handlers are closures over this machine and its bound
        # methods, so that an opcode costs one lookup in this table and one call.
        table = {**stream_opcodes(self), **literal_opcodes(self), **stack_opcodes(self), **call_opcodes(self)}
        return {ord(k): v for k, v in table.items()}
