"""Noticing model surgery: an instrumented model whose module tree changed since ``instrument()``.

PEFT's ``get_peft_model`` wraps each target ``Linear`` in a LoRA layer (the
``Linear`` moves to ``….q_proj.base_layer``), ``merge_and_unload`` puts the
``Linear`` back, quantisation tools replace layers. Hooks stay on the module
objects, but the names they were given describe the old tree. :func:`check`
(run as each ``record()`` block starts, and as a training callback's recorded
step starts) compares each live instrumentation's model with the tree it was
made for; where it changed it

* renames what moved: each instrumented module (and each module whose
  parameters' gradients are watched) gets its current qualified name, so
  records never carry a name that no longer exists;
* warns once per change, naming the modules moved, gone and new (those the
  spec would choose now but that have no hooks), and the fix: ``handle.refresh()``.

Limits: an instrumentation is watched while something holds its handle: the
caller, or the hook dictionaries of its modules (:func:`picklehooks.capture.hookdict.keep`),
which is not the case with ``PICKLEHOOKS_IDLE_HOOKS=0`` or on modules that had
hooks before ``instrument()``, and while its model lives (the handle holds the model
and its modules weakly, :class:`WeakModules`: no reference cycle keeps a deleted
model); a module no longer in the tree keeps its old name (its hooks run
only if something still calls it); the check walks each instrumented model's
modules once per ``record()`` (in C where the extension is built: for the bench's 37-module MLP
about 1 µs with warm caches and 7 to 11 µs right after a forward pass, against 11 and 28 to 45 µs
in Python); models
scripted, compiled or exported after instrumenting are not checked (their
names are fixed in their graphs).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import MutableMapping

from .. import _native, _ops
from .._shim import PicklehooksError
from . import hookdict as _hookdict
from .spec import from_spec, select

__all__ = ["check", "track", "untrack", "live", "WeakModules"]

_NAME_ATTR = "_picklehooks_name"
# The instrumentations with hooks on a model (kept alive by it): id -> weak reference. A dict, not a
# WeakSet, whose iteration is Python code (1.3 µs of each record() for one instrumentation).
_LIVE: dict[int, weakref.ref] = {}


class WeakModules(MutableMapping):
    """Qualified name -> module, holding each module (and, with ``params=True``, its own parameters) weakly.

    An instrumentation's tables of modules: the modules keep their handle alive
    (:func:`picklehooks.capture.hookdict.keep`), so a handle that held them strongly would
    make a reference cycle, and a model deleted would stay in memory (on its GPU too) until
    the garbage collector ran; ``torch.utils.hooks.RemovableHandle`` holds its hook
    dictionaries weakly for the same reason. A module that was freed drops out of the
    mapping's view, but its entry stays until :func:`check` reports it gone (its address
    may be reused by a module that replaced it, which the tree's fingerprint can't tell
    apart: :attr:`died` says to look) and ``remove()`` unwatches the parameters it had
    (they may live on in another module). ``params``: keep the module's own parameters,
    weakly, as they were when it was added, for that.
    """

    __slots__ = ("_refs", "_params", "died", "_on_death", "__weakref__")

    def __init__(self, *, params: bool = False) -> None:
        self._refs: dict[str, tuple[weakref.ref, tuple]] = {}
        self._params = params
        #: A module in the mapping was freed since :func:`check` last looked.
        self.died = False
        this = weakref.ref(self)

        def on_death(ref, this=this):  # holds the mapping weakly: no cycle through the callback
            table = this()
            if table is not None:
                table.died = True

        self._on_death = on_death

    def __getitem__(self, name: str):
        module = self._refs[name][0]()
        if module is None:
            raise KeyError(name)
        return module

    def __setitem__(self, name: str, module) -> None:
        params = tuple(weakref.ref(p) for p in module.parameters(recurse=False)) if self._params else ()
        self._refs[name] = (weakref.ref(module, self._on_death), params)

    def __delitem__(self, name: str) -> None:
        del self._refs[name]

    def __iter__(self):
        return iter([name for name, (ref, _) in self._refs.items() if ref() is not None])

    def __len__(self) -> int:
        return sum(1 for ref, _ in self._refs.values() if ref() is not None)

    def items(self) -> list:  # each reference read once: a module freed meanwhile is left out, not a KeyError
        return [(name, module) for name, module in ((n, ref()) for n, (ref, _) in list(self._refs.items()))
                if module is not None]

    def values(self) -> list:
        return [module for _, module in self.items()]

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    def entries(self) -> list[tuple[str, tuple]]:
        """Every (name, entry), a freed module's too: give an entry to :func:`entry_module` and :func:`entry_params`."""
        return list(self._refs.items())

    def take(self, name: str) -> tuple:
        """Remove ``name``'s entry, a freed module's too, and return it."""
        return self._refs.pop(name)

    def clear(self) -> None:
        self._refs.clear()


def entry_module(entry: tuple):
    """The module of a :class:`WeakModules` entry, or None once it was freed."""
    return entry[0]()


def entry_params(entry: tuple) -> list:
    """The module's own parameters now; those it had when added that still live, once it was freed."""
    module = entry[0]()
    if module is not None:
        return list(module.parameters(recurse=False))
    return [p for p in (ref() for ref in entry[1]) if p is not None]


def _fingerprint(model) -> list:
    """Every module's identity and child names, depth first: changes whenever a module is replaced,
    moved, added or removed. Read off the ``_modules`` dicts (no qualified names are built): about
    0.2 µs a module, paid at each ``record()``."""
    out, stack = [], [model]
    while stack:
        module = stack.pop()
        out.append(id(module))
        for key, child in module._modules.items():
            if child is not None:
                out.append(key)
                stack.append(child)
    return out


def track(handle) -> None:
    """Watch ``handle``'s model from now on, as it is now; its modules keep it alive meanwhile
    (the handle holds them, and the model, weakly: see :class:`WeakModules`)."""
    model = handle.model
    if model is None:
        return
    handle._tree = _fingerprint(model)
    handle.modules.died = handle._watching.died = False
    key = id(handle)

    def forget(ref, key=key):
        if _LIVE.get(key) is ref:  # not a newer handle at the same address
            del _LIVE[key]

    _LIVE[key] = weakref.ref(handle, forget)
    for module in handle.modules.values():
        _hookdict.keep(module, handle)


def untrack(handle) -> None:
    ref = _LIVE.get(id(handle))
    if ref is not None and ref() is handle:
        del _LIVE[id(handle)]


def live() -> list:
    """The instrumentations with hooks on a model now (not one whose model was freed while its handle was held)."""
    return [handle for handle in (ref() for ref in list(_LIVE.values()))
            if handle is not None and handle.model is not None]


def check() -> None:
    """Rename moved modules and warn about changed trees, for every live instrumentation."""
    for ref in list(_LIVE.values()):
        handle = ref()
        if handle is not None:
            model = handle.model
            if model is not None:
                _check(handle, model)


def _check(handle, model) -> None:
    # A hooked or watched module that was freed: its address may now be a new module's, in its
    # place in the tree, which the fingerprint (addresses) can't tell from the old one.
    died = handle.modules.died or handle._watching.died
    same = None if died else _native.same_tree(model, handle._tree)  # the walk in C; None: compare in Python
    if same:
        return
    tree = _fingerprint(model)
    if not died and same is None and tree == handle._tree:
        return
    handle._tree = tree
    handle.modules.died = handle._watching.died = False
    now: dict[int, str] = {}
    for name, module in model.named_modules():
        now.setdefault(id(module), name)
    moved, gone = {}, []
    for kind, table in (("hooked", handle.modules), ("watched", handle._watching)):
        for old, entry in table.entries():
            module = entry_module(entry)
            new = None if module is None else now.get(id(module))
            if new is None:  # set aside: remove() still cleans it, and its name is free for a module moving in
                gone.append(old)
                handle._gone.append((kind, old, table.take(old)))
            elif new != old:
                moved[old] = new
    _rename(handle, moved)
    try:
        settings = from_spec(handle._spec)
        wanted = select(model, settings.get("modules"), settings.get("depth"))
    except PicklehooksError:  # the spec chooses nothing in the new tree
        wanted = {}
    have = {id(m) for m in [*handle.modules.values(), *handle._watching.values()]}
    new_modules = [n for n, m in wanted.items() if id(m) not in have and n not in handle.skipped]
    if not (moved or gone or new_modules):
        return
    parts = []
    if moved:
        parts.append("moved: " + _listing(f"{o} -> {n}" for o, n in moved.items()))
    if gone:
        parts.append("no longer in the model: " + _listing(sorted(set(gone))))
    if new_modules:
        parts.append("new, without hooks: " + _listing(new_modules))
    warnings.warn(
        f"the modules of the instrumented {type(model).__name__} changed since instrument() (replaced or wrapped, "
        f"as PEFT and quantisation tools do); {'; '.join(parts)}. Records use the modules' current names; call "
        "handle.refresh() to instrument the model as it is now, with the same spec", UserWarning, stacklevel=4)


def _listing(items, limit: int = 6) -> str:
    items = list(items)
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _rename(handle, moved: dict[str, str]) -> None:
    """Each ``old`` name is ``moved[old]`` now: its hooks and watched parameters' records say so from here on.

    Taken out under the old names first, then put back under the new ones: two modules may swap names.
    """
    taken = [(old, new, handle.modules.pop(old, None), handle.skipped.pop(old, None), handle._watching.pop(old, None))
             for old, new in moved.items()]
    for old, new, module, skipped, watched in taken:
        if module is not None:
            module.__dict__[_NAME_ATTR] = new
            handle.modules[new] = module
        if skipped is not None:
            handle.skipped[new] = skipped
        if watched is not None:
            own = [(n, p) for n, p in watched.named_parameters(recurse=False) if p is not None]
            _ops.unwatch_grads([p for _, p in own], old)
            _ops.watch_grads(new, [n for n, _ in own], [p for _, p in own], handle._state_flags, claim=True)
            handle._watching[new] = watched
