"""torch.load(weights_only=True) of hooked checkpoints: refused without the allowlist, loaded with it."""

from __future__ import annotations

import pytest
import torch

import picklehooks
from tests import hooks
from tests.testutils import run_fresh

X = torch.ones(1, 4)


@pytest.fixture()
def checkpoint(tmp_path):
    model = hooks.mlp()
    model[0].register_forward_hook(picklehooks.portable(hooks.double_output))
    model[3].register_forward_hook(picklehooks.portable(hooks.make_clamp(0.1)))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return model, path


def test_refused_without_allowlist(checkpoint):
    """Plain weights_only=True refuses the file, and with only the classes allowed it names the hook."""
    model, path = checkpoint
    out = run_fresh(
        """
        import sys, torch
        try:
            torch.load(sys.argv[1], weights_only=True)
        except Exception as exc:
            print("refused", type(exc).__name__)
        classes = [torch.nn.Sequential, torch.nn.Linear, torch.nn.ReLU, torch.nn.Tanh]
        with torch.serialization.safe_globals(classes):
            try:
                torch.load(sys.argv[1], weights_only=True)
            except Exception as exc:
                print("refused", "picklehooks._hub.a" in str(exc))
        """,
        str(path),
    )
    assert out.split() == ["refused", "UnpicklingError", "refused", "True"]


def test_loads_with_safe_globals(checkpoint):
    """safe_globals(path, everything=True) lets weights_only=True load the model, hooks firing."""
    model, path = checkpoint
    out = run_fresh(
        """
        import sys, torch, picklehooks
        allowed = picklehooks.safe_globals(sys.argv[1], everything=True)
        with torch.serialization.safe_globals(allowed):
            loaded = torch.load(sys.argv[1], weights_only=True)
        print(loaded(torch.ones(1, 4)).tolist())
        """,
        str(path),
    )
    assert out.strip() == str(model(X).tolist())
    assert model(X).tolist() != hooks.mlp()(X).tolist()  # the hooks matter to the output


def test_hooks_only_list(checkpoint):
    """Without everything=True the list holds exactly the distinct hooks, for a file or a model."""
    model, path = checkpoint
    want = {id(f) for m in model.modules() for f in m._forward_hooks.values()}
    assert {id(f) for f in picklehooks.safe_globals(path)} == want
    assert {id(f) for f in picklehooks.safe_globals(model)} == want


def test_bad_inputs(tmp_path):
    """A file that is not a checkpoint, or everything=True on a model, raise PicklehooksError."""
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(picklehooks.PicklehooksError):
        picklehooks.safe_globals(bad)
    with pytest.raises(picklehooks.PicklehooksError, match="needs a file"):
        picklehooks.safe_globals(hooks.mlp(), everything=True)


# -- files nobody vouched for -----------------------------------------------------------------

def _hostile_checkpoint(path, text: str) -> str:
    """torch.save a model whose forward hook is the hub name of ``text`` (which need not decode here)."""
    name = picklehooks.serialize.codec.encode(text)
    hub = picklehooks._shim.hub()

    def fake():
        pass

    fake.__module__, fake.__qualname__, fake.__name__ = picklehooks._shim.HUB_NAME, name, name
    hub.__dict__[name] = fake  # so that pickle finds the object under that name; never decoded here
    try:
        model = hooks.mlp()
        model[0].register_forward_hook(fake)
        torch.save(model, path)
    finally:
        del hub.__dict__[name]
    return name


class _Exec:
    def __reduce__(self):
        return (exec, ("print('ran')",))


class _System:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


@pytest.fixture()
def planted(tmp_path):
    """A module whose import writes a marker, on a path the child process gets via cwd."""
    marker = tmp_path / "MARKER"
    (tmp_path / "sidefx_ckpt.py").write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 1\n")
    return tmp_path, marker


def _refusal_in_child(path, cwd, preload: str = "os") -> str:
    """The PicklehooksError message of safe_globals(path) in a fresh process that imported ``preload``."""
    out = run_fresh(
        f"""
        import sys, {preload}, picklehooks
        try:
            picklehooks.safe_globals(sys.argv[1])
        except picklehooks.PicklehooksError as exc:
            print("refused:", exc)
        else:
            print("allowed")
        """,
        str(path),
        cwd=cwd,
    )
    assert out.startswith("refused:"), out
    return out


class TestUntrustedFiles:
    def test_hook_importing_an_unknown_module_is_refused(self, planted):
        """safe_globals(path) never imports a module outside the trusted packages; the error says trust=."""
        where, marker = planted
        _hostile_checkpoint(where / "m.pt", "import sidefx_ckpt\ndef h(m, i, o):\n    return o\n")
        assert "trust=['sidefx_ckpt']" in _refusal_in_child(where / "m.pt", where)
        assert not marker.exists()

    def test_trust_allows_the_import(self, planted):
        """With trust=[...] the named package may be imported (that is what trusting it means)."""
        where, marker = planted
        _hostile_checkpoint(where / "m.pt", "import sidefx_ckpt\ndef h(m, i, o):\n    return o * sidefx_ckpt.VALUE\n")
        out = run_fresh(
            """
            import sys, picklehooks
            print(len(picklehooks.safe_globals(sys.argv[1], trust=["sidefx_ckpt"])))
            """,
            str(where / "m.pt"),
            cwd=where,
        )
        assert out.split() == ["1"] and marker.exists()

    def test_already_imported_module_needs_trust(self, planted):
        """Under safe_globals even a module the process already imported must be trusted by name."""
        where, marker = planted
        _hostile_checkpoint(where / "m.pt", "import json\ndef h(m, i, o):\n    return o\n")
        assert "'json'" in _refusal_in_child(where / "m.pt", where, preload="json")

    def test_rebinding_payload_never_runs(self, planted):
        """The float-rebinding payload is refused by safe_globals, and nothing runs."""
        where, marker = planted
        text = f"from os import system as float\n_ = float('touch {marker}')\ndef h(m, i, o):\n    return o\n"
        _hostile_checkpoint(where / "m.pt", text)
        with pytest.raises(picklehooks.PicklehooksError, match="shadow"):
            picklehooks.safe_globals(where / "m.pt")
        assert not marker.exists()

    @pytest.mark.parametrize("payload, named", [(_Exec(), "builtins.exec"), (_System(), "system")])
    def test_everything_refuses_dangerous_callables(self, tmp_path, payload, named):
        """everything=True never allowlists exec, os.system & co: it raises, listing them."""
        torch.save({"model": hooks.mlp(), "extra": payload}, tmp_path / "m.pt")
        with pytest.raises(picklehooks.PicklehooksError, match=named):
            picklehooks.safe_globals(tmp_path / "m.pt", everything=True)

    def test_everything_refuses_untrusted_class_modules(self, planted):
        """A class from an untrusted, not yet imported package is not imported to allowlist it."""
        where, marker = planted
        (where / "ckpt_classes.py").write_text(
            f"open({str(marker)!r}, 'w').close()\nimport torch\nclass Net(torch.nn.Linear):\n    pass\n"
        )
        run_fresh("import torch, ckpt_classes; torch.save(ckpt_classes.Net(2, 2), 'm.pt')", cwd=where)
        marker.unlink()
        out = run_fresh(
            """
            import picklehooks
            try:
                picklehooks.safe_globals("m.pt", everything=True)
            except picklehooks.PicklehooksError as exc:
                print("refused", "trust=['ckpt_classes']" in str(exc))
            print(len(picklehooks.safe_globals("m.pt", everything=True, trust=["ckpt_classes"])))
            """,
            cwd=where,
        )
        assert out.split() == ["refused", "True", "1"]


def test_picklescan_dangerous_globals_are_refused():
    """Every global picklescan's table calls dangerous is one safe_globals refuses."""
    scanner = pytest.importorskip("picklescan.scanner")
    from picklehooks.audit.policy import dangerous as _dangerous

    missed = []
    for module, names in scanner._unsafe_globals.items():
        for name in (["anything"] if names == "*" else sorted(names)):
            if not _dangerous(f"{module}.{name}"):
                missed.append(f"{module}.{name}")
    assert not missed, missed


def test_reach_through_is_caught_once_resolved():
    """A name that reaches os.system through a harmless module is refused once resolved."""
    from picklehooks.audit.policy import dangerous as _dangerous, dangerous_object as _dangerous_object

    assert not _dangerous("torch.nn.os.system")  # by name it looks like torch's
    assert _dangerous_object(__import__("os").system)
    assert _dangerous_object(exec) and not _dangerous_object(int) and not _dangerous_object(torch.nn.Linear)
