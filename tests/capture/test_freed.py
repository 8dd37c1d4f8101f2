"""An instrumented model is freed by reference counting alone, as soon as its last reference goes.

PyTorch's ``test_no_extra_reference_to_module`` pattern, with the garbage collector
off: ``del model`` must free it at once (a notebook's ``del model;
torch.cuda.empty_cache()`` frees its GPU memory), idle, recording inside an open
``record()`` block, and after it with the log still held. The modules keep their
instrumentation handle alive (for surgery checks and ``save_hooks``), so the handle
must hold them, and the model, weakly. Each case is also run on the same model
uninstrumented, which PyTorch frees: the test asks no more than that.
"""

from __future__ import annotations

import contextlib
import gc
import io
import warnings
import weakref

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture import tree as _tree

CAPTURES = ["default", "all"]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))


def _build(case: str, instrumented: bool, capture: str):
    """(model, handle or None, what to call: the model or its compiled wrapper)."""
    args = {} if capture == "default" else {"capture": capture}
    if case == "loaded":  # a saved instrumented model: its hooks are the portable generated ones
        saved = _net()
        handle = picklehooks.instrument(saved, **args) if instrumented else None
        buf = io.BytesIO()
        torch.save(saved, buf)
        if handle is not None:
            handle.remove()
        del saved, handle
        buf.seek(0)
        model = torch.load(buf, weights_only=False)
        assert any(hasattr(m, "_picklehooks_name") for m in model.modules()) == instrumented
        return model, None, model
    model = _net()
    handle = picklehooks.instrument(model, **args) if instrumented else None
    if case == "compiled":
        # Dynamo doesn't guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards):
        # the plain run's graph, without hooks, would serve the instrumented model too.
        torch._dynamo.reset()
        return model, handle, torch.compile(model)
    return model, handle, model


def _freed(case: str, instrumented: bool, capture: str, phase: str) -> bool:
    """Whether ``del`` of every reference this test holds frees the model, with the collector off."""
    x = torch.randn(4, 10)
    model, handle, run = _build(case, instrumented, capture)
    run(x)  # idle (and compiles the compiled one)
    gc.collect()
    gc.disable()
    try:
        ref, run_ref = weakref.ref(model), weakref.ref(run)
        if phase == "idle":
            del model, handle, run
            return ref() is None and run_ref() is None
        if phase == "open":
            with _quiet(), picklehooks.record() as log:
                out = run(x)
                out.sum().backward()
                del model, handle, run, out
                freed = ref() is None and run_ref() is None
                assert log is not None
            return freed
        with _quiet(), picklehooks.record() as log:
            out = run(x)
            out.sum().backward()
        assert bool(log.records) == instrumented
        del model, handle, run, out
        freed = ref() is None and run_ref() is None
        assert log is not None  # still referenced
        return freed
    finally:
        gc.enable()


@contextlib.contextmanager
def _quiet():
    """Ignore the warning that the uninstrumented model's block recorded nothing: expected there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "nothing was recorded", UserWarning)
        yield


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("phase", ["idle", "open", "closed"])
@pytest.mark.parametrize("case", ["eager", "compiled", "loaded"])
def test_del_frees_an_instrumented_model(case, phase, capture):
    if case == "compiled" and capture == "all":
        pytest.skip("one compiled capture is enough (compiling is slow)")
    plain = _freed(case, False, capture, phase)
    assert plain, "PyTorch itself keeps this model alive: the test can't ask more of picklehooks"
    assert _freed(case, True, capture, phase), f"the instrumented {case} model outlived its last reference ({phase})"


def test_the_handle_stays_reachable_from_the_model_and_lets_it_go():
    """The model keeps a dropped handle (surgery checks, save_hooks); the handle doesn't keep the model."""
    model = _net()
    handle = picklehooks.instrument(model, capture="all")
    handle_ref = weakref.ref(handle)
    del handle
    gc.collect()
    assert handle_ref() is not None and handle_ref() in _tree.live() and handle_ref().model is model
    assert sorted(handle_ref().modules) == ["0", "1", "2"]
    gc.disable()
    try:
        model_ref = weakref.ref(model)
        del model
        assert model_ref() is None and handle_ref() is None
    finally:
        gc.enable()


def test_a_held_handle_does_not_keep_the_model():
    model = _net()
    handle = picklehooks.instrument(model, capture="all")
    gc.disable()
    try:
        model_ref = weakref.ref(model)
        del model
        assert model_ref() is None
    finally:
        gc.enable()
    assert handle.model is None and dict(handle.modules) == {} and handle not in _tree.live()
    handle.remove()  # nothing left to remove: no error
    with pytest.raises(picklehooks.PicklehooksError, match="freed"):
        handle.refresh()


def test_a_replaced_module_that_was_freed_is_reported_gone():
    """A module freed after surgery: its address may be reused by its replacement; the check still sees it."""
    model = _net()
    handle = picklehooks.instrument(model)
    old = id(model[0])
    model[0] = nn.Identity()  # the old Linear is freed at once
    model[0] = nn.Linear(10, 10)  # and the new one usually takes its address: the tree's fingerprint is the same
    if id(model[0]) == old:
        assert _tree._fingerprint(model) == handle._tree
    with pytest.warns(UserWarning, match=r"no longer in the model: 0\b.*new, without hooks: 0"):
        with picklehooks.record():
            model(torch.randn(2, 10))
    assert sorted(handle.modules) == ["1", "2"]
    handle.remove()


def test_remove_unwatches_the_parameters_of_a_freed_module():
    """A watched module freed while its parameter lives on elsewhere: remove() still takes its gradient hooks off."""
    from picklehooks import _deliver

    model = _net()
    handle = picklehooks.instrument(model, capture="param_grad")
    weight = model[0].weight
    model[0] = nn.Linear(10, 10)
    assert any(k[0] == "0" for k in _deliver._WATCHED.get(weight, {}))
    handle.remove()
    assert not _deliver._WATCHED.get(weight) and not hasattr(weight, "_picklehooks_owners")
