"""The symbolic pickle machine: reads opcodes as the C unpickler does, runs none of them.

:class:`Machine` has its own opcode reader instead of
:func:`pickletools.genops`, because the two disagree on what a pickle is:
``pickletools`` parses ``INT``/``LONG`` literals with ``int(s)`` while
``_pickle.c`` uses ``strtol(s, 0)`` and ``int(s, 0)`` on a C string, so
``I0x10``, ``I017`` (octal), ``I5\\x00`` (the line ends at the NUL) or
``L1_000L`` load fine but stop ``genops``, and an audit built on it silently
missed everything after them. The literal rules below follow CPython's
``Modules/_pickle.c`` (``load_int``, ``load_long``, ``load_float``,
``load_get``, ``load_put``, ``load_string``).

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

Each opcode becomes a symbolic value (:mod:`._values`); no import, no call,
no ``__setstate__``. The stack, mark and memo discipline mirrors
``pickle._Unpickler``, so that what ends up where matches a real load.

Limits: at most :data:`._limits.MAX_OPCODES` opcodes per file; the total
length of the distinct global paths is bounded too (memoized strings would
otherwise let a small file name gigabytes of paths). Extension codes
(``EXT1``...) name globals through ``copyreg``'s registry, which the file
can't fill; they are reported as placeholders. Integers follow a 64-bit
``long`` (Linux, macOS).
"""

from __future__ import annotations

import _compat_pickle
import math
import re
import struct
import sys
from typing import Any

from .._shim import HUB_NAME
from ._limits import MAX_OPCODES, AuditError, Limits, exceeded, show
from ._values import Global, Node, Obj, PDict, Placeholder, PSet

_HIGHEST_PROTOCOL = 5  # a real load refuses higher
# Where torch.package finds a hook again (picklehooks._shim._reduce_package).
PACKAGED_HOOK_LOADER = "picklehooks._shim._load_packaged_hook"
# Calls whose result is a reference we can still name (see _reference()).
_GETATTR = "builtins.getattr"
_IMPORT_MODULE = "importlib.import_module"
_DUNDER_IMPORT = "builtins.__import__"
_HUB_FUNCTION = "picklehooks._shim.hub"
# Total characters of distinct global paths per file.
_MAX_GLOBAL_CHARS = 64 << 20


class Malformed(Exception):
    """The bytes are not a pickle a real load would get through; ``partial`` holds what was read."""

    def __init__(self, message: str, partial: "Parsed | None" = None) -> None:
        super().__init__(message)
        self.partial = partial


class Parsed:
    """One pickle's result: its root, values it built but dropped, the globals it names and calls."""

    __slots__ = ("root", "extras", "globals", "called", "end")

    def __init__(self, root: Any, extras: list[Any], globals_: list[Global], called: list[Global], end: int) -> None:
        self.root, self.extras, self.globals, self.called, self.end = root, extras, globals_, called, end


def packaged_hook_name(pid: Any) -> str | None:
    """The hook name in a torch.package persistent id, or None.

    A hook's ``__reduce_package__`` makes ``PackageExporter`` write the
    persistent id ``("reduce_package", id, picklehooks._shim._load_packaged_hook,
    (name,))``; the importer then calls that loader, which returns the hub's
    ``name``. We only read the name out of the tuple.
    """
    if not (isinstance(pid, tuple) and len(pid) == 4):
        return None
    tag, _, loader, args = pid
    if not (isinstance(tag, str) and tag == "reduce_package" and isinstance(loader, Global)):
        return None
    if loader.path != PACKAGED_HOOK_LOADER:
        return None
    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return None


def path_of(value: Any) -> str | None:
    """The dotted path a value stands for, when the pickle makes it knowable."""
    if isinstance(value, Global):
        return value.path
    if isinstance(value, Obj) and value.ref is not None:
        return value.ref.path if isinstance(value.ref, Global) else value.ref
    return None


# C's isspace() in the C locale: what strtol skips.
_C_SPACE = b" \t\n\v\f\r"
_DIGITS = {8: b"01234567", 10: b"0123456789", 16: b"0123456789abcdefABCDEF"}
# What _Py_dg_strtod and _Py_parse_inf_or_nan read: no space, no "_", no hex.
_C_FLOAT = re.compile(rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def _c_string(text: bytes) -> bytes:
    """A text argument (without its newline) as C reads it: the line with its newline, up to the first NUL."""
    if not text:  # _pickle.c refuses a line shorter than 2 bytes
        raise ValueError("an empty line")
    return (text + b"\n").partition(b"\0")[0]


def _strtol(s: bytes) -> tuple[int | None, int]:
    """glibc's ``strtol(s, &end, 0)`` for a 64-bit long: the value (None on overflow) and ``end``."""
    i, n = 0, len(s)
    while i < n and s[i] in _C_SPACE:
        i += 1
    negative = s[i : i + 1] == b"-"
    if s[i : i + 1] in (b"-", b"+"):
        i += 1
    base = 10
    if s[i : i + 1] == b"0":
        if s[i + 1 : i + 2] in (b"x", b"X"):
            base, i = 16, i + 2
        else:
            base = 8
    start, digits = i, _DIGITS[base]
    while i < n and s[i] in digits:
        i += 1
    if i == start:  # no number: 0, and `end` is the start (or the "x" of a bare "0x")
        return 0, start - 1 if base == 16 else 0
    significant = s[start:i].lstrip(b"0")  # any number of leading zeros is fine
    if len(significant) > 22:
        return None, i
    value = int(significant or b"0", base)
    value = -value if negative else value
    return (value if -(1 << 63) <= value < (1 << 63) else None), i


def _c_int(text: bytes) -> int:
    """``INT``'s literal as ``_pickle.c``'s ``load_int`` reads it: ``strtol(s, 0)``, then ``int(s, 0)``."""
    s = _c_string(text)
    value, end = _strtol(s)
    if value is not None and s[end : end + 1] in (b"", b"\n"):
        # A 3-byte line ("00\n", " 1\n") holding 0 or 1 is protocol 0's False or True.
        return bool(value) if len(text) == 2 and value in (0, 1) else value
    return int(s, 0)  # ValueError (no number, or over 4,300 digits) is malformed, as in C


def _c_long(text: bytes) -> int:
    """``LONG``'s literal (``load_long``): a final "L" ends the C string, then ``int(s, 0)``."""
    return int(_c_string(text[:-1] if text.endswith(b"L") else text), 0)


def _c_float(text: bytes) -> float:
    """``FLOAT``'s literal (``load_float``): ``PyOS_string_to_double`` up to a newline or NUL."""
    s = _c_string(text)
    match = _C_FLOAT.match(s)
    if match is None or s[match.end() : match.end() + 1] not in (b"", b"\n"):
        raise ValueError("could not convert string to float")
    value = float(match.group())
    if math.isinf(value) and not match.group().lstrip(b"+-")[:1].isalpha():  # C: ERANGE, not "inf"
        raise OverflowError("value too large to convert to float")
    return value


def _memo_index(text: bytes) -> int:
    """``GET``/``PUT``'s index (``load_get``, ``load_put``): ``int(s, 10)`` on the C string."""
    return int(_c_string(text), 10)


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


_NO_END = sys.maxsize  # no FRAME end ahead


class Machine:
    """Interprets the pickles of one buffer (bytes or mmap) between ``start`` and ``end``."""

    def __init__(self, buf: Any, start: int, end: int, limits: Limits, what: str, reading: Reading | None = None) -> None:
        self.buf, self.pos, self.end = buf, start, end
        self.limits, self.what = limits, what
        self.reading = reading if reading is not None else Reading()
        self._global_cache: dict[tuple[str, str, str], Global] = {}
        self._table = self._dispatch()
        # FRAMEs whose end lies ahead, innermost (nearest end) last: (end, offset of the FRAME, its length).
        # They persist across pickles: a frame may run past a STOP.
        self.ends: list[tuple[int, int, int]] = []
        self.next_end = _NO_END
        # The end of the buffer a file reader without one of its own holds (the frame it read last), or None.
        self.region: int | None = None
        self.pickles = 0  # pickles begun, for Reading.first_drop
        self.op = start  # offset of the opcode being read

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

    def resume(self) -> None:
        """Move to where a file reader reads on after a pickle: after its STOP, or at the end of the FRAME around it."""
        pos = self.pos
        for frame_end, _, _ in reversed(self.ends):
            if frame_end > pos and self._drop(frame_end):
                self.pos = frame_end
                break
        self.ends.clear()
        self.next_end, self.region = _NO_END, None

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

    # ------------------------------------------------------------------
    # FRAME ends.

    def _pass_ends(self, pos: int) -> None:
        ends = self.ends
        while ends and ends[-1][0] <= pos:
            if ends.pop()[0] == self.region:
                self.region = None
        self.next_end = ends[-1][0] if ends else _NO_END

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
        self.next_end = ends[-1][0] if ends else _NO_END
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

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._read(n), "little")

    def _int4(self) -> int:
        return int.from_bytes(self._read(4), "little", signed=True)

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
    # Globals and calls.

    def _python_global_at_end(self, start: int) -> None:
        """A GLOBAL/INST whose lines run to the end of the file without a newline.

        ``_pickle.c`` refuses it, but ``pickle._Unpickler`` (the pure-Python one) takes each line
        as ``readline()[:-1]``, and so imports a module before it fails: name that global.
        """
        rest = bytes(self.buf[start : self.end])
        if self.ends or rest.count(b"\n") > 1:  # inside a frame it fails before resolving anything
            return
        module, newline, name = rest.partition(b"\n")
        module, name = (module, name[:-1]) if newline else (module[:-1], b"")
        try:
            module_text, name_text = module.decode("utf-8"), name.decode("utf-8")
        except UnicodeDecodeError:
            return
        if module_text:
            self._global(module_text, name_text)

    def _global(self, module: Any, name: Any, via: str = "global") -> Global:
        if not isinstance(module, str) or not isinstance(name, str):
            raise Malformed(f"a global at byte {self.pos - 1} is named by {show(module)} and {show(name)}, not two strings")
        if via == "global" and self.proto < 3:  # what _pickle.c's find_class does with fix_imports=True
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name, via)
        g = self._global_cache.get(key)
        if g is None:
            self.limits.global_chars += len(module) + len(name)
            if self.limits.global_chars > _MAX_GLOBAL_CHARS:
                raise exceeded(self.what, f"the globals it names exceed {_MAX_GLOBAL_CHARS} characters in all")
            g = self._global_cache[key] = Global(module, name, via)
        self.globals.append(g)
        return g

    def _call(self, func: Any, args: Any, kwargs: Any = None) -> Obj:
        obj = Obj(func, args, kwargs)
        target = func if isinstance(func, Global) else func.ref if isinstance(func, Obj) else None
        if isinstance(target, Global):
            self.called.append(target)
            obj.ref = self._reference(target.path, args)
        return obj

    def _reference(self, func: str, args: Any) -> Global | str | None:
        """What a call returns when it is a lookup: loading would reach that path."""
        if not isinstance(args, tuple):
            return None
        if func == _GETATTR and len(args) in (2, 3) and isinstance(args[1], str):
            base = path_of(args[0])
            return None if base is None else self._global(base, args[1], via="getattr")
        if func == _IMPORT_MODULE and len(args) == 1 and isinstance(args[0], str):
            return args[0]
        if func == _DUNDER_IMPORT and args and isinstance(args[0], str):
            fromlist = args[3] if len(args) > 3 else None
            return args[0] if fromlist else args[0].partition(".")[0]
        if func == _HUB_FUNCTION and not args:
            return HUB_NAME
        return None

    # ------------------------------------------------------------------
    # Opcodes.

    def _dispatch(self) -> dict[int, Any]:
        push, pop, top, pop_mark, read, line = self._push, self._pop, self._top, self._pop_mark, self._read, self._line

        def const(value: Any):
            return lambda: push(value)

        def set_items(flat: list[Any]) -> None:
            if len(flat) % 2:
                raise Malformed(f"odd number of items for SETITEMS at byte {self.pos - 1}")
            target = top()
            pairs = list(zip(flat[::2], flat[1::2]))
            if isinstance(target, PDict):
                target.pairs.extend(pairs)
            elif isinstance(target, Node):
                target.dictitems.extend(pairs)
            else:  # a real load would call the target's __setitem__; keep the values visible
                self.dropped.extend(flat)

        def add_items(items: list[Any]) -> None:
            target = top()
            if isinstance(target, list):
                target.extend(items)
            elif isinstance(target, PSet):
                target.items.extend(items)
            elif isinstance(target, Node):
                target.items.extend(items)
            else:
                self.dropped.extend(items)

        def mark() -> None:
            self.metastack.append(self.stack)
            self.stack = []

        def stop() -> bool:
            return True

        def pop_op() -> None:
            if self.stack:
                self.dropped.append(pop())
            else:  # pickle pops the mark when the stack above it is empty
                self.dropped.extend(pop_mark())

        def memo_get(key: int) -> None:
            if key not in self.memo:
                raise Malformed(f"memo key {show(key)} read before it was written, at byte {self.pos - 1}")
            push(self.memo[key])

        def memo_put(key: int) -> None:
            if key < 0:
                raise Malformed(f"negative memo key {show(key)} at byte {self.pos - 1}")
            self.memo[key] = top()

        def tuple_n(n: int):
            def op() -> None:
                if len(self.stack) < n:
                    raise Malformed(f"stack underflow at byte {self.pos - 1}")
                items = self.stack[-n:]
                del self.stack[-n:]
                push(tuple(items))

            return op

        def proto() -> None:
            self.proto = read(1)[0]
            if self.proto > _HIGHEST_PROTOCOL:
                raise Malformed(f"unsupported pickle protocol {self.proto}")

        def string_nl() -> None:  # STRING: a quoted, escaped repr
            text = line()
            if not (len(text) >= 2 and text[0] == text[-1] and text[:1] in (b"'", b'"')):
                raise Malformed(f"STRING argument at byte {self.pos} is not quoted")
            push(_text(_escape_decode(text[1:-1])))

        def global_nl(inst: bool):
            def op() -> None:
                start = self.pos
                try:
                    module, name = line().decode("utf-8"), line().decode("utf-8")
                except Malformed:
                    self._python_global_at_end(start)
                    raise
                g = self._global(module, name)
                if inst:
                    push(self._call(g, tuple(pop_mark())))
                else:
                    push(g)

            return op

        def stack_global() -> None:
            name, module = pop(), pop()
            push(self._global(module, name))

        def reduce() -> None:
            args = pop()
            push(self._call(pop(), args))

        def newobj_ex() -> None:
            kwargs, args = pop(), pop()
            push(self._call(pop(), args, kwargs))

        def build() -> None:
            state = pop()
            target = top()
            if isinstance(target, Node):
                target.states.append(state)
            else:
                self.dropped.append(state)

        def obj() -> None:
            items = pop_mark()
            if not items:
                raise Malformed(f"OBJ without a class at byte {self.pos - 1}")
            push(self._call(items[0], tuple(items[1:])))

        def dict_op() -> None:
            flat = pop_mark()
            if len(flat) % 2:
                raise Malformed(f"odd number of items for DICT at byte {self.pos - 1}")
            push(PDict(zip(flat[::2], flat[1::2])))

        def binpersid() -> None:
            pid = pop()
            hook = packaged_hook_name(pid)
            if hook is not None:  # loading yields picklehooks._hub.<hook>
                self.globals.append(Global(HUB_NAME, hook, via="package"))
            push(Placeholder("persistent id", pid, hook))

        def setitem() -> None:
            value, key = pop(), pop()
            set_items([key, value])

        def append() -> None:
            add_items([pop()])

        def frame() -> None:
            at = self.op
            length = self._uint(8)
            pos = self.pos
            if pos + length > self.next_end:  # runs past the frame it sits in: a dropping reader reads it from there
                pos = self.pos = self._cross(pos, pos + length, True)
            if pos + length > self.end:
                raise Malformed(f"the FRAME at byte {at} declares {show(length)} bytes, past the end of the pickle")
            if self.region is None or pos + length > self.region:  # else a reader without a buffer has it already
                self.region = pos + length
            if length:
                self.ends.append((pos + length, at, length))
                self.next_end = pos + length

        def readonly_buffer() -> None:
            top()

        def float_nl() -> None:
            push(_c_float(line()))

        def long_nl() -> None:
            push(_c_long(line()))

        def long_bin(width: int):
            def op() -> None:
                n = self._uint(width) if width == 1 else self._int4()
                push(int.from_bytes(read(n), "little", signed=True))

            return op

        def string_bin(width: int, signed: bool, kind: str):
            drops = kind not in ("bytes", "bytearray")  # _pickle.c reads those with _Unpickler_ReadInto

            def op() -> None:
                n = self._int4() if signed else self._uint(width)
                data = read(n, drops)
                if kind == "str":
                    push(bytes(data).decode("utf-8", "surrogatepass"))
                elif kind == "string":
                    push(_text(bytes(data)))
                elif kind == "bytearray":
                    push(bytearray(data))
                else:
                    push(bytes(data))

            return op

        table: dict[str, Any] = {
            "(": mark,
            ".": stop,
            "0": pop_op,
            "1": lambda: self.dropped.extend(pop_mark()),
            "2": lambda: push(top()),
            "F": float_nl,
            "I": lambda: push(_c_int(line())),
            "J": lambda: push(self._int4()),
            "K": lambda: push(read(1)[0]),
            "L": long_nl,
            "M": lambda: push(self._uint(2)),
            "N": const(None),
            "P": lambda: push(Placeholder("persistent id", line().decode("ascii", "backslashreplace"))),
            "Q": binpersid,
            "R": reduce,
            "S": string_nl,
            "T": string_bin(4, True, "string"),
            "U": string_bin(1, False, "string"),
            "V": lambda: push(line().decode("raw-unicode-escape")),
            "X": string_bin(4, False, "str"),
            "a": append,
            "b": build,
            "c": global_nl(inst=False),
            "d": dict_op,
            "}": lambda: push(PDict()),
            "e": lambda: add_items(pop_mark()),
            "g": lambda: memo_get(_memo_index(line())),
            "h": lambda: memo_get(read(1)[0]),
            "i": global_nl(inst=True),
            "j": lambda: memo_get(self._uint(4)),
            "l": lambda: push(pop_mark()),
            "]": lambda: push([]),
            "o": obj,
            "p": lambda: memo_put(_memo_index(line())),
            "q": lambda: memo_put(read(1)[0]),
            "r": lambda: memo_put(self._uint(4)),
            "s": setitem,
            "t": lambda: push(tuple(pop_mark())),
            ")": lambda: push(()),
            "u": lambda: set_items(pop_mark()),
            "G": lambda: push(struct.unpack(">d", read(8))[0]),
            "\x80": proto,
            "\x81": lambda: push(self._call(*reversed([pop(), pop()]))),
            "\x82": lambda: push(Placeholder("extension code", read(1)[0])),
            "\x83": lambda: push(Placeholder("extension code", self._uint(2))),
            "\x84": lambda: push(Placeholder("extension code", self._int4())),
            "\x85": tuple_n(1),
            "\x86": tuple_n(2),
            "\x87": tuple_n(3),
            "\x88": const(True),
            "\x89": const(False),
            "\x8a": long_bin(1),
            "\x8b": long_bin(4),
            "B": string_bin(4, False, "bytes"),
            "C": string_bin(1, False, "bytes"),
            "\x8c": string_bin(1, False, "str"),
            "\x8d": string_bin(8, False, "str"),
            "\x8e": string_bin(8, False, "bytes"),
            "\x8f": lambda: push(PSet(frozen=False)),
            "\x90": lambda: add_items(pop_mark()),
            "\x91": lambda: push(PSet(True, pop_mark())),
            "\x92": newobj_ex,
            "\x93": stack_global,
            "\x94": lambda: self.memo.__setitem__(len(self.memo), top()),
            "\x95": frame,
            "\x96": string_bin(8, False, "bytearray"),
            "\x97": lambda: push(Placeholder("out-of-band buffer")),
            "\x98": readonly_buffer,
        }
        return {ord(k): v for k, v in table.items()}


def _escape_decode(data: bytes) -> bytes:
    import codecs

    return codecs.escape_decode(data)[0]


def _text(data: bytes) -> str | bytes:
    """A protocol-0/1 string: torch.load decodes it as UTF-8; we keep bytes that aren't."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data
