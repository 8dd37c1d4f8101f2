"""An instrumentation as plain JSON: what :func:`~picklehooks.instrument` was asked for, not what it found.

``handle.spec`` is a dict of JSON values that ``instrument(model, spec=...)``
re-applies, to the same model after surgery (``handle.refresh()``), to a model
loaded elsewhere (``from_pretrained``), or to another one::

    {"picklehooks_spec": 1,
     "modules": "all" | ["encoder.*", {"type": "torch.nn.modules.linear.Linear"}],
     "depth": null, "capture": ["output", "grad_output"], "mode": "stats",
     "scriptable": false, "on_nonfinite": null, "profile": false}

The module selection is kept *as given*, so that it selects by the same rule
on a changed tree: name patterns as they were written, module types by their
qualified class name, ``"all"`` for every submodule (the root itself where
the model has no submodules). A type matches a module whose class, or any
base class, has that qualified name, so re-applying a spec never imports
anything.

Limits: ``example_inputs``/``example_kwargs`` (values, not settings) are not
part of a spec: pass them again beside ``spec=`` where ``scriptable=True``
needs them. A type is matched by name only: a class moved to another module
is another name.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any, Iterable

from torch import nn

from .._shim import PicklehooksError

__all__ = ["SPEC_VERSION", "CAPTURE_KINDS", "TypeName", "to_spec", "from_spec", "select", "check_capture"]

CAPTURE_KINDS = ("input", "output", "grad_input", "grad_output", "param", "buffer", "param_grad")

SPEC_VERSION = 1
_KEY = "picklehooks_spec"
_FIELDS = {"modules", "depth", "capture", "mode", "scriptable", "on_nonfinite", "profile"}


def class_path(cls: type) -> str:
    """``module.QualName`` of ``cls`` (``torch.nn.modules.linear.Linear``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


class TypeName:
    """A module type in a spec, by qualified class name: matches a module whose class or a base class has it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def matches(self, module: nn.Module) -> bool:
        return any(class_path(cls) == self.name for cls in type(module).__mro__)

    def __repr__(self) -> str:
        return f"TypeName({self.name!r})"


def _modules_to_json(modules) -> Any:
    if modules is None:
        return "all"
    if isinstance(modules, (str, type, TypeName)) or not isinstance(modules, Iterable):
        modules = [modules]
    out = []
    for p in modules:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, type):
            out.append({"type": class_path(p)})
        elif isinstance(p, TypeName):
            out.append({"type": p.name})
        else:
            raise PicklehooksError(f"modules: {p!r} is neither a name pattern nor a module type")
    return out


def to_spec(*, modules, depth, capture: Iterable[str], mode: str, scriptable: bool, on_nonfinite, profile: bool,
            kinds_order: Iterable[str]) -> dict:
    """The spec of an ``instrument()`` call (its arguments checked already); ``kinds_order`` sorts ``capture``."""
    return {_KEY: SPEC_VERSION, "modules": _modules_to_json(modules), "depth": depth,
            "capture": [k for k in kinds_order if k in set(capture)], "mode": mode, "scriptable": bool(scriptable),
            "on_nonfinite": on_nonfinite, "profile": bool(profile)}


def from_spec(spec) -> dict:
    """``instrument()``'s keyword arguments from a spec (a dict, or its JSON text); say what is wrong with a bad one."""
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise PicklehooksError(f"spec is not JSON ({exc}); give handle.spec or its json.dumps()") from exc
    if not isinstance(spec, dict) or _KEY not in spec:
        raise PicklehooksError(f"spec={spec!r:.80}: not an instrumentation spec (a dict with {_KEY!r}, as "
                               "handle.spec gives)")
    if spec[_KEY] != SPEC_VERSION:
        raise PicklehooksError(f"spec version {spec[_KEY]!r}: this picklehooks reads version {SPEC_VERSION}; "
                               "upgrade picklehooks to read a newer one")
    unknown = sorted(set(spec) - _FIELDS - {_KEY})
    if unknown:
        raise PicklehooksError(f"spec has unknown fields {unknown}; it takes {sorted(_FIELDS)}")
    kwargs = {k: spec[k] for k in _FIELDS if k in spec}
    modules = kwargs.get("modules", "all")
    if modules == "all":
        kwargs["modules"] = None
    elif isinstance(modules, list):
        chosen = []
        for p in modules:
            if isinstance(p, str):
                chosen.append(p)
            elif isinstance(p, dict) and set(p) == {"type"} and isinstance(p["type"], str):
                chosen.append(TypeName(p["type"]))
            else:
                raise PicklehooksError(f"spec modules: {p!r} is neither a pattern nor {{'type': 'pkg.module.Class'}}")
        kwargs["modules"] = chosen
    else:
        raise PicklehooksError(f"spec modules={modules!r}: give 'all' or a list of patterns and {{'type': ...}}")
    if "capture" in kwargs:
        if not isinstance(kwargs["capture"], list) or not all(isinstance(k, str) for k in kwargs["capture"]):
            raise PicklehooksError(f"spec capture={kwargs['capture']!r}: give a list of capture kinds")
        kwargs["capture"] = tuple(kwargs["capture"])
    for flag in ("scriptable", "profile"):
        if flag in kwargs and not isinstance(kwargs[flag], bool):
            raise PicklehooksError(f"spec {flag}={kwargs[flag]!r}: give true or false")
    return kwargs


def check_capture(capture: str | Iterable[str]) -> set[str]:
    """The capture kinds ``capture`` names (``"all"``, one kind, or several); refuse unknown ones."""
    kinds = set(CAPTURE_KINDS) if capture == "all" else {capture} if isinstance(capture, str) else set(capture)
    bad = sorted(k for k in kinds if k not in CAPTURE_KINDS)
    if bad or not kinds:
        raise PicklehooksError(
            f"capture={capture!r}: {', '.join(map(repr, bad)) or 'nothing'} is not a capture kind; "
            f"use 'all' or any of {', '.join(CAPTURE_KINDS)}"
        )
    return kinds


def select(model: nn.Module, modules, depth: int | None) -> dict[str, nn.Module]:
    """Qualified name -> module for what ``modules`` (patterns, types, :class:`TypeName` objects; ``None``: every
    submodule but the root, or the root of a model without submodules) and ``depth`` choose in ``model``, in
    ``named_modules()`` order."""
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise PicklehooksError(f"depth={depth!r}: use a non-negative int (1 = the model's children)")
    if modules is not None and (isinstance(modules, (str, type, TypeName)) or not isinstance(modules, Iterable)):
        modules = [modules]
    chosen = {}
    for name, module in model.named_modules():
        level = 0 if name == "" else name.count(".") + 1
        if depth is not None and level > depth:
            continue
        if modules is None:
            if name == "" and next(model.children(), None) is not None:
                # FX drops root hooks; name "" explicitly to hook the root. A model that is one leaf
                # module (nn.Linear) has nothing else to hook, so its root is chosen.
                continue
        elif not any(
            (isinstance(p, str) and fnmatch.fnmatchcase(name, p)) or (isinstance(p, type) and isinstance(module, p))
            or (isinstance(p, TypeName) and p.matches(module))
            for p in modules
        ):
            continue
        chosen[name] = module
    if not chosen:
        raise PicklehooksError(
            f"modules={modules!r}, depth={depth!r} chose no module of {type(model).__name__}; "
            f"names look like {[n for n, _ in model.named_modules()][1:4]}"
        )
    return chosen
