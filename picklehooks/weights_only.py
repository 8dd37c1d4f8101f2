"""Loading hooked checkpoints with ``torch.load(weights_only=True)``.

Registries and serving stacks often load with ``weights_only=True``, which
refuses every global that isn't allowlisted, so a checkpoint holding portable
hooks fails on the hooks' ``picklehooks._hub.<name>`` references. After
auditing a file (``python -m picklehooks inspect FILE``), a user can allowlist
exactly those hooks::

    with torch.serialization.safe_globals(picklehooks.safe_globals("model.pt", everything=True)):
        model = torch.load("model.pt", weights_only=True)

What building the list runs, and what it never runs:

* The file is read without unpickling it (:func:`picklehooks.audit.find_hooks`
  and ``torch.serialization.get_unsafe_globals_in_checkpoint``).
* Each hook name is then decoded through the hub as *untrusted*
  (:func:`picklehooks._shim.untrusted`): its text may only import modules of
  the trusted packages (``torch``, ``typing``, ``math``, ``collections``,
  ``operator``, ``picklehooks``) and those named in ``trust=``, and defining it
  runs nothing else (see the shim's check). The hook's *body* runs later, when
  the model calls it: audit it first.
* ``everything=True`` also allowlists the file's other globals (a pickled
  ``nn.Module`` needs its classes). It refuses, listing them all, any global
  that could run arbitrary code when ``torch.load`` calls it (``exec``,
  ``eval``, ``open``, ``getattr``, ``os.*``, ``subprocess.*``, ... see
  :data:`DANGEROUS_MODULES` and :data:`DANGEROUS_BUILTINS`), and imports a
  module only if it belongs to a trusted package.
"""

from __future__ import annotations

import builtins
import importlib
import os
import sys
import types
import zipfile
from typing import Any, Iterable

import torch
from torch import nn

from ._shim import BASE_TRUSTED, HUB_NAME, DecodeError, PicklehooksError, hub, untrusted
from .portable import is_portable

__all__ = ["safe_globals"]

#: Top-level modules none of whose functions or classes may be allowlisted:
#: each can run commands, touch files or the network, load code or unpickle.
DANGEROUS_MODULES = frozenset(
    """os posix nt posixpath ntpath subprocess sys importlib ctypes cffi pickle _pickle pickletools copyreg
    marshal shelve dbm shutil tempfile glob io _io zipimport pkgutil runpy code codeop pty platform
    multiprocessing asyncio threading _thread signal gc inspect types operator _operator functools
    socket ssl http urllib ftplib smtplib imaplib telnetlib xmlrpc webbrowser requests aiohttp httplib
    commands uuid venv ensurepip pip setuptools distutils bdb pdb doctest pydoc trace timeit profile
    cProfile idlelib lib2to3 test _osx_support _aix_support _pyrepl logging.FileHandler dill cloudpickle
    joblib numpy.f2py numpy.testing torch.serialization torch._dynamo torch._inductor torch.jit.unsupported_tensor_ops
    torch.fx.experimental.symbolic_shapes.ShapeEnv torch.utils._config_module torch.utils.bottleneck
    torch.utils.collect_env torch.utils.data.datapipes.utils.decoder""".split()
)
#: Builtins that may be allowlisted: plain data types. Every other builtin
#: (exec, eval, compile, open, getattr, setattr, __import__, vars, type ...) is refused.
SAFE_BUILTINS = frozenset(
    "int float complex bool str bytes bytearray tuple list dict set frozenset slice range".split()
)
DANGEROUS_BUILTINS = frozenset(n for n in dir(builtins) if n not in SAFE_BUILTINS)


def _module_hooks(model: nn.Module) -> list:
    found = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key.endswith("hooks") and isinstance(value, dict):
                found += [fn for fn in value.values() if is_portable(fn)]
    return found


def _dangerous(dotted: str) -> bool:
    """True if the global ``dotted`` ("module.name") names something that can run arbitrary code."""
    parts = dotted.split(".")
    if parts[0] in ("builtins", "__builtin__"):
        return len(parts) != 2 or parts[1] not in SAFE_BUILTINS
    # Names that reach a dangerous module through another one (torch.serialization.os.system)
    # are caught once resolved, by _dangerous_object.
    return any(".".join(parts[:i]) in DANGEROUS_MODULES for i in range(1, len(parts) + 1))


def _dangerous_object(obj: Any) -> bool:
    """True for a resolved global that is a module, a dangerous builtin, or lives in a dangerous module."""
    if isinstance(obj, types.ModuleType):
        return True
    if isinstance(obj, types.BuiltinFunctionType) and getattr(obj, "__self__", None) is builtins:
        return obj.__name__ not in SAFE_BUILTINS
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and _dangerous(f"{module}.{getattr(obj, '__qualname__', '?')}")


def _import_global(dotted: str, trusted: frozenset[str]) -> Any:
    """Resolve ``"pkg.mod.Name"`` by importing the longest importable module prefix of a trusted package."""
    parts = dotted.split(".")
    if parts[0] not in trusted and dotted.rpartition(".")[0] not in sys.modules:
        raise PicklehooksError(
            f"the checkpoint needs {dotted!r}; importing {parts[0]!r} would run its code, and it is not "
            f"trusted: if you trust it, pass trust=[{parts[0]!r}]"
        )
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise PicklehooksError(f"can't import {dotted!r}, which the checkpoint needs; install the package that defines it")


def safe_globals(
    source: str | os.PathLike | nn.Module, *, everything: bool = False, trust: Iterable[str] = ()
) -> list:
    """The hook functions a checkpoint (or a model about to be saved) needs allowlisted.

    ``source`` is a ``torch.save`` file or an ``nn.Module``. With
    ``everything=True`` (files only) the list also holds every other global
    the file references, so that ``torch.load(weights_only=True)`` succeeds.
    ``trust`` names further top-level packages whose modules the hooks (and,
    with ``everything=True``, the file's globals) may import.

    >>> allowed = picklehooks.safe_globals("model.pt", everything=True, trust=["mymodels"])
    >>> with torch.serialization.safe_globals(allowed): model = torch.load("model.pt", weights_only=True)
    """
    trust = tuple(trust) if not isinstance(trust, str) else (trust,)
    if isinstance(source, nn.Module):
        if everything:
            raise PicklehooksError("everything=True needs a file: the globals a model pickles to are known once saved")
        return _unique(_module_hooks(source))
    from .audit import AuditError, audit_file  # the audit reads files; only this path needs it

    path = os.fspath(source)
    try:
        report = audit_file(path)
    except AuditError as exc:
        raise PicklehooksError(f"can't read {path!r}: {exc}") from None
    if report.problems or report.irregular:
        raise PicklehooksError(f"can't read {path!r} completely: {(report.problems or report.irregular)[0]}")
    entries = report.entries
    broken = [e for e in entries if e.error]
    if broken:
        raise PicklehooksError(f"{path!r}: hook {broken[0].name[:24]}... does not decode: {broken[0].error}")
    others: list[str] = []
    if everything:
        if zipfile.is_zipfile(path):
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except (RuntimeError, ValueError, OSError) as exc:  # torch's zip reader: a bad CRC, a broken directory
                raise PicklehooksError(f"can't read {path!r} as a torch.save checkpoint: {exc}") from None
        else:  # legacy torch.save: torch's checker reads zips only; the audit read what weights_only reads
            found = [g.path for g in report.unsafe]
        others = [g for g in found if not g.startswith(HUB_NAME + ".")]
        refused = sorted(g for g in others if _dangerous(g))
        if refused:
            raise PicklehooksError(
                f"{path!r} references {', '.join(refused)}, which can run arbitrary code when torch.load calls "
                "it; safe_globals won't allowlist it. Don't load this file with its globals allowed"
            )
    resolved = hub()
    result = []
    with untrusted(trust):
        for entry in entries:
            if entry.foreign:
                continue
            try:
                result.append(getattr(resolved, entry.name))
            except DecodeError as exc:
                raise PicklehooksError(f"{path!r}: {exc}") from None
    trusted = frozenset(BASE_TRUSTED + trust)
    for dotted in others:
        obj = _import_global(dotted, trusted)
        if _dangerous_object(obj):
            raise PicklehooksError(
                f"{path!r} references {dotted!r}, which resolves to {obj!r}, something that can run arbitrary "
                "code when torch.load calls it; safe_globals won't allowlist it"
            )
        result.append(obj)
    return _unique(result)


def _unique(objs: list) -> list:
    unique, seen = [], set()
    for obj in objs:
        if id(obj) not in seen:
            seen.add(id(obj))
            unique.append(obj)
    return unique
