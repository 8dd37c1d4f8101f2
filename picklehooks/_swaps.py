"""Tensors in an input's list, dict or dataclass, handed to the module as hooked views for one call.

Pinned runtime (see the docs' wire-contract page): torch.package archives copy
it with :mod:`picklehooks._hookrt`, whose pre-hooks put the views in and whose
forward hooks put the caller's tensors back.

A tensor inside a container the caller passes (DenseNet's list of earlier
features, DLA's children) has uses outside the module. Graphs (``jit.trace``,
``torch.compile``, ``torch.export``) hand the module a tapped copy, whose
gradient is the one flowing through this module's uses; so does eager mode
where gradients are captured: the pre-hook puts a hooked view in the
tensor's place in the caller's container, notes it here, and the module's
forward hook puts the caller's own tensor back. The container stays the
caller's object, and what the module added to it stays.

Limits: a module whose forward raises keeps the views in the caller's
containers until recording stops (forward hooks don't run then; the views
hold the same values); two threads calling one module at once may put back
each other's tensors; a tensor inside a frozen dataclass or a tuple subclass
(no namedtuple) can't be replaced, and records the gradient through all its
uses.
"""

from __future__ import annotations

from . import _state

# id(module) -> the calls in progress (a module may call itself), each a list of
# (container, key, the caller's tensor, the view put in its place)
SWAPPED: dict[int, list] = {}


def push(module, swaps: list) -> None:
    """Note the views the pre-hook put into the caller's containers for this call of ``module``."""
    if swaps:
        SWAPPED.setdefault(id(module), []).append(swaps)


def restore(module) -> None:
    """Put the caller's tensors back after ``module``'s call (its forward hook)."""
    calls = SWAPPED.get(id(module))
    if calls:
        _put_back(calls.pop())
        if not calls:
            del SWAPPED[id(module)]


def _put_back(swaps: list) -> None:
    for container, key, original, view in reversed(swaps):
        if isinstance(container, (list, dict)):
            if (key in container if isinstance(container, dict) else key < len(container)) \
                    and container[key] is view:
                container[key] = original
            else:  # the module moved it (list.insert, pop): find it
                keys = container.keys() if isinstance(container, dict) else range(len(container))
                found = next((k for k in keys if container[k] is view), None)
                if found is not None:
                    container[found] = original
        elif getattr(container, key, None) is view:  # a dataclass
            setattr(container, key, original)


def _stop(recording: bool) -> None:
    """When the last log stops: put back what calls that raised left in place."""
    if recording or not SWAPPED:
        return
    for calls in list(SWAPPED.values()):
        for swaps in reversed(calls):
            _put_back(swaps)
    SWAPPED.clear()


_state._ON_CHANGE.append(_stop)
