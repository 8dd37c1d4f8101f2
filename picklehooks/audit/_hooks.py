"""Finding hooks in the symbolic values: which module each hook is registered on, and as what.

Limits:

* A module's qualified name ("fc", "encoder.0") is known only where the pickle
  shows it: through the ``_modules`` dicts of ``nn.Module`` states below a
  module. A model inside a container gets the container path
  (``['model'].fc``); a module reachable only from a discarded or orphaned
  value gets ``?``; the root module is ``""``, shown as ``(root)``. Paths are
  cut after :data:`._limits.MAX_LOCATION` characters.
* A hook is found when it sits, directly or inside torch's ``_WrappedHook``,
  in a hook dict (a state key ending in ``hooks``, such as ``_forward_hooks``)
  of an ``nn.Module`` state, as a ``picklehooks._hub.<name>`` reference
  (however the pickle spells it: a global, a dotted protocol-4 name, a
  ``getattr`` on the hub) or as the persistent id a ``torch.package``
  exporter writes. Any other hub reference is still listed, as a
  ``function`` on module ``?``.
* A value (a state dict, a hook dict) that several modules share through
  the pickle's memo is read once, under the first module that reaches it:
  reading it again per module is how a small file becomes a long audit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ._limits import MAX_LOCATION, show
from ._machine import Parsed
from ._values import NESTS, Global, Node, Obj, PDict, Placeholder, PSet


@dataclass(frozen=True)
class HookEntry:
    """One hook found in a file.

    ``module`` is the qualified module name ("" for the root, "?" when the
    pickle doesn't show it); ``kind`` comes from the hook dict's key
    (``_forward_pre_hooks`` -> ``forward_pre``) or is ``function`` for a hub
    reference outside any hook dict. ``name`` is the hub name of a picklehooks
    hook, or ``module.qualname`` of a foreign one. A picklehooks hook has its
    decoded ``source`` or, when the name doesn't decode, an ``error``; a
    foreign hook has neither. ``resource`` is the archive member ("" for a plain file).
    """

    module: str
    kind: str
    name: str
    source: str | None
    error: str | None
    resource: str = ""

    @property
    def foreign(self) -> bool:
        """True for a hook that is not a picklehooks hook (its code is not in the file)."""
        return self.source is None and self.error is None


def hub_name(ref: Any) -> str | None:
    """The hook name if ``ref`` is a hub reference (plain, dotted, via getattr, or packaged), else None."""
    if isinstance(ref, Placeholder):
        return ref.hook_name
    if isinstance(ref, Obj) and isinstance(ref.ref, Global):
        ref = ref.ref
    if isinstance(ref, Global):
        return ref.hub_name
    return None


def _is_hook_key(key: str) -> bool:
    # _forward_hooks, _backward_pre_hooks, _state_dict_hooks, ... and the
    # companions _forward_hooks_with_kwargs / _always_called (whose values are
    # flags, which the caller skips).
    return key.endswith("hooks") or "_hooks_" in key


def _kind(key: str) -> str:
    """``_forward_pre_hooks`` -> ``forward_pre``; ``_forward_hooks_with_kwargs`` -> ``forward_with_kwargs``."""
    kind = key.strip("_").replace("_hooks", "")
    if kind.endswith("hooks"):
        kind = kind[: -len("hooks")].rstrip("_")
    return kind or "hook"


def _state_dicts(node: Node) -> Iterator[PDict]:
    """The dict part of each BUILD state (``__dict__``, or ``(__dict__, slots)``)."""
    for state in node.states:
        if isinstance(state, PDict):
            yield state
        elif isinstance(state, tuple) and len(state) == 2:
            yield from (part for part in state if isinstance(part, PDict))


def _dict_pairs(value: Any) -> list[tuple[Any, Any]]:
    """Entries of a dict or of an OrderedDict-like node."""
    if isinstance(value, PDict):
        return value.pairs
    if isinstance(value, Node):
        return value.dictitems
    return []


def _join(prefix: str, name: str) -> str:
    """``prefix.name``, cut at MAX_LOCATION: a deep tree must not cost a path per level."""
    if len(prefix) >= MAX_LOCATION:
        return prefix
    text = f"{prefix}.{name}" if prefix else name
    return text if len(text) <= MAX_LOCATION else text[: MAX_LOCATION - 3] + "..."


def _key_text(key: Any) -> str:
    """A container key as shown in a location: ``['model']``, ``[0]``; long or odd keys abbreviated."""
    if not isinstance(key, (str, int, float, bytes, bool, type(None))):
        return "?"
    return f"[{show(key)}]"


def _name_text(key: Any) -> str:
    """A submodule's name as a path component (a str; anything else shown abbreviated)."""
    return key[: MAX_LOCATION + 1] if isinstance(key, str) else show(key)


class Collector:
    """Gathers hook entries for one resource, deduplicated, in the order found.

    ``decode`` maps a hub name to ``(source, error)``; it is shared across
    resources, so that each name is decoded once.
    """

    def __init__(self, resource: str, decode: Any) -> None:
        self.resource = resource
        self.entries: dict[tuple[str, str, str], HookEntry] = {}
        self.attached: set[str] = set()  # hub names seen in some module's hook dict
        self._decode = decode
        self._seen_hook_dicts: set[int] = set()

    def add(self, module: str, kind: str, fn: Any) -> None:
        # torch wraps state-dict hooks in _WrappedHook, whose state is {"hook": fn, ...}.
        if isinstance(fn, Obj) and fn.ref is None:
            for state in _state_dicts(fn):
                if isinstance(state.get("hook"), (Global, Placeholder, Obj)):
                    fn = state.get("hook")
                    break
        name = hub_name(fn)
        if name is not None:
            self.attached.add(name)
            self._add_hub(module, kind, name)
        elif isinstance(fn, Global):
            self._put(HookEntry(module, kind, fn.dotted, None, None, self.resource))
        elif isinstance(fn, Obj):  # functools.partial(...), a callable instance ...
            what = fn.func.dotted if isinstance(fn.func, Global) else "<computed callable>"
            self._put(HookEntry(module, kind, f"{what}(...)", None, None, self.resource))
        # Anything else (the True flags of _forward_hooks_with_kwargs ...) is no hook.

    def add_loose(self, g: Global) -> None:
        """A hub reference outside every hook dict (a bare pickled function ...)."""
        name = g.hub_name
        if name is not None and name not in self.attached:
            self._add_hub("?", "function", name)

    def _add_hub(self, module: str, kind: str, name: str) -> None:
        source, error = self._decode(name)
        self._put(HookEntry(module, kind, name, source, error, self.resource))

    def _put(self, entry: HookEntry) -> None:
        self.entries.setdefault((entry.module, entry.kind, entry.name), entry)

    def module(self, path: str, state: PDict) -> None:
        for key, value in state.pairs:
            if isinstance(key, str) and _is_hook_key(key) and id(value) not in self._seen_hook_dicts:
                self._seen_hook_dicts.add(id(value))
                for _hook_id, fn in _dict_pairs(value):
                    self.add(path, _kind(key), fn)


def walk(parsed: Parsed, collector: Collector) -> None:
    """Visit every value once, depth first in pickle order, naming modules as we go.

    Iterative, because a checkpoint's tree can be deeper than Python's
    recursion limit, and visited-by-identity, because memo references make
    it a graph (possibly cyclic).
    """
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(value, "?") for value in reversed(parsed.extras) if isinstance(value, NESTS)]
    todo.append((parsed.root, ""))  # the root first, so it names what it reaches
    while todo:
        value, loc = todo.pop()
        if id(value) in seen or not isinstance(value, NESTS):
            continue
        seen.add(id(value))
        # Only values that can hold others are pushed (and get a location
        # string built): most of a checkpoint is strings and numbers.
        children: list[tuple[Any, str]] = []
        if isinstance(value, Node):
            for part in _state_dicts(value):
                if id(part) in seen:  # shared through the memo: read under its first owner only
                    continue
                seen.add(id(part))
                submodules = part.get("_modules")
                if isinstance(submodules, (PDict, Obj)):  # an nn.Module (an OrderedDict before torch 2.0)
                    collector.module(loc, part)
                    if id(submodules) not in seen:
                        seen.add(id(submodules))  # its values are named below, not as ['key']
                        children += [(v, _join(loc, _name_text(k))) for k, v in _dict_pairs(submodules) if isinstance(v, NESTS)]
                children += [(v, _join(loc, _name_text(k))) for k, v in part.pairs if isinstance(v, NESTS)]
            children += [(part, loc) for part in value.states if not isinstance(part, PDict)]
            if isinstance(value, Obj):
                children += [(value.func, loc), (value.args, loc), (value.kwargs, loc)]
            elif isinstance(value, Placeholder):
                children.append((value.detail, loc))
            children += _item_children(value.items, loc)
            children += _pair_children(value.dictitems, loc)
        elif isinstance(value, PDict):
            children += _pair_children(value.pairs, loc)
        elif isinstance(value, PSet):
            children += [(v, loc) for v in value.items if isinstance(v, NESTS)]
        else:
            children += _item_children(value, loc)
        todo.extend(reversed(children))


def _item_children(items: Any, loc: str) -> list[tuple[Any, str]]:
    if len(loc) >= MAX_LOCATION:
        return [(v, loc) for v in items if isinstance(v, NESTS)]
    return [(v, f"{loc}[{i}]"[: MAX_LOCATION]) for i, v in enumerate(items) if isinstance(v, NESTS)]


def _pair_children(pairs: list[tuple[Any, Any]], loc: str) -> list[tuple[Any, str]]:
    """The keys and values of a dict that can hold other values, with their locations."""
    children = []
    for k, v in pairs:
        if isinstance(k, NESTS):  # a real load would fail to hash it, but audit it anyway
            children.append((k, loc))
        if isinstance(v, NESTS):
            children.append((v, loc if len(loc) >= MAX_LOCATION else f"{loc}{_key_text(k)}"[:MAX_LOCATION]))
    return children


def collect(parsed: list[Parsed], resource: str, decode: Any) -> list[HookEntry]:
    """The hook entries of one resource's pickles."""
    collector = Collector(resource, decode)
    for one in parsed:
        walk(one, collector)
    # Only now do we know every hook dict of the resource; hub references
    # outside all of them are listed on their own.
    for one in parsed:
        for g in one.globals:
            collector.add_loose(g)
    return list(collector.entries.values())
