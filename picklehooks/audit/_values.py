"""Symbolic values: what a pickle *would* build, without building it.

Globals become :class:`Global` placeholders, calls (``REDUCE``, ``NEWOBJ``
...) become :class:`Obj` nodes that record what would be called with what,
and persistent ids, extension codes and out-of-band buffers become
:class:`Placeholder` nodes. Dicts and sets are our own classes, not
dict/set: keys and items stay in pickle order and never need to be hashable
(a Global, a node, a list ...). Every class has ``__slots__``: a pickle may
hold millions of them.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from .._shim import HUB_NAME

# torch.package loads modules under a mangled name: "<torch_package_0>.pkg.mod".
_PACKAGE_MANGLE = re.compile(r"<torch_package_\d+>\.")


def demangle(module: str) -> str:
    return _PACKAGE_MANGLE.sub("", module, count=1) if module.startswith("<") else module


class Global:
    """A reference loading would resolve: ``GLOBAL``/``STACK_GLOBAL``/``INST``, or a ``getattr`` on one.

    ``path`` is the dotted path it resolves to (mangling removed): since
    protocol 4 pickle resolves a dotted ``name`` attribute by attribute, so
    ``("picklehooks", "_hub.<hook>")`` is the hook ``picklehooks._hub.<hook>``.
    ``via`` says how the file names it: ``"global"`` or ``"getattr"``.
    """

    __slots__ = ("module", "name", "path", "via")

    def __init__(self, module: str, name: str, via: str = "global") -> None:
        self.module, self.name, self.via = module, name, via
        self.path = f"{demangle(module)}.{name}"

    @property
    def dotted(self) -> str:
        return self.path

    @property
    def hub_name(self) -> str | None:
        """The hook name if this is ``picklehooks._hub.<name>``, else None."""
        head, _, rest = self.path.rpartition(".")
        return rest if head == HUB_NAME and rest else None

    def __repr__(self) -> str:
        return f"<Global {self.path[:60]}>"


class Node:
    """Something loading would create by running code; collects what is applied to it."""

    __slots__ = ("states", "items", "dictitems")

    def __init__(self) -> None:
        self.states: list[Any] = []  # BUILD arguments, in order
        self.items: list[Any] = []  # APPEND(S) onto it
        self.dictitems: list[tuple[Any, Any]] = []  # SETITEM(S) onto it

    def __repr__(self) -> str:  # never recurse: the graph may be cyclic
        return f"<{type(self).__name__} at {id(self):#x}>"


class Obj(Node):
    """A call: ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` or ``INST``.

    ``ref`` is set when the call's result is itself a known reference:
    ``getattr(<path>, "name")``, ``importlib.import_module("mod")``,
    ``picklehooks._shim.hub()``.
    """

    __slots__ = ("func", "args", "kwargs", "ref")

    def __init__(self, func: Any, args: Any, kwargs: Any = None) -> None:
        super().__init__()
        self.func, self.args, self.kwargs = func, args, kwargs
        self.ref: Global | str | None = None


class Placeholder(Node):
    """A value only the loader could supply: persistent id, extension code, out-of-band buffer.

    ``hook_name`` is set for the persistent id under which ``torch.package``
    stores a picklehooks hook.
    """

    __slots__ = ("what", "detail", "hook_name")

    def __init__(self, what: str, detail: Any = None, hook_name: str | None = None) -> None:
        super().__init__()
        self.what, self.detail, self.hook_name = what, detail, hook_name


class PDict:
    """A dict as ``(key, value)`` pairs, in pickle order."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: Iterable[tuple[Any, Any]] = ()) -> None:
        self.pairs: list[tuple[Any, Any]] = list(pairs)

    def get(self, key: str) -> Any:
        """The value of the last ``key`` entry (as dict assignment would leave it), or None."""
        found = None
        for k, v in self.pairs:
            if isinstance(k, str) and k == key:
                found = v
        return found

    def __repr__(self) -> str:
        return f"<PDict of {len(self.pairs)} at {id(self):#x}>"


class PSet:
    """A set or frozenset as a list of items."""

    __slots__ = ("frozen", "items")

    def __init__(self, frozen: bool, items: Iterable[Any] = ()) -> None:
        self.frozen = frozen
        self.items: list[Any] = list(items)

    def __repr__(self) -> str:
        return f"<PSet of {len(self.items)} at {id(self):#x}>"


# What the walk descends into; everything else is a leaf (str, int, Global ...).
NESTS = (Node, PDict, PSet, list, tuple)
