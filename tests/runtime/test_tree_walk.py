"""The C tree check (csrc/tree.c's ``same_tree``) answers what comparing Python fingerprints answers.

``record()`` asks :func:`picklehooks._native.same_tree` whether an instrumented
model's module tree is still the one :func:`picklehooks.capture.tree._fingerprint`
took; where it says ``None`` (and always with the twin) the Python fingerprints are
compared. Each case below changes a model the way surgery does and holds the C's
answer to ``_fingerprint(model) == tree``; then the end-to-end check: a change
that only the walk can see (no module is registered: a ``ModuleList`` entry
deleted) still renames the records, with the extension and without.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch
from torch import nn

from picklehooks import _native
from picklehooks.capture.tree import _fingerprint

same_tree = getattr(_native._speedups, "same_tree", None)
needs_c = pytest.mark.skipif(same_tree is None, reason="the C extension is not built")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 3)),
                         nn.ModuleList([nn.Tanh(), nn.GELU(), nn.Identity()]))


def _replace(m):
    m[1][1] = nn.Linear(3, 3)


def _wrap(m):
    m[0] = nn.Sequential(m[0])


def _add(m):
    m[1].add_module("extra", nn.Identity())


def _delete_from_list(m):
    del m[2][0]  # ModuleList re-keys its _modules: no module is registered


def _delete_attr(m):
    del m[1]._modules["1"]


def _none_child(m):
    m[1].register_module("1", None)


def _swap(m):
    m[1]._modules["0"], m[1]._modules["1"] = m[1]._modules["1"], m[1]._modules["0"]


def _rename_key(m):
    m[1]._modules = {"a" if k == "0" else k: v for k, v in m[1]._modules.items()}


def _move_to_leaf(m):
    m[0].add_module("inner", m[2][1])


def _reorder_ordered(m):
    m[1]._modules = OrderedDict(m[1]._modules)
    m[1]._modules.move_to_end("0")  # the order of .items(), not of the dict underneath


class Children(dict):
    pass


CHANGES = [_replace, _wrap, _add, _delete_from_list, _delete_attr, _none_child, _swap, _rename_key,
           _move_to_leaf, _reorder_ordered]


@needs_c
def test_an_unchanged_tree_is_the_same():
    m = model()
    assert same_tree(m, _fingerprint(m)) is True
    assert same_tree(nn.Linear(2, 2), _fingerprint(nn.Linear(2, 2))) is False  # another module's id


@needs_c
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_each_change_answers_as_the_python_fingerprints_do(change):
    m = model()
    before = _fingerprint(m)
    change(m)
    assert _fingerprint(m) != before  # the case is a change at all
    assert same_tree(m, before) is False
    assert same_tree(m, _fingerprint(m)) is True


@needs_c
def test_an_ordered_dict_is_walked_in_its_own_order():
    m = model()
    del m[2][0]  # ModuleList.__delitem__ leaves an OrderedDict
    assert type(m[2]._modules) is OrderedDict or type(m[2]._modules) is dict
    m[1]._modules = OrderedDict(m[1]._modules)
    assert same_tree(m, _fingerprint(m)) is True


@needs_c
def test_a_tree_cut_short_or_too_long_is_not_the_same():
    m = model()
    tree = _fingerprint(m)
    assert same_tree(m, tree[:-1]) is False
    assert same_tree(m, [*tree, "more"]) is False
    assert same_tree(m, []) is False


@needs_c
def test_what_only_python_can_read_is_left_to_it():
    m = model()
    tree = _fingerprint(m)
    assert same_tree(m, tuple(tree)) is None  # not a list
    assert same_tree(m, [float(tree[0]), *tree[1:]]) is None  # not an int
    m[1]._modules = Children(m[1]._modules)  # a subclass may iterate as it likes
    assert same_tree(m, _fingerprint(m)) is None
    m = model()
    m[1]._modules[0] = m[1]._modules.pop("0")  # a key that isn't a str
    assert same_tree(m, _fingerprint(m)) is None


@needs_c
def test_the_walk_raises_what_reading_raises():
    with pytest.raises(TypeError, match="takes 2 arguments"):
        same_tree(model())


def test_the_twin_leaves_it_to_python():
    assert _native._twin.same_tree(model(), []) is None


SCRIPT = textwrap.dedent("""
    import warnings
    import torch
    from torch import nn
    import picklehooks
    from picklehooks import _native
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Tanh(), nn.GELU()]))
    picklehooks.instrument(m, modules=["1.0", "1.1"])
    del m[1][0]  # 1.1 (GELU) is 1.0 now; nothing was registered
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with picklehooks.record() as log:
            m[1][0](torch.ones(3))
    renamed = any("1.1 -> 1.0" in str(w.message) for w in caught)
    print(_native.AVAILABLE, sorted({r.module for r in log.records}), renamed, sep="|")
""")


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_deleted_list_entry_renames_the_records(native):
    """Fresh processes, with the extension and with the twin: the check sees a change no hook announces."""
    env = {**os.environ, "PICKLEHOOKS_NATIVE": native}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True).stdout
    available, modules, warned = out.strip().split("|")
    if native == "1" and same_tree is None:
        pytest.skip("the C extension is not built")
    assert available == ("True" if native == "1" else "False")
    assert (modules, warned) == ("['1.0']", "True"), out
