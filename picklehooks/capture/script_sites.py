"""Where a scripted program's module calls come from: read off its graphs, once per program.

TorchScript compiles a module's hooks once, not per call, and runs no Python while a parent calls
its children, so a scripted program has no ``picklehooks::call_site`` ops (see
:mod:`picklehooks._sites`). Its graphs keep what is needed: each module call is a
``prim::CallMethod`` of ``forward`` in its parent's graph (methods the parent calls on itself
included), with the source range of the line that makes it; ``jit.script`` unrolls loops over a
``ModuleList``. A record a scripted program makes without a site asks the log
(``Sources._script_site``), which asks :func:`scripted_source`: it finds the program on the stack
(the scripted root's ``nn.Module._call_impl``, which runs the root's hooks), reads its graphs once
(:class:`_ScriptSites`) and names call ``k`` of a module by its ``k``-th site, modulo their count
per call of its parent. A ``jit.trace``d program made before traced graphs had ``call_site`` ops
is read the same way.

Files are named by the modules loaded from them, else by the module the scripted class came from
(``__torch__.tests.models.small.Stage``: a program loaded in another process), else by their name;
functions and classes by the ``def`` and ``class`` statements around the lines, read from the
files the source ranges name (through ``linecache``), where they exist.

Limits: a module called inside a loop or a branch of its parent's graph (``for _ in range(n)``,
``if``), or from two parents, has no source (``None``): the order of its calls isn't the graph's.
A module of the program that isn't instrumented is not named. Failures to read a graph give no
source; they never fail the record.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import weakref

import torch

from .._sites import _frame, _parsed, class_line, describe_class, module_file, run_site

__all__ = ["scripted_source"]

_RANGE = re.compile(r'File "(.+)", line (\d+)')
_MANGLE = re.compile(r"\.___torch_mangle_\d+")
_SYS_MODULES = importlib.import_module("sys").modules  # (sys itself can't be imported in an archive)
_BY_FILE: dict[str, str | None] = {}  # normcased file path -> the module loaded from it (None: none)
_SCRIPTED = weakref.WeakKeyDictionary()  # a scripted program's root -> its _ScriptSites
_TORCH_MODULE = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))


def scripted_source(module: str, call: int) -> str | None:
    """The source of call ``call`` of ``module`` in the scripted (or ``jit.trace``d) program whose
    record op is running: found on its graphs, once per program (:class:`_ScriptSites`). None
    outside one, and where its graphs don't tell (see :class:`_ScriptSites`)."""
    frame = _frame(1)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and \
                os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == _TORCH_MODULE:
            root = frame.f_locals.get("self")
            if isinstance(root, torch.jit.RecursiveScriptModule):
                break
        frame = frame.f_back
    else:
        return None
    try:
        sites = _SCRIPTED.get(root)
        if sites is None:
            sites = _SCRIPTED[root] = _ScriptSites(root)
        if module == sites.root_name:
            site = run_site()
            return None if site is None else f"{site} ({sites.classes[module]})"
        return sites.text(module, call)
    except Exception:  # noqa: BLE001 - TorchScript's graph API moved: no source, the record stays
        return None


class _ScriptSites:
    """The call sites of each module of a scripted program, by its ``_picklehooks_name``: the
    ``prim::CallMethod`` of its ``forward`` in its parent's graphs (methods the parent calls on itself
    included), in graph order, with the source range TorchScript kept (``jit.script`` unrolls loops
    over a ``ModuleList``). A module called inside a loop or a branch (``prim::Loop``, ``prim::If``),
    or from two parents, has no source: the order of its calls isn't the graph's."""

    def __init__(self, root) -> None:
        self.sites: dict[str, list] = {}
        self.unsure: set[str] = set()
        self.classes: dict[str, str] = {}
        by_path = {path: mod for path, mod in root.named_modules()}
        self.names = {path: _picklehooks_name(mod) for path, mod in by_path.items()}
        self.root_name = self.names.get("")
        for path, mod in by_path.items():
            if self.names[path] is not None:
                self.classes[self.names[path]] = _script_class(mod)
        owners: dict[str, str] = {}
        for path, mod in by_path.items():
            if mod._c._has_method("forward"):
                self._walk(mod, path, mod._c._get_method("forward").graph, owners, False, set())
        self._texts: dict[tuple, str | None] = {}

    def _walk(self, module, path: str, graph, owners: dict, nested: bool, seen: set) -> None:
        values = {next(iter(graph.inputs())): path}

        def visit(block, nested: bool) -> None:
            for node in block.nodes():
                kind = node.kind()
                if kind == "prim::GetAttr" and node.inputsAt(0) in values:
                    base = values[node.inputsAt(0)]
                    values[node.output()] = f"{base}.{node.s('name')}" if base else node.s("name")
                elif kind == "prim::CallMethod" and node.inputsAt(0) in values:
                    target, method = values[node.inputsAt(0)], node.s("name")
                    if target == path and method != "forward" and method not in seen:
                        seen.add(method)  # a method the module calls on itself: its calls are this graph's
                        self._walk(module, path, module._c._get_method(method).graph, owners, nested, seen)
                        seen.discard(method)
                    elif target != path and method == "forward":
                        name = self.names.get(target)
                        if name is None:
                            continue
                        if owners.setdefault(name, path) != path or nested:
                            self.unsure.add(name)
                        match = _RANGE.search(node.sourceRange())
                        self.sites.setdefault(name, []).append(
                            (match.group(1), int(match.group(2)), _type_module(module)[0]) if match else None)
                for inner in node.blocks():
                    visit(inner, True)

        visit(graph, nested)

    def text(self, module: str, call: int) -> str | None:
        sites = self.sites.get(module)
        if not sites or module in self.unsure:
            return None
        site = sites[call % len(sites)]
        key = (module, site)
        if key not in self._texts:
            where = None if site is None else _file_site(*site)
            self._texts[key] = None if where is None else f"{where} ({self.classes[module]})"
        return self._texts[key]


def _picklehooks_name(module) -> str | None:
    c = module._c
    return c.getattr("_picklehooks_name") if c.hasattr("_picklehooks_name") else None


def _type_module(module) -> tuple[str, str]:
    """(module, class) of the Python class a scripted module was made from, by the name TorchScript
    kept (``__torch__.tests.models.small.Stage``)."""
    qualified = _MANGLE.sub("", module._c._type().qualified_name()).removeprefix("__torch__.")
    where, _, name = qualified.rpartition(".")
    return where, name


def _script_class(module) -> str:
    """:func:`describe_class` of the Python class a scripted module was made from: the class itself
    where its module is imported; else its ``class`` statement, in the file its ``forward``'s
    source range names (a program loaded in another process); else its name."""
    where, name = _type_module(module)
    cls = getattr(_SYS_MODULES.get(where), name, None)
    if isinstance(cls, type):
        return describe_class(cls)
    if module._c._has_method("forward"):
        for node in module._c._get_method("forward").graph.nodes():
            match = _RANGE.search(node.sourceRange())
            if match:
                at = class_line(_parsed(match.group(1), {}), name, int(match.group(2)))
                if at is not None:
                    return f"{module.original_name}, {_file_label(match.group(1), where)}:{at}"
                break
    return module.original_name


def _file_label(filename: str, hint: str | None = None) -> str:
    """A file as records name it (see :func:`_file_name`): by the module loaded from it; else by
    ``hint`` (the module a scripted class came from) where the file is that module's; else its name."""
    path = os.path.normcase(os.path.abspath(filename))
    if path not in _BY_FILE:  # (once per file: one loaded later than the first look stays unnamed by it)
        _BY_FILE.update((os.path.normcase(os.path.abspath(f)), n) for n, m in list(_SYS_MODULES.items())
                        if isinstance(f := getattr(m, "__file__", None), str))
        _BY_FILE.setdefault(path, None)
    module_name = _BY_FILE[path]
    if module_name is None and hint:
        stem = os.path.normcase(os.path.join(*hint.split(".")))
        if path.endswith(os.sep + stem + ".py") or path.endswith(os.sep + os.path.join(stem, "__init__.py")):
            module_name = hint
    return module_file(filename, module_name)


def _file_site(filename: str, line: int, hint: str | None = None) -> str | None:
    """``"file:line in function"`` for a line of a file, as :func:`site_text` names a frame: the file
    as :func:`_file_label` names it, the function by the ``def`` around the line."""
    tree = _parsed(filename, {})
    qualname = _function_at(tree, line) if tree is not None else None
    return None if qualname is None else f"{_file_label(filename, hint)}:{line} in {qualname}"


def _function_at(tree, line: int) -> str | None:
    """The qualified name (``co_qualname``'s) of the innermost function whose body holds ``line``."""
    best = None

    def visit(node, prefix: str) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    if not isinstance(child, ast.ClassDef):
                        best = name
                    visit(child, name + (".<locals>." if not isinstance(child, ast.ClassDef) else "."))
            else:
                visit(child, prefix)

    visit(tree, "")
    return best
