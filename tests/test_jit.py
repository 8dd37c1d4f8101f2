"""TorchScript: scripting modules with portable hooks, then jit.save / jit.load in a fresh process."""

from __future__ import annotations

import pytest
import torch

import picklehooks
from tests import hooks
from tests.testutils import run_fresh, run_without_picklehooks

X = torch.ones(2, 4)


@pytest.fixture(scope="module")
def scripted():
    model = hooks.mlp()
    model[0].register_forward_hook(picklehooks.portable(hooks.typed_forward))
    model[2].register_forward_pre_hook(picklehooks.portable(hooks.typed_pre))
    model[3].register_forward_hook(picklehooks.portable(hooks.typed_forward))
    return model, torch.jit.script(model)


def test_script_matches_eager(scripted):
    """The scripted model runs the hooks exactly as eager does."""
    model, script = scripted
    assert torch.allclose(script(X), model(X))
    assert not torch.allclose(hooks.mlp()(X), model(X)), "the hooks must change the result"


def test_script_after_pickle_round_trip(scripted, tmp_path):
    """A model loaded from torch.save can be scripted in a fresh process."""
    model, _ = scripted
    path = tmp_path / "eager.pt"
    torch.save(model, path)
    out = run_fresh(
        "import sys, torch\nm = torch.load(sys.argv[1], weights_only=False)\n"
        "print(torch.jit.script(m)(torch.ones(2, 4)).tolist())",
        str(path),
    )
    assert out.strip() == str(model(X).tolist())


def test_jit_save_load_in_fresh_process(scripted, tmp_path):
    """jit.save here, jit.load in a fresh interpreter that cannot import picklehooks."""
    model, script = scripted
    path = tmp_path / "scripted.pt"
    torch.jit.save(script, path)
    out = run_without_picklehooks(
        """
        import torch
        loaded = torch.jit.load(sys.argv[1])
        print(loaded(torch.ones(2, 4)).tolist())
        """,
        str(path),
    )
    assert out.strip() == str(model(X).tolist())
