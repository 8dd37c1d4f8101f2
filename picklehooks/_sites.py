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
  (:func:`dynamo_frames`, :func:`traced_text`);
* in a ``jit.script`` program (whose hooks TorchScript compiles once per module, not per call),
  from its graphs: :mod:`picklehooks.capture.script_sites`, on the log's side, with the helpers here.

Part of the hook runtime, so it travels into torch.package archives: standard library and torch
only. Texts are kept per (code, line) and per class, once per process.

Limits: calls from code a tracer generated (an FX ``GraphModule``'s ``forward`` calling a leaf
module, such as ``nn.Linear``, which ``symbolic_trace`` doesn't trace into: the graph keeps no
line for it) have no source; for scripted programs, see :mod:`picklehooks.capture.script_sites`.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import re

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
        "picklehooks/_deliver.py", "picklehooks/capture/sources.py", "picklehooks/capture/script_sites.py"}
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
        name = _FILES[key] = module_file(_MANGLED.sub("", code.co_filename), _MANGLED.sub("", module_name or ""))
    return name


def module_file(filename: str, module_name: str | None) -> str:
    """The name records give ``filename``, the file of module ``module_name``: ``a/b.py`` or
    ``a/b/__init__.py`` (the same in every process), its own name for ``__main__`` or no module."""
    if not module_name or module_name == "__main__":
        return os.path.basename(filename)
    if os.path.basename(filename) == "__init__.py":
        return module_name.replace(".", "/") + "/__init__.py"
    return module_name.replace(".", "/") + ".py"


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
    caller = _traced_caller(frames)
    if caller is None or cls is None:
        return None
    site = site_text(*caller[:3])
    return None if site is None else f"{site} ({describe_class(cls)})"


def _traced_caller(frames: tuple) -> tuple | None:
    """The first of :func:`dynamo_frames`' frames that is none of the call machinery (the rule of
    :func:`caller_source`), or None."""
    return next((f for f in frames if not (_skipped(f[0].co_filename) or (f[3] and f[0].co_name == "__call__"))),
                None)


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
    line = class_line(_parsed(code.co_filename, method.__globals__), cls.__name__, code.co_firstlineno)
    if line is None:
        return cls.__qualname__
    return f"{cls.__qualname__}, {_file_name(code, method.__globals__.get('__name__'))}:{line}"


def class_line(tree: ast.Module | None, name: str, inside: int) -> int | None:
    """The line of the innermost ``class name`` statement around line ``inside`` of ``tree``, as
    ``inspect.getsourcelines`` gives it (its first decorator's line, if any); None if there is none."""
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == name and node.lineno <= inside <= (node.end_lineno or inside):
            if best is None or node.lineno > best.lineno:
                best = node
    return None if best is None else (best.decorator_list[0].lineno if best.decorator_list else best.lineno)


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
    caller = _traced_caller(frames)
    if caller is None or _tracer_frame(caller[0].co_filename):
        return "", describe_class(cls)
    site = site_text(*caller[:3])
    return None if site is None else (site, describe_class(cls))


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo: Dynamo calls
# the function while tracing and puts what it returns into the graph as constants.
dynamo_call_site._dynamo_marked_constant = True


def run_site() -> str | None:
    """``"file:line in function"`` of the line that called the traced program now running (for a
    call site a graph left empty): the first frame outside torch, picklehooks and generated code."""
    frame = _frame(1)
    while frame is not None:
        code = frame.f_code
        passed = _RUN_SKIP.get(code.co_filename)
        if passed is None:
            passed = _RUN_SKIP[code.co_filename] = _run_skipped(code.co_filename)
        if not passed:
            return site_text(code, frame.f_lineno, frame.f_globals)
        frame = frame.f_back
    return None


_RUN_SKIP: dict[str, bool] = {}


def _run_skipped(filename: str) -> bool:
    if filename.startswith("<"):  # generated code (FX's forward), but a notebook cell or an archive's module
        return _skipped(filename) or not (filename.startswith("<ipython-input") or _MANGLED.match(filename))
    return os.path.normcase(os.path.abspath(filename)).startswith(_TORCH_DIR) or _skipped(filename)
