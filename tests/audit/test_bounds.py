"""Small files that used to drive ``inspect`` to unbounded memory or time.

Each case runs ``python -m picklehooks inspect`` in a subprocess under
``RLIMIT_AS`` (1.5 GiB, which a torch import alone uses 0.6 of) and a
timeout, and asserts a bounded run: no traceback, a non-zero status, and
either a full report or the one-line "could not read ...; treat as unsafe".
Before the bounds, these measured 22 GB (nested module states with a 4 KB
key), 97 s (1 MB of nested tuples), 2.3 GB (a 1 MB zip of 1 GiB of zeros)
and 2.3 GB / 125 s (2,000 names each decoding to 1 MiB).
"""

from __future__ import annotations

import base64
import os
import resource
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from picklehooks import audit
from picklehooks._shim import FORMATS, HUB_NAME, MAX_SOURCE_BYTES
from tests.testutils import REPO

MEMORY = 3 << 29  # 1.5 GiB of address space
SECONDS = 60  # far above what a bounded run takes (a few seconds), far below the old minutes


def run_limited(path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``inspect path`` under the memory limit; returns the process and its wall time."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "picklehooks", "inspect", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=SECONDS,
        preexec_fn=limit,
    )
    return proc, time.monotonic() - start


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == audit.EXIT_UNREADABLE, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith("treat as unsafe"), lines
    for needle in needles:
        assert needle in lines[0]


def s(text: str) -> bytes:
    data = text.encode()
    return (b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))) + data


class TestBounds:
    def test_nested_module_states_with_long_key(self, tmp_path):
        """2,500 nested module states under one memoized 4 KB key: locations are cut, the report completes."""
        key = "k" * 4096
        head = b"\x80\x04" + s("_modules") + b"\x94" + s(key) + b"\x94" + b"c__main__\nM\n\x94" + b"000"
        # Per level: M() then BUILD {"_modules": {key: <child>}}; the child is the next level.
        opening = b"h\x02)\x81}(h\x00}(h\x01"
        closing = b"uub"
        depth = 2500
        path = tmp_path / "modules.pkl"
        path.write_bytes(head + opening * depth + b"N" + closing * depth + b".")
        assert path.stat().st_size < 45_000
        proc, seconds = run_limited(path)
        assert "Traceback" not in proc.stderr
        assert proc.returncode == audit.EXIT_UNSAFE  # __main__.M is not allowlisted
        assert "  UNSAFE  __main__.M (called)" in proc.stdout.splitlines()
        assert len(proc.stdout) < 100_000 and seconds < SECONDS

    def test_nested_tuples(self, tmp_path):
        """1 MB of nested tuples around os.system: read to the bottom, reported, in bounded time."""
        depth = 500_000
        path = tmp_path / "tuples.pkl"
        path.write_bytes(b"(" * depth + b"cos\nsystem\n" + b"t" * depth + b".")
        proc, seconds = run_limited(path)
        assert "Traceback" not in proc.stderr
        assert proc.returncode == audit.EXIT_UNSAFE
        assert "  UNSAFE  os.system" in proc.stdout.splitlines()
        assert seconds < SECONDS

    def test_zip_bomb(self, tmp_path):
        """A 1 MB zip whose data.pkl inflates to 1 GiB of zeros is refused by its declared size."""
        path = tmp_path / "bomb.pt"
        zeros = bytes(1 << 20)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
            with archive.open("bomb/data.pkl", "w", force_zip64=True) as member:
                for _ in range(1024):
                    member.write(zeros)
        assert path.stat().st_size < 8 << 20
        proc, seconds = run_limited(path)
        assert_one_line_error(proc, "could not read zip member 'bomb/data.pkl'", "exceeds")
        assert seconds < SECONDS

    def test_zip_member_larger_than_declared(self, tmp_path):
        """A member that declares a small size but inflates past the bound is refused while reading."""
        path = tmp_path / "liar.pt"
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("liar/data.pkl", bytes(40 << 20))
        data = bytearray(path.read_bytes())
        # Forge both size fields (local header and central directory) to 100 bytes.
        true = struct.pack("<I", 40 << 20)
        assert data.count(true) == 2
        path.write_bytes(bytes(data).replace(true, struct.pack("<I", 100)))
        proc, _ = run_limited(path)
        assert proc.returncode == audit.EXIT_UNREADABLE and "Traceback" not in proc.stderr
        assert len(proc.stderr.splitlines()) == 1

    def test_many_names_decoding_to_a_mebibyte(self, tmp_path):
        """2,000 hub names of 1 MiB each: decoding stops at the file's bound, with a 'could not read' line."""
        zstandard = pytest.importorskip("zstandard")
        dictionary = zstandard.ZstdCompressionDict(FORMATS["a"].encode(), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        # Level 1 (fast) with a window as large as the text: the single-segment frame picklehooks writes.
        params = zstandard.ZstdCompressionParameters.from_level(
            1, window_log=21, write_checksum=1, write_content_size=1, write_dict_id=0
        )
        compressor = zstandard.ZstdCompressor(dict_data=dictionary, compression_params=params)
        filler = "#" * (MAX_SOURCE_BYTES - 64)
        names = []
        for i in range(2000):
            frame = compressor.compress(f"{filler}\ndef h{i}(m, i, o):\n    return o\n".encode())[4:]  # no magic
            names.append("a" + base64.b32encode(frame).decode().replace("=", "_"))
        path = tmp_path / "names.pkl"
        path.write_bytes(b"\x80\x02]" + b"".join(f"c{HUB_NAME}\n{name}\na".encode() for name in names) + b".")
        proc, seconds = run_limited(path)
        assert "Traceback" not in proc.stderr
        assert proc.returncode == audit.EXIT_UNDECODABLE | audit.EXIT_INCOMPLETE
        assert "could not read every hook: their decoded text exceeds" in proc.stdout
        assert len(proc.stdout) < 40 << 20 and seconds < SECONDS

    def test_too_many_opcodes(self, tmp_path):
        """A pickle of more opcodes than the bound gets the one-line error naming the bound."""
        path = tmp_path / "nones.pkl"
        path.write_bytes(b"]" + b"Na" * 1_100_000 + b".")
        proc, _ = run_limited(path)
        assert_one_line_error(proc, "pickle opcodes")

    def test_huge_int_key(self, tmp_path):
        """A dict key of 5,000 digits is shown by its size; never a traceback."""
        number = 10**5000
        body = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
        path = tmp_path / "key.pkl"
        path.write_bytes(b"\x80\x02}\x8b" + struct.pack("<I", len(body)) + body + b"}cos\nsystem\n\x85s.")
        proc, _ = run_limited(path)
        assert "Traceback" not in proc.stderr
        assert proc.returncode == audit.EXIT_UNSAFE
