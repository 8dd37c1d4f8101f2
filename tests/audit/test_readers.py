"""``inspect`` reads what CPython's C unpickler reads: FRAME boundaries, C number parsing, NumPy files.

Each test is one reproducer of issue 26. The ground truth is CPython itself: a child process
loads the file (``pickle.load``, ``pickle.loads``, ``torch.load(weights_only=False)``) and prints
the ``pickle.find_class`` audit events it raised; the only global these files name is the
harmless ``os.getcwd``.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import picklehooks
from picklehooks import audit
from picklehooks._shim import PicklehooksError
from tests.audit.test_corpus import double_output
from tests.testutils import REPO

GETCWD = b"cos\ngetcwd\n"


def resolved(path: Path, load: str) -> list[str]:
    """The globals CPython resolves running ``load`` (an expression of ``path``) in a fresh process."""
    code = (
        "import sys, json, io, pickle, torch\n"
        "found = []\n"
        "sys.addaudithook(lambda e, a: found.append('.'.join(a)) if e == 'pickle.find_class' else None)\n"
        f"path = {str(path)!r}\n"
        f"try:\n    {load}\nexcept Exception:\n    pass\n"
        "print(json.dumps(found))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True, timeout=120)
    return json.loads(proc.stdout.splitlines()[-1])


def frame(body: bytes, length: int | None = None) -> bytes:
    return b"\x95" + struct.pack("<Q", len(body) if length is None else length) + body


def assert_flagged(path: Path, frame_at: int | None = None, *globals_: str) -> audit.AuditReport:
    """inspect exits with UNSAFE set, lists the globals, and names the FRAME's offset."""
    report = audit.audit_file(path)
    assert report.exit_code & audit.EXIT_UNSAFE
    assert set(globals_) <= {g.path for g in report.unsafe}, report.globals
    if frame_at is not None:
        assert any(m.startswith(f"FRAME at byte {frame_at} ") for m in report.irregular), report.irregular
    return report


def write_member(src: Path, dst: Path, suffix: str, data: bytes) -> None:
    """Copy the zip ``src`` to ``dst`` with the member ending in ``suffix`` replaced by ``data``."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for info in old.infolist():
            new.writestr(info, data if info.filename.endswith(suffix) else old.read(info))


# --------------------------------------------------------------------------
# 0/1. FRAME boundaries.

# The 33 bytes: a SHORT_BINUNICODE runs past its 4-byte frame. pickle.loads reads "abxyz",
# then a SHORT_BINBYTES that swallows the GLOBAL; a file reader reads "xyzC\x0c" and then the GLOBAL.
STRADDLE = b"\x80\x04" + frame(b"\x8c\x05ab") + b"xyzC\x0c" + GETCWD + b"0."


class TestFrames:
    def test_zip_data_pkl_straddle(self, tmp_path):
        """torch.load reads data.pkl through BytesIO: the global behind the frame's end resolves."""
        good, path = tmp_path / "good.pt", tmp_path / "straddle.pt"
        torch.save({"w": 1}, good)
        write_member(good, path, "data.pkl", STRADDLE)
        assert resolved(path, "torch.load(path, weights_only=False)") == ["os.getcwd"]
        assert_flagged(path, 2, "os.getcwd")

    def test_zip_straddle_global_line(self, tmp_path):
        """With a GLOBAL line straddling instead, the name a file reader resolves is the one listed."""
        good, path = tmp_path / "good.pt", tmp_path / "straddle.pt"
        torch.save({"w": 1}, good)
        data = b"\x80\x02" + frame(b"cfuzz") + b"os\ngetcwd\n0N."  # loads: "fuzzos"; a file reader: "os"
        write_member(good, path, "data.pkl", data)
        assert resolved(path, "torch.load(path, weights_only=False)") == ["os.getcwd"]
        report = assert_flagged(path, 2, "os.getcwd")
        assert "fuzzos.getcwd" in {g.path for g in report.globals}  # pickle.loads' reading, also audited

    def test_plain_file_frame_larger_than_the_buffer(self, tmp_path):
        """open()'s buffer holds a small frame; a larger one is read exactly, and dropped at its end."""
        body = b"\x8e" + struct.pack("<Q", 8300) + b"z" * 8300 + b"0" + b"\x8c\x05ab"
        data = b"\x80\x04" + frame(body) + b"xyzC\x0c" + GETCWD + b"0N."
        path = tmp_path / "big.pkl"
        path.write_bytes(data)
        assert resolved(path, "pickle.load(open(path, 'rb'))") == ["os.getcwd"]
        assert resolved(path, "pickle.loads(open(path, 'rb').read())") == []
        assert_flagged(path, 2, "os.getcwd")

    @pytest.mark.parametrize("op", ["BINUNICODE", "BININT", "FRAME", "UNICODE"])
    def test_straddling_opcodes(self, tmp_path, op):
        """Each argument _Unpickler_Read reads is read again from the frame's end, hiding nothing from the audit.

        pickle.loads reads the argument in place and then a SHORT_BINBYTES that swallows the GLOBAL;
        a file reader reads the argument from the frame's end and then runs the GLOBAL. A text line
        (UNICODE) read again from the frame's end ends at the same newline: only its text differs.
        """
        tail = GETCWD + b"0N."
        swallow = b"C" + bytes([len(tail)]) + tail + b"N."
        if op == "BINUNICODE":  # the length inside the frame, then 2 of 5 text bytes
            data = frame(b"X\x05\x00\x00\x00ab") + b"xyz" + swallow
        elif op == "BININT":  # 2 of 4 bytes
            data = frame(b"Jab") + b"xy" + swallow
        elif op == "FRAME":  # a nested 5-byte frame, 2 bytes of it inside: a file reader reads all 5 from the outer end
            data = frame(b"\x95\x05\x00\x00\x00\x00\x00\x00\x00ab") + b"N0N0N" + tail
        else:
            data = frame(b"Vab") + b"xyz\n0" + tail
        path = tmp_path / "s.pkl"
        path.write_bytes(b"\x80\x04" + data)
        theirs = resolved(path, "pickle.load(io.BytesIO(open(path, 'rb').read()))")
        assert theirs == ["os.getcwd"]
        assert_flagged(path, 2, "os.getcwd")

    def test_legacy_magic_pickle_frame_past_stop(self, tmp_path):
        """torch.load starts the next pickle of a legacy file at the end of the frame around the magic number."""
        magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[2:-1]  # LONG1 of the magic number
        benign = b"".join(pickle.dumps(x, protocol=2) for x in (1001, {"protocol_version": 1001}, {"w": 1}, []))
        hidden = b"".join(pickle.dumps(x, protocol=2) for x in (1001, {"protocol_version": 1001}))
        hidden += b"\x80\x02" + GETCWD + b")R." + pickle.dumps([], protocol=2)
        pad = benign + b"\x00" * (1 << 17)  # beyond _pickle.c's prefetch: read() as one buffer, never peeked
        data = b"\x80\x02" + frame(magic + b"." + pad) + hidden
        path = tmp_path / "legacy.pt"
        path.write_bytes(data)
        assert "os.getcwd" in resolved(path, "torch.load(path, weights_only=False)")
        assert_flagged(path, 2, "os.getcwd")

    def test_clean_frames_are_not_flagged(self, tmp_path):
        """What the pickler writes (frames that end on opcode boundaries) reads one way only."""
        path = tmp_path / "ok.pkl"
        path.write_bytes(pickle.dumps([{"a": list(range(5000)), "b": b"x" * 70000}, "tail"], protocol=5))
        report = audit.audit_file(path)
        assert report.irregular == [] and report.exit_code == 0


# --------------------------------------------------------------------------
# 2. NumPy files.


class TestNumpy:
    np = pytest.importorskip("numpy")

    def test_object_npy(self, tmp_path):
        """An object array's pickle, behind the .npy header, is audited: its globals are listed."""
        path = tmp_path / "a.npy"
        self.np.save(path, self.np.array([picklehooks.portable(double_output), 1], dtype=object), allow_pickle=True)
        report = audit.audit_file(path)
        assert report.exit_code != audit.EXIT_UNREADABLE
        assert any(g.path.startswith("numpy") for g in report.globals)
        assert double_output.__name__ in " ".join(e.source or "" for e in report.entries)

    def test_object_npy_runs_a_global(self, tmp_path):
        """A crafted object array names os.getcwd; numpy.load(allow_pickle=True) resolves it."""
        path = tmp_path / "evil.npy"
        header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
        header += b" " * (63 - len(header) % 64) + b"\n"
        path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\x80\x02" + GETCWD + b")R.")
        assert resolved(path, "__import__('numpy').load(path, allow_pickle=True)") == ["os.getcwd"]
        assert_flagged(path, None, "os.getcwd")

    def test_npz_members(self, tmp_path):
        """Each .npz member is read: an object array's pickle is audited, plain arrays are fine."""
        plain, mixed = tmp_path / "plain.npz", tmp_path / "mixed.npz"
        self.np.savez(plain, a=self.np.arange(4), b=self.np.zeros((2, 3), dtype="<f4"))
        report = audit.audit_file(plain)
        assert report.exit_code == 0 and report.globals == []
        self.np.savez(mixed, a=self.np.arange(4), o=self.np.array([{"k": 1}], dtype=object))
        report = audit.audit_file(mixed)
        assert report.exit_code == audit.EXIT_UNSAFE  # numpy's own reconstruct globals aren't allowlisted
        assert {r for g in report.globals for r in g.resources} == {"o.npy"}
        assert any(g.path.startswith("numpy") for g in report.globals)

    def test_plain_npy_is_data(self, tmp_path):
        path = tmp_path / "p.npy"
        self.np.save(path, self.np.arange(10, dtype="<i8"))
        report = audit.audit_file(path)
        assert report.exit_code == 0 and report.globals == []


# --------------------------------------------------------------------------
# 3. C number parsing.


class TestNumbers:
    @pytest.mark.parametrize("literal", [b"I5\x00\n", b"I" + b"0" * 70 + b"5\n", b"L5\x00L\n", b"F1.5\x00\n", b"I\x00x\n",
                                         b"F1.5\n"])
    def test_literal_then_global(self, tmp_path, literal):
        """The C parser ends a literal's line at a NUL and accepts any leading zeros: the global after it is read."""
        data = literal + b"0" + GETCWD + b"."
        path = tmp_path / "n.pkl"
        path.write_bytes(data)
        assert resolved(path, "pickle.loads(open(path, 'rb').read())") == ["os.getcwd"]
        report = assert_flagged(path, None, "os.getcwd")
        assert report.problems == []

    @pytest.mark.parametrize("memo", [b"p1\x00\ng1\x00\n", b"p007\ng7\n"])
    def test_memo_index_then_global(self, tmp_path, memo):
        data = b"N" + memo + b"00" + GETCWD + b"."
        path = tmp_path / "m.pkl"
        path.write_bytes(data)
        assert resolved(path, "pickle.loads(open(path, 'rb').read())") == ["os.getcwd"]
        assert audit.audit_file(path).problems == []
        assert_flagged(path, None, "os.getcwd")

    @pytest.mark.parametrize("literal", [b"F 1.5\n", b"F1_0\n", b"F1e999\n", b"I0x\n"])
    def test_literals_c_refuses(self, tmp_path, literal):
        """What the C parser refuses stops the audit there too ("could not read")."""
        path = tmp_path / "r.pkl"
        path.write_bytes(b"(N." + b"(" + literal + GETCWD + b"t.")
        assert resolved(path, "[pickle.load(f) for f in [open(path, 'rb')] for _ in range(2)]") == []
        assert audit.audit_file(path).problems

    def test_python_unpickler_global_without_newline(self, tmp_path):
        """pickle._Unpickler takes a last GLOBAL name line without newline: inspect names that global."""
        path = tmp_path / "eof.pkl"
        path.write_bytes(b"cos\ngetcwdX")
        assert resolved(path, "pickle._loads(open(path, 'rb').read())") == ["os.getcwd"]
        with pytest.raises(audit.AuditError, match="os.getcwd"):
            audit.audit_file(path)


# --------------------------------------------------------------------------
# 4. safe_globals on legacy and broken files.


class TestSafeGlobals:
    def test_legacy_checkpoint(self, tmp_path):
        """A legacy torch.save file works as torch.load(weights_only=True) reads it."""
        path = tmp_path / "legacy.pt"
        hook = picklehooks.portable(double_output)
        torch.save({"sd": torch.nn.Linear(2, 2).state_dict(), "hook": hook}, path, _use_new_zipfile_serialization=False)
        allowed = picklehooks.safe_globals(path, everything=True)
        with torch.serialization.safe_globals(allowed):
            loaded = torch.load(path, weights_only=True)
        assert loaded["hook"].__name__ == hook.__name__

    @pytest.mark.parametrize("damage", ["crc", "directory", "garbage"])
    def test_unreadable_file(self, tmp_path, damage):
        """A file that can't be read raises PicklehooksError naming it and why, never a bare error."""
        path = tmp_path / "bad.pt"
        torch.save({"w": torch.zeros(3)}, path)
        data = bytearray(path.read_bytes())
        if damage == "crc":
            at = data.find(b"\x80\x02", data.find(b"data.pkl"))  # the pickle's first bytes
            data[at + 3] ^= 0xFF
        elif damage == "directory":
            at = data.rfind(b"PK\x01\x02")
            data[at + 20 : at + 24] = b"\xff\xff\xff\x7f"
        else:
            data = bytearray(b"\x00garbage")
        path.write_bytes(bytes(data))
        with pytest.raises(PicklehooksError, match="bad.pt"):
            picklehooks.safe_globals(path, everything=True)
