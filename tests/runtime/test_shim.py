"""The shim: the hub module, its finder and loader, source visibility, thread safety, shape checks."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import linecache
import sys
import threading
import traceback
from pathlib import Path

import pytest

import picklehooks
from picklehooks import _shim, codec
from tests import hooks
from tests.testutils import REPO, run_fresh


def _fresh_hook(tag: str):
    """A hook whose text no other test uses, so its first lookup really decodes."""
    return codec.encode(f"def hook_{tag}(module, inputs, output):\n    return output + {len(tag)}\n")


class TestFinder:
    def test_importable_by_stable_name(self):
        """importlib finds and imports the hub through the meta_path finder."""
        spec = importlib.util.find_spec(_shim.HUB_NAME)
        assert spec is not None and spec.loader is _shim.HUB_LOADER
        assert importlib.import_module(_shim.HUB_NAME) is _shim.hub()

    def test_get_source_holds_decoded_hooks(self):
        """The loader's get_source shows every decoded hook's text."""
        fn = picklehooks.portable(hooks.double_output)
        text = _shim.HUB_LOADER.get_source(_shim.HUB_NAME)
        assert inspect.getsource(hooks.double_output) in text
        assert fn.__code__.co_filename == _shim.HUB_FILENAME
        assert _shim.HUB_LOADER.get_source("something.else") is None

    def test_finder_installed_once(self):
        """Re-installing does not stack finders."""
        _shim.install()
        _shim.install()
        assert sum(isinstance(f, _shim._HubFinder) for f in sys.meta_path) == 1

    def test_dunder_lookups_are_plain_attribute_errors(self):
        """Probes such as __path__ are not decoded."""
        with pytest.raises(AttributeError) as info:
            _shim.hub().__path__
        assert not isinstance(info.value, picklehooks.DecodeError)


class TestSourceVisibility:
    def test_getsource_after_clearcache(self):
        """inspect.getsource finds the hook's lines even after linecache.clearcache()."""
        fn = picklehooks.portable(hooks.make_clamp(0.25))
        before = inspect.getsource(fn)
        assert before.startswith("def clamp_hook") and "0.25" in before  # the constant is written in
        linecache.clearcache()
        assert inspect.getsource(fn) == before

    def test_getsource_of_hooks_decoded_later(self):
        """A hook decoded after the cache was realised is still found (the entry is refreshed)."""
        first = picklehooks.portable(hooks.double_output)
        inspect.getsource(first)  # realise the linecache entry
        second = getattr(_shim.hub(), _fresh_hook("later"))
        assert "def hook_later" in inspect.getsource(second)
        linecache.clearcache()
        assert "def hook_later" in inspect.getsource(second)
        assert inspect.getsource(first) == inspect.getsource(hooks.double_output)

    def test_traceback_shows_hook_lines(self):
        """A failing hook's traceback quotes its own line."""
        name = codec.encode("def failing(module, inputs, output):\n    raise ValueError('boom in hook')\n")
        fn = getattr(_shim.hub(), name)
        linecache.clearcache()
        try:
            fn(None, None, None)
        except ValueError:
            text = traceback.format_exc()
        assert "raise ValueError('boom in hook')" in text
        assert "in failing" in text

    def test_identity_attributes(self):
        """__module__, __name__ and __qualname__ make pickle's identity check pass."""
        name = _fresh_hook("ident")
        fn = getattr(_shim.hub(), name)
        assert (fn.__module__, fn.__name__, fn.__qualname__) == (_shim.HUB_NAME, name, name)
        assert getattr(importlib.import_module(fn.__module__), fn.__qualname__) is fn


class TestThreadSafety:
    def test_concurrent_first_access_gives_one_object(self):
        """Many threads resolving a never-seen name at once all get the same function."""
        name = _fresh_hook("threads")
        hub = _shim.hub()
        assert name not in hub.__dict__
        barrier = threading.Barrier(16)
        results = []

        def worker():
            barrier.wait()
            results.append(getattr(hub, name))

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 16 and all(r is results[0] for r in results)
        assert _shim.HUB_LOADER.get_source(_shim.HUB_NAME).count("def hook_threads") == 1


class TestShapeCheck:
    @pytest.mark.parametrize(
        "source",
        [
            "while True:\n    pass\ndef f():\n    pass\n",
            "import os\nos.system('echo hi')\ndef f():\n    pass\n",
            "def f():\n    pass\ndef g():\n    pass\n",
            "x = 1\n",
            "x = __import__('os').getcwd()\ndef f():\n    pass\n",
            "@staticmethod\ndef f():\n    pass\n",
            "def f(x=print('side effect')):\n    pass\n",
            "from os import *\ndef f():\n    pass\n",
            "def f(:\n",
        ],
    )
    def test_rejects_text_that_is_not_a_hook(self, source):
        """Decoded text that could do more than define one function never runs."""
        with pytest.raises(picklehooks.DecodeError):
            getattr(_shim.hub(), codec.encode(source))

    def test_accepts_generated_forms(self):
        """Imports, constants (dtype, device, nan) and one typed def are accepted."""
        source = (
            "import torch\nfrom typing import Tuple\nlimit = float('nan')\ndev = torch.device('cpu')\n"
            "dt = torch.float16\npair = (1, -2.5, [b'x', None], {'k': True})\n"
            "def f(m, i: Tuple[torch.Tensor], o: torch.Tensor | None = None, k: int = -1) -> torch.Tensor:\n"
            "    return o\n"
        )
        fn = getattr(_shim.hub(), codec.encode(source))
        assert fn.__globals__["dev"] == __import__("torch").device("cpu")


class TestStandalone:
    def test_shim_imports_only_stdlib_and_zstd(self):
        """The shim's own imports are the standard library and the decompressor."""
        tree = ast.parse(Path(_shim.__file__).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, "the shim must not import from its own package"
                imported.add(node.module.split(".")[0])
        allowed = set(sys.stdlib_module_names) | {"zstandard", "compression"}
        assert imported <= allowed, imported - allowed

    def test_shim_runs_alone(self):
        """Loaded as a lone file with torch and picklehooks blocked, the shim still decodes hooks."""
        name = codec.encode("import math\ndef area(r):\n    return math.pi * r * r\n")
        out = run_fresh(
            f"""
            import importlib.util, sys
            class Block:
                def find_spec(self, name, path=None, target=None):
                    if name.split('.')[0] in ('torch', 'picklehooks'):
                        raise ImportError('blocked: ' + name)
            sys.meta_path.insert(0, Block())
            spec = importlib.util.spec_from_file_location('lone_shim', {str(Path(_shim.__file__))!r})
            shim = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(shim)
            import types
            loader = shim._HubLoader('lone_hub', 'lone/hub.py')
            mod = types.ModuleType('lone_hub')
            sys.modules['lone_hub'] = mod
            loader.bind(mod.__dict__)
            print(getattr(mod, {name!r})(2.0), 'torch' in sys.modules)
            """,
            cwd=REPO.parent,
        )
        assert out.split() == [repr(__import__("math").pi * 4), "False"]
