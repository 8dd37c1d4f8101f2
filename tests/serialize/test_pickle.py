"""Hooked models through pickle (every protocol), deepcopy, torch.save in a fresh process, and spawn."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
import torch.multiprocessing as mp

import picklehooks
from tests import hooks
from tests.testutils import run_fresh


def hooked_model():
    model = hooks.mlp()
    model[0].register_forward_hook(picklehooks.portable(hooks.make_clamp(0.3)))
    model[0].register_forward_pre_hook(picklehooks.portable(hooks.add_one_pre))
    model[2][0].register_forward_hook(picklehooks.portable(hooks.double_output))
    model[3].register_forward_hook(picklehooks.portable(lambda m, i, o: o - 100))
    return model


X = torch.ones(1, 4)


@pytest.fixture(scope="module")
def model():
    return hooked_model()


def assert_same_hooks(a, b):
    for (name, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        assert list(ma._forward_hooks.values()) == list(mb._forward_hooks.values()), name
        assert list(ma._forward_pre_hooks.values()) == list(mb._forward_pre_hooks.values()), name


class TestInProcess:
    @pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
    def test_every_protocol(self, model, protocol):
        """Each pickle protocol restores the very same hook functions, which still fire."""
        loaded = pickle.loads(pickle.dumps(model, protocol=protocol))
        assert_same_hooks(model, loaded)
        assert torch.equal(loaded(X), model(X))

    def test_deepcopy(self, model):
        """deepcopy keeps the hooks (functions are copied by reference)."""
        clone = copy.deepcopy(model)
        assert_same_hooks(model, clone)
        assert torch.equal(clone(X), model(X))

    def test_hooks_really_fire(self, model):
        """Removing the hooks changes the output, so the comparisons above test something."""
        bare = hooks.mlp()
        assert not torch.equal(bare(X), model(X))


class TestFreshProcess:
    @pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
    def test_torch_save_then_load_elsewhere(self, model, tmp_path, protocol):
        """torch.save here, torch.load in a fresh interpreter: same output, hooks readable there."""
        path = tmp_path / "model.pt"
        torch.save(model, path, pickle_protocol=protocol)
        out = run_fresh(
            """
            import inspect, sys, torch
            model = torch.load(sys.argv[1], weights_only=False)
            hook = next(iter(model[2][0]._forward_hooks.values()))
            print(model(torch.ones(1, 4)).tolist())
            print(inspect.getsource(hook).splitlines()[0])
            print('tests' in sys.modules, 'picklehooks._hub' in sys.modules)
            """,
            str(path),
        )
        lines = out.splitlines()
        assert lines[0] == str(model(X).tolist())
        assert lines[1] == "def double_output(module, inputs, output):"
        assert lines[2] == "False True"

    def test_legacy_serialization(self, model, tmp_path):
        """The pre-zip torch.save format works too."""
        path = tmp_path / "legacy.pt"
        torch.save(model, path, _use_new_zipfile_serialization=False)
        out = run_fresh(
            "import sys, torch\nprint(torch.load(sys.argv[1], weights_only=False)(torch.ones(1, 4)).tolist())",
            str(path),
        )
        assert out.strip() == str(model(X).tolist())

    def test_spawned_worker(self, model):
        """A torch.multiprocessing spawn worker receives the model and its hooks fire there."""
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        from tests._workers import run_model

        mp.spawn(run_model, args=(model, queue), nprocs=1, join=True)
        rank, output, n_hooks = queue.get()
        assert (rank, output, n_hooks) == (0, model(X).tolist(), 1)
