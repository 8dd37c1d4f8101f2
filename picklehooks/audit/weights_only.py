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
  :data:`~picklehooks.audit.policy.DANGEROUS_MODULES` and
  :data:`~picklehooks.audit.policy.DANGEROUS_BUILTINS`), and imports a
  module only if it belongs to a trusted package.
"""

from __future__ import annotations

import os
import zipfile
from typing import Iterable

import torch
from torch import nn

from .._shim import HUB_NAME, DecodeError, PicklehooksError, hub
from .policy import BASE_TRUSTED, dangerous, dangerous_object, import_trusted, untrusted
from .policy import DANGEROUS_BUILTINS, DANGEROUS_MODULES, SAFE_BUILTINS  # noqa: F401 - where the docstring named them
from ..serialize.portable import is_portable

__all__ = ["safe_globals"]


def _module_hooks(model: nn.Module) -> list:
    found = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key.endswith("hooks") and isinstance(value, dict):
                found += [fn for fn in value.values() if is_portable(fn)]
    return found


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
    from . import AuditError, audit_file  # the audit reads files; only this path needs it

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
        refused = sorted(g for g in others if dangerous(g))
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
        obj = import_trusted(dotted, trusted)
        if dangerous_object(obj):
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
