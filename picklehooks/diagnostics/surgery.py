"""Gradient surgery with portable hooks: clamp the gradient leaving a module, zero a parameter's gradient.

::

    from picklehooks.diagnostics.surgery import clamp_grad, zero_param_grad
    h1 = clamp_grad(model.encoder, min=-1.0, max=1.0)   # gradient w.r.t. encoder's output, clamped
    h2 = zero_param_grad(model.head, "bias")             # head.bias never learns
    torch.save(model, "model.pt")                        # the surgery travels with the model
    h1.remove(); h2.remove()                             # and comes off again

Both are portable hooks (:func:`picklehooks.portable`) with their settings
baked in as constants, so the model stays picklable and keeps its surgery
through ``pickle``, ``torch.save``/``torch.load`` (in another process too)
and ``copy.deepcopy``.

Gradients are changed by *tensor* hooks (``Tensor.register_hook``), and
PyTorch never pickles those. So the portable part is a module hook that
(re)attaches the tensor hook when the module runs:

* :func:`clamp_grad` is a forward hook: every forward registers a fresh hook
  on that call's output tensor(s), clamping the gradient flowing back into
  the module (and so the gradients of its parameters and of everything
  before it);
* :func:`zero_param_grad` is a forward pre-hook: it attaches a hook returning
  zeros to the named parameter, lazily, at most once per parameter object.
  The parameter remembers the hook's id in ``param._picklehooks_zero``; the
  hook counts as attached only while that id is still in the parameter's
  own hook table, so a copy from ``torch.load`` or ``pickle`` (which keeps
  the attribute but not the hook) gets a new one on its first forward.
  The zeroed parameter's ``.grad`` becomes a zero tensor, not ``None``, so
  optimizers still see it; weight decay and momentum still move it.

Limits: eager mode only. Tensor hooks don't exist under TorchScript
(``torch.jit.script`` can't compile these hooks) and FX/``torch.export``
graphs don't run module hooks; ``torch.compile`` is untested. A tensor hook
sees the gradient of the value the module returned: a later in-place change
of that tensor (``ReLU(inplace=True)``) doesn't move the clamp. Only tensors
directly in the output (a tensor, or a tuple/list/dict of tensors) are
clamped.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._shim import PicklehooksError
from ..portable import portable

__all__ = ["clamp_grad", "zero_param_grad", "ZERO_MARK"]

#: The attribute a parameter carries while :func:`zero_param_grad`'s tensor hook is attached to it.
ZERO_MARK = "_picklehooks_zero"


def _bound(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise PicklehooksError(f"clamp_grad: {name}={value!r} must be a number or None")
    return float(value)


def clamp_grad(module: nn.Module, min: float | None = None, max: float | None = None) -> RemovableHandle:
    """Clamp the gradient flowing back into ``module`` (w.r.t. its output) to ``[min, max]``.

    A portable forward hook (``min``/``max`` baked in) registers, on every
    call, a tensor hook on each output tensor that requires grad. Returns the
    forward hook's handle: ``remove()`` stops it (hooks already on live
    outputs fire once more, for their pending backward). Eager mode only.
    """
    if not isinstance(module, nn.Module):
        raise PicklehooksError(f"clamp_grad takes an nn.Module, got {type(module).__name__}")
    lo, hi = _bound("min", min), _bound("max", max)
    if lo is None and hi is None:
        raise PicklehooksError("clamp_grad: give min, max or both")
    if lo is not None and hi is not None and lo > hi:
        raise PicklehooksError(f"clamp_grad: min={lo} is above max={hi}")

    def clamp_grad_hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            outs = [output]
        elif isinstance(output, (tuple, list)):
            outs = list(output)
        elif isinstance(output, dict):
            outs = list(output.values())
        else:
            outs = []
        for out in outs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: grad.clamp(lo, hi))

    return module.register_forward_hook(portable(clamp_grad_hook))


class _ZeroGradHandle(RemovableHandle):
    """The pre-hook's handle; ``remove()`` also takes the tensor hook off the parameter."""

    def __init__(self, inner: RemovableHandle, module: nn.Module, name: str) -> None:
        self.__dict__.update(inner.__dict__)  # same hook dict and id: removing either removes the pre-hook
        self._module, self._name = module, name

    def remove(self) -> None:
        super().remove()
        try:
            param = self._module.get_parameter(self._name)
        except AttributeError:  # the parameter was deleted or replaced by a non-parameter
            return
        key = param.__dict__.pop(ZERO_MARK, None)
        hooks = param._backward_hooks
        if key is not None and hooks is not None:
            hooks.pop(key, None)


def zero_param_grad(module: nn.Module, name: str) -> RemovableHandle:
    """Make the gradient of ``module``'s parameter ``name`` (``"bias"``, ``"0.weight"``) zero.

    A portable forward pre-hook attaches a tensor hook returning zeros to the
    parameter the first time the module runs (again after a load; at most once
    per parameter object, even with several such hooks). Only this
    parameter's gradient changes: the gradient flowing to the module's input
    and to its other parameters is untouched. ``remove()`` on the returned
    handle takes off both hooks. Eager mode only.
    """
    if not isinstance(module, nn.Module):
        raise PicklehooksError(f"zero_param_grad takes an nn.Module, got {type(module).__name__}")
    if not isinstance(name, str):
        raise PicklehooksError(f"zero_param_grad: name must be a parameter's name (str), got {name!r}")
    try:
        module.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in module.named_parameters()]
        raise PicklehooksError(f"zero_param_grad: {type(module).__name__} has no parameter {name!r}; "
                               f"it has {names}") from None
    mark = ZERO_MARK

    def zero_param_grad_hook(module, inputs):
        param = module.get_parameter(name)
        if not param.requires_grad:
            return None
        hooks = param._backward_hooks  # never pickled: a loaded copy has none, whatever its mark says
        if hooks is not None and param.__dict__.get(mark) in hooks:
            return None
        handle = param.register_hook(lambda grad: torch.zeros_like(grad))
        param.__dict__[mark] = handle.id
        return None

    inner = module.register_forward_pre_hook(portable(zero_param_grad_hook))
    return _ZeroGradHandle(inner, module, name)
