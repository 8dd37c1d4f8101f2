"""Where a module call came from: the text of its call site, for the hook runtime and the log.

A record's ``source`` reads ``"file:line in function (Class, file:line)"``: the line that called
the module (in the parent's ``forward``; for the root, the line that called the model), then
the module's class and the line that defines it (see :mod:`picklehooks.capture.sources`, the
log's side). This module finds those texts:

* in eager mode, from the live stack, as a call's first hook runs (:func:`caller_source`);
* while ``jit.trace`` or ``torch.fx.symbolic_trace`` runs the hooks, from the live stack, and
  while ``torch.export`` traces them, from the stack Dynamo traces (:func:`trace_call_site`,
  :func:`dynamo_call_site`): the hook runtime puts the text into the graph, as the arguments of a
  ``picklehooks::call_site`` op, so a saved or loaded program carries it. A call the tracer made
  itself (the root's) gets an empty site: the line that calls the program is found when it runs
  (:func:`run_site`);
* under ``torch.compile``, from the stack Dynamo was tracing when a value got its site number
  (:func:`dynamo_frames`, :func:`traced_text`).

Part of the hook runtime, so it travels into torch.package archives: standard library and torch
only. Texts are kept per (code, line) and per class, once per process.

Limits: ``jit.script`` compiles hooks once per module, not per call, and runs no Python while
the parent calls its children, so its records have no source; nor do calls from code a tracer
generated (an FX ``GraphModule``'s ``forward`` calling a leaf module, such as ``nn.Linear``,
which ``symbolic_trace`` doesn't trace into: the graph keeps no line for it).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import os
import re
import weakref

import torch

_MODULE_PY = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))
_TORCH_DIR = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep
# torch.compile's wrappers, between a compiled model (OptimizedModule) and the line that called it.
_DYNAMO_DIR = _TORCH_DIR + "_dynamo" + os.sep
# Where a tracer calls the module it traces from: a call found there is the root's, whose line is
# the one that calls the traced program, found when it runs.
_TRACERS = tuple(_TORCH_DIR + d + os.sep for d in (
    "jit", "fx", "export", "_export", "_dynamo", "_functorch", "_higher_order_ops", "_subclasses", "_library"))
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The frames between a module's caller and the hooks: nn.Module's call machinery, the hooks' hub,
# the hook runtime and the ops' kernels (also their copies in a torch.package archive,
# "<torch_package_0>.picklehooks/..."), and the log's side of this.
_OWN = {"picklehooks/_hookrt.py", "picklehooks/_taps.py", "picklehooks/_sites.py", "picklehooks/_ops.py",
        "picklehooks/_deliver.py", "picklehooks/capture/sources.py"}
_OWN_PATHS = {os.path.normcase(os.path.join(_PACKAGE_DIR, *name.split("/")[1:])) for name in _OWN}
_MANGLED = re.compile(r"^<torch_package_\d+>\.?")
# Code objects not to stop at, by file name, cached.
_SKIP: dict[str, bool] = {}
_SITES: dict[tuple, str] = {}  # (code, line) -> "file:line in function"
_CLASSES: dict[type, str] = {}  # module class -> "Class, file:line"
_FILES: dict[tuple, str] = {}  # (co_filename, module name) -> the name records use


def _skipped(filename: str) -> bool:
    skip = _SKIP.get(filename)
    if skip is None:
        plain = _MANGLED.sub("", filename)
        path = os.path.normcase(os.path.abspath(filename)) if not filename.startswith("<") else filename
        skip = _SKIP[filename] = (path == _MODULE_PY or path in _OWN_PATHS or plain in _OWN
                                  or plain.startswith("<picklehooks-generated>") or path.startswith(_DYNAMO_DIR))
    return skip


def _file_name(code, module_name: str | None) -> str:
    """The file of ``code`` as records name it: by its module (the same in every process and archive)."""
    key = (code.co_filename, module_name)
    name = _FILES.get(key)
    if name is None:
        plain = _MANGLED.sub("", module_name or "")
        if not plain or plain == "__main__":
            name = os.path.basename(_MANGLED.sub("", code.co_filename))
        elif os.path.basename(code.co_filename) == "__init__.py":
            name = plain.replace(".", "/") + "/__init__.py"
        else:
            name = plain.replace(".", "/") + ".py"
        _FILES[key] = name
    return name


def _own_call(frame) -> bool:
    """Whether ``frame`` is a module's own ``__call__`` (which then calls ``nn.Module.__call__``)."""
    return frame.f_code.co_name == "__call__" and isinstance(frame.f_locals.get("self"), torch.nn.Module)


def site_text(code, line: int, module_globals: dict) -> str | None:
    site = _SITES.get((code, line))
    if site is None:
        if code.co_filename.startswith("<") and not _MANGLED.match(code.co_filename):
            # generated code (exec, FX's forward); a notebook cell is named "<ipython-input-...>"
            site = f"{code.co_filename}:{line} in {code.co_qualname}" if code.co_filename.startswith(
                "<ipython-input") else None
        else:
            site = f"{_file_name(code, module_globals.get('__name__'))}:{line} in {code.co_qualname}"
        _SITES[(code, line)] = site
    return site


def traced_text(frames: tuple) -> str | None:
    """The source of a value a ``torch.compile`` graph records, from :func:`dynamo_frames` when its
    site was drawn, by the rule :func:`caller_source` walks a live stack with."""
    cls = next((c for *_, c in frames if c is not None), None)
    for code, line, module_globals, own_call, _ in frames:
        if _skipped(code.co_filename) or (own_call and code.co_name == "__call__"):
            continue
        site = site_text(code, line, module_globals)
        return None if site is None or cls is None else f"{site} ({describe_class(cls)})"
    return None


_MISSING = object()
_TEXTS: dict[tuple, str | None] = {}  # (code, line, module class) -> the whole source text


def caller_source(cls: type, depth: int = 1) -> str | None:
    """The source text of a call of a module of class ``cls`` whose hook is running: the caller's
    ``"file:line in function"`` and :func:`describe_class`, kept per (code, line, class). About a
    µs: a log that never starts a step counts calls on and asks for every new call's. ``depth``:
    frames to skip first (this function's caller is 1)."""
    frame = _frame(depth + 1)
    skip = _SKIP
    while frame is not None:
        code = frame.f_code
        skipped = skip.get(code.co_filename)
        if skipped is None:
            skipped = _skipped(code.co_filename)
        if not skipped and not (code.co_name == "__call__" and _own_call(frame)):
            break
        frame = frame.f_back
    if frame is None:
        return None
    key = (code, frame.f_lineno, cls)
    text = _TEXTS.get(key, _MISSING)
    if text is _MISSING:
        site = site_text(code, frame.f_lineno, frame.f_globals)
        text = _TEXTS[key] = None if site is None else f"{site} ({describe_class(cls)})"
    return text


def describe_class(cls: type) -> str:
    """``"Class, file:line"``: a module class and the line that defines it (``"Class"`` where unknown)."""
    text = _CLASSES.get(cls)
    if text is None:
        text = _CLASSES[cls] = _class_text(cls)
    return text


def _class_text(cls: type) -> str:
    # The class statement around one of its methods (its forward first), as inspect.getsourcelines
    # gives it (its first decorator's line, if any), read through the method's globals: linecache
    # asks their loader, so code in a torch.package archive is found too, where inspect finds none.
    methods = [f for f in map(_unwrapped, vars(cls).values()) if hasattr(f, "__code__") and hasattr(f, "__globals__")]
    forward = _unwrapped(vars(cls).get("forward"))
    method = forward if forward in methods else (methods[0] if methods else None)
    if method is None:
        return cls.__qualname__
    code = method.__code__
    tree = _parsed(code.co_filename, method.__globals__)
    inside = code.co_firstlineno
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__ \
                and node.lineno <= inside <= (node.end_lineno or inside):
            if best is None or node.lineno > best.lineno:  # the innermost
                best = node
    if best is None:
        return cls.__qualname__
    line = best.decorator_list[0].lineno if best.decorator_list else best.lineno
    return f"{cls.__qualname__}, {_file_name(code, method.__globals__.get('__name__'))}:{line}"


_TREES: dict[str, ast.Module | None] = {}


def _parsed(filename: str, module_globals: dict) -> ast.Module | None:
    if filename not in _TREES:
        try:
            _TREES[filename] = ast.parse("".join(linecache.getlines(filename, module_globals)))
        except (SyntaxError, ValueError):
            _TREES[filename] = None
    return _TREES[filename]


def _unwrapped(f):
    try:
        return inspect.unwrap(f) if callable(f) else f
    except ValueError:  # a __wrapped__ cycle
        return f




def _frame(depth: int):
    """The frame ``depth`` calls above the caller (``sys._getframe``, which a torch.package archive may
    not import: ``sys`` is refused there unless the exporter externs it)."""
    frame = inspect.currentframe().f_back
    for _ in range(depth):
        frame = frame.f_back
    return frame


def _tracer_frame(filename: str) -> bool:
    return os.path.normcase(os.path.abspath(filename)).startswith(_TRACERS) if not filename.startswith("<") else False


_FX_TRACE_PY = os.path.normcase(os.path.abspath(torch.fx._symbolic_trace.__file__))


def _caller(frame):
    """The first frame from ``frame`` up that is none of the call machinery (see :func:`caller_source`),
    nor FX's, which calls each module it traces through (its ``call_module``, also a subclass's)."""
    while frame is not None:
        code = frame.f_code
        if not (_skipped(code.co_filename) or (code.co_name == "__call__" and _own_call(frame))
                or os.path.normcase(os.path.abspath(code.co_filename)) == _FX_TRACE_PY
                or (code.co_name == "call_module" and isinstance(frame.f_locals.get("self"), torch.fx.Tracer))):
            return frame
        frame = frame.f_back
    return None


# Module calls whose pre-hook put a call site into the graph being traced: their forward hook doesn't.
_BEGUN: set[str] = set()


def _first_hook(name: str, pre: bool) -> bool:
    if pre:
        _BEGUN.add(name)
        return True
    if name in _BEGUN:
        _BEGUN.discard(name)
        return False
    return True


def trace_call_site(module, name: str, pre: bool) -> tuple[str, str] | None:
    """``(site, class)`` of the call of ``module`` (named ``name``) whose hook ``jit.trace`` or FX runs:
    ``site`` is ``""`` for the call the tracer made (the root), None where the hook's call site is
    already in the graph (its pre-hook put it there) or is code without a file."""
    if not _first_hook(name, pre):
        return None
    frame = _caller(_frame(1))
    if frame is None or _tracer_frame(frame.f_code.co_filename):
        return "", describe_class(type(module))
    site = site_text(frame.f_code, frame.f_lineno, frame.f_globals)
    return None if site is None else (site, describe_class(type(module)))


def fx_tracer():
    """The ``torch.fx.Tracer`` running the hook that asks (found on the stack), or None."""
    frame = _frame(1)
    while frame is not None:
        here = frame.f_locals.get("self") if frame.f_code.co_name == "call_module" else None
        if isinstance(here, torch.fx.Tracer):
            return here
        frame = frame.f_back
    return None


def dynamo_frames() -> tuple | None:
    """The Python stack Dynamo is tracing, innermost first: per frame ``(code, line, globals,
    whether its self is a module, the hooked module's class or None)`` (classes, not modules: a
    model must stay free to go). Called by functions Dynamo runs as constants while it traces."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx().output.current_tx  # the innermost frame being traced
        frames = []
        while tx is not None:
            here, module = tx.symbolic_locals.get("self"), tx.symbolic_locals.get("module")
            frames.append((tx.f_code, tx.lineno, tx.f_globals, isinstance(getattr(here, "value", None), torch.nn.Module),
                           type(module.value) if isinstance(getattr(module, "value", None), torch.nn.Module) else None))
            tx = tx.parent
        return tuple(frames)
    except Exception:  # noqa: BLE001 - Dynamo's internals moved: no source, nothing else changes
        return None


def dynamo_call_site(name: str, pre: bool) -> tuple[str, str] | None:
    """:func:`trace_call_site` while Dynamo traces the hook (``torch.export``), from its stack."""
    if not _first_hook(name, pre):
        return None
    frames = dynamo_frames()
    cls = next((c for *_, c in frames if c is not None), None) if frames else None
    if cls is None:
        return None
    for code, line, module_globals, own_call, _ in frames:
        if _skipped(code.co_filename) or (own_call and code.co_name == "__call__"):
            continue
        if _tracer_frame(code.co_filename):
            break
        site = site_text(code, line, module_globals)
        return None if site is None else (site, describe_class(cls))
    return "", describe_class(cls)


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo: Dynamo calls
# the function while tracing and puts what it returns into the graph as constants.
dynamo_call_site._dynamo_marked_constant = True


def run_site() -> str | None:
    """``"file:line in function"`` of the line that called the traced program now running (for a
    call site a graph left empty): the first frame outside torch, picklehooks and generated code."""
    frame = _frame(1)
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith("<"):  # generated code (FX's forward), but a notebook cell or an archive's module
            inside = not filename.startswith("<ipython-input") and not _MANGLED.match(filename)
        else:
            inside = os.path.normcase(os.path.abspath(filename)).startswith(_TORCH_DIR)
        if not (inside or _skipped(filename)):
            return site_text(code, frame.f_lineno, frame.f_globals)
        frame = frame.f_back
    return None


# -- TorchScript: a scripted program's call sites, read off its graphs ---------------------------

_RANGE = re.compile(r'File "(.+)", line (\d+)')
_MANGLE = re.compile(r"\.___torch_mangle_\d+")
_SYS_MODULES = importlib.import_module("sys").modules  # (sys itself can't be imported in an archive)
_BY_FILE: dict[str, str] = {}  # normcased file path -> the module loaded from it
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
        self.root_name = None
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
                tree = _parsed(match.group(1), {})
                line = int(match.group(2))
                best = None
                for statement in ast.walk(tree) if tree is not None else ():
                    if isinstance(statement, ast.ClassDef) and statement.name == name \
                            and statement.lineno <= line <= (statement.end_lineno or line):
                        if best is None or statement.lineno > best.lineno:
                            best = statement
                if best is not None:
                    at = best.decorator_list[0].lineno if best.decorator_list else best.lineno
                    return f"{module.original_name}, {_file_label(match.group(1), where)}:{at}"
                break
    return module.original_name


def _file_label(filename: str, hint: str | None = None) -> str:
    """A file as records name it (see :func:`_file_name`): by the module loaded from it; else by
    ``hint`` (the module a scripted class came from) where the file is that module's; else its name."""
    path = os.path.normcase(os.path.abspath(filename))
    if path not in _BY_FILE:
        _BY_FILE.update((os.path.normcase(os.path.abspath(f)), n) for n, m in list(_SYS_MODULES.items())
                        if isinstance(f := getattr(m, "__file__", None), str))
    module_name = _BY_FILE.get(path)
    if module_name is None and hint:
        stem = os.path.normcase(os.path.join(*hint.split(".")))
        if path.endswith(os.sep + stem + ".py") or path.endswith(os.sep + os.path.join(stem, "__init__.py")):
            module_name = hint
    if not module_name or module_name == "__main__":
        return os.path.basename(filename)
    if os.path.basename(filename) == "__init__.py":
        return module_name.replace(".", "/") + "/__init__.py"
    return module_name.replace(".", "/") + ".py"


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
