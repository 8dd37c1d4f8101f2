"""portable(): what it bakes in, what it imports, what it refuses, and sharing."""

from __future__ import annotations

import functools
import io
import math
import pickle
import typing
from typing import Tuple

import pytest
import torch
import torch.nn as nn

import picklehooks
from picklehooks.serialize.portable import module_text
from tests import hooks

LOG: list = []


def _out(fn, value=1.0):
    return fn(None, None, torch.tensor([value]))


class TestBehaviour:
    def test_same_results_as_original(self):
        """The portable twin computes what the original computes."""
        for original in (hooks.double_output, hooks.make_clamp(0.5), hooks.make_clamp(2.0, torch.float64)):
            twin = picklehooks.portable(original)
            assert twin is not original
            assert torch.equal(_out(twin, 1.7), _out(original, 1.7))

    def test_decorator(self):
        """portable works as a decorator."""

        @picklehooks.portable
        def triple(module, inputs, output):
            return output * 3

        assert picklehooks.is_portable(triple) and _out(triple).item() == 3.0

    def test_idempotent(self):
        """portable(portable(f)) is portable(f)."""
        once = picklehooks.portable(hooks.double_output)
        assert picklehooks.portable(once) is once

    def test_annotations_kept(self):
        """Type annotations survive, because TorchScript needs them."""
        twin = picklehooks.portable(hooks.typed_forward)
        assert typing.get_type_hints(twin) == typing.get_type_hints(hooks.typed_forward)

    def test_nested_functions_and_defaults(self):
        """Inner functions, comprehensions and default values work."""
        offset = 2

        def hook(module, inputs, output, scale: float = 0.5):
            def inner(t):
                return t * scale + offset

            return sum(inner(x) for x in [output, output])

        assert _out(picklehooks.portable(hook)).item() == 5.0

    def test_mutable_constants_are_copied(self):
        """Captured lists are baked as values, so later changes don't leak in."""
        weights = [1, 2]

        def hook(module, inputs, output):
            return output * sum(weights)

        twin = picklehooks.portable(hook)
        weights.append(100)
        assert _out(twin).item() == 3.0


class TestBaking:
    def test_constants(self):
        """Plain constants, containers, dtype, device and non-finite floats are baked in."""
        consts = dict(s="x", i=3, f=0.1, b=True, n=None, by=b"\x00", t=(1,), l=[1.5, "a"], d={"k": (2, 3)},
                      dt=torch.bfloat16, dev=torch.device("cpu"), nan=math.nan, inf=-math.inf)

        def make(s, i, f, b, n, by, t, l, d, dt, dev, nan, inf):
            def hook(module, inputs, output):
                return (s, i, f, b, n, by, t, l, d, dt, dev, nan, inf)

            return hook

        got = _out(picklehooks.portable(make(**consts)))
        for (key, want), have in zip(consts.items(), got):
            assert have == want or (key == "nan" and math.isnan(have)), key
            assert type(have) is type(want), key

    def test_imports(self):
        """Modules and importable objects become import lines."""
        text = module_text(hooks.make_clamp(1.0))
        assert "import math\n" in text
        assert "import torch.nn.functional as F\n" in text
        text = module_text(hooks.typed_forward)
        assert "import torch.nn as nn\n" in text and "from typing import Tuple\n" in text

    def test_from_import_alias(self):
        """An object imported under another name keeps that name."""
        from math import sqrt as root

        def hook(module, inputs, output):
            return root(output.item())

        assert "from math import sqrt as root\n" in module_text(hook)
        assert _out(picklehooks.portable(hook), 4.0) == 2.0

    def test_builtins_are_not_imported(self):
        """Builtins stay builtins."""

        def hook(module, inputs, output):
            return len(inputs), abs(output)

        assert module_text(hook).startswith("def hook")


class TestRefusals:
    def _refuse(self, fn, *fragments):
        with pytest.raises(picklehooks.PicklehooksError) as info:
            picklehooks.portable(fn)
        for fragment in fragments:
            assert fragment in str(info.value)

    def test_tensor(self):
        """A captured tensor is refused with a hint to use a buffer."""
        bias = torch.ones(3)

        def hook(module, inputs, output):
            return output + bias

        self._refuse(hook, "'bias'", "Tensor", "buffer")

    def test_mutable_object(self):
        """A module-level list of arbitrary objects or an instance is refused."""
        self._refuse(hooks.make_recorder([]), "'sink'", "in place")

        def hook(module, inputs, output):
            LOG.append(output)

        hook.__globals__["LOG"] = [object()]
        self._refuse(hook, "'LOG'")

    def test_open_file(self):
        """An open file is refused, naming the variable."""
        handle = io.StringIO()

        def hook(module, inputs, output):
            handle.write(str(output))

        self._refuse(hook, "'handle'", "StringIO")

    def test_unknown_global(self):
        """A name that isn't defined is refused."""

        def hook(module, inputs, output):
            return not_defined_anywhere(output)  # noqa: F821

        self._refuse(hook, "'not_defined_anywhere'", "not defined")

    def test_local_function(self):
        """A helper defined inside a function can't be imported elsewhere."""

        def helper(x):
            return x

        def hook(module, inputs, output):
            return helper(output)

        self._refuse(hook, "'helper'", "local function")

    def test_main_module_object(self):
        """Objects living in __main__ are refused."""

        def helper(x):
            return x

        helper.__module__, helper.__qualname__ = "__main__", "helper"

        def hook(module, inputs, output):
            return helper(output)

        self._refuse(hook, "'helper'", "__main__")

    def test_nonlocal(self):
        """A hook that writes to its creator's variables is refused."""
        count = 0

        def hook(module, inputs, output):
            nonlocal count
            count += 1

        self._refuse(hook, "nonlocal")

    def test_global_write(self):
        """Assigning a global is refused."""

        def hook(module, inputs, output):
            global LOG
            LOG = output

        self._refuse(hook, "'LOG'")

    def test_not_a_function(self):
        """Partials, builtins and methods are refused with a hint."""
        self._refuse(functools.partial(hooks.double_output, None), "partial", "def")
        self._refuse(print, "builtin")

    def test_no_source(self):
        """A function built by exec() has no source to carry."""
        namespace: dict = {}
        exec("def hook(module, inputs, output):\n    return output\n", namespace)
        self._refuse(namespace["hook"], "source")

    def test_self_referencing_container(self):
        """A list that contains itself can't be a literal."""
        loop: list = []
        loop.append(loop)

        def hook(module, inputs, output):
            return loop

        self._refuse(hook, "'loop'", "contains itself")


class TestLambdas:
    def test_two_lambdas_on_one_line(self):
        """Each lambda on a shared line is found by its source position."""
        pair = [lambda m, i, o: o * 5, lambda m, i, o: o * 7]
        twins = [picklehooks.portable(f) for f in pair]
        assert [_out(t).item() for t in twins] == [5.0, 7.0]

    def test_lambda_inside_a_call_with_closure(self):
        """A lambda passed inline, capturing a constant, works."""
        k = 11
        module = nn.Linear(1, 1)
        module.register_forward_hook(picklehooks.portable(lambda m, i, o: o * 0 + k))
        assert module(torch.ones(1, 1)).item() == 11.0

    def test_nested_lambdas(self):
        """The outer and inner lambda are told apart."""
        outer = lambda m, i, o: (lambda t: t + 1)(o)  # noqa: E731
        assert _out(picklehooks.portable(outer)).item() == 2.0


class TestSharing:
    def test_equal_sources_share_one_function(self):
        """Closures with equal constants become one function; different constants two."""
        a, b, c = (picklehooks.portable(hooks.make_clamp(x)) for x in (0.5, 0.5, 0.7))
        assert a is b and a is not c

    def test_pickle_carries_k_names_for_n_modules(self):
        """20 hooked modules with 2 distinct hooks put exactly 2 names in the pickle."""
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)])
        distinct = [picklehooks.portable(hooks.double_output), picklehooks.portable(hooks.make_clamp(9.0))]
        for index, layer in enumerate(model):
            layer.register_forward_hook(picklehooks.portable(
                hooks.double_output if index % 2 else hooks.make_clamp(9.0)))
        data = pickle.dumps(model, protocol=4)
        for fn in distinct:
            assert data.count(fn.__name__.encode()) == 1
