"""Hooked views changed in place: where their gradient goes, and hooking it there.

Pinned runtime (see the docs' wire-contract page): torch.package archives copy
it with :mod:`picklehooks._taps`, which hooks the views, and
:mod:`picklehooks._hookrt`, whose forward hooks look for changes.

Limits: a change made after the last instrumented module returned (by code
outside every instrumented module, before ``backward()``) can't be followed:
recording warns when it stops, naming the calls. A view whose base changed
some other way than through a view (the base itself changed in place) keeps
the gradient of its own node.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from . import _state

# The graph task autograd is executing in this thread (-1: none, outside backward).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)

# A hooked view (an input as the module gets it, an output that is a view or an input handed
# back) keeps its hook on its own autograd node. When the view, or a view of it, is then changed
# in place (``h += x`` by the caller, ``ReLU(inplace=True)`` next), autograd puts a ``CopySlices``
# node on the view's base and sends the gradient of everything after the change through it
# straight to the base's earlier history, past the view's node: a plain tensor hook on the view is
# lost then (register_full_backward_hook refuses such models). Each hooked view is therefore
# watched while its base lives: the next forward hook that finds the base's version changed
# hooks that CopySlices node too, and the view's gradient (its uses before the change, through its own
# node, plus its region of what the change passes on) reaches the recorder once, summed, when the
# backward pass ends.

# (the view's version when hooked, weakref to its base, the base's grad_fn then, the view's hook
# dictionary, the recorder in it, the view's geometry). Not the view itself: a view of it (the
# next module's input) may be what is changed, after the view is gone but its node is not.
VIEWS: list = []


def watch(x: torch.Tensor, recorder) -> None:
    """Watch the hooked view ``x`` for in-place changes (see :func:`rescue`)."""
    base = x._base
    if base.grad_fn is not None:  # a view of a leaf that requires grad can't be changed in place
        VIEWS.append((x._version, weakref.ref(base), base.grad_fn, x._backward_hooks, recorder,
                       (x.size(), x.stride(), x.storage_offset())))


def _copy_slices(base: torch.Tensor, earlier):
    """The ``CopySlices`` node through which a change to a view of ``base`` reaches ``earlier``
    (the base's ``grad_fn`` before the change), or None where the base changed some other way."""
    node, hops = base.grad_fn, 0
    while node is not None and hops < 64 and node.next_functions and node.next_functions[0][0] is not earlier:
        node, hops = node.next_functions[0][0], hops + 1
    if node is None or not node.next_functions or node.next_functions[0][0] is not earlier:
        return None
    return node if type(node).__name__ == "CopySlices" else None


def rescue(final: bool = False) -> list:
    """Hook the gradient of each watched view that was changed in place since it was hooked.

    Called by every eager forward hook while views are watched, and when the
    last log stops (``final``): views whose base died unchanged are dropped then.
    Returns the names of the calls whose gradient hook was lost for good: a
    view changed in place after the last instrumented module returned, found
    only when recording stopped (:func:`_stop_watching` warns about them).
    """
    lost, keep = [], []
    for entry in VIEWS[:]:
        version, base_ref, earlier, hooks, recorder, geometry = entry
        base = base_ref()
        if base is None:
            continue
        if base._version == version:
            if not final:
                keep.append(entry)
            continue
        key = next((k for k, h in hooks.items() if h is recorder), None)
        if key is None:
            continue  # rescued already (a view of the same base found first), or removed by its handle
        node = _copy_slices(base, earlier)
        if node is None:
            continue  # the base changed some other way: the view's own node keeps its gradient
        if final:
            lost.append(f"{recorder.name} {recorder.kind[5:]} {recorder.path}".rstrip())
            continue
        parts = _ViewGrad(recorder, base, geometry)
        hooks[key] = parts.before
        node.register_hook(parts.after)
    VIEWS[:] = keep
    return lost


class _ViewGrad:
    """A changed view's gradient: the part through its own node (its uses before the change) plus
    its region of what ``CopySlices`` passes to the base's history, handed to the recorder once, at
    the end of the backward pass (whichever parts it had)."""

    __slots__ = ("recorder", "base_geometry", "view_geometry", "pending")

    def __init__(self, recorder, base: torch.Tensor, view_geometry: tuple) -> None:
        self.recorder = recorder
        self.base_geometry = (base.size(), base.stride(), base.storage_offset())
        self.view_geometry = view_geometry
        self.pending: dict = {}

    def before(self, grad: torch.Tensor) -> None:
        self._add(grad)

    def after(self, grad_inputs, grad_outputs) -> None:
        grad = grad_inputs[0] if grad_inputs else None
        if grad is None:
            return
        size, stride, offset = self.base_geometry
        if self.view_geometry != (size, stride, offset):
            if grad.stride() != stride:  # CopySlices hands on a gradient laid out as the base
                grad = torch.empty_strided(size, stride, dtype=grad.dtype, device=grad.device).copy_(grad)
            vsize, vstride, voffset = self.view_geometry
            grad = grad.as_strided(vsize, vstride, grad.storage_offset() + voffset - offset)
        self._add(grad)

    def _add(self, grad: torch.Tensor) -> None:
        task = _graph_task_id()
        if task in self.pending:
            self.pending[task] = self.pending[task] + grad
        else:
            self.pending[task] = grad
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.recorder(self.pending.pop(task)))


def _stop_watching(recording: bool) -> None:
    """When the last log stops: say which calls lost their gradient record to an in-place change
    made after the last hook ran, and forget the watched views."""
    if recording or not VIEWS:
        return
    lost = rescue(final=True)
    if lost:
        warnings.warn(
            "picklehooks recorded no gradient for " + ", ".join(lost) + ": the value was changed in place "
            "after the last instrumented module returned, so no hook could follow the change; instrument "
            "a module that runs after the change (modules=[\"\"] for the model itself) or change a copy",
            stacklevel=2)


_state._ON_CHANGE.append(_stop_watching)
