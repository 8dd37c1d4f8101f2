"""Literal opcodes: the values a pickle spells out in its bytes, read as ``_pickle.c`` reads them.

The machine has its own literal rules instead of :func:`pickletools.genops`'s,
because the two disagree on what a pickle is: ``pickletools`` parses
``INT``/``LONG`` literals with ``int(s)`` while ``_pickle.c`` uses
``strtol(s, 0)`` and ``int(s, 0)`` on a C string, so ``I0x10``, ``I017``
(octal), ``I5\\x00`` (the line ends at the NUL) or ``L1_000L`` load fine but
stop ``genops``, and an audit built on it silently missed everything after
them. The rules below follow CPython's ``Modules/_pickle.c`` (``load_int``,
``load_long``, ``load_float``, ``load_get``, ``load_put``, ``load_string``).

:func:`literal_opcodes` gives the handlers of the opcodes that push such a
value (numbers, strings, bytes, ``None``, ``True``, ``False``); the memo
opcodes' text indexes (:func:`memo_index`) are read here too.

Limits: integers follow a 64-bit ``long`` (Linux, macOS). A protocol 0/1
string that is not UTF-8 is kept as bytes (``torch.load`` decodes them as
UTF-8).
"""

from __future__ import annotations

import math
import re
import struct
from typing import TYPE_CHECKING, Any, Callable

from ._stream import Malformed

if TYPE_CHECKING:
    from ._machine import Machine

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


def memo_index(text: bytes) -> int:
    """``GET``/``PUT``'s index (``load_get``, ``load_put``): ``int(s, 10)`` on the C string."""
    return int(_c_string(text), 10)


def _escape_decode(data: bytes) -> bytes:
    import codecs

    return codecs.escape_decode(data)[0]


def _text(data: bytes) -> str | bytes:
    """A protocol-0/1 string: torch.load decodes it as UTF-8; we keep bytes that aren't."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


def literal_opcodes(m: Machine) -> dict[str, Callable[[], Any]]:
    """The handlers of the opcodes that push a literal, keyed by opcode."""
    push, read, line = m._push, m._read, m._line

    def const(value: Any):
        return lambda: push(value)

    def string_nl() -> None:  # STRING: a quoted, escaped repr
        text = line()
        if not (len(text) >= 2 and text[0] == text[-1] and text[:1] in (b"'", b'"')):
            raise Malformed(f"STRING argument at byte {m.pos} is not quoted")
        push(_text(_escape_decode(text[1:-1])))

    def float_nl() -> None:
        push(_c_float(line()))

    def long_nl() -> None:
        push(_c_long(line()))

    def long_bin(width: int):
        def op() -> None:
            n = m._uint(width) if width == 1 else m._int4()
            push(int.from_bytes(read(n), "little", signed=True))

        return op

    def string_bin(width: int, signed: bool, kind: str):
        drops = kind not in ("bytes", "bytearray")  # _pickle.c reads those with _Unpickler_ReadInto

        def op() -> None:
            n = m._int4() if signed else m._uint(width)
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

    return {
        "F": float_nl,
        "I": lambda: push(_c_int(line())),
        "J": lambda: push(m._int4()),
        "K": lambda: push(read(1)[0]),
        "L": long_nl,
        "M": lambda: push(m._uint(2)),
        "N": const(None),
        "S": string_nl,
        "T": string_bin(4, True, "string"),
        "U": string_bin(1, False, "string"),
        "V": lambda: push(line().decode("raw-unicode-escape")),
        "X": string_bin(4, False, "str"),
        "G": lambda: push(struct.unpack(">d", read(8))[0]),
        "\x88": const(True),
        "\x89": const(False),
        "\x8a": long_bin(1),
        "\x8b": long_bin(4),
        "B": string_bin(4, False, "bytes"),
        "C": string_bin(1, False, "bytes"),
        "\x8c": string_bin(1, False, "str"),
        "\x8d": string_bin(8, False, "str"),
        "\x8e": string_bin(8, False, "bytes"),
        "\x96": string_bin(8, False, "bytearray"),
    }
