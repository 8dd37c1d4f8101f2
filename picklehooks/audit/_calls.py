"""Globals and calls: the opcodes through which a load imports or runs something.

``GLOBAL``, ``STACK_GLOBAL`` and ``INST`` name a global (:class:`._values.Global`),
with ``_pickle.c``'s ``fix_imports`` renames below protocol 3; ``REDUCE``,
``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` and ``INST`` become calls
(:class:`._values.Obj`) and ``BUILD`` a state applied to one. What only
the loader supplies (persistent ids, extension codes, protocol 5's
out-of-band buffers) becomes a placeholder. A call whose result is itself
a reference (``getattr(<path>, "name")``, ``importlib.import_module``,
``__import__``, ``picklehooks._shim.hub()``) names that path too, and a
``torch.package`` persistent id that stands for a hook names the hook.

Limits: the total length of the distinct global paths per file is bounded
(memoized strings would otherwise let a small file name gigabytes of paths).
Extension codes (``EXT1``...) name globals through ``copyreg``'s registry,
which the file can't fill; they are reported as placeholders. Calls other
than the lookups above return nothing the machine can name.
"""

from __future__ import annotations

import _compat_pickle
from typing import TYPE_CHECKING, Any, Callable

from .._shim import HUB_NAME
from ._limits import exceeded, show
from ._stream import Malformed
from ._values import Global, Node, Obj, Placeholder

if TYPE_CHECKING:
    from ._machine import Machine

# Where torch.package finds a hook again (picklehooks._shim._reduce_package).
PACKAGED_HOOK_LOADER = "picklehooks._shim._load_packaged_hook"
# Calls whose result is a reference we can still name (see _reference()).
_GETATTR = "builtins.getattr"
_IMPORT_MODULE = "importlib.import_module"
_DUNDER_IMPORT = "builtins.__import__"
_HUB_FUNCTION = "picklehooks._shim.hub"
# Total characters of distinct global paths per file.
_MAX_GLOBAL_CHARS = 64 << 20


def packaged_hook_name(pid: Any) -> str | None:
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
    if loader.path != PACKAGED_HOOK_LOADER:
        return None
    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return None


def path_of(value: Any) -> str | None:
    """The dotted path a value stands for, when the pickle makes it knowable."""
    if isinstance(value, Global):
        return value.path
    if isinstance(value, Obj) and value.ref is not None:
        return value.ref.path if isinstance(value.ref, Global) else value.ref
    return None


def _python_global_at_end(m: Machine, start: int) -> None:
    """A GLOBAL/INST whose lines run to the end of the file without a newline.

    ``_pickle.c`` refuses it, but ``pickle._Unpickler`` (the pure-Python one) takes each line
    as ``readline()[:-1]``, and so imports a module before it fails: name that global.
    """
    rest = bytes(m.buf[start : m.end])
    if m.ends or rest.count(b"\n") > 1:  # inside a frame it fails before resolving anything
        return
    module, newline, name = rest.partition(b"\n")
    module, name = (module, name[:-1]) if newline else (module[:-1], b"")
    try:
        module_text, name_text = module.decode("utf-8"), name.decode("utf-8")
    except UnicodeDecodeError:
        return
    if module_text:
        _global(m, module_text, name_text)


def _global(m: Machine, module: Any, name: Any, via: str = "global") -> Global:
    if not isinstance(module, str) or not isinstance(name, str):
        raise Malformed(f"a global at byte {m.pos - 1} is named by {show(module)} and {show(name)}, not two strings")
    if via == "global" and m.proto < 3:  # what _pickle.c's find_class does with fix_imports=True
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    key = (module, name, via)
    g = m._global_cache.get(key)
    if g is None:
        m.limits.global_chars += len(module) + len(name)
        if m.limits.global_chars > _MAX_GLOBAL_CHARS:
            raise exceeded(m.what, f"the globals it names exceed {_MAX_GLOBAL_CHARS} characters in all")
        g = m._global_cache[key] = Global(module, name, via)
    m.globals.append(g)
    return g


def _call(m: Machine, func: Any, args: Any, kwargs: Any = None) -> Obj:
    obj = Obj(func, args, kwargs)
    target = func if isinstance(func, Global) else func.ref if isinstance(func, Obj) else None
    if isinstance(target, Global):
        m.called.append(target)
        obj.ref = _reference(m, target.path, args)
    return obj


def _reference(m: Machine, func: str, args: Any) -> Global | str | None:
    """What a call returns when it is a lookup: loading would reach that path."""
    if not isinstance(args, tuple):
        return None
    if func == _GETATTR and len(args) in (2, 3) and isinstance(args[1], str):
        base = path_of(args[0])
        return None if base is None else _global(m, base, args[1], via="getattr")
    if func == _IMPORT_MODULE and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    if func == _DUNDER_IMPORT and args and isinstance(args[0], str):
        fromlist = args[3] if len(args) > 3 else None
        return args[0] if fromlist else args[0].partition(".")[0]
    if func == _HUB_FUNCTION and not args:
        return HUB_NAME
    return None


def call_opcodes(m: Machine) -> dict[str, Callable[[], Any]]:
    """The handlers of the global, call and BUILD opcodes, and of the values only the loader supplies."""
    push, pop, top, pop_mark, read, line = m._push, m._pop, m._top, m._pop_mark, m._read, m._line

    def global_nl(inst: bool):
        def op() -> None:
            start = m.pos
            try:
                module, name = line().decode("utf-8"), line().decode("utf-8")
            except Malformed:
                _python_global_at_end(m, start)
                raise
            g = _global(m, module, name)
            if inst:
                push(_call(m, g, tuple(pop_mark())))
            else:
                push(g)

        return op

    def stack_global() -> None:
        name, module = pop(), pop()
        push(_global(m, module, name))

    def reduce() -> None:
        args = pop()
        push(_call(m, pop(), args))

    def newobj_ex() -> None:
        kwargs, args = pop(), pop()
        push(_call(m, pop(), args, kwargs))

    def build() -> None:
        state = pop()
        target = top()
        if isinstance(target, Node):
            target.states.append(state)
        else:
            m.dropped.append(state)

    def obj() -> None:
        items = pop_mark()
        if not items:
            raise Malformed(f"OBJ without a class at byte {m.pos - 1}")
        push(_call(m, items[0], tuple(items[1:])))

    def binpersid() -> None:
        pid = pop()
        hook = packaged_hook_name(pid)
        if hook is not None:  # loading yields picklehooks._hub.<hook>
            m.globals.append(Global(HUB_NAME, hook, via="package"))
        push(Placeholder("persistent id", pid, hook))

    def readonly_buffer() -> None:
        top()

    return {
        "P": lambda: push(Placeholder("persistent id", line().decode("ascii", "backslashreplace"))),
        "Q": binpersid,
        "R": reduce,
        "b": build,
        "c": global_nl(inst=False),
        "i": global_nl(inst=True),
        "o": obj,
        "\x81": lambda: push(_call(m, *reversed([pop(), pop()]))),
        "\x82": lambda: push(Placeholder("extension code", read(1)[0])),
        "\x83": lambda: push(Placeholder("extension code", m._uint(2))),
        "\x84": lambda: push(Placeholder("extension code", m._int4())),
        "\x92": newobj_ex,
        "\x93": stack_global,
        "\x97": lambda: push(Placeholder("out-of-band buffer")),
        "\x98": readonly_buffer,
    }
