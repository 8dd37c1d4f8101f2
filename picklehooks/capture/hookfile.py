"""``save_hooks``/``load_hooks``: a model's portable hooks and its instrumentation, as text in config.json or safetensors.

The Hugging Face Hub's formats hold no pickle, and ``from_pretrained``
builds a fresh model, so hooks don't travel through ``save_pretrained``.
They can as text (:mod:`picklehooks.serialize.hookdoc` has the format)::

    model.save_pretrained(directory)
    picklehooks.save_hooks(model, directory)              # into directory/config.json

    model = AutoModelForCausalLM.from_pretrained(directory)
    picklehooks.load_hooks(model, directory, trust=True)  # after reviewing: python -m picklehooks inspect directory

``save_hooks`` writes every :func:`~picklehooks.portable` hook on the model's
modules (forward, forward pre-, full backward and backward pre-hooks, with
their ``with_kwargs``/``always_call`` flags, order, and whether they ran
before picklehooks' own hooks) and the spec of the model's live
:func:`~picklehooks.instrument` (``handle.spec``). ``load_hooks`` re-applies
the spec (settings, not code: always allowed) and attaches the hooks, which
*are* code that runs when the model runs, so only with consent:
``trust=True`` or a list of the hooks' names (or fingerprints, as ``inspect``
shows them) the user has reviewed. Their text is decoded under
:func:`picklehooks.untrusted` (imports only from torch and the standard
packages it names, plus ``trust_imports``).

Limits: hooks that aren't portable (closures, bound methods, legacy
``register_backward_hook`` hooks, global hooks) can't be written: they are
named in a warning. The instrumentation's ``example_inputs`` are not saved.
"""

from __future__ import annotations

import os
import warnings

from torch import nn
from torch.utils.hooks import RemovableHandle

from .._shim import HUB_NAME, PicklehooksError, hub, untrusted
from ..serialize import hookdoc
from ..serialize.hookdoc import fingerprint
from . import tree as _tree
from .instrument import _NAME_ATTR, Instrumentation, instrument

__all__ = ["save_hooks", "load_hooks", "fingerprint", "LoadedHooks"]

_DICTS = {"forward_pre": "_forward_pre_hooks", "forward": "_forward_hooks", "backward_pre": "_backward_pre_hooks",
          "backward": "_backward_hooks"}
_WITH_KWARGS = {"forward_pre": "_forward_pre_hooks_with_kwargs", "forward": "_forward_hooks_with_kwargs"}


def _generated(module: nn.Module, fn) -> bool:
    """One of instrument()'s own hooks (re-made from the spec, not saved)."""
    return _NAME_ATTR in module.__dict__ and getattr(getattr(fn, "__code__", None), "co_name", "").startswith(
        "picklehooks_")


def _hooks_of(model: nn.Module) -> tuple[list[dict], list[str]]:
    """The portable hooks on ``model``'s modules as document entries, and what can't be saved."""
    entries, unsaved = [], []
    for qualified, module in model.named_modules():
        where = qualified or "(root)"
        for kind, attr in _DICTS.items():
            hooks = module.__dict__.get(attr) or {}
            if kind == "backward" and hooks and module._is_full_backward_hook is False:
                unsaved += [f"legacy backward hook {getattr(fn, '__qualname__', fn)!r} on {where}"
                            for fn in hooks.values()]
                continue
            mine = [i for i, fn in enumerate(hooks.values()) if _generated(module, fn)]
            with_kwargs = module.__dict__.get(_WITH_KWARGS.get(kind, ""), {})
            always = module.__dict__.get("_forward_hooks_always_called", {}) if kind == "forward" else {}
            order = 0
            for i, (hook_id, fn) in enumerate(hooks.items()):
                if _generated(module, fn):
                    continue
                if getattr(fn, "__module__", None) != HUB_NAME:
                    unsaved.append(f"{kind} hook {getattr(fn, '__qualname__', fn)!r} on {where}")
                    continue
                entries.append({"module": qualified, "kind": kind, "order": order, "name": fn.__name__,
                                "with_kwargs": bool(with_kwargs.get(hook_id, False)),
                                "prepend": bool(mine) and i < mine[0], "always_call": bool(always.get(hook_id, False))})
                order += 1
    return entries, unsaved


def save_hooks(model: nn.Module, path: str | os.PathLike) -> dict:
    """Write ``model``'s portable hooks and instrumentation spec into ``path``; return the document.

    ``path``: an HF model directory (into its ``config.json``, under ``"picklehooks"``),
    a ``config.json`` file, or a ``.safetensors`` file (into its metadata).
    """
    if not isinstance(model, nn.Module):
        raise PicklehooksError(f"save_hooks() takes an nn.Module, got {type(model).__name__}")
    entries, unsaved = _hooks_of(model)
    handles = [h for h in _tree.live() if h.model is model]
    if not handles and any(_NAME_ATTR in m.__dict__ for m in model.modules()):
        raise PicklehooksError(
            "this model carries picklehooks instrumentation with no handle in this process (it was loaded), so "
            "its spec is unknown: instrument it here (instrument(model, spec=...) or handle.refresh()) first")
    if len(handles) > 1:
        raise PicklehooksError(f"{len(handles)} instrumentations are live on this model; a file holds one spec")
    if unsaved:
        warnings.warn(f"save_hooks() can't write {len(unsaved)} hooks that aren't portable: {'; '.join(unsaved[:5])}"
                      f"{' ...' if len(unsaved) > 5 else ''}; make them with picklehooks.portable(fn)", UserWarning,
                      stacklevel=2)
    doc = {"format": hookdoc.FORMAT, "version": hookdoc.VERSION, "spec": handles[0].spec if handles else None,
           "hooks": entries}
    hookdoc.write(path, doc)
    return doc


class LoadedHooks:
    """What :func:`load_hooks` attached: ``instrumentation`` (or ``None``) and ``hooks``; ``remove()`` undoes it."""

    def __init__(self, instrumentation: Instrumentation | None, hooks: list[RemovableHandle]) -> None:
        self.instrumentation, self.hooks = instrumentation, hooks

    def remove(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        if self.instrumentation is not None:
            self.instrumentation.remove()

    def __repr__(self) -> str:
        spec = "an instrumentation" if self.instrumentation is not None else "no instrumentation"
        return f"<picklehooks.LoadedHooks: {len(self.hooks)} hooks, {spec}>"


def load_hooks(model: nn.Module, path: str | os.PathLike, *, trust: bool | list[str] | None = None,
               trust_imports: tuple[str, ...] = ()) -> LoadedHooks:
    """Re-attach what :func:`save_hooks` wrote in ``path`` to ``model`` (after ``from_pretrained``).

    ``trust``: ``True`` attaches every hook; a list attaches them only if it
    names each one (its name or :func:`fingerprint`); ``False`` attaches none
    (the spec only) and warns, naming each and how to review it; ``None``
    (the default) refuses a file that holds hooks, before decoding or
    attaching anything, saying how to review them. The spec is applied in
    every case. Nothing is attached unless everything can be.
    """
    if not isinstance(model, nn.Module):
        raise PicklehooksError(f"load_hooks() takes an nn.Module, got {type(model).__name__}")
    doc = hookdoc.read(path)
    if doc is None:
        raise PicklehooksError(f"{os.fspath(path)!r} holds no picklehooks hooks (save_hooks() writes them)")
    hooks = sorted(doc["hooks"], key=lambda h: (h["module"], h["kind"], h["order"]))
    if hooks and trust is None:
        raise PicklehooksError(
            f"{os.fspath(path)!r} carries {len(hooks)} hooks, which are code that runs when the model runs; review "
            f"them with `python -m picklehooks inspect {os.fspath(path)}`, then pass trust=True, or trust=[their "
            "names or fingerprints]; trust=False applies the instrumentation spec alone")
    if isinstance(trust, (list, tuple, set)):
        allowed = set(trust)
        unreviewed = [h for h in hooks if h["name"] not in allowed and fingerprint(h["name"]) not in allowed]
        if unreviewed:
            raise PicklehooksError(
                f"trust= doesn't name {len(unreviewed)} of the hooks: " + ", ".join(
                    f"{h['kind']} hook on {h['module'] or '(root)'} (fingerprint {fingerprint(h['name'])})"
                    for h in unreviewed[:5]) + "; nothing was attached")
    elif trust not in (True, False, None):
        raise PicklehooksError(f"trust={trust!r}: give True, False, or a list of hook names or fingerprints")
    if trust is False:
        if hooks:  # said, as trust=None says it: nothing is attached without a word
            warnings.warn(
                f"load_hooks(trust=False) attached none of the {len(hooks)} hooks in {os.fspath(path)!r}, only the "
                "instrumentation spec: " + ", ".join(
                    f"{h['kind']} hook on {h['module'] or '(root)'} (fingerprint {fingerprint(h['name'])})"
                    for h in hooks[:5]) + (" ..." if len(hooks) > 5 else "") + "; they are code that runs when the "
                f"model runs: review them with `python -m picklehooks inspect {os.fspath(path)}`, then pass "
                "trust=True, or trust=[their names or fingerprints], to attach them", UserWarning, stacklevel=2)
        hooks = []
    modules = dict(model.named_modules())
    missing = sorted({h["module"] for h in hooks if h["module"] not in modules})
    if missing:
        raise PicklehooksError(f"{type(model).__name__} has no modules {missing[:5]} that hooks in "
                               f"{os.fspath(path)!r} go on; nothing was attached")
    with untrusted(tuple(trust_imports)):
        functions = [getattr(hub(), h["name"]) for h in hooks]  # decoded and checked: still nothing attached
    instrumentation = instrument(model, spec=doc["spec"]) if doc["spec"] is not None else None
    handles = []
    try:
        # Hooks that ran before picklehooks' own: prepended, last first, so they keep their order.
        ordered = [(h, fn) for h, fn in zip(hooks, functions) if not h["prepend"]]
        ordered += [(h, fn) for h, fn in reversed(list(zip(hooks, functions))) if h["prepend"]]
        for h, fn in ordered:
            handles.append(_register(modules[h["module"]], h, fn))
    except BaseException:
        LoadedHooks(instrumentation, handles).remove()
        raise
    return LoadedHooks(instrumentation, handles)


def _register(module: nn.Module, hook: dict, fn) -> RemovableHandle:
    kind, prepend = hook["kind"], hook["prepend"]
    if kind == "forward_pre":
        return module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=hook["with_kwargs"])
    if kind == "forward":
        return module.register_forward_hook(fn, prepend=prepend, with_kwargs=hook["with_kwargs"],
                                            always_call=hook["always_call"])
    if kind == "backward_pre":
        return module.register_full_backward_pre_hook(fn, prepend=prepend)
    return module.register_full_backward_hook(fn, prepend=prepend)
