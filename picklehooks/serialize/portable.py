"""Turn an ordinary Python function into a portable hook.

``portable(fn)`` rebuilds ``fn`` as self-contained module text: the imports
it needs, its free variables baked in as constants, and its own ``def`` (a
lambda becomes a one-line ``def``). That text is encoded into a name
(:mod:`picklehooks.serialize.codec`) and resolved through the hub
(:mod:`picklehooks._shim`), so the returned function *is* the function any
other process gets from the same name. Equal texts give one shared function.

What can be baked in:

* constants: ``str``, ``int``, ``float``, ``bool``, ``None``, ``bytes``,
  tuples/lists/dicts of them, ``torch.dtype`` and ``torch.device``; lists and
  dicts are copied, so a hook's changes to them stay private;
* modules (``torch``, ``math``, ``F``) become ``import`` statements, and
  classes, functions and ``typing`` names that can be imported from a real
  module (not ``__main__``) become ``from ... import ...``.

Anything else (a tensor, a mutable object, an open file, a local function, a
name that isn't defined yet) raises :class:`PicklehooksError` naming it.

Scalars (``int``, ``float``, ``bool``, ``str``, ``None``) and tuples of them
are written into the def itself (``return output * 5.0``), not as module
constants: TorchScript compiles a literal in a hook's body but refuses to
read a module-level float ("python value of type 'float' cannot be used as
a value"). Non-finite floats are written ``math.inf``, ``math.nan`` and
``-1e999``, never as calls. A name the def rebinds somewhere (a lambda
parameter, say), or reads inside an f-string, stays a module constant.

Import statements at the top level of the def move to the text's header,
so that TorchScript can compile the hook: the module is then imported when
the hook is loaded, not when it first runs.

Limits: ``portable`` needs the function's source (a file, not the REPL),
refuses ``nonlocal`` and ``global`` writes (a portable hook can't share state
with its creator), and bakes values as they are *now*: later changes to a
captured variable don't reach the hook.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import symtable
import sys
import textwrap
import types
from typing import Any, Callable, TypeVar

import torch

from . import codec
from .._shim import HUB_NAME, PicklehooksError, hub

__all__ = ["portable", "is_portable"]

F = TypeVar("F", bound=Callable[..., Any])

_LAMBDA_NAME = "_lambda"


def is_portable(fn: object) -> bool:
    """True if ``fn`` is a hook that :func:`portable` produced (or decoded)."""
    return (
        isinstance(fn, types.FunctionType)
        and fn.__module__ == HUB_NAME
        and sys.modules.get(HUB_NAME) is not None
        and sys.modules[HUB_NAME].__dict__.get(fn.__name__) is fn
    )


def portable(fn: F) -> F:
    """Return a pickle-safe twin of ``fn`` whose identity is its encoded source.

    Use it as a call or a decorator::

        model.fc.register_forward_hook(picklehooks.portable(my_hook))

        @picklehooks.serialize.portable
        def my_hook(module, inputs, output): ...
    """
    if is_portable(fn):
        return fn
    if not isinstance(fn, types.FunctionType):
        raise PicklehooksError(
            f"portable() takes a Python function (def or lambda), got {type(fn).__name__} {fn!r}; "
            "wrap it in a def that calls it"
        )
    if fn.__code__.co_flags & (inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        raise PicklehooksError(f"portable() can't make async function {fn.__qualname__!r} a hook; use a plain def")
    return getattr(hub(), codec.encode(module_text(fn)))


def module_text(fn: types.FunctionType) -> str:
    """Return the self-contained module text that :func:`portable` encodes for ``fn``."""
    body = _lambda_as_def(fn) if fn.__name__ == "<lambda>" else _def_source(fn)
    header, inline = _header(fn, body)
    hoisted_body, hoisted = _hoist_imports(body)
    if hoisted:
        header, inline = _header(fn, body, hoisted)
    return header + _inline(hoisted_body, inline)


def _hoist_imports(body: str) -> tuple[str, set[str]]:
    """``body`` with the import statements at the top level of the def moved out, and those statements.

    TorchScript compiles no import statement ("import statements aren't
    supported"), so a hook that imports inside its def (``import math``)
    could not be scripted where it travels. Each such line becomes ``pass``,
    so the def keeps its line numbers and stays valid; an import inside an
    ``if`` or ``try`` stays where it is. So a hoisted module is imported when
    the hook is loaded, not when it first runs: a host that loads the hook
    needs it installed.
    """
    tree = ast.parse(body)
    func = tree.body[0]
    moves = [n for n in func.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    if not moves:
        return body, set()
    lines = body.splitlines(keepends=True)
    hoisted = set()
    for node in reversed(moves):
        hoisted.add(ast.unparse(node))
        first, last = node.lineno - 1, node.end_lineno - 1
        if node.lineno == func.lineno or any(other is not node and other.lineno - 1 <= last and other.end_lineno - 1 >= first
               for other in func.body):
            return body, set()  # shares a line with another statement (``import math; y = 1``): leave it
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
        lines[first:last + 1] = [indent + "pass\n"] + ["\n"] * (last - first)
    return "".join(lines), hoisted


# --------------------------------------------------------------------------
# Getting the function's own text.


def _source_lines(fn: types.FunctionType) -> list[str]:
    try:
        lines, _ = inspect.findsource(fn)
    except (OSError, TypeError) as exc:
        raise PicklehooksError(
            f"can't read the source of {fn.__qualname__!r} ({exc}); portable() needs functions "
            "defined in a file or notebook cell, not typed into a bare REPL or built with exec()"
        ) from None
    return lines


def _def_source(fn: types.FunctionType) -> str:
    try:
        text = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError) as exc:
        _source_lines(fn)  # raises the clear error when there is no source at all
        raise PicklehooksError(f"can't parse the source of {fn.__qualname__!r}: {exc}") from None
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise PicklehooksError(f"the source of {fn.__qualname__!r} is not a def: {text.splitlines()[0]!r}")
    # Drop decorator lines (e.g. @picklehooks.serialize.portable) but keep the user's text as written.
    lines = text.splitlines(keepends=True)[node.lineno - 1 :]
    return "".join(lines).rstrip() + "\n"


def _lambda_as_def(fn: types.FunctionType) -> str:
    """Find ``fn``'s lambda in its file and rewrite it as a one-line def.

    A line can hold several lambdas, so we match on position: every
    instruction of ``fn.__code__`` carries its source span (PEP 657), and the
    right lambda is the smallest one whose span holds them all.
    """
    lines = _source_lines(fn)
    text = "".join(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:  # pragma: no cover - the file did compile once
        raise PicklehooksError(f"can't parse the file that defines lambda {fn!r}: {exc}") from None
    # Skip missing and zero-width positions (RESUME carries "line, column 0").
    spans = [p for p in fn.__code__.co_positions() if None not in p and (p[0], p[2]) < (p[1], p[3])]
    if not spans:
        raise PicklehooksError(f"lambda {fn!r} carries no source positions; define the hook with def instead")
    lo = min((p[0], p[2]) for p in spans)
    hi = max((p[1], p[3]) for p in spans)
    candidates = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Lambda)
        and (n.lineno, n.col_offset) <= lo
        and hi <= (n.end_lineno, n.end_col_offset)
    ]
    if not candidates:
        raise PicklehooksError(
            f"can't locate the lambda {fn!r} in its source; define the hook with def instead"
        )
    node = min(candidates, key=lambda n: (n.end_lineno - n.lineno, n.end_col_offset - n.col_offset))
    # Positions give us the node; unparse gives valid one-line text for it.
    args, body = ast.unparse(node.args), ast.unparse(node.body)
    return f"def {_LAMBDA_NAME}({args}):\n    return ({body})\n"


# --------------------------------------------------------------------------
# Finding and baking in the names the function needs.


def _needed_names(fn: types.FunctionType, body: str) -> list[str]:
    """Names ``body`` reads from outside itself, in first-seen order."""
    try:
        table = symtable.symtable(body, "<portable>", "exec")
    except SyntaxError as exc:
        raise PicklehooksError(
            f"hook {fn.__qualname__!r} can't stand alone: {exc.msg}. A portable hook can't write to "
            "variables of the function that made it (nonlocal); return values instead"
        ) from None
    names: dict[str, None] = {}
    # Module level: annotations and defaults are evaluated here.
    for sym in table.get_symbols():
        if sym.is_referenced() and not sym.is_assigned() and not sym.is_imported():
            names[sym.get_name()] = None

    def walk(t: symtable.SymbolTable) -> None:
        for sym in t.get_symbols():
            if sym.is_declared_global() and sym.is_assigned():
                raise PicklehooksError(
                    f"hook {fn.__qualname__!r} assigns the global {sym.get_name()!r}; a portable hook "
                    "runs in its own namespace, so it can't change its creator's globals"
                )
            if sym.is_global() and sym.is_referenced():
                names[sym.get_name()] = None
        for child in t.get_children():
            walk(child)

    for child in table.get_children():
        walk(child)
    return list(names)


def _lookup(fn: types.FunctionType, name: str) -> tuple[bool, Any]:
    if name in fn.__code__.co_freevars:
        cell = fn.__closure__[fn.__code__.co_freevars.index(name)]
        try:
            return True, cell.cell_contents
        except ValueError:
            raise PicklehooksError(
                f"hook {fn.__qualname__!r} uses {name!r}, which its enclosing function has not assigned yet"
            ) from None
    if name in fn.__globals__:
        return True, fn.__globals__[name]
    return False, None


_MUTATORS = frozenset(
    "append extend insert remove pop clear sort reverse update setdefault popitem __setitem__ __delitem__".split()
)


def _mutated_names(body: str) -> set[str]:
    """Names that ``body`` changes in place (``x.append(...)``, ``x[k] = v``, ``del x[k]``)."""
    mutated = set()
    for node in ast.walk(ast.parse(body)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
            and isinstance(node.func.value, ast.Name)
        ):
            mutated.add(node.func.value.id)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.value, ast.Name)
        ):
            mutated.add(node.value.id)
    return mutated


def _header(fn: types.FunctionType, body: str, hoisted: set[str] = frozenset()) -> tuple[str, dict[str, str]]:
    """The imports and module-level constants ``body`` needs, and the constants to write into it instead.

    ``hoisted``: import statements taken out of the def (see :func:`_hoist_imports`).
    """
    imports: list[str] = list(hoisted)
    constants: list[str] = []
    inline: dict[str, str] = {}
    mutated = _mutated_names(body)
    bound, in_fstrings = _bound_in_def(body)
    needed = _needed_names(fn, body)
    # `math.inf` can be written only where `math` would mean the math module.
    math_ok = "math" not in bound and ("math" not in needed or _lookup(fn, "math")[1] is math)
    for name in needed:
        found, value = _lookup(fn, name)
        if not found:
            if hasattr(builtins, name):
                continue
            raise PicklehooksError(
                f"hook {fn.__qualname__!r} uses the name {name!r}, which is not defined where the hook "
                "was made; define or import it before calling portable()"
            )
        if isinstance(value, types.ModuleType):
            imports.append(_import_module_line(fn, name, value))
        elif _is_importable(value):
            imports.append(_import_object_line(fn, name, value))
        else:
            if name == "torch":
                raise PicklehooksError(f"hook {fn.__qualname__!r} binds 'torch' to {value!r}; rename that variable")
            if name in mutated and isinstance(value, (list, dict)):
                # Baking makes a copy: writes would silently miss the caller's object.
                raise PicklehooksError(
                    f"hook {fn.__qualname__!r} changes the captured {type(value).__name__} {name!r} in place, "
                    "but a portable hook gets its own copy, so the caller would never see the change; "
                    "store results on the module (e.g. a buffer) or use picklehooks' logging instead"
                )
            text = _inline_literal(value)
            if text is not None and name not in bound and name not in in_fstrings and (
                    "math." not in text or math_ok):
                # TorchScript reads no module-level float, int, bool, str or None ("python value
                # of type 'float' cannot be used as a value"), but compiles a literal in the body.
                inline[name] = text
                if "math." in text:
                    imports.append("import math")
                continue
            literal, needs_torch = _literal(fn, name, value, math_ok=math_ok)
            if needs_torch and "import torch" not in imports:
                imports.append("import torch")
            if "math." in literal:
                imports.append("import math")
            constants.append(f"{name} = {literal}")
    lines = sorted(set(imports), key=lambda line: (line.startswith("from"), line)) + constants
    return "".join(line + "\n" for line in lines), inline


def _inline_literal(value: Any) -> str | None:
    """Python text for a constant worth writing into the body (a scalar, or a tuple of them), else None.

    Non-finite floats are ``math.inf``, ``math.nan`` and ``-1e999``:
    TorchScript reads those and the shim accepts them anywhere (a default
    or a module-level constant), where ``float('inf')`` is a call and
    ``-math.inf`` an operator applied to a name, which the shim refuses.
    """
    kind = type(value)
    if kind in (bool, type(None), str):
        return repr(value)
    if kind is int:
        return repr(value) if value >= 0 else f"({value!r})"
    if kind is float:
        if math.isnan(value):
            return "math.nan"
        if math.isinf(value):
            return "math.inf" if value > 0 else "(-1e999)"
        return repr(value) if math.copysign(1.0, value) > 0 else f"({value!r})"
    if kind is tuple:
        items = [_inline_literal(v) for v in value]
        if any(i is None for i in items):
            return None
        return "(" + items[0] + ",)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    return None


def _bound_in_def(body: str) -> tuple[set[str], set[str]]:
    """Names the def's text binds anywhere (arguments, assignments, inner defs), and names read in f-strings.

    A constant is written into the body only where its name means the
    constant everywhere in it; inside f-strings Python 3.11 reports no
    reliable positions, so those names stay module-level constants.
    """
    bound, in_fstrings = set(), set()
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.JoinedStr):
            in_fstrings.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
    return bound, in_fstrings


def _inline(body: str, inline: dict[str, str]) -> str:
    """``body`` with each read of a name in ``inline`` replaced by its literal text, the rest as written."""
    if not inline:
        return body
    lines = [line.encode("utf-8") for line in body.splitlines(keepends=True)]
    spots = sorted(
        ((n.lineno, n.col_offset, n.end_col_offset, n.id) for n in ast.walk(ast.parse(body))
         if isinstance(n, ast.Name) and n.id in inline),
        reverse=True,
    )
    for lineno, start, end, name in spots:  # last first, so earlier offsets (in bytes) stay valid
        line = lines[lineno - 1]
        lines[lineno - 1] = line[:start] + inline[name].encode("utf-8") + line[end:]
    return b"".join(lines).decode("utf-8")


def _import_module_line(fn: types.FunctionType, name: str, module: types.ModuleType) -> str:
    modname = module.__name__
    if modname == "__main__" or sys.modules.get(modname) is not module:
        raise PicklehooksError(
            f"hook {fn.__qualname__!r} uses {name!r}, the module {modname!r}, which another process "
            "can't import by that name; import an installed module instead"
        )
    return f"import {modname}" if modname == name else f"import {modname} as {name}"


def _is_importable(value: Any) -> bool:
    return inspect.isclass(value) or inspect.isroutine(value) or type(value).__module__ == "typing"


def _import_object_line(fn: types.FunctionType, name: str, value: Any) -> str:
    modname = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(value, "_name", None) or name
    why = None
    if not isinstance(modname, str) or modname == "__main__":
        why = f"it is defined in {modname or 'no module'}, which another process can't import"
    elif "<locals>" in qualname:
        why = "it is a local function or class"
    else:
        module = sys.modules.get(modname)
        for attr in (name, qualname):
            if module is not None and "." not in attr and getattr(module, attr, None) is value:
                return f"from {modname} import {attr}" + ("" if attr == name else f" as {name}")
        why = f"it can't be imported as {modname}.{qualname}"
    raise PicklehooksError(
        f"hook {fn.__qualname__!r} uses {name!r} = {value!r}, but {why}; move it to an installed "
        "module, inline it into the hook, or reach it through a module (e.g. torch.relu)"
    )


_PLAIN = (str, int, bool, bytes, type(None))


def _literal(
    fn: types.FunctionType, name: str, value: Any, _seen: frozenset = frozenset(), *, math_ok: bool = True
) -> tuple[str, bool]:
    """Return (Python text for ``value``, whether it needs ``import torch``).

    Non-finite floats are written ``math.inf``/``math.nan`` (the caller adds
    ``import math``) unless ``math_ok`` is false, because the hook's creator
    binds ``math`` to something else; then ``float('inf')``, which older
    texts hold too.
    """
    kind = type(value)
    if kind in _PLAIN:
        return repr(value), False
    if kind is float:
        if math.isfinite(value):
            return repr(value), False
        if math_ok:
            return _inline_literal(value), False
        return (f"float({str(value)!r})", False)
    if isinstance(value, torch.dtype):
        return str(value), True
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})", True
    if kind in (tuple, list, dict):
        if id(value) in _seen:
            raise PicklehooksError(f"hook {fn.__qualname__!r}: {name!r} contains itself; it can't be baked in")
        seen = _seen | {id(value)}
        if kind is dict:
            parts = [(_literal(fn, name, k, seen, math_ok=math_ok), _literal(fn, name, v, seen, math_ok=math_ok))
                     for k, v in value.items()]
            text = "{" + ", ".join(f"{k[0]}: {v[0]}" for k, v in parts) + "}"
            return text, any(k[1] or v[1] for k, v in parts)
        items = [_literal(fn, name, v, seen, math_ok=math_ok) for v in value]
        inner = ", ".join(t for t, _ in items)
        text = f"[{inner}]" if kind is list else (f"({inner},)" if len(items) == 1 else f"({inner})")
        return text, any(t for _, t in items)
    hint = (
        "register it as a buffer or parameter on the module and read it there"
        if isinstance(value, torch.Tensor)
        else "pass plain constants (str/int/float/bool/None/bytes, tuples, lists and dicts of them, "
        "torch.dtype, torch.device) or store state on the module"
    )
    raise PicklehooksError(
        f"hook {fn.__qualname__!r} captures {name!r} = {_brief(value)} ({kind.__qualname__}), which "
        f"can't be baked into a portable hook; {hint}"
    )


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
