"""Backward compatibility: checkpoints saved by earlier formats keep loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.testutils import run_fresh

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("path", sorted(DATA.glob("frozen_v*.pt")), ids=lambda p: p.name)
def test_frozen_checkpoint_loads_and_runs(path):
    """The frozen model loads in a fresh process, its hooks fire, and its hook names decode."""
    out = run_fresh(
        """
        import sys, torch
        from picklehooks import codec
        saved = torch.load(sys.argv[1], weights_only=False)
        model = saved["model"]
        hooks = [*model[0]._forward_hooks.values(), *model[2]._forward_pre_hooks.values()]
        assert [h.__name__[0] for h in hooks] == [saved["format"]] * 2, [h.__name__[:3] for h in hooks]
        assert [codec.decode(h.__name__) for h in hooks] == saved["sources"]
        torch.testing.assert_close(model(saved["input"]), saved["expected"])
        model[0]._forward_hooks.clear()
        assert not torch.allclose(model(saved["input"]), saved["expected"])
        print("ok")
        """,
        str(path),
    )
    assert out.strip() == "ok"
