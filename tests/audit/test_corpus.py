"""A hostile corpus for :mod:`picklehooks.audit`: files that run code when loaded, built here.

Each case's payload would create a marker file; the audit must report the
payload (UNSAFE, non-zero exit) and the marker must never appear. Where the
format allows it, a control load with torch or pickle shows the payload
really runs, so the "no marker" checks test something. Ground truth for
what a load would run comes from torch (``torch.load``,
``torch.serialization.get_unsafe_globals_in_checkpoint``), not from the
auditor.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn

import picklehooks
from picklehooks import audit, codec
from picklehooks._shim import HUB_NAME
from tests.audit.test_cli import inspect_cli


def double_output(module, inputs, output):
    return output * 2.0


class _System:
    """Pickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class _Exec:
    """Pickles as ``exec(<code creating marker>)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class _Open:
    """Pickles as ``open(marker, "w")``: loading creates the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


SYSTEM = f"{os.system.__module__}.system"  # "posix.system": what pickle writes for os.system


# --------------------------------------------------------------------------
# Raw opcodes.


def s(text: str) -> bytes:
    """A str argument: SHORT_BINUNICODE or BINUNICODE."""
    data = text.encode()
    return (b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))) + data


def glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def hook_name() -> str:
    return picklehooks.portable(double_output).__name__


# --------------------------------------------------------------------------
# The corpus.


@dataclass
class Case:
    path: Path
    marker: Path
    unsafe: set[str] = field(default_factory=set)  # paths that must be reported UNSAFE
    hooks: set[str] = field(default_factory=set)  # hub names that must be listed with their text
    control: Callable[[], object] | None = None  # a real load, which runs the payload


def _legacy_header() -> bytes:
    """The first three pickles of a real legacy torch.save file (magic, protocol, sys_info)."""
    buf = io.BytesIO()
    torch.save({}, buf, _use_new_zipfile_serialization=False)
    buf.seek(0)
    return b"".join(pickle.dumps(pickle.load(buf), protocol=2) for _ in range(3))


def _payload(marker: Path) -> dict:
    return {"bomb": _System(marker), "hook": picklehooks.portable(double_output)}


def _tar_header_ok(data: bytes) -> bool:
    """Whether tarfile (as torch.load's legacy_load opens a file) reads a tar header at the start of data."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            return True
    except tarfile.TarError:
        return False


def build(name: str, tmp: Path) -> Case:
    """Write corpus case ``name`` under ``tmp``."""
    marker = tmp / "marker"
    path = tmp / f"{name}.bin"
    cmd = f"touch '{marker}'"
    if name == "reduce-system":
        path.write_bytes(pickle.dumps({"x": _System(marker)}, protocol=2))
        return Case(path, marker, {SYSTEM}, control=lambda: pickle.loads(path.read_bytes()))
    if name == "reduce-exec":
        path.write_bytes(pickle.dumps([_Exec(marker)], protocol=4))
        return Case(path, marker, {"builtins.exec"}, control=lambda: pickle.loads(path.read_bytes()))
    if name == "reduce-open":
        path.write_bytes(pickle.dumps(_Open(marker), protocol=0))
        return Case(path, marker, {f"{open.__module__}.open"}, control=lambda: pickle.loads(path.read_bytes()).close())
    if name == "memo-stack-global":
        # The module and name strings are memoized, popped, and fetched back for STACK_GLOBAL.
        data = b"\x80\x04" + s("os") + b"\x94" + s("system") + b"\x94" + b"00" + b"h\x00h\x01\x93" + s(cmd) + b"\x85R."
        path.write_bytes(data)
        return Case(path, marker, {"os.system"}, control=lambda: pickle.loads(path.read_bytes()))
    if name == "getattr-chain":
        # getattr(importlib.import_module("os"), "system")(cmd)
        data = (
            b"\x80\x04" + glob("builtins", "getattr") + glob("importlib", "import_module") + s("os") + b"\x85R"
            + s("system") + b"\x86R" + s(cmd) + b"\x85R."
        )
        path.write_bytes(data)
        unsafe = {"builtins.getattr", "importlib.import_module", "os.system"}
        return Case(path, marker, unsafe, control=lambda: pickle.loads(path.read_bytes()))
    if name == "getattr-hub":
        # getattr(picklehooks._shim.hub(), name): a hub hook reached without naming picklehooks._hub.
        data = b"\x80\x02" + glob("builtins", "getattr") + glob("picklehooks._shim", "hub") + b")R" + s(hook_name()) + b"\x86R."
        path.write_bytes(data)
        return Case(path, marker, {"builtins.getattr"}, {hook_name()})
    if name == "dotted-hub":
        # Protocol 4 resolves "_hub.<name>" on module "picklehooks" attribute by attribute.
        path.write_bytes(b"\x80\x04" + s("picklehooks") + s(f"_hub.{hook_name()}") + b"\x93.")
        return Case(path, marker, set(), {hook_name()})
    if name == "legacy-int-literal":
        # pickletools' int() rejects "0x10"; _pickle.c's strtol(s, 0) reads 16 and goes on.
        body = pickle.dumps(_payload(marker), protocol=0)
        crafted = b"(I0x10\nI017\n" + body[:-1] + b"t."
        path.write_bytes(_legacy_header() + crafted + pickle.dumps([], protocol=2))
        return Case(path, marker, {SYSTEM}, {hook_name()}, control=lambda: torch.load(path, weights_only=False))
    if name == "legacy-tar":
        members = {
            "storages": pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2),
            "tensors": pickle.dumps(0, protocol=2),
            "pickle": pickle.dumps(_payload(marker), protocol=2),
        }
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return Case(path, marker, {SYSTEM}, {hook_name()}, control=lambda: torch.load(path, weights_only=False))
    if name == "zip-reduce":
        torch.save({"w": torch.zeros(2), **_payload(marker)}, path)
        return Case(path, marker, {SYSTEM}, {hook_name()}, control=lambda: torch.load(path, weights_only=False))
    if name == "zip-exec-in-model":
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].register_forward_hook(picklehooks.portable(double_output))
        model.trap = _Exec(marker)  # an attribute of the module: pickled in its state
        torch.save(model, path)
        return Case(path, marker, {"builtins.exec"}, {hook_name()}, control=lambda: torch.load(path, weights_only=False))
    if name == "tar-header-pickle":
        # A pickle whose first 512 bytes are also a valid tar header (its checksum field reads 0,
        # and the signed sum of the block comes to 0 for one frame length): tarfile, and so
        # torch.load, take it for a tar; pickle.load runs it. Found by padding, not by chance.
        for pad in range(1024):
            data = pickle.dumps({10**5000: _System(marker), "pad": "x" * pad, "hook": picklehooks.portable(double_output)},
                                protocol=4)
            if _tar_header_ok(data):
                break
        else:
            raise AssertionError("no padding makes the pickle's first block a tar header")
        path.write_bytes(data)
        return Case(path, marker, {SYSTEM}, {hook_name()}, control=lambda: pickle.loads(path.read_bytes()))
    if name == "tar-polyglot":
        # A real legacy tar, harmless to torch.load, whose first member's name is a pickle that
        # pickle.load runs (the marker relative to the loading process's directory: a name has
        # 100 bytes).
        polyglot = f"cos\nsystem\n(S'touch {marker.name}'\ntR.".encode()
        members = {
            polyglot.decode(): b"",
            "storages": pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2),
            "tensors": pickle.dumps(0, protocol=2),
            "pickle": pickle.dumps({"hook": picklehooks.portable(double_output)}, protocol=2),
        }
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        assert path.read_bytes().startswith(polyglot)

        def control():
            torch.load(path, weights_only=False)  # reads the members: runs nothing
            assert not marker.exists()
            subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", str(path)],
                           cwd=tmp, check=True)

        return Case(path, marker, {"os.system"}, {hook_name()}, control=control)
    if name == "big-int-key":
        # str() of this key raises (int_max_str_digits); the audit must not.
        path.write_bytes(pickle.dumps({10**5000: _System(marker), "hook": picklehooks.portable(double_output)}, protocol=4))
        return Case(path, marker, {SYSTEM}, {hook_name()}, control=lambda: pickle.loads(path.read_bytes()))
    raise KeyError(name)


CASES = [
    "reduce-system",
    "reduce-exec",
    "reduce-open",
    "memo-stack-global",
    "getattr-chain",
    "getattr-hub",
    "dotted-hub",
    "legacy-int-literal",
    "legacy-tar",
    "zip-reduce",
    "zip-exec-in-model",
    "big-int-key",
    "tar-header-pickle",
    "tar-polyglot",
]


class TestCorpus:
    @pytest.mark.parametrize("name", CASES)
    def test_reported_and_never_run(self, tmp_path, name):
        """Every payload global is UNSAFE, every hook is listed with its text, and no marker appears."""
        case = build(name, tmp_path)
        report = audit.audit_file(case.path)
        assert not case.marker.exists()
        unsafe = {g.path for g in report.unsafe}
        assert case.unsafe <= unsafe, unsafe
        hooks = {e.name: e for e in report.entries if not e.foreign}
        assert case.hooks <= set(hooks)
        for hook in case.hooks:
            assert hooks[hook].source == codec.decode(hook)
        assert report.problems == []
        assert report.exit_code == (audit.EXIT_UNSAFE if case.unsafe else 0)
        if case.control is not None:  # a real load runs the payload: the checks above mean something
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                case.control()
            assert case.marker.exists()

    @pytest.mark.parametrize("name", ["reduce-system", "legacy-int-literal", "legacy-tar", "big-int-key",
                                      "tar-header-pickle", "tar-polyglot"])
    def test_cli_exits_unsafe(self, tmp_path, name):
        """The command names each payload global as UNSAFE, exits 4, and runs nothing."""
        case = build(name, tmp_path)
        proc = inspect_cli(case.path)
        assert not case.marker.exists()
        assert proc.returncode == audit.EXIT_UNSAFE, proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stdout.splitlines()
        for path in case.unsafe:
            assert any(line.startswith(f"  UNSAFE  {path} (called)") for line in lines), proc.stdout
        for hook in case.hooks:
            for line in codec.decode(hook).splitlines():
                assert f"    {line}".rstrip() in lines

    def test_hooks_show_their_imports(self, tmp_path):
        """Each hook's header is followed by the modules its text imports."""
        source = "import math\nfrom torch import nn\ndef scaled(module, inputs, output):\n    return output * math.pi\n"
        name = codec.encode(source)
        path = tmp_path / "h.pkl"
        path.write_bytes(b"\x80\x04" + s(HUB_NAME) + s(name) + b"\x93.")
        report = audit.audit_file(path)
        assert report.imports[name] == ["math", "torch"]
        proc = inspect_cli(path)
        assert "    imports: math, torch" in proc.stdout.splitlines()


class TestTorchGroundTruth:
    @pytest.mark.parametrize("name", ["zip-reduce", "zip-exec-in-model"])
    def test_superset_of_torch_unsafe_globals(self, tmp_path, name):
        """Every global torch's own checker calls unsafe (other than hooks) is UNSAFE here too."""
        case = build(name, tmp_path)
        theirs = set(torch.serialization.get_unsafe_globals_in_checkpoint(case.path))
        report = audit.audit_file(case.path)
        hooks = {f"{HUB_NAME}.{e.name}" for e in report.entries if not e.foreign}
        assert theirs - hooks <= {g.path for g in report.unsafe}
        assert theirs & hooks == hooks  # torch sees the hooks as globals too

    def test_allowlisted_state_dict_is_clean(self, tmp_path):
        """A plain state dict names only globals torch allowlists, and exits 0."""
        path = tmp_path / "sd.pt"
        torch.save(nn.Linear(3, 2).state_dict(), path)
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
        report = audit.audit_file(path)
        assert report.unsafe == [] and report.exit_code == 0
        torch.load(path, weights_only=True)  # and torch agrees by loading it


def _package(path: Path) -> None:
    from torch.package import PackageExporter

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].register_forward_hook(picklehooks.portable(double_output))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PackageExporter(str(path)) as exporter:
            exporter.save_pickle("m", "model.pkl", model)


def _rewrite(src: Path, dst: Path, member_suffix: str, edit: Callable[[bytes], bytes]) -> None:
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for info in old.infolist():
            data = old.read(info)
            new.writestr(info, edit(data) if info.filename.endswith(member_suffix) else data)


class TestPackagedShim:
    def test_own_shim_is_ok(self, tmp_path):
        """An archive written by this version carries this version's shim, reported as identical."""
        path = tmp_path / "pkg.pt"
        _package(path)
        report = audit.audit_file(path)
        shim = [b for b in report.bundled if b.module == "picklehooks._shim"]
        assert [b.status for b in shim] == ["same"]
        assert hook_name() in {e.name for e in report.entries}

    def test_tampered_shim_is_unsafe(self, tmp_path):
        """A shim that differs from the one this version writes is UNSAFE, and the command says so."""
        good, path = tmp_path / "good.pt", tmp_path / "tampered.pt"
        _package(good)
        marker = tmp_path / "marker"
        payload = f"\nopen({str(marker)!r}, 'w').close()\n".encode()
        _rewrite(good, path, "picklehooks/_shim.py", lambda data: data + payload)
        report = audit.audit_file(path)
        assert [b.status for b in report.bundled if b.module == "picklehooks._shim"] == ["differs"]
        assert report.exit_code & audit.EXIT_UNSAFE
        proc = inspect_cli(path)
        assert "  UNSAFE  picklehooks._shim differs from the one this picklehooks version writes" in proc.stdout
        assert proc.returncode & audit.EXIT_UNSAFE
        assert not marker.exists()


class TestLiterals:
    @pytest.mark.parametrize(
        "literal",
        [b"I0x10\n", b"I017\n", b"I 42\n", b"I-0x7f\n", b"L1_000L\n", b"L0o17\n", b"I99999999999999999999999\n"],
    )
    def test_int_literals_like_the_unpickler(self, tmp_path, literal):
        """Literals the C unpickler accepts are read, and what follows them is still audited."""
        data = b"(" + literal + glob("os", "system") + b"(S'true'\ntRt."
        expected = pickle.loads(data.replace(glob("os", "system") + b"(S'true'\ntR", b"N"))  # same literal, no call
        path = tmp_path / "lit.pkl"
        path.write_bytes(data)
        report = audit.audit_file(path)
        assert {g.path for g in report.unsafe} == {"os.system"}
        assert report.problems == [] and expected is not None

    def test_literal_the_unpickler_refuses(self, tmp_path):
        """A literal no unpickler reads stops the audit with 'could not read', never 'no hooks', exit 8."""
        first = pickle.dumps({"a": 1}, protocol=2)
        path = tmp_path / "bad.pkl"
        path.write_bytes(first + b"(I12abc\n" + glob("os", "system") + b"t.")
        with pytest.raises(ValueError):
            pickle.loads(b"I12abc\n.")
        report = audit.audit_file(path)
        assert report.problems and report.problems[0].startswith("could not read the file from byte")
        assert report.exit_code & audit.EXIT_INCOMPLETE
        with pytest.raises(audit.AuditError):
            audit.find_hooks(path)
