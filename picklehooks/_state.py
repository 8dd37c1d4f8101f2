"""Which log is recording right now: per thread/context, with a fallback for autograd threads.

``record()`` sets a :mod:`contextvars` variable, so recording is on for the
current thread or asyncio task only. Backward passes may run on autograd's
device threads, which don't inherit context; there (and only there: not in
another thread of the user's), a gradient goes to the one log that is active
anywhere in the process, if there is exactly one.
"""

from __future__ import annotations

import contextvars
import importlib
import threading
from typing import Any

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("picklehooks_active_log", default=None)
_ANYWHERE: list = []  # logs active in any thread, for autograd threads
_LOCK = threading.Lock()
# Called (under _LOCK) with whether any log records, each time a log starts or stops.
_ON_CHANGE: list = []


class _Switch:
    """``bool(_ANYWHERE)`` as an attribute: what a hook traced by ``torch.compile`` reads, so that
    Dynamo guards on it and keeps one graph while nothing records (no picklehooks op in it) and
    one while something does. A plain object, not a module global: a torch.package archive's copy
    of this file must share the host's (below), and the archive's modules aren't the host's."""

    def __init__(self) -> None:
        self.on = False


SWITCH: _Switch | None = _Switch()


def active(*, from_autograd: bool = False):
    """Return the log recording in this context, or ``None``.

    ``from_autograd``: called from a gradient hook. A backward on the CPU runs
    in the thread that called it, whose context says whether it records; only
    autograd's own device threads (started by C++, so Python sees them as
    dummy threads) fall back to the one log active anywhere.
    """
    log = _ACTIVE.get()
    if log is None and from_autograd and isinstance(threading.current_thread(), threading._DummyThread):
        with _LOCK:
            if len(_ANYWHERE) == 1:
                return _ANYWHERE[0]
    return log


def push(log) -> contextvars.Token:
    with _LOCK:
        _ANYWHERE.append(log)
        SWITCH.on = True
        for notify in _ON_CHANGE:
            notify(True)
    return _ACTIVE.set(log)


def pop(log, token: contextvars.Token) -> None:
    """Stop ``log`` recording: undo its :func:`push`, also from another context than the one that pushed.

    A token can only be reset in the context that made it; elsewhere (a
    callback's exit run by another thread or task) the log stops being active
    there, and always anywhere (``_ANYWHERE``), so nothing keeps recording into it.
    """
    try:
        _ACTIVE.reset(token)
    except ValueError:  # "created in a different Context"
        if _ACTIVE.get() is log:
            _ACTIVE.set(None if token.old_value is contextvars.Token.MISSING else token.old_value)
    with _LOCK:
        if log in _ANYWHERE:
            _ANYWHERE.remove(log)
        SWITCH.on = bool(_ANYWHERE)
        for notify in _ON_CHANGE:
            notify(bool(_ANYWHERE))


# Not used by this version's hooks (they read _ANYWHERE), but kept: the runtime that earlier
# versions copied into torch.package archives calls it on the host's module.
def idle() -> bool:
    """True when nothing records here, so a plain eager hook may skip its work."""
    return _ACTIVE.get() is None and not _ANYWHERE


# A copy of this file inside a torch.package archive shares the host's switch
# when picklehooks is installed there, so the host's record() sees what
# packaged hooks capture. (importlib, so the exporter's scan doesn't follow it.)
if __name__ != "picklehooks._state":
    try:
        _host = importlib.import_module("picklehooks._state")
    except ImportError:
        pass
    else:
        active, push, pop, idle = _host.active, _host.push, _host.pop, _host.idle
        _ACTIVE, _ANYWHERE, _ON_CHANGE = _host._ACTIVE, _host._ANYWHERE, _host._ON_CHANGE
        # A host from before the switch never flips one: None, and compiled hooks never skip.
        SWITCH = getattr(_host, "SWITCH", None)
