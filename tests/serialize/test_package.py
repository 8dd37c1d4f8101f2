"""torch.package: hooked models load on hosts without picklehooks, script there, and re-export."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.package import PackageExporter, PackageImporter, sys_importer

import picklehooks
import picklehooks.serialize.package
from tests import hooks
from tests.testutils import run_fresh, run_without_picklehooks

X = torch.ones(2, 4)

# Child code: load the archive, report output, hook sources and the hook objects' identity.
LOAD = """
import inspect, json, torch
from torch.package import PackageImporter
model = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
fns = [f for m in model.modules() for f in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
print(json.dumps({
    "output": model(torch.ones(2, 4)).tolist(),
    "heads": [inspect.getsource(f).splitlines()[0] for f in fns],
    "distinct": len({id(f) for f in fns}),
}))
"""


def hooked_model(typed: bool = False):
    model = hooks.mlp()
    if typed:  # TorchScript-compatible hooks
        model[0].register_forward_hook(picklehooks.portable(hooks.typed_forward))
        model[2].register_forward_pre_hook(picklehooks.portable(hooks.typed_pre))
        model[3].register_forward_hook(picklehooks.portable(hooks.typed_forward))
    else:  # hooks importing math, torch.nn.functional, and a closure constant
        model[0].register_forward_hook(picklehooks.portable(hooks.make_clamp(0.3)))
        model[2][0].register_forward_hook(picklehooks.portable(hooks.make_clamp(0.3)))
        model[2][0].register_forward_pre_hook(picklehooks.portable(hooks.add_one_pre))
        model[3].register_forward_hook(picklehooks.portable(hooks.double_output))
    return model


def expected(model):
    fns = [f for m in model.modules() for f in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
    return {
        "output": model(X).tolist(),
        "heads": [f"def {picklehooks.serialize.codec.decode(f.__name__).split('def ', 1)[1].splitlines()[0]}" for f in fns],
        "distinct": len({id(f) for f in fns}),
    }


class TestExport:
    def test_one_call_export(self, tmp_path):
        """picklehooks.serialize.package.save, then plain PackageImporter on a host without picklehooks."""
        model = hooked_model()
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        got = json.loads(run_without_picklehooks(LOAD, str(path)))
        assert got == expected(model)
        assert got["distinct"] == 3  # the shared clamp stays one function

    def test_imports_inside_the_hook_body(self, tmp_path):
        """A module the hook imports in its body is declared to the exporter, so the archive loads and runs it."""
        model = hooks.mlp()
        model[0].register_forward_hook(picklehooks.portable(hooks.import_in_body))
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        got = json.loads(run_fresh("import sys\n" + LOAD, str(path)))
        assert got["output"] == model(X).tolist()

    @pytest.mark.parametrize("order", ["prepare_first", "patterns_first", "no_prepare"])
    def test_own_exporter(self, tmp_path, order):
        """A user-driven exporter with its own patterns, with prepare before or after them, or not at all."""
        model = hooked_model()
        path = tmp_path / "model.pt"
        with PackageExporter(path) as pe:
            if order == "prepare_first":
                picklehooks.serialize.package.prepare(pe)
            pe.extern(["numpy", "numpy.**"])
            pe.mock("hypothesis.**")
            pe.intern("tests.**")
            if order == "patterns_first":
                picklehooks.serialize.package.prepare(pe)
            pe.save_pickle("model", "model.pkl", model)
        assert json.loads(run_without_picklehooks(LOAD, str(path))) == expected(model)

    def test_prepare_rejects_other_objects(self):
        """prepare() names what it was given."""
        with pytest.raises(TypeError, match="PackageImporter"):
            picklehooks.serialize.package.prepare(PackageImporter)

    def test_undeclared_import_is_named(self, tmp_path):
        """A hook importing a module the exporter has no rule for gets a clear PicklehooksError."""
        import numpy as np

        def to_numpy_mean(module, inputs, output):
            return np.mean(output.detach().numpy())

        model = torch.nn.Linear(2, 2)
        model.register_forward_hook(picklehooks.portable(to_numpy_mean))
        with pytest.raises(picklehooks.PicklehooksError) as info:
            with PackageExporter(tmp_path / "bad.pt") as pe:
                pe.save_pickle("model", "model.pkl", model)
        message = str(info.value)
        assert "'to_numpy_mean'" in message and "'numpy'" in message and "extern" in message


class TestLoad:
    def test_script_after_loading(self, tmp_path):
        """torch.jit.script works on the model loaded from the archive, without picklehooks."""
        model = hooked_model(typed=True)
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        out = run_without_picklehooks(
            """
            import torch
            from torch.package import PackageImporter
            model = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
            print(torch.jit.script(model)(torch.ones(2, 4)).tolist())
            """,
            str(path),
        )
        assert out.strip() == str(model(X).tolist())

    @pytest.mark.parametrize("host", ["without_picklehooks", "with_picklehooks"])
    def test_two_importers_in_one_process(self, tmp_path, host):
        """Two importers (and the host's own hub) keep separate functions and linecache keys."""
        model = hooked_model()
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        code = """
            import inspect, torch
            from torch.package import PackageImporter
            a = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
            b = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
            fa, fb = (next(iter(m[0]._forward_hooks.values())) for m in (a, b))
            ga = next(iter(a[2][0]._forward_hooks.values()))
            assert fa is not fb and fa is ga and fa.__name__ == fb.__name__
            assert fa.__code__.co_filename != fb.__code__.co_filename
            assert inspect.getsource(fa) == inspect.getsource(fb)
            assert torch.equal(a(torch.ones(2, 4)), b(torch.ones(2, 4)))
            if 'picklehooks' in sys.argv[2:]:
                import picklehooks
                host = picklehooks.portable(fa)  # the host's own hub decodes the same text
                assert host is not fa and host.__module__ == 'picklehooks._hub'
                assert host.__code__.co_filename not in (fa.__code__.co_filename, fb.__code__.co_filename)
                assert inspect.getsource(host) == inspect.getsource(fa)
            print(a(torch.ones(2, 4)).tolist())
            """
        if host == "with_picklehooks":
            out = run_fresh("import sys\n" + __import__("textwrap").dedent(code), str(path), "picklehooks")
        else:
            out = run_without_picklehooks(code, str(path))
        assert out.strip() == str(model(X).tolist())

    def test_re_export(self, tmp_path):
        """A model loaded from an archive and exported again keeps its hooks, without picklehooks."""
        model = hooked_model()
        first, second = tmp_path / "first.pt", tmp_path / "second.pt"
        picklehooks.serialize.package.save(first, model)
        run_without_picklehooks(
            """
            from torch.package import PackageExporter, PackageImporter, sys_importer
            importer = PackageImporter(sys.argv[1])
            model = importer.load_pickle("model", "model.pkl")
            with PackageExporter(sys.argv[2], importer=(importer, sys_importer)) as pe:
                pe.intern("**")
                pe.save_pickle("model", "model.pkl", model)
            """,
            str(first),
            str(second),
        )
        assert json.loads(run_without_picklehooks(LOAD, str(second))) == expected(model)

    def test_loaded_in_this_process_too(self, tmp_path):
        """Loading next to an installed picklehooks leaves the host hub untouched."""
        model = hooked_model()
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        importer = PackageImporter(path)
        loaded = importer.load_pickle("model", "model.pkl")
        theirs = next(iter(loaded[0]._forward_hooks.values()))
        ours = next(iter(model[0]._forward_hooks.values()))
        assert theirs is not ours and theirs.__name__ == ours.__name__
        assert torch.equal(loaded(X), model(X))
        with PackageExporter(tmp_path / "again.pt", importer=(importer, sys_importer)) as pe:
            pe.save_pickle("model", "model.pkl", loaded)
        again = PackageImporter(tmp_path / "again.pt").load_pickle("model", "model.pkl")
        assert torch.equal(again(X), model(X))


class TestInstrumented:
    def test_instrumented_model_without_picklehooks(self, tmp_path):
        """An instrumented model's archive carries the logging runtime: it runs and scripts without picklehooks."""
        from tests.models import small

        model = small.transformer()
        x = small.inputs("transformer")
        handle = picklehooks.instrument(model, capture="all", example_inputs=x, scriptable=True)
        assert handle.modules
        path, inputs = tmp_path / "model.pt", tmp_path / "inputs.pt"
        picklehooks.serialize.package.save(path, model)
        torch.save(x, inputs)
        out = run_without_picklehooks(
            """
            import torch
            from torch.package import PackageImporter
            model = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
            x = torch.load(sys.argv[2])
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
            eager = model(*x)[0]
            scripted = torch.jit.script(model)(*x)[0]
            assert torch.equal(eager, scripted)
            # A second importer reuses the ops the first registered (op names are process-wide).
            again = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
            assert torch.equal(again(*x)[0], eager)
            print(hooks, eager.tolist())
            """,
            str(path),
            str(inputs),
        )
        count, result = out.strip().split(" ", 1)
        assert int(count) == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) > 0
        assert result == str(model(*x)[0].tolist())

    def test_packaged_guard_raises_the_hosts_error(self, tmp_path):
        """Loaded next to an installed picklehooks, a packaged guard raises picklehooks.NonfiniteError itself."""
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        picklehooks.instrument(model, on_nonfinite="raise")
        path = tmp_path / "model.pt"
        picklehooks.serialize.package.save(path, model)
        loaded = PackageImporter(path).load_pickle("model", "model.pkl")
        with pytest.raises(picklehooks.NonfiniteError) as info:
            loaded(torch.tensor([[1.0, math.nan, 0.0]]))
        assert info.value.module == "0"
