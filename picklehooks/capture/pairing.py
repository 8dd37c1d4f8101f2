"""Which forward call each record belongs to, and which call each gradient flows back to.

A record's ``call`` counts the calls of its module in the log. An output
shares the ``call`` of its invocation's inputs, also when a module calls
itself (:meth:`CallPairing._invocation`); a gradient takes the ``call`` of the
latest forward call of the same value whose gradient hasn't arrived yet,
first among the calls that surely get one (:func:`_expects_grad`).

Limits: exact whenever each backward pass follows its own forward (training
loops, modules called several times); at most :data:`_MAX_OPEN` invocations of
one module open at once, and :data:`_MAYBE_KEPT` calls that may get a gradient
(an inference loop under ``no_grad``), are tracked.
"""

from __future__ import annotations

import torch

from .._ops import GRAD_NONE, GRAD_SURE

# A gradient record takes the call number of the forward call it flows back to (backward
# visits the latest call first). Not param_grad: a parameter's gradient is accumulated
# over every call of the step and delivered once per backward, so those are counted.
_FORWARD_OF = {"grad_output": "output", "grad_input": "input"}
_PAIRED = frozenset(_FORWARD_OF.values())

_SURE, _MAYBE = 2, 1
_MAX_OPEN = 256  # invocations of one module open at once (recursion depth) that a log tracks
_MAYBE_KEPT = 4096
_MAYBE_TRIM = 2 * _MAYBE_KEPT


def _expects_grad(kind: str, x: torch.Tensor, flags: int = 0) -> int:
    """Whether a gradient will come back for this forward value: pairs it with its call.

    ``flags`` decide where they say (:data:`~picklehooks._ops.GRAD_SURE`: :data:`_SURE`,
    :data:`~picklehooks._ops.GRAD_NONE`: 0): ``torch.compile`` and ``torch.export``
    set them from what tracing saw (their forward runs without autograd), and
    the eager hooks, for a value that requires grad, from whether they hook its
    gradient. Otherwise :data:`_SURE` where the tensor requires grad, 0 where it
    doesn't with autograd on, and :data:`_MAYBE` with autograd off: a graph traced
    by an older version, and an eager forward under ``no_grad``, which reentrant
    checkpointing recomputes for backward; gradients pair with the sure calls first.
    """
    if kind not in _PAIRED:
        return 0
    if flags & (GRAD_SURE | GRAD_NONE):
        return _SURE if flags & GRAD_SURE else 0
    return _SURE if x.requires_grad else 0 if torch.is_grad_enabled() else _MAYBE


class CallPairing:
    """The call counters of one log: its ops and hooks ask :meth:`_next_call` for each record's ``call``.

    The attribute names are read by the native row lane (:func:`picklehooks._native.row_lane`).
    """

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str, str], int] = {}
        # Per module: invocations whose inputs were recorded and outputs not yet, innermost last,
        # each (call, input paths, output paths); and the one whose outputs are being recorded.
        self._open: dict[str, list[tuple[int, set, set]]] = {}
        self._closing: dict[str, tuple[int, set, set]] = {}
        # Forward calls whose gradient hasn't arrived yet, per (module, kind, path):
        # backward handles the latest forward first, so gradients pop from the end;
        # from the calls that surely get one first (see _expects_grad).
        self._awaiting_grad: dict[tuple[str, str, str], list[int]] = {}
        self._maybe_grad: dict[tuple[str, str, str], list[int]] = {}

    def _restart_calls(self) -> None:
        """Count calls from 0 again (a new training step): every gradient of the old calls has come.

        Cleared in place: the native lane holds these dicts by attribute name only, but clearing
        keeps any reference to them valid.
        """
        for table in (self._calls, self._open, self._closing, self._awaiting_grad, self._maybe_grad,
                      self.__dict__.get("_site_calls", {})):  # compiled graphs' tap sites (picklehooks._deliver)
            table.clear()

    def _next_call(self, module: str, kind: str, path: str, expect: int = 0) -> int:
        """The ``call`` of a new record; ``expect``: whether a gradient of this forward value
        will follow (:data:`_SURE`), may follow (:data:`_MAYBE`), or won't (0)."""
        key = (module, kind, path)
        forward = _FORWARD_OF.get(kind)
        if forward is not None:
            fkey = (module, forward, path)
            for waiting in (self._awaiting_grad.get(fkey), self._maybe_grad.get(fkey)):
                if waiting:
                    return waiting.pop()
        calls = self._calls
        call = count = calls.get(key, 0)
        if kind == "input" or kind == "output" and self._open:  # (no inputs recorded: nothing to pair)
            call = self._invocation(module, kind, path, count)
            calls[key] = call + 1 if call >= count else count
        else:
            calls[key] = count + 1
        if expect:
            table = self._awaiting_grad if expect == _SURE else self._maybe_grad
            waiting = table.get(key)
            if waiting is None:
                table[key] = [call]
            else:
                waiting.append(call)
                if len(waiting) > _MAYBE_TRIM and expect == _MAYBE:  # inference loops: no gradient ever comes
                    del waiting[:-_MAYBE_KEPT]
        return call

    def _invocation(self, module: str, kind: str, path: str, call: int) -> int:
        """Pair an output with the inputs of the same invocation, also when a module calls itself.

        Inputs are recorded as an invocation starts and outputs as it ends, in
        program order (in graphs too: the ops are ordered effects), so each
        module keeps a stack of open invocations: an input whose path the top
        one already has opens a new one (a call from inside the call); the
        first output pops the top, and the outputs after it in the same hook
        (other paths) share its ``call``: the ``call`` of that invocation's
        first input. A module whose inputs aren't recorded counts outputs by
        themselves.
        """
        stack = self._open.get(module)
        if kind == "input":
            if stack is None:
                stack = self._open[module] = []
            if not stack or path in stack[-1][1]:
                stack.append((call, {path}, set()))
                if len(stack) > _MAX_OPEN:  # inputs recorded, outputs never: don't grow
                    del stack[0]
            else:
                stack[-1][1].add(path)
            return call
        closing = self._closing.get(module)
        if closing is not None and path not in closing[2]:
            closing[2].add(path)
            return closing[0]
        if not stack:
            return call
        closing = self._closing[module] = stack.pop()
        closing[2].add(path)
        return closing[0]

    def _note_call(self, module: str, kind: str, path: str, x: torch.Tensor | None = None, flags: int = 0) -> None:
        """Count a forward call whose value isn't recorded, so its gradient gets the right ``call``.

        Without ``x``, as the runtime copied into torch.package archives by earlier
        versions calls it, every such call awaits a gradient (as it did then).
        """
        expect = (_SURE if kind in _PAIRED else 0) if x is None else _expects_grad(kind, x, flags)
        self._next_call(module, kind, path, expect)
