"""List the picklehooks hooks in a checkpoint or pickle without loading it.

``python -m picklehooks inspect FILE`` (and :func:`find_hooks`) reads

* a ``torch.save`` checkpoint (a zip holding ``<archive>/data.pkl``),
* a ``torch.package`` archive (a zip with ``.pkl`` resources anywhere),
* a legacy ``torch.save`` file (several pickles, then raw storage bytes), or
* a plain pickle of any protocol (0-5), possibly several concatenated,

and prints every hook whose pickle reference is ``picklehooks._hub.<name>``:
the module it is registered on, its kind (``forward``, ``forward_pre``,
``backward``, ``state_dict`` ...) and the source text its name encodes.

Nothing from the file runs. The pickle opcodes are read with
:func:`pickletools.genops` and interpreted by a *symbolic* machine: globals
become :class:`Global` placeholders, calls (``REDUCE``, ``NEWOBJ`` ...) become
:class:`Obj` nodes that record what would be called with what, and persistent
ids, extension codes and out-of-band buffers become :class:`Placeholder`
nodes. No ``pickle.load``, no import, no call. Hook names are decoded with
:func:`picklehooks.codec.decode`, which only decompresses text; they are never
resolved through the hub, so no hook is compiled or executed either.

Limits:

* A module's qualified name ("fc", "encoder.0") is known only where the pickle
  shows it: through the ``_modules`` dicts of ``nn.Module`` states below a
  module. A model inside a container gets the container path
  (``['model'].fc``); a module reachable only from a discarded or orphaned
  value gets ``?``; the root module is ``""``, shown as ``(root)``.
* A hook is found when it sits, directly or inside torch's ``_WrappedHook``,
  in a hook dict (a state key ending in ``hooks``, such as ``_forward_hooks``)
  of an ``nn.Module`` state, as a ``picklehooks._hub.<name>`` reference or as
  the persistent id a ``torch.package`` exporter writes for a hook. Any other
  hub reference is still listed, as a ``function`` on module ``?``. Entries
  are deduplicated by (module, kind, name) within each pickle resource.
* Hooks that are not picklehooks hooks (a ``mymodule.my_hook`` reference, a
  ``functools.partial``) are listed as *foreign*: their code is not in the
  file, and loading the file imports it.
* Hook text is reported as decoded; whether the hub would accept its shape is
  checked only when the file is loaded.
* Reading is bounded by the file's size (forged lengths can't make it read
  more), but a file that really holds a huge pickle takes memory in proportion.
"""

from __future__ import annotations

import io
import mmap
import os
import pickletools
import re
import stat
import sys
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ._shim import HUB_NAME, DecodeError, PicklehooksError
from .codec import decode

__all__ = ["AuditError", "HookEntry", "find_hooks", "main"]

# torch.save's legacy format starts with a pickle of this number.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# ...followed by the protocol version, sys_info, the object and the storage
# keys; raw storage bytes come after those five pickles.
_LEGACY_PICKLES = 5
_HIGHEST_PROTOCOL = 5  # what pickletools knows; a real load refuses higher
# torch.package loads modules under a mangled name: "<torch_package_0>.pkg.mod".
_PACKAGE_MANGLE = re.compile(r"<torch_package_\d+>\.")
# Where torch.package finds a hook again (picklehooks._shim._reduce_package).
_PACKAGED_HOOK_LOADER = ("picklehooks._shim", "_load_packaged_hook")


class AuditError(PicklehooksError, ValueError):
    """The file can't be audited: it is missing, unreadable, or not a pickle/checkpoint."""


@dataclass(frozen=True)
class HookEntry:
    """One hook found in a file.

    ``module`` is the qualified module name ("" for the root, "?" when the
    pickle doesn't show it); ``kind`` comes from the hook dict's key
    (``_forward_pre_hooks`` -> ``forward_pre``) or is ``function`` for a hub
    reference outside any hook dict. ``name`` is the hub name of a picklehooks
    hook, or ``module.qualname`` of a foreign one. A picklehooks hook has its
    decoded ``source`` or, when the name doesn't decode, an ``error``; a
    foreign hook has neither. ``resource`` is the zip entry ("" for a plain file).
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


# --------------------------------------------------------------------------
# Symbolic values: what the pickle *would* build, without building it.
# Dicts and sets are our own classes, not dict/set: keys and items stay in
# pickle order and never need to be hashable (a Global, a node, a list ...).


@dataclass(frozen=True)
class Global:
    """A ``GLOBAL``/``STACK_GLOBAL``/``INST`` reference: what loading would import."""

    module: str
    name: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


class Node:
    """Something loading would create by running code; collects what is applied to it."""

    def __init__(self) -> None:
        self.states: list[Any] = []  # BUILD arguments, in order
        self.items: list[Any] = []  # APPEND(S) onto it
        self.dictitems: list[tuple[Any, Any]] = []  # SETITEM(S) onto it

    def __repr__(self) -> str:  # never recurse: the graph may be cyclic
        return f"<{type(self).__name__} at {id(self):#x}>"


class Obj(Node):
    """A call: ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` or ``INST``."""

    def __init__(self, func: Any, args: Any, kwargs: Any = None) -> None:
        super().__init__()
        self.func, self.args, self.kwargs = func, args, kwargs


class Placeholder(Node):
    """A value only the loader could supply: persistent id, extension code, out-of-band buffer.

    ``hook_name`` is set for the persistent id under which ``torch.package``
    stores a picklehooks hook (see :func:`_packaged_hook_name`).
    """

    def __init__(self, what: str, detail: Any = None, hook_name: str | None = None) -> None:
        super().__init__()
        self.what, self.detail, self.hook_name = what, detail, hook_name


class PDict:
    """A dict as ``(key, value)`` pairs, in pickle order."""

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

    def __init__(self, frozen: bool, items: Iterable[Any] = ()) -> None:
        self.frozen = frozen
        self.items: list[Any] = list(items)

    def __repr__(self) -> str:
        return f"<PSet of {len(self.items)} at {id(self):#x}>"


class _Malformed(Exception):
    """The bytes are not a pickle the symbolic machine can follow."""


@dataclass
class _Parsed:
    """One pickle's result: its root, values it built but dropped, and every global it names."""

    root: Any
    extras: list[Any]
    globals: list[Global]


_CONSTANTS = frozenset(
    "INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING BINBYTES "
    "SHORT_BINBYTES BINBYTES8 UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8 FLOAT BINFLOAT".split()
)
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _run_machine(stream: Any) -> _Parsed:
    """Interpret one pickle's opcodes symbolically; stop after its ``STOP``.

    Mirrors :class:`pickle._Unpickler`'s stack, mark and memo discipline, so
    that what ends up where matches a real load, but every call, import and
    lookup is replaced by a node recording it.
    """
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    dropped: list[Any] = []  # popped values and state applied to non-nodes: still audited
    globals_seen: list[Global] = []
    pos: int | None = 0

    # Values are pushed through push(), never ``stack.append(...)`` inline:
    # MARK-consuming opcodes rebind ``stack``, and ``stack.append(tuple(pop_mark()))``
    # would bind the *old* list's append before pop_mark() runs.
    def push(value: Any) -> None:
        stack.append(value)

    def pop() -> Any:
        if not stack:
            raise _Malformed(f"stack underflow at byte {pos}")
        return stack.pop()

    def top() -> Any:
        if not stack:
            raise _Malformed(f"empty stack at byte {pos}")
        return stack[-1]

    def pop_mark() -> list[Any]:
        nonlocal stack
        if not metastack:
            raise _Malformed(f"no MARK to pop at byte {pos}")
        items, stack = stack, metastack.pop()
        return items

    def make_global(module: Any, name: Any) -> Global:
        if not isinstance(module, str) or not isinstance(name, str):
            raise _Malformed(f"global at byte {pos} is named by non-strings")
        g = Global(module, name)
        globals_seen.append(g)
        return g

    def set_items(target: Any, flat: list[Any]) -> None:
        if len(flat) % 2:
            raise _Malformed(f"odd number of items for SETITEMS at byte {pos}")
        pairs = list(zip(flat[::2], flat[1::2]))
        if isinstance(target, PDict):
            target.pairs.extend(pairs)
        elif isinstance(target, Node):
            target.dictitems.extend(pairs)
        else:  # a real load would call the target's __setitem__; keep the values visible
            dropped.extend(flat)

    def add_items(target: Any, items: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, Node):
            target.items.extend(items)
        else:
            dropped.extend(items)

    try:
        for opcode, arg, pos in pickletools.genops(stream):
            name = opcode.name
            if name in _CONSTANTS:
                push(arg)
            elif name in _MEMO_GETS:
                if arg not in memo:
                    raise _Malformed(f"memo key {arg} read before it was written, at byte {pos}")
                push(memo[arg])
            elif name in _MEMO_PUTS:
                memo[arg] = top()
            else:
                # Cases run in order, so the opcodes torch.save writes most come first.
                match name:
                    case "MARK":
                        metastack.append(stack)
                        stack = []
                    case "EMPTY_DICT":
                        push(PDict())
                    case "SETITEMS":
                        flat = pop_mark()
                        set_items(top(), flat)
                    case "SETITEM":
                        value, key = pop(), pop()
                        set_items(top(), [key, value])
                    case "EMPTY_TUPLE":
                        push(())
                    case "TUPLE":
                        push(tuple(pop_mark()))
                    case "TUPLE1" | "TUPLE2" | "TUPLE3":
                        n = int(name[-1])
                        items = [pop() for _ in range(n)]
                        push(tuple(reversed(items)))
                    case "REDUCE":
                        args = pop()
                        push(Obj(pop(), args))
                    case "NEWOBJ":
                        args = pop()
                        push(Obj(pop(), args))
                    case "BUILD":
                        state = pop()
                        target = top()
                        if isinstance(target, Node):
                            target.states.append(state)
                        else:
                            dropped.append(state)
                    case "GLOBAL":
                        module, _, attr = arg.partition(" ")
                        push(make_global(module, attr))
                    case "STACK_GLOBAL":
                        attr, module = pop(), pop()
                        push(make_global(module, attr))
                    case "NONE":
                        push(None)
                    case "NEWTRUE":
                        push(True)
                    case "NEWFALSE":
                        push(False)
                    case "EMPTY_LIST":
                        push([])
                    case "APPEND":
                        value = pop()
                        add_items(top(), [value])
                    case "APPENDS":
                        items = pop_mark()
                        add_items(top(), items)
                    case "BINPERSID":
                        pid = pop()
                        hook_name = _packaged_hook_name(pid)
                        if hook_name is not None:  # loading yields picklehooks._hub.<hook_name>
                            globals_seen.append(Global(HUB_NAME, hook_name))
                        push(Placeholder("persistent id", pid, hook_name))
                    case "FRAME":
                        pass  # framing only groups opcodes
                    case "STOP":
                        break
                    case "DICT":
                        flat = pop_mark()
                        if len(flat) % 2:
                            raise _Malformed(f"odd number of items for DICT at byte {pos}")
                        push(PDict(zip(flat[::2], flat[1::2])))
                    case "LIST":
                        push(pop_mark())
                    case "MEMOIZE":
                        memo[len(memo)] = top()
                    case "POP":
                        if stack:
                            dropped.append(pop())
                        else:  # pickle pops the mark when the stack above it is empty
                            dropped.extend(pop_mark())
                    case "POP_MARK":
                        dropped.extend(pop_mark())
                    case "DUP":
                        push(top())
                    case "PROTO":
                        if arg > _HIGHEST_PROTOCOL:
                            raise _Malformed(f"unsupported pickle protocol {arg}")
                    case "EMPTY_SET":
                        push(PSet(frozen=False))
                    case "ADDITEMS":
                        items = pop_mark()
                        target = top()
                        if isinstance(target, PSet):
                            target.items.extend(items)
                        else:
                            add_items(target, items)
                    case "FROZENSET":
                        push(PSet(True, pop_mark()))
                    case "INST":
                        module, _, attr = arg.partition(" ")
                        cls = make_global(module, attr)
                        push(Obj(cls, tuple(pop_mark())))
                    case "OBJ":
                        items = pop_mark()
                        if not items:
                            raise _Malformed(f"OBJ without a class at byte {pos}")
                        push(Obj(items[0], tuple(items[1:])))
                    case "NEWOBJ_EX":
                        kwargs, args = pop(), pop()
                        push(Obj(pop(), args, kwargs))
                    case "PERSID":
                        push(Placeholder("persistent id", arg))
                    case "EXT1" | "EXT2" | "EXT4":
                        push(Placeholder("extension code", arg))
                    case "BYTEARRAY8":
                        push(bytearray(arg))
                    case "NEXT_BUFFER":
                        push(Placeholder("out-of-band buffer"))
                    case "READONLY_BUFFER":
                        top()
                    case _:  # an opcode newer than this machine
                        raise _Malformed(f"opcode {name} at byte {pos} is not supported")
        else:  # pragma: no cover - genops raises before running out without STOP
            raise _Malformed("pickle ended before STOP")
    except (ValueError, OverflowError) as exc:
        # genops' complaints about untrusted bytes (unknown opcode, short read,
        # bad literal): not a pickle we can follow.
        raise _Malformed(str(exc) or type(exc).__name__) from None
    if not stack:
        raise _Malformed(f"STOP with an empty stack at byte {pos}")
    # Every value built is now reachable from the root, from the rest of the
    # stack, or from `dropped`; the memo only holds more references to them.
    return _Parsed(stack[-1], [*dropped, *stack[:-1]], globals_seen)


def _scan(stream: io.BytesIO | mmap.mmap) -> list[_Parsed]:
    """Parse pickles one after another until one fails or the bytes run out.

    The first must parse. Later failures end the scan quietly: a legacy
    ``torch.save`` file, like many log-style pickle files, ends in bytes that
    are not pickles.

    ``stream`` is in memory or mapped, never a plain file: a pickle declares
    its own lengths (``BINBYTES8`` says how much follows), and these readers
    return at most what is there instead of allocating what a forged length
    asks for.
    """
    size = len(stream.getbuffer()) if isinstance(stream, io.BytesIO) else len(stream)
    if size == 0:
        raise _Malformed("empty")
    parsed: list[_Parsed] = []
    limit: int | None = None
    while stream.tell() < size and (limit is None or len(parsed) < limit):
        try:
            parsed.append(_run_machine(stream))
        except _Malformed as exc:
            if not parsed:
                raise _Malformed(f"not a pickle, torch.save checkpoint or torch.package archive ({exc})") from None
            break
        root = parsed[0].root
        if len(parsed) == 1 and type(root) is int and root == _LEGACY_MAGIC:
            limit = _LEGACY_PICKLES  # what follows is storage bytes, not pickles
    return parsed


# --------------------------------------------------------------------------
# Walking the symbolic tree for modules and their hooks.


def _demangle(module: str) -> str:
    return _PACKAGE_MANGLE.sub("", module, count=1) if module.startswith("<") else module


def _packaged_hook_name(pid: Any) -> str | None:
    """The hook name in a torch.package persistent id, or None.

    A hook's ``__reduce_package__`` makes ``PackageExporter`` write the
    persistent id ``("reduce_package", id, picklehooks._shim._load_packaged_hook,
    (name,))``; the importer then calls that loader, which returns the hub's
    ``name``. We only read the name out of the tuple.
    """
    if not (isinstance(pid, tuple) and len(pid) == 4):
        return None
    tag, _, loader, args = pid
    if not (isinstance(tag, str) and tag == "reduce_package" and isinstance(loader, Global)):
        return None
    if (_demangle(loader.module), loader.name) != _PACKAGED_HOOK_LOADER:
        return None
    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return None


def _hub_name(ref: Any) -> str | None:
    """The hook name if ``ref`` is a hub reference (plain, mangled or packaged), else None."""
    if isinstance(ref, Placeholder):
        return ref.hook_name
    if isinstance(ref, Global):
        return ref.name if _demangle(ref.module) == HUB_NAME else None
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


def _module_state(node: Node) -> PDict | None:
    """The state of an ``nn.Module`` (recognised by its ``_modules`` entry), or None.

    ``_modules`` is a dict since torch 2.0 and an OrderedDict (a node) before.
    """
    for state in _state_dicts(node):
        if isinstance(state.get("_modules"), (PDict, Obj)):
            return state
    return None


def _dict_pairs(value: Any) -> list[tuple[Any, Any]]:
    """Entries of a dict or of an OrderedDict-like node."""
    if isinstance(value, PDict):
        return value.pairs
    if isinstance(value, Node):
        return value.dictitems
    return []


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _key_text(key: Any) -> str:
    """A container key as shown in a location: ``['model']``, ``[0]``; long or odd keys abbreviated."""
    if not isinstance(key, (str, int, float, bytes, bool, type(None))):
        return "?"
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


# Hook name -> (source, None) or (None, decode error message).
_Decoded = dict[str, tuple[str | None, str | None]]


class _Collector:
    """Gathers hook entries for one resource, deduplicated, in the order found."""

    def __init__(self, resource: str, decoded: _Decoded) -> None:
        self.resource = resource
        self.entries: dict[tuple[str, str, str], HookEntry] = {}
        self.attached: set[str] = set()  # hub names seen in some module's hook dict
        self._decoded = decoded  # shared across resources: each name is decoded once

    def add(self, module: str, kind: str, fn: Any) -> None:
        # torch wraps state-dict hooks in _WrappedHook, whose state is {"hook": fn, ...}.
        if isinstance(fn, Obj):
            for state in _state_dicts(fn):
                if isinstance(state.get("hook"), (Global, Placeholder, Obj)):
                    fn = state.get("hook")
                    break
        name = _hub_name(fn)
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
        name = _hub_name(g)
        if name is not None and name not in self.attached:
            self._add_hub("?", "function", name)

    def _add_hub(self, module: str, kind: str, name: str) -> None:
        if name not in self._decoded:
            try:
                self._decoded[name] = (decode(name), None)
            except DecodeError as exc:
                self._decoded[name] = (None, str(exc))
        source, error = self._decoded[name]
        self._put(HookEntry(module, kind, name, source, error, self.resource))

    def _put(self, entry: HookEntry) -> None:
        self.entries.setdefault((entry.module, entry.kind, entry.name), entry)

    def module(self, path: str, state: PDict) -> None:
        for key, value in state.pairs:
            if isinstance(key, str) and _is_hook_key(key):
                for _hook_id, fn in _dict_pairs(value):
                    self.add(path, _kind(key), fn)


# What the walk descends into; everything else is a leaf (str, int, Global ...).
_NESTS = (Node, PDict, PSet, list, tuple)


def _walk(parsed: _Parsed, collector: _Collector) -> None:
    """Visit every value once, depth first in pickle order, naming modules as we go.

    Iterative, because a checkpoint's tree can be deeper than Python's
    recursion limit, and visited-by-identity, because memo references make
    it a graph (possibly cyclic).
    """
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(value, "?") for value in reversed(parsed.extras) if isinstance(value, _NESTS)]
    todo.append((parsed.root, ""))  # the root first, so it names what it reaches
    while todo:
        value, loc = todo.pop()
        if id(value) in seen or not isinstance(value, _NESTS):
            continue
        seen.add(id(value))
        # Only values that can hold others are pushed (and get a location
        # string built): most of a checkpoint is strings and numbers.
        children: list[tuple[Any, str]] = []
        if isinstance(value, Node):
            state = _module_state(value)
            if state is not None:
                collector.module(loc, state)
                submodules = state.get("_modules")
                seen.add(id(submodules))  # its values are named below, not as ['key']
                children += [(v, _join(loc, str(k))) for k, v in _dict_pairs(submodules) if isinstance(v, _NESTS)]
            for part in value.states:
                if isinstance(part, PDict):
                    children += [(v, _join(loc, str(k))) for k, v in part.pairs if isinstance(v, _NESTS)]
                else:
                    children.append((part, loc))
            if isinstance(value, Obj):
                children += [(value.func, loc), (value.args, loc), (value.kwargs, loc)]
            elif isinstance(value, Placeholder):
                children.append((value.detail, loc))
            children += [(v, f"{loc}[{i}]") for i, v in enumerate(value.items) if isinstance(v, _NESTS)]
            children += _pair_children(value.dictitems, loc)
        elif isinstance(value, PDict):
            children += _pair_children(value.pairs, loc)
        elif isinstance(value, PSet):
            children += [(v, loc) for v in value.items if isinstance(v, _NESTS)]
        else:
            children += [(v, f"{loc}[{i}]") for i, v in enumerate(value) if isinstance(v, _NESTS)]
        todo.extend(reversed(children))


def _pair_children(pairs: list[tuple[Any, Any]], loc: str) -> list[tuple[Any, str]]:
    """The keys and values of a dict that can hold other values, with their locations."""
    children = []
    for k, v in pairs:
        if isinstance(k, _NESTS):  # a real load would fail to hash it, but audit it anyway
            children.append((k, loc))
        if isinstance(v, _NESTS):
            children.append((v, f"{loc}[{_key_text(k)}]"))
    return children


# --------------------------------------------------------------------------
# Files.


def _check_regular_file(path: str) -> None:
    """Raise AuditError for anything that isn't an existing, non-empty regular file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise AuditError("no such file") from None
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None
    if stat.S_ISDIR(info.st_mode):
        raise AuditError("is a directory")
    if not stat.S_ISREG(info.st_mode):  # a FIFO or /dev/zero could block or never end
        raise AuditError("not a regular file")
    if info.st_size == 0:
        raise AuditError("empty file")


def _collect(parsed: list[_Parsed], resource: str, decoded: _Decoded) -> list[HookEntry]:
    collector = _Collector(resource, decoded)
    for one in parsed:
        _walk(one, collector)
    # Only now do we know every hook dict of the resource; hub references
    # outside all of them are listed on their own.
    for one in parsed:
        for g in one.globals:
            collector.add_loose(g)
    return list(collector.entries.values())


# A zip starts with a local file header, or (when it has no entries) with its end record.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def _audit_zip(path: str, decoded: _Decoded) -> list[HookEntry]:
    """Audit every ``.pkl`` member: ``data.pkl`` of torch.save, resources of torch.package."""
    try:
        archive = zipfile.ZipFile(path)
    # NotImplementedError: a zip version or feature zipfile doesn't support
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError, ValueError) as exc:
        raise AuditError(f"unreadable zip archive: {exc}") from None
    entries: list[HookEntry] = []
    with archive:
        pickles = [i for i in archive.infolist() if i.filename.endswith(".pkl") and not i.is_dir()]
        if not pickles:
            raise AuditError("a zip archive without .pkl pickles (not a torch.save checkpoint or torch.package archive)")
        for info in pickles:
            try:
                raw = archive.open(info)
            # RuntimeError: an encrypted member; NotImplementedError: an unknown compression
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError, EOFError, ValueError) as exc:
                raise AuditError(f"entry {info.filename!r} is unreadable: {exc}") from None
            try:
                with raw:  # zip members are small (tensor data lives in other members)
                    data = raw.read()
                parsed = _scan(io.BytesIO(data))
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as exc:  # corrupt member
                raise AuditError(f"entry {info.filename!r} is unreadable: {exc}") from None
            except _Malformed as exc:
                raise AuditError(f"entry {info.filename!r}: {exc}") from None
            entries += _collect(parsed, info.filename, decoded)
    return entries


def find_hooks(path: str | os.PathLike[str]) -> list[HookEntry]:
    """Return the hooks in the checkpoint, package or pickle at ``path``, without loading it.

    Raises :class:`AuditError` if the file can't be read or is not a pickle,
    ``torch.save`` checkpoint or ``torch.package`` archive.
    """
    path = os.fspath(path)
    _check_regular_file(path)
    decoded: _Decoded = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) in _ZIP_MAGICS:
                parsed = None
            else:
                # Mapped, not read: a legacy torch.save file is mostly storage
                # bytes after its pickles, which are never touched.
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    parsed = _scan(mapped)
    except OSError as exc:
        raise AuditError(exc.strerror or str(exc)) from None
    except _Malformed as exc:
        raise AuditError(str(exc)) from None
    if parsed is None:
        return _audit_zip(path, decoded)
    return _collect(parsed, "", decoded)


# --------------------------------------------------------------------------
# The command line.


def _printable(text: str, *, one_line: bool = False) -> str:
    """Escape control characters: names and source come from the file and could
    otherwise move the cursor or recolour the terminal of whoever audits it."""
    keep = "\t" if one_line else "\n\t"
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def _abbrev(name: str) -> str:
    name = _printable(name, one_line=True)
    return name if len(name) <= 40 else f"{name[:24]}...{name[-12:]}"


def _write(line: str, stream: Any = None) -> None:
    stream = stream or sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    # An ASCII terminal still gets every line, with escapes for what it can't show.
    print(line.encode(encoding, "backslashreplace").decode(encoding), file=stream)


def _header(entry: HookEntry) -> str:
    if entry.kind == "function":
        where = "function outside any module hook dict"
    else:
        module = "(root)" if entry.module == "" else _printable(entry.module, one_line=True)
        where = f"{_printable(entry.kind, one_line=True)} hook on {module}"
    resource = f" [{_printable(entry.resource, one_line=True)}]" if entry.resource else ""
    if entry.foreign:
        name = _printable(entry.name, one_line=True)
        return f"{where}{resource}: foreign hook {name} (not decodable; loading will import it)"
    return f"{where}{resource}: {HUB_NAME}.{_abbrev(entry.name)} ({len(entry.name)} chars)"


def main(path: str) -> int:
    """Print the hooks in ``path``; return 0, 1 (unreadable file) or 2 (undecodable hook name)."""
    shown = _printable(os.fspath(path), one_line=True)
    try:
        entries = find_hooks(path)
    except AuditError as exc:
        _write(f"picklehooks inspect: error: {shown}: {_printable(str(exc), one_line=True)}", sys.stderr)
        return 1
    ours = [e for e in entries if not e.foreign]
    foreign = [e for e in entries if e.foreign]
    bad = [e for e in ours if e.error is not None]
    if not ours:
        _write(f"no picklehooks hooks found in {shown}")
    else:
        counts = f"{len(ours)} picklehooks hook{'s' * (len(ours) != 1)}"
        if bad:
            counts += f" ({len(bad)} undecodable)"
        if foreign:
            counts += f", {len(foreign)} foreign"
        _write(f"{shown}: {counts}")
    for entry in entries:
        _write("")
        _write(_header(entry))
        if entry.error is not None:
            _write(f"    error: {_printable(entry.error, one_line=True)}")
        elif entry.source is not None:
            for line in _printable(entry.source).rstrip("\n").split("\n"):
                _write(f"    {line}".rstrip())
    return 2 if bad else 0
