"""``python -m picklehooks inspect`` and :mod:`picklehooks.audit`: list hooks without loading the file.

A whole pickled model names its own classes (``torch.nn.modules.linear.Linear``
...), which ``torch.load(weights_only=True)`` refuses, so ``inspect`` marks
them UNSAFE and exits with bit 4 (``UNSAFE``) set; a state dict exits 0.

Expected hooks are always derived from the model that was saved (its hook
dicts and the hooks' own names) and from the hook functions' source, never
from hard-coded names or texts.
"""

from __future__ import annotations

import hashlib

import inspect
import os
import pickle
import random
import subprocess
import sys
import uuid
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import picklehooks
from picklehooks import audit, codec
from picklehooks._shim import HUB_NAME, hub
from tests.testutils import REPO, run_fresh

LIMIT = 5.0


# Hooks: module-level defs, so that portable() can read their source.
def scale_output(module, inputs, output):
    return output * 2.0


def shift_input(module, inputs):
    return (inputs[0] + 1.0,)


def clip_output(module, inputs, output):
    return output.clamp(-LIMIT, LIMIT)


def note_loaded(module, incompatible_keys):
    return None


def ordinary_hook(module, inputs, output):
    return output


class _MakesDir:
    """Pickles as a call to ``os.mkdir(path)``: loading it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class _WritesFile:
    """Pickles as ``exec(code)`` whose code creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


# --------------------------------------------------------------------------
# Helpers.


def hooked_model() -> nn.Sequential:
    """A nested model with portable forward and forward-pre hooks below the root."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    model[0].register_forward_hook(picklehooks.portable(scale_output))
    model[1].register_forward_hook(picklehooks.portable(clip_output))
    model[1][1].register_forward_pre_hook(picklehooks.portable(shift_input))
    return model


# The original function behind each portable hook, keyed by the hook's name.
ORIGINALS = {picklehooks.portable(fn).__name__: fn for fn in (scale_output, shift_input, clip_output, note_loaded)}


def model_hooks(model: nn.Module, prefix: str = "") -> set[tuple[str, str, str]]:
    """(module path, kind, hook name) of every forward / forward-pre hook the model really has."""
    found = set()
    for path, module in model.named_modules():
        path = f"{prefix}.{path}" if prefix and path else prefix or path
        for kind, hooks in (("forward", module._forward_hooks), ("forward_pre", module._forward_pre_hooks)):
            found |= {(path, kind, hook.__name__) for hook in hooks.values()}
    return found


def found(entries: list[audit.HookEntry]) -> set[tuple[str, str, str]]:
    return {(e.module, e.kind, e.name) for e in entries if not e.foreign}


def assert_sources(entries: list[audit.HookEntry]) -> None:
    """Each decoded source is what the name encodes and holds the original hook's def line.

    (Only the def line: portable() writes captured constants into the body as literals.)
    """
    for entry in entries:
        if entry.foreign:
            continue
        assert entry.error is None, entry.error
        assert entry.source == codec.decode(entry.name)
        assert inspect.getsource(ORIGINALS[entry.name]).splitlines()[0] in entry.source


def inspect_cli(path: Path | str) -> subprocess.CompletedProcess:
    """Run ``python -m picklehooks inspect path`` in a fresh interpreter."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "picklehooks", "inspect", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=240,
    )


def save(obj, path: Path, fmt: str) -> Path:
    """Write ``obj`` in one of the formats the auditor reads."""
    if fmt == "torch.save":
        torch.save(obj, path)
    elif fmt == "torch.save-legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:  # "pickle-N"
        path.write_bytes(pickle.dumps(obj, protocol=int(fmt.rpartition("-")[2])))
    return path


FORMATS = ["torch.save", "torch.save-legacy"] + [f"pickle-{p}" for p in range(pickle.HIGHEST_PROTOCOL + 1)]


def pickle_with_hub_hook(name: str) -> bytes:
    """A pickled hooked model whose hook on ``1.1`` is ``picklehooks._hub.<name>``.

    The name is spliced into the pickle's bytes in place of an ordinary
    function's reference, so it is never resolved (and never needs to be).
    """
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    model[1][1].register_forward_hook(ordinary_hook)
    # Protocol 0 writes a function as GLOBAL "module\nname\n", with no length
    # prefix, so a name of any length can take the place of another.
    data = pickle.dumps(model, protocol=0)
    old = f"c{ordinary_hook.__module__}\n{ordinary_hook.__qualname__}\n".encode()
    assert data.count(old) == 1
    return data.replace(old, f"c{HUB_NAME}\n{name}\n".encode())


# --------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def model() -> nn.Sequential:
    return hooked_model()


class TestFormats:
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_finds_every_hook(self, model, tmp_path, fmt):
        """Every format lists each hook with its module path, kind, name and decoded source."""
        entries = audit.find_hooks(save(model, tmp_path / "model.bin", fmt))
        assert found(entries) == model_hooks(model)
        assert {e.module for e in entries} == {"0", "1", "1.1"}
        assert_sources(entries)

    def test_zip_entries_name_their_resource(self, model, tmp_path):
        """Hooks from a torch.save zip name the archive member they were found in."""
        entries = audit.find_hooks(save(model, tmp_path / "ckpt.pt", "torch.save"))
        assert {e.resource for e in entries} == {"ckpt/data.pkl"}

    def test_checkpoint_dict(self, model, tmp_path):
        """A model inside a checkpoint dict gets the dict key as its path prefix."""
        path = save({"model": model, "step": 3}, tmp_path / "ckpt.pt", "torch.save")
        assert found(audit.find_hooks(path)) == model_hooks(model, prefix="['model']")

    def test_concatenated_pickles(self, model, tmp_path):
        """Pickles written one after another in one file are all audited."""
        other = nn.Sequential(nn.Linear(2, 2))
        other[0].register_forward_hook(picklehooks.portable(clip_output))
        path = tmp_path / "log.pkl"
        with open(path, "wb") as f:
            pickle.dump({"epoch": 1}, f)
            pickle.dump(other, f)
            pickle.dump(model, f)
        assert found(audit.find_hooks(path)) == model_hooks(other) | model_hooks(model)

    def test_torch_package(self, model, tmp_path):
        """A torch.package archive's pickle resources are audited, wherever they are."""
        from torch.package import PackageExporter

        path = tmp_path / "pkg.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's TypedStorage deprecation notice
            with PackageExporter(str(path)) as exporter:
                exporter.save_pickle("models/nested", "model.pkl", model)
        entries = audit.find_hooks(path)
        assert found(entries) == model_hooks(model)
        assert {e.resource for e in entries} == {"pkg/models/nested/model.pkl"}
        assert_sources(entries)

    def test_bare_function(self, tmp_path):
        """A pickled hook outside any module is listed as a function on module '?'."""
        hook = picklehooks.portable(scale_output)
        path = tmp_path / "fn.pkl"
        path.write_bytes(pickle.dumps({"fn": hook}))
        (entry,) = audit.find_hooks(path)
        assert (entry.module, entry.kind, entry.name) == ("?", "function", hook.__name__)
        assert_sources([entry])

    def test_same_hook_on_two_modules(self, tmp_path):
        """One function registered on two modules is listed once per module."""
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        hook = picklehooks.portable(scale_output)
        model[0].register_forward_hook(hook)
        model[1].register_forward_hook(hook)
        model[1].register_forward_hook(hook)  # twice on one module: one entry
        entries = audit.find_hooks(save(model, tmp_path / "m.pt", "torch.save"))
        assert [(e.module, e.kind) for e in entries] == [("0", "forward"), ("1", "forward")]


class TestHookKinds:
    def test_root_and_other_kinds(self, tmp_path):
        """Backward and state-dict hooks (wrapped by torch) are found, with kinds from their dict keys."""
        model = nn.Sequential(nn.Linear(2, 2))
        model.register_forward_hook(picklehooks.portable(scale_output))
        model[0].register_full_backward_hook(picklehooks.portable(clip_output))
        model[0].register_load_state_dict_post_hook(picklehooks.portable(note_loaded))
        entries = audit.find_hooks(save(model, tmp_path / "m.pt", "torch.save"))
        kinds = {(e.module, e.kind, ORIGINALS[e.name]) for e in entries}
        assert kinds == {
            ("", "forward", scale_output),
            ("0", "backward", clip_output),
            ("0", "load_state_dict_post", note_loaded),
        }
        assert_sources(entries)

    def test_foreign_hook(self, tmp_path):
        """An ordinary function as a hook is listed as foreign: its code is not in the file."""
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].register_forward_hook(ordinary_hook)
        model[0].register_forward_pre_hook(picklehooks.portable(shift_input))
        path = save(model, tmp_path / "m.pt", "torch.save")
        dotted = f"{ordinary_hook.__module__}.{ordinary_hook.__qualname__}"
        (foreign,) = [e for e in audit.find_hooks(path) if e.foreign]
        assert (foreign.module, foreign.kind, foreign.name) == ("0", "forward", dotted)
        assert foreign.source is None and foreign.error is None
        proc = inspect_cli(path)
        assert proc.returncode == audit.EXIT_UNSAFE, proc.stderr
        assert f"foreign hook {dotted} (not decodable; loading will import it)" in proc.stdout
        assert f"  UNSAFE  {dotted} [m/data.pkl]" in proc.stdout.splitlines()


class TestCli:
    def test_lists_hooks(self, model, tmp_path):
        """The command prints a header per hook, then its source indented; the model's classes are UNSAFE."""
        path = save(model, tmp_path / "model.pt", "torch.save")
        proc = inspect_cli(path)
        assert proc.returncode == audit.EXIT_UNSAFE, proc.stderr
        assert proc.stderr == ""
        out = proc.stdout
        for module, kind, name in model_hooks(model):
            assert f"{kind} hook on {module} [model/data.pkl]: {HUB_NAME}.{name[:24]}" in out
            for line in codec.decode(name).splitlines():
                assert f"\n    {line}".rstrip() in out

    def test_long_names_are_abbreviated(self, model, tmp_path):
        """Headers show a shortened hub name, its length and its fingerprint, not the whole name."""
        proc = inspect_cli(save(model, tmp_path / "model.pkl", "pickle-4"))
        for _, _, name in model_hooks(model):
            assert name not in proc.stdout
            assert f"({len(name)} chars, fingerprint {hashlib.sha256(name.encode()).hexdigest()[:16]})" in proc.stdout

    def test_no_hooks(self, tmp_path):
        """A state dict without hooks says so, lists only allowlisted globals, and exits 0."""
        path = save(nn.Linear(2, 2).state_dict(), tmp_path / "plain.pt", "torch.save")
        proc = inspect_cli(path)
        assert (proc.returncode, proc.stderr) == (0, "")
        assert proc.stdout.splitlines()[0] == f"no picklehooks hooks found in {path}"
        assert "UNSAFE  " not in proc.stdout

    def test_no_hooks_whole_module(self, tmp_path):
        """A whole module without hooks says so, and its class is UNSAFE (exit 4)."""
        path = save(nn.Linear(2, 2), tmp_path / "plain.pt", "torch.save")
        proc = inspect_cli(path)
        assert (proc.returncode, proc.stderr) == (audit.EXIT_UNSAFE, "")
        assert proc.stdout.splitlines()[0] == f"no picklehooks hooks found in {path}"
        assert "  UNSAFE  torch.nn.modules.linear.Linear (called) [plain/data.pkl]" in proc.stdout.splitlines()

    def test_main_return_code(self, model, tmp_path, capsys):
        """audit.main returns the same status (UNSAFE: the model's classes) and prints the listing in-process too."""
        path = save(model, tmp_path / "model.pkl", "pickle-2")
        assert audit.main(str(path)) == audit.EXIT_UNSAFE
        assert f"{len(model_hooks(model))} picklehooks hooks" in capsys.readouterr().out


class TestNothingExecutes:
    def test_reduce_payloads_do_not_run(self, model, tmp_path):
        """Calls the pickle asks for (os.mkdir, exec) never run, are reported UNSAFE; the hooks are still listed."""
        made_dir, written = tmp_path / "made-by-mkdir", tmp_path / "written-by-exec"
        payload = {"bomb": _MakesDir(made_dir), "model": model, "exec": _WritesFile(written)}
        path = tmp_path / "trap.pkl"
        path.write_bytes(pickle.dumps(payload))
        proc = inspect_cli(path)
        assert proc.returncode == audit.EXIT_UNSAFE, proc.stderr
        lines = proc.stdout.splitlines()
        assert f"  UNSAFE  {os.mkdir.__module__}.mkdir (called)" in lines and "  UNSAFE  builtins.exec (called)" in lines
        assert not made_dir.exists() and not written.exists()
        assert found(audit.find_hooks(path)) == model_hooks(model, prefix="['model']")
        assert not made_dir.exists() and not written.exists()
        # Control: a real load does run them, so the checks above test something.
        pickle.loads(path.read_bytes())
        assert made_dir.is_dir() and written.is_file()

    def test_hook_names_are_never_resolved(self, tmp_path):
        """Auditing decodes a hook name without defining it in the hub."""
        source = f'TAG = "{uuid.uuid4().hex}"\ndef tagged(module, inputs, output):\n    return output * 3\n'
        name = codec.encode(source)  # encoded only: this process has never resolved it
        path = tmp_path / "spliced.pkl"
        path.write_bytes(pickle_with_hub_hook(name))
        hub_module = hub()  # exists (this process has portable hooks), without our name
        (entry,) = audit.find_hooks(path)
        assert (entry.module, entry.kind, entry.name, entry.source) == ("1.1", "forward", name, source)
        assert name not in hub_module.__dict__

    def test_fresh_process_never_imports_the_hub(self, model, tmp_path):
        """In a fresh interpreter, auditing a hooked checkpoint doesn't even import the hub."""
        path = save(model, tmp_path / "model.pt", "torch.save")
        out = run_fresh(
            """
            import sys
            from picklehooks import audit
            entries = audit.find_hooks(sys.argv[1])
            print(len(entries), "picklehooks._hub" in sys.modules)
            """,
            str(path),
            cwd=REPO,
        )
        assert out.split() == [str(len(model_hooks(model))), "False"]


class TestCorruptNames:
    @staticmethod
    def corrupt(name: str, how: str) -> str:
        """A variant of ``name`` that decode() rejects, found deterministically."""
        if how == "truncated":
            bad = name[:-8]
        else:  # "mutated": one base32 character changed in place
            alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
            for i in range(len(name) // 2, len(name)):
                if name[i] in alphabet:
                    bad = name[:i] + alphabet[(alphabet.index(name[i]) + 1) % 32] + name[i + 1 :]
                    break
        with pytest.raises(picklehooks.DecodeError):
            codec.decode(bad)
        return bad

    @pytest.mark.parametrize("how", ["mutated", "truncated"])
    def test_bad_name_reports_error_and_exits_2(self, tmp_path, how):
        """A hook name that doesn't decode is reported with decode()'s message, exit status bit 2 set."""
        good = picklehooks.portable(scale_output).__name__
        bad = self.corrupt(good, how)
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].register_forward_hook(picklehooks.portable(scale_output))
        if how == "mutated":  # same length: splice into a binary pickle
            data = pickle.dumps(model, protocol=4)
            assert data.count(good.encode()) == 1
            data = data.replace(good.encode(), bad.encode())
        else:  # shorter: only a newline-terminated GLOBAL can take it
            data = pickle.dumps(model, protocol=0)
            old = f"c{HUB_NAME}\n{good}\n".encode()
            assert data.count(old) == 1
            data = data.replace(old, f"c{HUB_NAME}\n{bad}\n".encode())
        path = tmp_path / "bad.pkl"
        path.write_bytes(data)
        with pytest.raises(picklehooks.DecodeError) as expected:
            codec.decode(bad)
        (entry,) = audit.find_hooks(path)
        assert (entry.module, entry.kind, entry.name) == ("0", "forward", bad)
        assert entry.source is None and entry.error == str(expected.value)
        proc = inspect_cli(path)
        assert proc.returncode == audit.EXIT_UNDECODABLE | audit.EXIT_UNSAFE  # and the model's classes
        assert f"error: {expected.value}" in proc.stdout
        assert "Traceback" not in proc.stderr


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a pickle\n")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(random.Random(0).randbytes(4096))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.pkl"
    truncated.write_bytes(pickle.dumps(hooked_model(), protocol=4)[:300])
    nopickles = tmp_path / "nopickles.zip"
    with zipfile.ZipFile(nopickles, "w") as archive:
        archive.writestr("archive/readme.txt", "no pickles here")
    directory = tmp_path / "a-directory"
    directory.mkdir()
    return {
        "text": text,
        "random bytes": noise,
        "empty": empty,
        "truncated": truncated,
        "zip without pickles": nopickles,
        "directory": directory,
        "missing": tmp_path / "does-not-exist.pt",
    }


BAD_KINDS = ["text", "random bytes", "empty", "truncated", "zip without pickles", "directory", "missing"]


class TestBadInputs:
    @pytest.mark.parametrize("kind", BAD_KINDS)
    def test_one_line_error_exit_1(self, tmp_path, kind):
        """The command prints one error line on stderr, nothing on stdout, and exits 1."""
        path = _bad_inputs(tmp_path)[kind]
        proc = inspect_cli(path)
        assert proc.returncode == 1
        assert proc.stdout == ""
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"picklehooks inspect: error: {path}: ")

    @pytest.mark.parametrize("kind", BAD_KINDS)
    def test_find_hooks_raises_audit_error(self, tmp_path, kind):
        """find_hooks raises AuditError (not some internal exception) for the same inputs."""
        with pytest.raises(audit.AuditError):
            audit.find_hooks(_bad_inputs(tmp_path)[kind])
