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
