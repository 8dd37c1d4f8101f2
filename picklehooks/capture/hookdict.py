"""Hook dictionaries that ``nn.Module`` sees as empty while nothing records: idle hooks cost nothing.

``nn.Module._call_impl`` calls ``forward`` directly, skipping all of its hook
machinery, when every hook dictionary of the module is falsy. ``instrument()``
swaps a chosen module's ``_forward_hooks`` and ``_forward_pre_hooks`` for a
:class:`HookDict`, which holds the same hooks but is falsy while

* every hook in it is one of picklehooks' hooks that would return at once
  anyway (:func:`picklehooks._hookrt.skip`: no guard, no profiler range), and
* no log records anywhere in the process, and
* nothing traces the model (``torch.compile``, ``torch.export``, FX,
  ``torch.jit.trace``): a graph must contain the hooks' ops whatever the
  recording state is when it later runs.

A hook anyone else adds to the dictionary makes it truthy again. A
:class:`HookDict` pickles and deep-copies as a plain ``OrderedDict``, so saved
files never reference this class, and a model loaded elsewhere runs its hooks
as usual (they return at once while nothing records).

Limits: this relies on ``_call_impl`` testing the dictionaries' truth value
(true from torch 1.x to at least 2.13). :func:`works` checks that behaviour
once per process on a probe module; where it fails, ``instrument()`` keeps
plain dictionaries (``tests/capture/test_hookdict.py`` fails loudly too).
Disable it with ``PICKLEHOOKS_IDLE_HOOKS=0``.
"""

from __future__ import annotations

import copy
import functools
import os
from collections import OrderedDict

import torch

from .. import _hookrt, _state

_ANYWHERE = _state._ANYWHERE  # the logs recording in any thread; the same list object for the process
_dynamo_compiling, _compiler, _fx, _is_jit_tracing = (_hookrt._dynamo_compiling, _hookrt._compiler, _hookrt._fx,
                                                      _hookrt._is_jit_tracing)


def _idle_truth(self) -> bool:
    """``HookDict.__bool__`` while no log records anywhere (see :func:`_recording_changed`)."""
    if not len(self):
        return False
    # Compiling first: torch.compile must see the hooks whatever the recording state, without a
    # guard on it (reading _ANYWHERE would recompile when recording starts). The checks are
    # _hookrt._tracing()'s, spelled inline as there (see _hookrt._dynamo_compiling).
    return (_dynamo_compiling() or _compiler._is_compiling_flag or bool(_ANYWHERE)
            or not self.idle_keys.issuperset(self) or _fx._is_fx_tracing_flag or _is_jit_tracing())


class HookDict(OrderedDict):
    """An ``OrderedDict`` of hooks whose truth value says whether ``nn.Module`` must run them now."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: Keys of the hooks that do nothing while idle (see the module docstring). Keys
        #: removed from the dict may linger here: only keys present in the dict count.
        self.idle_keys: set[int] = set()

    __bool__ = _idle_truth

    def __reduce__(self):
        return (OrderedDict, (list(self.items()),))

    def __copy__(self) -> OrderedDict:
        return OrderedDict(self)

    def __deepcopy__(self, memo) -> OrderedDict:
        # Into memo before the values are copied: a hook that holds its own RemovableHandle
        # (which refers back to this dict) must get a handle to the new dict, not a second copy.
        new = memo[id(self)] = OrderedDict()
        for k, v in self.items():
            new[k] = copy.deepcopy(v, memo)
        return new


def _recording_changed(recording: bool) -> None:
    """While a log records anywhere, every non-empty dictionary is true, so ``HookDict`` drops
    its ``__bool__``: a dictionary's own C-level truth test costs no Python call, three times
    per module call (about 0.7 µs of a recorded call's 8 to 15). Called under ``_state._LOCK``."""
    if recording:
        if "__bool__" in HookDict.__dict__:
            del HookDict.__bool__
    else:
        HookDict.__bool__ = _idle_truth


_state._ON_CHANGE.append(_recording_changed)
_recording_changed(bool(_ANYWHERE))

_ATTRS = ("_forward_pre_hooks", "_forward_hooks")


def prepare(module: torch.nn.Module) -> None:
    """Swap ``module``'s empty forward hook dictionaries for :class:`HookDict`\\ s (before hooks are added).

    A dictionary that already holds hooks is left alone: their handles refer
    to it, and it would be truthy anyway.
    """
    if not works():
        return
    for attr in _ATTRS:
        hooks = module.__dict__.get(attr)
        if type(hooks) is OrderedDict and not hooks:
            module.__dict__[attr] = HookDict()


def mark_idle(module: torch.nn.Module, attr: str, handle) -> None:
    """Let the hook behind ``handle`` (in ``module.<attr>``) be skipped while idle."""
    hooks = module.__dict__.get(attr)
    if isinstance(hooks, HookDict):
        hooks.idle_keys.add(handle.id)


def keep(module: torch.nn.Module, owner) -> None:
    """Keep ``owner`` (an instrumentation handle) alive for as long as ``module``'s hook dictionaries live.

    Held by the :class:`HookDict` only: it pickles and copies as a plain ``OrderedDict``, so the
    owner never travels with the model. A module whose dictionaries are plain keeps nothing.
    The owner must hold the module (and its model) weakly, as an ``Instrumentation`` does:
    otherwise the two make a reference cycle, and a deleted model waits for the garbage collector.
    """
    for attr in _ATTRS:
        hooks = module.__dict__.get(attr)
        if isinstance(hooks, HookDict):
            hooks.owner = owner


def restore(module: torch.nn.Module) -> None:
    """Put plain dictionaries back where a :class:`HookDict` is empty again (after ``remove()``)."""
    for attr in _ATTRS:
        hooks = module.__dict__.get(attr)
        if isinstance(hooks, HookDict) and not dict.__len__(hooks):
            module.__dict__[attr] = OrderedDict()


class _Probe(OrderedDict):
    truth = False

    def __bool__(self) -> bool:
        return self.truth


# torch.nn.modules.module's global hook dictionaries, which works() sets aside while it probes.
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


@functools.lru_cache(maxsize=None)
def works() -> bool:
    """True when ``nn.Module`` runs a module's forward hooks exactly when their dictionary is truthy."""
    if os.environ.get("PICKLEHOOKS_IDLE_HOOKS", "1") == "0":
        return False
    calls = []
    probe = torch.nn.Identity()
    probe.__dict__["_forward_hooks"] = hooks = _Probe()
    probe.register_forward_hook(lambda *_: calls.append(1))
    # Global module hooks would send the probe down the hook path whatever its dict says (and
    # show the user's global hooks a module they never called): set them aside meanwhile.
    module_globals = torch.nn.modules.module
    aside = [(d, dict(d)) for d in (getattr(module_globals, n, None) for n in _GLOBAL_HOOKS) if d]
    for d, _ in aside:
        d.clear()
    try:
        probe(torch.zeros(1))
        skipped = not calls
        hooks.truth = True
        probe(torch.zeros(1))
    finally:
        for d, items in aside:
            d.update(items)
    return skipped and len(calls) == 1
