"""Where a record came from: the line of code that called its module, found once per call.

A record's ``source`` (``Record.source``, the ``source`` column of tables, sinks and
``records.json``) reads

    ``transformers/models/gpt2/modeling_gpt2.py:412 in GPT2MLP.forward (NewGELUActivation, transformers/activations.py:56)``

the line that called the module (in the parent's ``forward``; for the root, the line that
called the model), the function it is in, then the module's class and the line that defines
it. Each call of a module has its own source (one ``nn.Identity`` used at three places, a
block called in a loop from one line).

**How.** While a log records in eager mode, the first hook that runs for a module call (its
pre-hook, else its forward hook) asks the log (:meth:`Sources._call_begins`), which counts the
module's calls as the records' ``call`` counts them and, for a ``(module, call)`` it has no
source for yet, walks up the Python stack to the first frame that is neither ``nn.Module``'s
call machinery, nor a module's own ``__call__`` (Hugging Face's ``GradientCheckpointingLayer``),
nor picklehooks. The text of each (code, line) and of each class is made once per process. So
the steady state (a training loop, whose steps count calls from 0) costs one dictionary look-up
per module call; a log that never starts a step counts calls on, and finds each new one's
source (a few µs).

**Files** are named by their module (``transformers/models/gpt2/modeling_gpt2.py``, relative to
the directory it is imported from), so a model loaded with ``torch.load`` in another process
or from a ``torch.package`` archive (whose modules are ``<torch_package_0>.…``) names the same
files as the model it was saved from; a script run as ``__main__`` is named by its file name.

**torch.compile.** Dynamo runs the hooks as Python while it traces: each value a graph records
gets a site number (:func:`picklehooks._ops.compiled_site`, a constant Dynamo calls while
tracing), which remembers the stack Dynamo was tracing (its translators' code, line and
globals). When the graph's op records the value, the log turns that stack into the record's
source (:func:`traced_source`, by the rule the live walk follows), once per ``(module, call)``.

Limits: eager mode (which includes a model loaded with ``torch.load`` or from a
``torch.package`` archive) and ``torch.compile`` graphs, in the process that compiled them,
find sources. Records made by ``jit.script``, ``jit.trace`` and ``torch.export`` programs,
whose ops carry no room for a source, and calls from FX's generated ``forward`` (not the
model's code) have none (``None``). A module called recursively (from inside its own call) may
get its calls' sources swapped; under ``torch.compile``, where Inductor can reorder a graph's
record ops (see the limitations page), so may a module called twice.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import re
import sys

import torch

__all__ = ["caller_source", "describe_class", "traced_source"]

_MODULE_PY = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))
# torch.compile's wrappers, between a compiled model (OptimizedModule) and the line that called it.
_DYNAMO_DIR = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep + "_dynamo" + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The frames between a module's caller and this file: nn.Module's call machinery, the hooks' hub,
# the hook runtime (also its copy in a torch.package archive, "<torch_package_0>.picklehooks/...").
_OWN = {"picklehooks/_hookrt.py", "picklehooks/_taps.py", "picklehooks/capture/sources.py"}
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


def _site_text(code, line: int, module_globals: dict) -> str | None:
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


def traced_source(frames: tuple) -> str | None:
    """The source of a value a ``torch.compile`` graph records, from the stack Dynamo was tracing
    (:data:`picklehooks._ops.SITE_FRAMES`: innermost first, each ``(code, line, globals, self is a
    module, the hooked module's class)``), by the rule :func:`caller_source` walks a live stack with.
    Once per stack: the text is kept by the tuple's identity (the runtime keeps every tuple)."""
    key = id(frames)
    if key not in _TRACED:
        _TRACED[key] = _traced_text(frames)
    return _TRACED[key]


_TRACED: dict[int, str | None] = {}


def _traced_text(frames: tuple) -> str | None:
    cls = next((c for *_, c in frames if c is not None), None)
    for code, line, module_globals, own_call, _ in frames:
        if _skipped(code.co_filename) or (own_call and code.co_name == "__call__"):
            continue
        site = _site_text(code, line, module_globals)
        return None if site is None or cls is None else f"{site} ({describe_class(cls)})"
    return None


_MISSING = object()
_TEXTS: dict[tuple, str | None] = {}  # (code, line, module class) -> the whole source text


def caller_source(cls: type, depth: int = 1) -> str | None:
    """The source text of a call of a module of class ``cls`` whose hook is running: the caller's
    ``"file:line in function"`` and :func:`describe_class`, kept per (code, line, class). About a
    µs: a log that never starts a step counts calls on and asks for every new call's. ``depth``:
    frames to skip first (this function's caller is 1)."""
    frame = sys._getframe(depth + 1)
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
        site = _site_text(code, frame.f_lineno, frame.f_globals)
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


class Sources:
    """A log's sources: ``(module, call) -> source``, found as calls begin (see the module docstring).

    Mixed into the log's row-writing side; the hook runtime calls :meth:`_call_begins` by name
    (an earlier version's log has none, and its records no source)."""

    def __init__(self) -> None:
        self._sources: dict[tuple[str, int], str | None] = {}
        self._invocations: dict[str, int] = {}
        self._begun: set[str] = set()  # modules whose pre-hook counted the call their forward hook ends

    def _restart_sources(self) -> None:
        """Count calls from 0 again (with the records' ``call``, at a step's start); sources stay."""
        self._invocations.clear()
        self._begun.clear()

    def _call_begins(self, module, name: str, pre: bool) -> None:
        """A call of ``module`` (named ``name``) is running its hooks: the pre-hook's (``pre``) or, for a
        module without one, its forward hook's. Counts the call; finds its source once."""
        if not pre and name in self._begun:
            self._begun.discard(name)  # its pre-hook counted this call
            return
        if pre:
            self._begun.add(name)
        invocations = self._invocations
        call = invocations.get(name, 0)
        invocations[name] = call + 1
        key = (name, call)
        if key not in self._sources:
            self._sources[key] = caller_source(type(module), 2)

    def _graph_call_site(self, module: str, kind: str, path: str, frames: tuple) -> None:
        """A ``torch.compile`` graph's op just recorded (or counted) a value of ``module``: give the
        record's ``(module, call)`` the source tracing saw (called by the op's kernel, by name)."""
        rows = self._rows
        row = rows[-1] if rows else None
        if row is not None and row[0] == module and row[1] == kind and row[2] == path:
            call = row[3]
        else:  # counted without a row (a gradient-only tap), or read meanwhile
            call = self._calls.get((module, kind, path), 1) - 1
        key = (module, call)
        if key not in self._sources:
            self._sources[key] = traced_source(frames)
