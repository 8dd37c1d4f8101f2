"""A soundness oracle for ``inspect``: CPython's own ``pickle.find_class`` audit events.

Hypothesis generates opcode streams (every protocol 0-5, FRAMEs whose declared length may end
anywhere, memo ops, STACK_GLOBAL, REDUCE, BUILD, INST/OBJ, literals of every kind, text
literals as the C parser reads them, several pickles in a row, truncation). A child process
(:mod:`tests.audit._pickle_oracle`) loads each one with ``pickle.loads`` and, pickle after pickle,
with ``pickle.load`` from ``BytesIO`` and from ``open()``, and records every global CPython resolves;
the audit hook stops any load before a real global could run, and the fake module's globals
do nothing. The test fails when

* a global was resolved that ``audit_file`` (what ``inspect`` prints) does not list, or
* the three ways read the stream differently and ``inspect`` would exit 0.

One child serves every example. ``MAX_EXAMPLES`` (1,000; ``PH_FUZZ=N`` runs N) examples run,
in about 25 s on one core; before the FRAME fix, the first failures Hypothesis found were
FRAME straddles like the issue's.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picklehooks import audit
from picklehooks.audit.policy import allowed_globals
from tests.testutils import REPO

MAX_EXAMPLES = int(os.environ.get("PH_FUZZ", 1000))
FAKE = "phfuzz"
# Strings the streams are built from: module and attribute names of the fake module, two real
# globals (the child stops their loads at once), and plain text.
NAMES = [FAKE, "getcwd", "system", "sub.getcwd", "os", "collections", "OrderedDict", "ab"]
GLOBALS = [(FAKE, "getcwd"), (FAKE, "system"), (FAKE, "sub.getcwd"), ("os", "getcwd"), ("collections", "OrderedDict")]


class Oracle:
    """The child process: one path in, one JSON answer out."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.audit._pickle_oracle"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, path: Path) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the oracle's child process died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def oracle():
    child = Oracle()
    yield child
    child.close()


# --------------------------------------------------------------------------
# Opcode streams.


def counted(op: bytes, width: int, data: bytes) -> bytes:
    return op + len(data).to_bytes(width, "little") + data


def short_str(text: bytes) -> bytes:
    return counted(b"\x8c", 1, text)


@st.composite
def global_op(draw) -> bytes:
    module, name = draw(st.sampled_from(GLOBALS))
    form = draw(st.sampled_from(["GLOBAL", "INST", "STACK_GLOBAL", "STACK_GLOBAL_MEMO"]))
    if form == "GLOBAL":
        return f"c{module}\n{name}\n".encode()
    if form == "INST":
        return f"(i{module}\n{name}\n".encode()
    if form == "STACK_GLOBAL":
        return short_str(module.encode()) + short_str(name.encode()) + b"\x93"
    # Memoized strings fetched back (fickling's memo expansion).
    return short_str(module.encode()) + b"\x94" + short_str(name.encode()) + b"\x94" + b"00h\x00h\x01\x93"


TEXT_INTS = [b"I5\n", b"I5\x00\n", b"I" + b"0" * 70 + b"7\n", b"I0x1f\n", b"I 1\n", b"I01\n", b"I\x00z\n", b"I12z\n",
             b"L5\x00L\n", b"L7L\n", b"L1_0\n", b"F1.5\n", b"F1.5\x00\n", b"F 1\n", b"Finf\n", b"F1e999\n"]


@st.composite
def literal(draw) -> bytes:
    kind = draw(st.integers(0, 14))
    text = draw(st.sampled_from(NAMES)).encode()
    if kind == 0:
        return draw(st.sampled_from(TEXT_INTS))
    if kind == 1:
        return b"K" + bytes([draw(st.integers(0, 255))])
    if kind == 2:
        return b"J" + struct.pack("<i", draw(st.integers(-5, 5)))
    if kind == 3:
        return short_str(text)
    if kind == 4:
        return counted(b"X", 4, text)
    if kind == 5:
        return counted(b"C", 1, text)
    if kind == 6:
        return counted(b"B", 4, text)
    if kind == 7:
        return counted(b"\x8e", 8, text)
    if kind == 8:
        return counted(b"\x96", 8, text)
    if kind == 9:
        return b"V" + text + b"\n"
    if kind == 10:
        return b"S'" + text + b"'\n"
    if kind == 11:
        return counted(b"U", 1, text)
    if kind == 12:
        return b"G" + struct.pack(">d", 1.5)
    if kind == 13:
        return counted(b"\x8a", 1, b"\x05")
    return draw(st.sampled_from([b"N", b"\x88", b"\x89", b")", b"]", b"}", b"\x8f"]))


STRUCTURE = [b"(", b"t", b"l", b"d", b"\x85", b"\x86", b"\x87", b"a", b"e", b"s", b"u", b"\x90", b"\x91", b"0", b"1",
             b"2", b"R", b"b", b"\x81", b"\x92", b"o", b"\x93", b"\x94", b"p0\n", b"p1\x00\n", b"g0\n", b"g01\n", b"q\x01",
             b"h\x01", b"r\x00\x00\x00\x00", b"j\x00\x00\x00\x00", b"."]


@st.composite
def straddle(draw, body) -> bytes:
    """A FRAME that ends inside an argument: a file reader reads the argument again from after it.

    ``pickle.loads`` reads the argument in place and then a bytes literal that swallows ``hidden``;
    a file reader reads the argument from the frame's end, which runs into ``hidden``.
    """
    hidden = draw(body)
    op, width = draw(st.sampled_from([(b"\x8c", 1), (b"X", 4), (b"U", 1), (b"T", 4)]))
    inside = draw(st.integers(2, 6))  # argument bytes inside the frame
    rest = draw(st.integers(0, 4))  # argument bytes after it, as pickle.loads reads them
    pad = b"x" * (inside - 2)
    length = inside + rest
    frame_body = op + length.to_bytes(width, "little") + b"a" * inside
    after = b"y" * rest + counted(b"C", 1, pad + hidden) if len(pad + hidden) < 256 else b""
    return b"\x95" + len(frame_body).to_bytes(8, "little") + frame_body + after


@st.composite
def frame(draw, body) -> bytes:
    """A FRAME around some opcodes, whose declared length may be off by a few bytes."""
    inner = draw(body)
    length = max(0, len(inner) + draw(st.sampled_from([0, 0, 0, -1, -2, 1, 3])))
    return b"\x95" + length.to_bytes(8, "little") + inner


def pieces(depth: int):
    base = st.one_of(literal(), st.sampled_from(STRUCTURE), global_op())
    if depth == 0:
        return base
    body = st.lists(pieces(depth - 1), max_size=6).map(b"".join)
    return st.one_of(base, base, base, frame(body), straddle(body))


@st.composite
def streams(draw) -> bytes:
    out = b""
    for _ in range(draw(st.integers(1, 2))):
        proto = draw(st.integers(0, 5))
        head = b"\x80" + bytes([proto]) if proto >= 2 else b""
        out += head + b"".join(draw(st.lists(pieces(2), max_size=12))) + draw(st.sampled_from([b".", b"N.", b""]))
    if draw(st.integers(0, 5)) == 0:
        out = out[: draw(st.integers(0, len(out)))]
    return out


def inspect(path: Path) -> tuple[int, set[str], str]:
    """What ``inspect`` exits with, the globals it lists, and its error (exit 1: it lists none)."""
    try:
        report = audit.audit_file(path)
    except audit.AuditError as exc:
        return audit.EXIT_UNREADABLE, set(), str(exc)
    return report.exit_code, {g.path for g in report.globals}, ""


def named(path: str, listed: set[str], error: str) -> bool:
    """Whether inspect names a global a load resolved: listed, or (can't audit) in its error, if unsafe."""
    return path in listed or bool(error) and (path in error or path in allowed_globals())


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(data=streams())
def test_every_global_a_load_resolves_is_listed(oracle, tmp_path, data):
    path = tmp_path / "fuzz.pkl"
    path.write_bytes(data)
    answer = oracle(path)
    code, listed, error = inspect(path)
    for way, (events, _) in answer.items():
        for module, name in events:
            assert named(f"{module}.{name}", listed, error), (way, f"{module}.{name}", data, code, listed, error)
    one_pickle = {json.dumps(answer[way]) for way in ("loads", "bytesio first", "file first")}
    streams = {json.dumps(answer[way]) for way in ("bytesio", "file")}
    if len(one_pickle) > 1 or len(streams) > 1:  # the ways read it differently
        assert code != 0, (answer, data)
