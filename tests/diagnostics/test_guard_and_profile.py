"""instrument(on_nonfinite="raise") guards, and instrument(profile=True) profiler ranges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.diagnostics.profile import module_times
from tests.models.faults import NaNGrad
from tests.testutils import run_fresh, transformed


def model_with_nan_at(layer: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[layer].weight[0, 0] = float("nan")
    return model


class TestGuard:
    @pytest.mark.parametrize("backend", ["eager", "script"])
    def test_forward_nan_names_module_and_step(self, backend):
        """The first module whose output is NaN raises, naming itself and the step."""
        model = model_with_nan_at(2)
        x = torch.randn(2, 3)
        picklehooks.instrument(model, on_nonfinite="raise", example_inputs=(x,))
        runner = torch.jit.script(model) if backend == "script" else model
        with picklehooks.record(step=7), pytest.raises(Exception) as info:
            runner(x)
        assert "non-finite output in module '2'" in str(info.value) and "step 7" in str(info.value)
        if backend == "eager":
            assert isinstance(info.value, picklehooks.NonfiniteError)

    def test_guard_works_without_recording(self):
        """Outside record() the guard still raises (it just can't name a step)."""
        model = model_with_nan_at(0)
        picklehooks.instrument(model, on_nonfinite="raise")
        with pytest.raises(picklehooks.NonfiniteError, match="module '0'.*no step is known"):
            model(torch.randn(2, 3))

    def test_backward_nan(self):
        """A NaN that appears only in backward is caught at the module whose output gradient it is."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), NaNGrad(), nn.Linear(4, 1))
        picklehooks.instrument(model, on_nonfinite="raise")
        out = model(torch.randn(2, 3))  # forward is clean
        with pytest.raises(picklehooks.NonfiniteError, match="non-finite grad_output in module '0'"):
            out.sum().backward()

    def test_clean_model_passes_and_bad_value_is_refused(self):
        """A finite model runs unchanged; on_nonfinite only takes None or 'raise'."""
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(3, 2))
        guarded = nn.Sequential(nn.Linear(3, 2))
        guarded.load_state_dict(plain.state_dict())
        picklehooks.instrument(guarded, on_nonfinite="raise")
        x = torch.randn(4, 3)
        assert torch.equal(guarded(x), plain(x))
        with pytest.raises(picklehooks.PicklehooksError, match="'warn'"):
            picklehooks.instrument(nn.Sequential(nn.Linear(3, 2)), on_nonfinite="warn")


class TestProfile:
    def test_ranges_named_after_modules(self):
        """profile=True makes key_averages() show each module, and module_times() tabulates them."""
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        picklehooks.instrument(model, profile=True)
        x = torch.randn(4, 8)
        with torch.profiler.profile() as prof:
            for _ in range(3):
                model(x)
        rows = module_times(prof, model)
        assert {r["module"] for r in rows} == {"0", "1", "2", "2.0", "2.1"}
        assert all(r["calls"] == 3 and r["total_ms"] >= r["self_ms"] >= 0 for r in rows)
        by_name = {r["module"]: r for r in rows}
        assert by_name["2"]["total_ms"] >= by_name["2.0"]["total_ms"]  # a parent includes its children

    def test_remove_leaves_nothing(self):
        """remove() takes the profiling hooks and their bookkeeping away."""
        model = nn.Sequential(nn.Linear(2, 2))
        handle = picklehooks.instrument(model, profile=True)
        model(torch.ones(1, 2))
        handle.remove()
        assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
        assert not [k for k in vars(model[0]) if k.startswith("_picklehooks")]

    def test_profiled_model_still_pickles(self, tmp_path):
        """The profiling hooks are portable like every other."""
        model = nn.Sequential(nn.Linear(2, 2))
        picklehooks.instrument(model, profile=True)
        model(torch.ones(1, 2))
        torch.save(model, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        with torch.profiler.profile() as prof:
            loaded(torch.ones(1, 2))
        assert [r["module"] for r in module_times(prof, loaded)] == ["0"]


class TestErrors:
    def test_nonfinite_error_carries_where(self):
        """NonfiniteError has module, kind, path and step attributes, and pickles with them."""
        import pickle

        model = model_with_nan_at(4)
        picklehooks.instrument(model, on_nonfinite="raise")
        with picklehooks.record(step=3), pytest.raises(picklehooks.NonfiniteError) as info:
            model(torch.randn(2, 3))
        err = pickle.loads(pickle.dumps(info.value))
        assert (err.module, err.kind, err.path, err.step) == ("4", "output", "", 3)

    def test_module_swapped_after_instrument(self):
        """quantize_dynamic after instrument() gets a clear error, not an AttributeError."""
        import warnings

        model = nn.Sequential(nn.Linear(4, 4))
        picklehooks.instrument(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        with picklehooks.record(), pytest.raises(picklehooks.PicklehooksError, match="instrument the transformed model"):
            quantized(torch.randn(2, 4))


PROFILE_CHILD = """
import sys, torch
import picklehooks  # registers the picklehooks:: ops a scripted model calls
from picklehooks.diagnostics.profile import module_times
model = torch.jit.load(sys.argv[1])
with torch.profiler.profile() as prof:
    for _ in range(2):
        model(torch.randn(4, 8))
print(sorted((r["module"], r["calls"]) for r in module_times(prof, model)))
"""


@pytest.mark.parametrize("backend", ["script", "script_saveload", "fx", "compile", "export"])
def test_profile_ranges_in_every_backend(backend, tmp_path):
    """profile=True ranges name each module under TorchScript (also jit.load in a fresh process), FX, compile, export."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    x = torch.randn(4, 8)
    picklehooks.instrument(model, profile=True, example_inputs=(x,))
    want = [(name, 2) for name in ("0", "1", "2", "2.0", "2.1")]
    if backend == "script_saveload":
        torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
        out = run_fresh(PROFILE_CHILD, str(tmp_path / "model.pt"))
        assert out.strip().splitlines()[-1] == repr(want)
        return
    run = transformed(model, backend, (x,))
    if backend == "compile":
        run(x)  # compiled outside the profile
    reference = model(x)
    with torch.profiler.profile() as prof:
        for _ in range(2):
            torch.testing.assert_close(run(x), reference)
    assert sorted((r["module"], r["calls"]) for r in module_times(prof)) == want
