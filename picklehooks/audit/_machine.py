"""The symbolic pickle machine: reads opcodes as the C unpickler does, runs none of them.

:class:`Machine` has its own opcode reader instead of
:func:`pickletools.genops`, because the two disagree on what a pickle is:
``pickletools`` parses ``INT``/``LONG`` literals with ``int(s)`` while
``_pickle.c`` uses ``strtol(s, 0)`` and ``int(s, 0)``, so ``I0x10``,
``I017`` (octal) or ``L1_000L`` load fine but stop ``genops``, and an audit
built on it silently missed everything after them. The literal rules below
follow CPython's ``Modules/_pickle.c`` (``load_int``, ``load_long``,
``load_get``, ``load_put``, ``load_string``).

Each opcode becomes a symbolic value (:mod:`._values`); no import, no call,
no ``__setstate__``. The stack, mark and memo discipline mirrors
``pickle._Unpickler``, so that what ends up where matches a real load.

Limits: at most :data:`._limits.MAX_OPCODES` opcodes per file; the total
length of the distinct global paths is bounded too (memoized strings would
otherwise let a small file name gigabytes of paths). Extension codes
(``EXT1``...) name globals through ``copyreg``'s registry, which the file
can't fill; they are reported as placeholders.
"""

from __future__ import annotations

import _compat_pickle
import struct
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


def _c_int(text: bytes) -> int:
    """``INT``'s literal as ``_pickle.c``'s ``load_int`` reads it: ``strtol(s, 0)``, then ``int(s, 0)``."""
    if text in (b"00", b"01"):  # protocol 0's False and True
        return bool(int(text))
    body = text.lstrip(b" \t\n\v\f\r")
    sign = -1 if body[:1] == b"-" else 1
    digits = body[1:] if body[:1] in (b"-", b"+") else body
    base = 10
    if digits[:2].lower() == b"0x" and digits[2:3] and digits[2:3] in b"0123456789abcdefABCDEF":
        base, digits = 16, digits[2:]
    elif digits[:1] == b"0":
        base = 8
    allowed = b"0123456789abcdefABCDEF"[: base + (6 if base == 16 else 0)]
    if digits and all(c in allowed for c in digits) and len(digits) < 64:
        value = sign * int(digits, base)
        if -(1 << 63) <= value < (1 << 63):  # strtol's range; beyond it C falls back to int(s, 0)
            return value
    return int(text, 0)  # ValueError (no number, or over 4,300 digits) is malformed, as in C


class Machine:
    """Interprets the pickles of one buffer (bytes or mmap) between ``start`` and ``end``."""

    def __init__(self, buf: Any, start: int, end: int, limits: Limits, what: str) -> None:
        self.buf, self.pos, self.end = buf, start, end
        self.limits, self.what = limits, what
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
                if pos >= end:
                    raise Malformed(f"pickle ends at byte {pos} before its STOP opcode")
                code = buf[pos]
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
        self.limits.opcodes_left -= count
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
    # Reading arguments. Lengths come from the file: check them against
    # what is there before slicing, so a forged length allocates nothing.

    def _read(self, n: int) -> Any:
        pos = self.pos
        if n < 0 or pos + n > self.end:
            raise Malformed(f"an argument at byte {pos} claims {show(n)} bytes, past the end of the pickle")
        self.pos = pos + n
        return self.buf[pos : pos + n]

    def _line(self) -> bytes:
        pos = self.pos
        nl = self.buf.find(b"\n", pos, self.end)
        if nl < 0:
            raise Malformed(f"a text argument at byte {pos} has no end of line")
        self.pos = nl + 1
        return bytes(self.buf[pos:nl])

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
            text = line().rstrip()
            if not (len(text) >= 2 and text[0] == text[-1] and text[:1] in (b"'", b'"')):
                raise Malformed(f"STRING argument at byte {self.pos} is not quoted")
            push(_text(_escape_decode(text[1:-1])))

        def global_nl(inst: bool):
            def op() -> None:
                module, name = line().decode("utf-8"), line().decode("utf-8")
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
            read(8)  # framing only groups opcodes

        def readonly_buffer() -> None:
            top()

        def float_nl() -> None:
            push(float(line()))

        def long_nl() -> None:
            text = line()
            push(int(text[:-1] if text.endswith(b"L") else text, 0))

        def long_bin(width: int):
            def op() -> None:
                n = self._uint(width) if width == 1 else self._int4()
                push(int.from_bytes(read(n), "little", signed=True))

            return op

        def string_bin(width: int, signed: bool, kind: str):
            def op() -> None:
                n = self._int4() if signed else self._uint(width)
                data = read(n)
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
            "g": lambda: memo_get(int(line(), 10)),
            "h": lambda: memo_get(read(1)[0]),
            "i": global_nl(inst=True),
            "j": lambda: memo_get(self._uint(4)),
            "l": lambda: push(pop_mark()),
            "]": lambda: push([]),
            "o": obj,
            "p": lambda: memo_put(int(line(), 10)),
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
