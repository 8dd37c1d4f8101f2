"""Portable hooks with captured constants script, and survive a fresh process (issue 11).

Ground truth: the original closure registered as a plain hook on an
un-instrumented copy of the module.
"""

from __future__ import annotations

import copy
import math
from typing import Tuple

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.serialize.portable import module_text
from tests.testutils import REPO, run_fresh


def make_scale(scale):
    def hook(module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output * scale

    return hook


def make_many(lo, hi, pair, flag, label, nothing, count, fill):
    def hook(module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        if flag and nothing is None and label == "clip":
            output = output.clamp(lo, hi) * pair[0] + pair[1] * count
        return torch.nan_to_num(output, nan=fill)

    return hook


def make_shadowed(scale):
    def hook(module, inputs, output):
        twice = lambda scale: scale * 2  # noqa: E731 - a lambda parameter named like the constant
        return twice(output) * scale

    return hook


def make_listed(bounds):
    def hook(module, inputs, output):
        return output.clamp(bounds[0], bounds[1])

    return hook


CASES = {
    "scale": make_scale(5.0),
    "negative-int": make_scale(-3),
    "many": make_many(-1.5, math.inf, (2, -3), True, "clip", None, 4, 0.25),
    "infinite": make_many(-math.inf, math.inf, (1.0, 0.0), True, "clip", None, 1, -0.5),
    "nan-fill": make_many(-1.0, 1.0, (1, 0), False, "no", None, 0, math.nan),
}


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)


def plain_output(hook, x: torch.Tensor) -> torch.Tensor:
    """The original closure, as a plain hook on an un-instrumented module."""
    model = linear()
    model.register_forward_hook(hook)
    return model(x)


@pytest.mark.parametrize("name", list(CASES))
class TestScriptableConstants:
    def test_scripts_and_computes_what_the_closure_computes(self, name):
        """torch.jit.script accepts the portable hook, and the scripted module equals the plain one."""
        hook, x = CASES[name], torch.randn(4, 3) * 3
        model = linear()
        model.register_forward_hook(picklehooks.portable(hook))
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x), plain_output(hook, x), rtol=0, atol=0, equal_nan=True)

    def test_scripted_and_saved_runs_in_a_fresh_process(self, name, tmp_path):
        """Saved with torch.jit.save, the module computes the same in a fresh interpreter."""
        hook, x = CASES[name], torch.randn(4, 3) * 3
        model = linear()
        model.register_forward_hook(picklehooks.portable(hook))
        torch.jit.save(torch.jit.script(model), tmp_path / "m.pt")
        torch.save(x, tmp_path / "x.pt")
        run_fresh(
            """
            import sys, torch
            model, x = torch.jit.load(sys.argv[1]), torch.load(sys.argv[2])
            torch.save(model(x), sys.argv[3])
            """, str(tmp_path / "m.pt"), str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), cwd=REPO)
        torch.testing.assert_close(torch.load(tmp_path / "y.pt"), plain_output(hook, x), rtol=0, atol=0,
                                   equal_nan=True)

    def test_constants_are_written_into_the_body(self, name):
        """No module-level constant is left for these values, and non-finite floats are math.inf/math.nan."""
        text = module_text(CASES[name])
        assert not [line for line in text.splitlines() if "=" in line and not line.startswith((" ", "def"))]
        assert "float(" not in text


class TestKeptAtModuleLevel:
    def test_name_bound_inside_the_def_stays_a_constant(self, tmp_path):
        """A constant whose name a lambda inside the hook rebinds is not substituted; results match."""
        hook, x = make_shadowed(3.0), torch.randn(2, 3)
        assert "scale = 3.0\n" in module_text(hook)
        model = linear()
        model.register_forward_hook(picklehooks.portable(hook))
        assert torch.equal(model(x), plain_output(hook, x))

    def test_lists_with_infinities_survive_pickle_in_a_fresh_process(self, tmp_path):
        """A captured list stays a module-level copy, its infinities written math.inf, and loads elsewhere."""
        hook, x = make_listed([-math.inf, math.inf]), torch.randn(4, 3)
        text = module_text(hook)
        assert "bounds = [(-1e999), math.inf]\n" in text and "import math\n" in text
        model = linear()
        model.register_forward_hook(picklehooks.portable(hook))
        assert torch.equal(output_in_fresh_process(model, x, tmp_path), plain_output(hook, x))


NEGATIVE_INFINITY = -math.inf


def output_in_fresh_process(model, x, tmp_path) -> torch.Tensor:
    """``model(x)`` computed by a fresh interpreter that torch.load()s the pickled model."""
    torch.save({"model": model, "x": x}, tmp_path / "m.pt")
    run_fresh(
        """
        import sys, torch
        saved = torch.load(sys.argv[1], weights_only=False)
        torch.save(saved["model"](saved["x"]), sys.argv[2])
        """, str(tmp_path / "m.pt"), str(tmp_path / "y.pt"), cwd=REPO)
    return torch.load(tmp_path / "y.pt")


def clamp_with_defaults(module, inputs, output, lo=NEGATIVE_INFINITY, hi=math.inf):
    return output.clamp(lo, hi)


def test_constants_in_defaults_decode_in_a_fresh_process(tmp_path):
    """A default made of a global -inf is written so that the decoder accepts it elsewhere."""
    hook, x = clamp_with_defaults, torch.randn(4, 3)
    assert "lo=(-1e999), hi=math.inf" in module_text(hook)
    model = linear()
    model.register_forward_hook(picklehooks.portable(hook))
    assert torch.equal(output_in_fresh_process(model, x, tmp_path), plain_output(hook, x))
