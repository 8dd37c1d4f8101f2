"""The sample shapes of three established scanners' corpora, built here with our own code.

picklescan (dangerous globals by name), fickling (FRAME straddles that hide opcodes from a
whole-buffer reader, memo and DUP expansions), modelscan (payloads injected into ``torch.save``
zips) and NumPy object arrays (which picklescan and modelscan read). Each payload only touches a
marker file: the control load (what a user would run) creates it, so ``inspect`` flagging the
file means something; ``inspect`` itself never does.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from picklehooks import audit
from tests.audit.test_corpus import SYSTEM, _Exec, _System, s

np = pytest.importorskip("numpy")


def system_call(marker: Path) -> bytes:
    """``os.system("touch marker")`` as protocol-4 opcodes, leaving its result on the stack."""
    return s("os") + s("system") + b"\x93" + s(f"touch '{marker}'") + b"\x85R"


def straddle(op: bytes, payload: bytes) -> bytes:
    """fickling's FRAME straddle: ``op``'s argument runs past its frame, and the payload follows.

    ``pickle.loads`` reads the argument in place, then a SHORT_BINBYTES that swallows the payload;
    a file reader reads the argument again from the frame's end, which ends with that
    SHORT_BINBYTES' opcode and length, and runs into the payload.
    """
    hidden = payload + b"0"
    swallow = b"C" + bytes([len(hidden)]) + hidden + b"N."
    if op == b"\x8c":  # SHORT_BINUNICODE: 5 text bytes, 2 in the frame
        inside, after = b"\x8c\x05ab", b"xyz"
    elif op == b"X":  # BINUNICODE
        inside, after = b"X\x05\x00\x00\x00ab", b"xyz"
    else:  # BININT: 2 of 4 bytes
        inside, after = b"Jab", b"xy"
    return b"\x80\x04\x95" + struct.pack("<Q", len(inside)) + inside + after + swallow


def inject(src: Path, dst: Path, payload: bytes) -> None:
    """modelscan's injection: the payload runs first, then data.pkl's own opcodes (after its PROTO)."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for info in old.infolist():
            data = old.read(info)
            if info.filename.endswith("data.pkl"):
                data = data[:2] + payload + b"0" + data[2:]
            new.writestr(info, data)


def build(name: str, tmp: Path) -> tuple[Path, Path, callable]:
    """Write case ``name``: (its path, its marker, the control load that runs the payload)."""
    marker = tmp / "marker"
    path = tmp / (name + {"numpy-object-npy": ".npy", "numpy-object-npz": ".npz"}.get(name, ""))
    plain = lambda: pickle.loads(path.read_bytes())  # noqa: E731
    from_file = lambda: pickle.load(io.BytesIO(path.read_bytes()))  # noqa: E731
    torch_load = lambda: torch.load(path, weights_only=False)  # noqa: E731
    if name == "picklescan-exec":
        path.write_bytes(pickle.dumps(_Exec(marker), protocol=0))
        return path, marker, plain
    if name == "picklescan-eval":
        path.write_bytes(b"cbuiltins\neval\n(V__import__('os').system(\"touch '" + str(marker).encode() + b"'\")\ntR.")
        return path, marker, plain
    if name == "picklescan-system":
        path.write_bytes(pickle.dumps([_System(marker)], protocol=1))
        return path, marker, plain
    if name.startswith("fickling-straddle-"):
        op = {"unicode": b"\x8c", "binunicode": b"X", "binint": b"J"}[name.rsplit("-", 1)[1]]
        path.write_bytes(straddle(op, system_call(marker)))
        return path, marker, from_file
    if name == "fickling-memo-dup":
        # The global built once, memoized, duplicated and fetched back; the command likewise.
        data = (b"\x80\x04" + s("os") + b"\x94" + s("system") + b"\x94" + b"00" + b"h\x00h\x01\x93\x94" + b"20"
                + s(f"touch '{marker}'") + b"\x94" + b"\x85R0" + b"h\x02h\x03\x85R.")
        path.write_bytes(data)
        return path, marker, plain
    if name == "modelscan-zip-injection":
        good = tmp / "good.pt"
        torch.save({"w": torch.zeros(2)}, good)
        inject(good, path, system_call(marker))
        return path, marker, torch_load
    if name == "modelscan-zip-straddle":
        good = tmp / "good.pt"
        torch.save({"w": torch.zeros(2)}, good)
        with zipfile.ZipFile(good) as old, zipfile.ZipFile(path, "w") as new:
            for info in old.infolist():
                data = old.read(info)
                new.writestr(info, straddle(b"\x8c", system_call(marker)) if info.filename.endswith("data.pkl") else data)
        return path, marker, torch_load
    if name == "numpy-object-npy":
        np.save(path, np.array([_System(marker), 1], dtype=object), allow_pickle=True)
        return path, marker, lambda: np.load(path, allow_pickle=True)
    if name == "numpy-object-npz":
        np.savez(path, plain=np.arange(3), bomb=np.array([_System(marker)], dtype=object))
        return path, marker, lambda: np.load(path, allow_pickle=True)["bomb"]
    raise KeyError(name)


CASES = ["picklescan-exec", "picklescan-eval", "picklescan-system", "fickling-straddle-unicode",
         "fickling-straddle-binunicode", "fickling-straddle-binint", "fickling-memo-dup", "modelscan-zip-injection",
         "modelscan-zip-straddle", "numpy-object-npy", "numpy-object-npz"]
UNSAFE = {"picklescan-exec": "builtins.exec", "picklescan-eval": "builtins.eval"}


@pytest.mark.parametrize("name", CASES)
def test_flagged_and_the_control_runs_it(tmp_path, name):
    """inspect marks the payload UNSAFE without running it; a plain load of the same file runs it."""
    path, marker, control = build(name, tmp_path)
    report = audit.audit_file(path)
    assert not marker.exists()
    assert report.exit_code & audit.EXIT_UNSAFE
    expected = UNSAFE.get(name, "os.system" if "straddle" in name or "dup" in name or "injection" in name else SYSTEM)
    assert expected in {g.path for g in report.unsafe}, [g.path for g in report.globals]
    if "straddle" in name:
        assert report.irregular and report.irregular[0].startswith("FRAME at byte 2 ")
    if name.startswith("numpy-object-npz"):
        assert {r for g in report.globals for r in g.resources} == {"bomb.npy"}
    cwd = os.getcwd()
    try:
        control()
    finally:
        os.chdir(cwd)
    assert marker.exists()
