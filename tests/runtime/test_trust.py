"""The trust boundary of decoding: a hook name can only import and define.

Every hostile text below would, if executed as written, create a marker file
(through a planted module whose every special method writes it). Each case
asserts the exact refusal (``DecodeError``, also an ``AttributeError``) and
that no marker appeared. Ground truth for "the text would run code" is the
text itself: each payload is checked to write the marker when ``exec``'d
directly, so a case that stopped being dangerous would fail here.
"""

from __future__ import annotations

import base64
import os
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import picklehooks
from picklehooks import _shim, codec

EVILMOD = '''
"""Planted by tests/runtime/test_trust.py: every hook into this module's objects writes MARKER."""
import os

MARKER = os.environ["PICKLEHOOKS_TEST_MARKER"]


def touch(*args, **kwargs):
    with open(MARKER, "a") as f:
        f.write("ran\\n")
    return 0


class Meta(type):
    def __or__(cls, other):
        return touch()

    __ror__ = __or__

    def __getitem__(cls, key):
        return touch()


class Evil(metaclass=Meta):
    def __class_getitem__(cls, key):
        return touch()

    def __getattr__(self, name):
        return touch()

    def __hash__(self):
        return touch()

    def __format__(self, spec):
        touch()
        return ""

    def __neg__(self):
        return touch()

    def __or__(self, other):
        return touch()

    def __iter__(self):
        touch()
        return iter(())

    def __getitem__(self, key):
        return touch()


evil_obj = Evil()
'''

SIDEFX = 'import evilmod\nevilmod.touch()\n'  # a module whose import is the side effect


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """``evilmod`` (imported) and ``sidefx_*`` (not imported) on sys.path; yields the marker path."""
    root = tmp_path_factory.mktemp("planted")
    marker = root / "MARKER"
    old = os.environ.get("PICKLEHOOKS_TEST_MARKER")
    os.environ["PICKLEHOOKS_TEST_MARKER"] = str(marker)
    (root / "evilmod.py").write_text(EVILMOD)
    for name in ("sidefx_a", "sidefx_b", "exitmod"):
        (root / f"{name}.py").write_text(SIDEFX if name != "exitmod" else "raise SystemExit(3)\n")
    pkg = root / "sidefxpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text(SIDEFX)
    sys.path.insert(0, str(root))
    import evilmod  # noqa: F401 - imported, so the default policy lets hook text import it
    import sidefxpkg  # noqa: F401 - the package is loaded, its submodule is not

    try:
        yield marker
    finally:
        sys.path.remove(str(root))
        for name in ("evilmod", "sidefxpkg"):
            sys.modules.pop(name, None)
        if old is None:
            os.environ.pop("PICKLEHOOKS_TEST_MARKER", None)
        else:
            os.environ["PICKLEHOOKS_TEST_MARKER"] = old


def _resolve(text: str):
    return getattr(_shim.hub(), codec.encode(textwrap.dedent(text)))


def _assert_refused(text: str, marker, match: str | None = None):
    with pytest.raises(picklehooks.DecodeError, match=match) as info:
        _resolve(text)
    assert isinstance(info.value, AttributeError)
    assert not marker.exists(), f"decoding ran code:\n{text}"
    return info.value


# (id, hostile text, what the refusal names). Each text writes the marker when exec'd.
HOSTILE = [
    ("rebind-float-module-level", "from evilmod import touch as float\n_ = float('x')\ndef f():\n    pass\n", "shadow"),
    ("rebind-float-default", "from evilmod import touch as float\ndef f(x=float('x')):\n    pass\n", "shadow"),
    ("rebind-float-annotation", "from evilmod import touch as float\ndef f(x: float('x')):\n    pass\n", "shadow"),
    ("rebind-float-kwonly-default", "from evilmod import touch as float\ndef f(*, x=float('x')):\n    pass\n", "shadow"),
    ("rebind-float-return", "from evilmod import touch as float\ndef f() -> float('x'):\n    pass\n", "shadow"),
    ("assign-float", "from evilmod import touch\nfloat = touch\n_ = float('x')\ndef f():\n    pass\n", "shadow"),
    ("rebind-torch", "from evilmod import evil_obj as torch\n_ = torch.device('cpu')\ndef f():\n    pass\n", "calls"),
    ("plain-call", "from evilmod import touch\n_ = touch()\ndef f():\n    pass\n", "calls"),
    ("subscript-class", "from evilmod import Evil\ndef f(x: Evil[int]):\n    pass\n", "subscript"),
    ("subscript-object", "from evilmod import evil_obj\n_ = evil_obj[0]\ndef f():\n    pass\n", "subscript"),
    ("subscript-module-attr", "import evilmod\ndef f(x: evilmod.Evil[int]):\n    pass\n", "subscript"),
    ("or-annotation", "from evilmod import Evil\ndef f(x: Evil | None):\n    pass\n", "'\\|'"),
    ("or-object", "from evilmod import evil_obj\ndef f(x: evil_obj | None):\n    pass\n", "'\\|'"),
    ("hash-set", "from evilmod import evil_obj\n_ = {evil_obj}\ndef f():\n    pass\n", "hash"),
    ("hash-dict-key", "from evilmod import evil_obj\ndef f(x={evil_obj: 1}):\n    pass\n", "hash"),
    ("fstring", "from evilmod import evil_obj\n_ = f'{evil_obj}'\ndef f():\n    pass\n", "JoinedStr"),
    ("neg", "from evilmod import evil_obj\n_ = -evil_obj\ndef f():\n    pass\n", "unary"),
    ("attr-through-object", "import evilmod\n_ = evilmod.evil_obj.anything\ndef f():\n    pass\n", "through an object"),
    ("attr-of-from-import", "from evilmod import evil_obj\n_ = evil_obj.anything\ndef f():\n    pass\n", "not bound by an 'import'"),
    ("genexp-default", "from evilmod import evil_obj\ndef f(x=tuple(i for i in evil_obj)):\n    pass\n", "calls"),
    ("starred", "from evilmod import evil_obj\n_ = [*evil_obj]\ndef f():\n    pass\n", "Starred"),
    ("decorator", "from evilmod import touch\n@touch\ndef f():\n    pass\n", "decorators"),
    ("second-statement", "import evilmod\nevilmod.touch()\ndef f():\n    pass\n", "Expr statement"),
    ("import-side-effect", "import sidefx_a\ndef f():\n    pass\n", "not imported yet"),
    ("from-import-submodule", "from sidefxpkg import sub\ndef f():\n    pass\n", "not imported yet"),
    ("import-main", "import evilmod.__main__\ndef f():\n    pass\n", "__main__"),
    ("ctypes-subscript", "import ctypes\n_ = ctypes.cdll['libpicklehooks_marker.so']\ndef f():\n    pass\n", "subscript"),
    ("builtins-rebind", "from evilmod import touch as __builtins__\ndef f():\n    pass\n", "shadow"),
    ("lambda-default", "from evilmod import touch\ndef f(x=(lambda: touch())()):\n    pass\n", "calls"),
    ("walrus", "from evilmod import touch\n_ = (g := touch)()\ndef f():\n    pass\n", "calls"),
]


@pytest.mark.parametrize("case_id, text, match", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_text_is_refused(planted, case_id, text, match):
    """Each hostile text is refused with a DecodeError naming why, and runs nothing."""
    _assert_refused(text, planted, match)


@pytest.mark.parametrize("case_id, text, match", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_texts_really_run_code(planted, tmp_path, case_id, text, match):
    """Control: executed directly, each hostile text does write the marker (or import a side effect)."""
    if case_id in ("import-main", "builtins-rebind", "ctypes-subscript"):
        pytest.skip("refused by name: the danger is not in running the text once")
    sys.modules.pop("sidefx_a", None)
    sys.modules.pop("sidefxpkg.sub", None)
    try:
        exec(compile(text, "<hostile>", "exec", dont_inherit=True), {})
    except Exception:
        pass  # e.g. touch() returning 0 where a type was expected: the marker is written first
    assert planted.exists()
    planted.unlink()


def test_stdlib_side_effect_modules_are_not_imported(planted):
    """import antigravity / unittest.__main__ are refused without being imported."""
    before = set(sys.modules)
    _assert_refused("import antigravity\ndef f():\n    pass\n", planted, "antigravity")
    _assert_refused("import unittest.__main__\ndef f():\n    pass\n", planted, "__main__")
    _assert_refused("from unittest import __main__\ndef f():\n    pass\n", planted, "__main__")
    assert {"antigravity", "unittest.__main__", "webbrowser"} & (set(sys.modules) - before) == set()


def test_hub_may_not_import_itself(planted):
    """Text that imports the hub (to decode more hooks while being decoded) is refused."""
    _assert_refused("import picklehooks._hub\ndef f():\n    pass\n", planted, "hub")
    _assert_refused("from picklehooks import _hub\ndef f():\n    pass\n", planted, "hub")


class TestEverythingIsADecodeError:
    def test_undefined_name(self, planted):
        """A default naming an unbound name is refused up front (no NameError)."""
        _assert_refused("def f(x=undefined_thing):\n    pass\n", planted, "before binding")

    def test_missing_module_of_trusted_package(self, planted):
        """ModuleNotFoundError while importing becomes a DecodeError."""
        _assert_refused("import torch.no_such_module_xyz\ndef f():\n    pass\n", planted, "ModuleNotFoundError")

    def test_missing_module(self, planted):
        _assert_refused("import no_such_module_xyz\ndef f():\n    pass\n", planted, "no_such_module_xyz")

    def test_deep_nesting(self, planted):
        """Text nested deeper than the checker's recursion gives a DecodeError, not RecursionError."""
        deep = "import typing\ndef f(x: " + " | ".join(["typing.Any"] * 30000) + "):\n    pass\n"
        _assert_refused(deep, planted)

    def test_system_exit_while_importing(self, planted):
        """A trusted module that exits on import gives a DecodeError, not SystemExit."""
        with _shim.untrusted(trust=["exitmod"]):
            _assert_refused("import exitmod\ndef f():\n    pass\n", planted, "SystemExit")

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(name=st.text(min_size=1, max_size=80))
    def test_hasattr_never_raises(self, planted, name):
        """hasattr(hub, anything) is True or False, never an exception."""
        assert hasattr(_shim.hub(), name) in (True, False)


class TestOneTextOneName:
    def test_trailing_bytes_refused(self):
        """Bytes appended after the zstd frame make a different name for the same text: refused."""
        name = codec.encode("def f(x):\n    return x\n")
        frame = base64.b32decode(name[1:].replace("_", "="))
        forged = name[0] + base64.b32encode(frame + b"\x00junk").decode().replace("=", "_")
        with pytest.raises(picklehooks.DecodeError, match="after its zstd frame"):
            codec.decode(forged)
        assert codec.decode(name) == "def f(x):\n    return x\n"

    def test_non_canonical_base32_refused(self):
        """Unused low bits of the last base32 character must be zero, or one frame has many names."""
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
        for n in range(20):  # find a frame whose length leaves unused bits (it is padded)
            name = codec.encode(f"def g(x):\n    return x + {n}\n")
            payload = name[1:].rstrip("_")
            if len(payload) < len(name) - 1:
                break
        last = alphabet.index(payload[-1])
        forged = name[0] + payload[:-1] + alphabet[last ^ 1] + name[1 + len(payload):]
        assert base64.b32decode(forged[1:].replace("_", "=")) == base64.b32decode(name[1:].replace("_", "="))
        with pytest.raises(picklehooks.DecodeError, match="canonical"):
            codec.decode(forged)

    def test_total_decoded_text_is_bounded(self, monkeypatch):
        """Once a process decoded MAX_TOTAL_SOURCE_BYTES of hook text, further names are refused."""
        monkeypatch.setattr(_shim, "MAX_TOTAL_SOURCE_BYTES", _shim._total_decoded + 10)
        with pytest.raises(picklehooks.DecodeError, match="already decoded"):
            _resolve("def bounded_total(x):\n    return x * 3\n")
        monkeypatch.undo()
        assert _resolve("def bounded_total(x):\n    return x * 3\n")(2) == 6


def test_no_deadlock_when_an_import_resolves_another_hook(tmp_path):
    """Thread A imports a module that resolves hook 2; thread B resolves hook 1, which imports that module."""
    second = codec.encode("def second_hook(x):\n    return x + 2\n")
    (tmp_path / "resolves_at_import.py").write_text(
        "import time, picklehooks._shim as s\n"
        "STARTED.set()\n"
        "time.sleep(0.5)\n"
        f"SECOND = getattr(s.hub(), {second!r})\n".replace("STARTED", "__import__('builtins')._ph_started")
    )
    import builtins

    builtins._ph_started = threading.Event()
    sys.path.insert(0, str(tmp_path))
    results = {}
    try:
        first = codec.encode("import resolves_at_import\ndef first_hook(x):\n    return x + 1\n")

        def importer():
            import resolves_at_import

            results["a"] = resolves_at_import.SECOND(1)

        def resolver():
            builtins._ph_started.wait(5)
            results["b"] = getattr(_shim.hub(), first)(1)

        threads = [threading.Thread(target=importer, daemon=True), threading.Thread(target=resolver, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads), "deadlock: the hub lock was held across an import"
        assert results == {"a": 3, "b": 2}
    finally:
        sys.path.remove(str(tmp_path))
        del builtins._ph_started


def test_accepted_forms_still_define(planted):
    """What portable()/instrument() generate, and old generated calls, still decode."""
    fn = _resolve(
        """\
        import math
        import torch
        import torch.nn as nn
        from typing import Dict, List, Optional, Tuple
        import picklehooks._hookrt as _rt
        import evilmod
        inf = float('inf')
        dev = torch.device('cpu', 0)
        big = math.inf
        dt = torch.float32
        planted_class = evilmod.Evil
        table = {'a': (1, -2.0), 3: [None, b'x']}
        def accepted(module: nn.Module, inputs: Tuple[torch.Tensor, ...], output: Optional[List[torch.Tensor]],
                     extra: 'torch.Tensor | None' = None, *, flag: list[int] | None = None) -> Dict[str, torch.Tensor]:
            return {'n': inf}
        """
    )
    assert fn(None, (), None) == {"n": float("inf")}
    assert fn.__globals__["planted_class"] is sys.modules["evilmod"].Evil
    assert not planted.exists()


class TestUntrusted:
    def test_loaded_modules_need_trust(self, planted):
        """Under untrusted(), an already-imported module outside the trusted packages is refused, naming trust=."""
        text = "import evilmod\ndef g():\n    return evilmod\n"
        with _shim.untrusted():
            _assert_refused(text, planted, r"trust=\['evilmod'\]")
        with _shim.untrusted(trust=["evilmod"]):
            assert _resolve(text)() is sys.modules["evilmod"]

    def test_attribute_chains_of_untrusted_packages(self, planted):
        """Trusting a package lets chains read through its objects; default mode allows one step."""
        text = "import evilmod\nx = evilmod.Evil.mro\ndef h():\n    return x\n"
        _assert_refused(text, planted, "through an object")
        with _shim.untrusted(trust=["evilmod"]):
            assert _resolve(text)() is not None

    def test_bad_trust_values(self):
        with pytest.raises(picklehooks.PicklehooksError, match="top-level package names"):
            with _shim.untrusted(trust=["os.path"]):
                pass


# -- Property: a grammar of dangerous constructs never runs -------------------------------------

_BINDERS = [
    "from evilmod import touch as {n}\n",
    "from evilmod import Evil as {n}\n",
    "from evilmod import evil_obj as {n}\n",
    "import evilmod as {n}\n",
    "{n} = evilmod.touch\n",
    "from evilmod import touch\n{n} = touch\n",
]
_NAMES = ["float", "torch", "typing", "Optional", "list", "x", "__builtins__", "print"]
_EXPRS = [
    "{n}('x')", "{n}.device('cpu')", "{n}[int]", "{n} | None", "{{{n}}}", "{{{n}: 1}}", "-{n}", "f'{{{n}}}'",
    "{n}.attr", "{n}.attr.deeper", "[*{n}]", "({n} for _ in ())", "{n}.Optional[int]", "({n}, {n}('y'))",
    "(lambda: {n}())()", "{n}[{n}]", "evilmod.evil_obj.x", "evilmod.Evil[{n}]",
]
_PLACES = [
    "v = {e}\ndef f():\n    pass\n",
    "def f(a={e}):\n    pass\n",
    "def f(*, a={e}):\n    pass\n",
    "def f(a: {e}):\n    pass\n",
    "def f() -> {e}:\n    pass\n",
    "def f(*a: {e}):\n    pass\n",
    "v = ({e},)\ndef f():\n    pass\n",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    binder=st.sampled_from(_BINDERS),
    name=st.sampled_from(_NAMES),
    expr=st.sampled_from(_EXPRS),
    place=st.sampled_from(_PLACES),
    preamble=st.sampled_from(["", "import typing\n", "import torch\n", "import evilmod\n"]),
)
def test_grammar_of_dangerous_constructs_never_runs(planted, binder, name, expr, place, preamble):
    """Texts built from rebinding + dangerous expression + evaluated position never write the marker."""
    text = preamble + binder.format(n=name) + place.format(e=expr.format(n=name))
    try:
        _resolve(text)
    except picklehooks.DecodeError:
        pass
    assert not planted.exists(), f"decoding ran code:\n{text}"
