"""Loading hooked checkpoints with ``torch.load(weights_only=True)``.

Registries and serving stacks often load with ``weights_only=True``, which
refuses every global that isn't allowlisted, so a checkpoint holding portable
hooks fails on the hooks' ``picklehooks._hub.<name>`` references. After
auditing a file (``python -m picklehooks inspect FILE``), a user can allowlist
exactly those hooks::

    with torch.serialization.safe_globals(picklehooks.safe_globals("model.pt", everything=True)):
        model = torch.load("model.pt", weights_only=True)

Limits: building the list resolves each hook through the hub, which runs its
text (imports and one ``def``): that is what allowlisting means, so audit
first. A whole pickled ``nn.Module`` also needs its classes allowlisted;
``everything=True`` adds every other global the file names (found with
``torch.serialization.get_unsafe_globals_in_checkpoint``), importing their
modules.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from torch import nn

from .audit import find_hooks
from ._shim import HUB_NAME, PicklehooksError, hub
from .portable import is_portable

__all__ = ["safe_globals"]


def _module_hooks(model: nn.Module) -> list:
    found = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key.endswith("hooks") and isinstance(value, dict):
                found += [fn for fn in value.values() if is_portable(fn)]
    return found


def _import_global(dotted: str) -> Any:
    """Resolve ``"pkg.mod.Name"`` by importing the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise PicklehooksError(f"can't import {dotted!r}, which the checkpoint needs; install the package that defines it")


def safe_globals(source: str | os.PathLike | nn.Module, *, everything: bool = False) -> list:
    """The hook functions a checkpoint (or a model about to be saved) needs allowlisted.

    ``source`` is a ``torch.save`` file or an ``nn.Module``. With
    ``everything=True`` (files only) the list also holds every other global
    the file references, so that ``torch.load(weights_only=True)`` succeeds.
    """
    if isinstance(source, nn.Module):
        if everything:
            raise PicklehooksError("everything=True needs a file: the globals a model pickles to are known once saved")
        result = _module_hooks(source)
    else:
        entries = find_hooks(source)
        broken = [e for e in entries if e.error]
        if broken:
            raise PicklehooksError(f"{os.fspath(source)!r}: hook {broken[0].name[:24]}... does not decode: {broken[0].error}")
        resolved = hub()
        result = [getattr(resolved, e.name) for e in entries if not e.foreign]
        if everything:
            for dotted in torch.serialization.get_unsafe_globals_in_checkpoint(source):
                if not dotted.startswith(HUB_NAME + "."):
                    result.append(_import_global(dotted))
    unique, seen = [], set()
    for obj in result:
        if id(obj) not in seen:
            seen.add(id(obj))
            unique.append(obj)
    return unique
