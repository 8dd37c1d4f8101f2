"""Gradient surgery with portable hooks: clamp the gradient leaving a module, zero a parameter's gradient.

::

    from picklehooks.diagnostics.surgery import clamp_grad, zero_param_grad
    h1 = clamp_grad(model.encoder, min=-1.0, max=1.0)   # gradient w.r.t. encoder's output, clamped
    h2 = zero_param_grad(model.head, "bias")             # head.bias never learns
    torch.save(model, "model.pt")                        # the surgery travels with the model
    h1.remove(); h2.remove()                             # and comes off again

Both are portable hooks with their settings baked into their source as
constants, so the model keeps its surgery through ``pickle``,
``torch.save``/``torch.load`` (in another process too), ``copy.deepcopy``
and ``torch.package``, and both work in every backend picklehooks supports:
eager, TorchScript (also after ``torch.jit.save``/``load``), FX,
``torch.compile(fullgraph=True)`` and ``torch.export``. They act through
two ops (see :mod:`picklehooks._ops`), since tensor hooks are never
pickled and can't be attached from TorchScript or a traced graph:

* :func:`clamp_grad` is a forward hook that routes each output tensor
  through ``picklehooks::clamp_grad``, whose autograd formula clamps the
  gradient flowing back into the module (and so the gradients of its
  parameters and of everything before it);
* :func:`zero_param_grad` is a forward pre-hook on the module that owns the
  parameter; it hands the parameter to ``picklehooks::zero_grads`` (eager
  mode calls its kernel directly), which attaches a tensor hook returning
  zeros, at most once per parameter object. A copy from ``torch.load`` or
  ``pickle`` (which never keeps tensor hooks) gets its own on its first
  forward. The zeroed parameter's ``.grad`` becomes a zero tensor, not
  ``None``, so optimizers still see it; weight decay and momentum still
  move it.

Limits: under TorchScript the hooks are typed for the common call, one
tensor in (and, for ``clamp_grad``, one tensor out): ``torch.jit.script``
refuses them on other modules; eager and traced models take any nesting of
tuples, lists and dicts. ``zero_param_grad`` needs the owning module to be
called as a module, with a tensor argument when traced. A process that loads
a scripted or exported model must ``import picklehooks`` (it registers the
ops). The clamp acts on the value the module returned: a later in-place
change of that tensor (``ReLU(inplace=True)``) doesn't move it.
"""

from __future__ import annotations

import keyword
import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _ops
from .._shim import PicklehooksError
from ..capture.instrument import _hook

__all__ = ["clamp_grad", "zero_param_grad"]


def _bound(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise PicklehooksError(f"clamp_grad: {name}={value!r} must be a number or None")
    return float(value)


def clamp_grad(module: nn.Module, min: float | None = None, max: float | None = None) -> RemovableHandle:
    """Clamp the gradient flowing back into ``module`` (w.r.t. its output) to ``[min, max]``.

    Returns the forward hook's handle: ``remove()`` stops the clamping
    (outputs computed before still clamp their pending backward).
    """
    if not isinstance(module, nn.Module):
        raise PicklehooksError(f"clamp_grad takes an nn.Module, got {type(module).__name__}")
    lo, hi = _bound("min", min), _bound("max", max)
    if lo is None and hi is None:
        raise PicklehooksError("clamp_grad: give min, max or both")
    if lo is not None and hi is not None and lo > hi:
        raise PicklehooksError(f"clamp_grad: min={lo} is above max={hi}")
    return module.register_forward_hook(_hook(_CLAMP.format(lo=lo, hi=hi)))


_HEADER = """\
import torch
from typing import List, Optional, Tuple
import picklehooks._hookrt as _rt
"""
_CLAMP = _HEADER + """\
def picklehooks_clamp_grad(module: torch.nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    lo = {lo!r}  # locals, not globals: TorchScript takes no global floats
    hi = {hi!r}
    if not torch.jit.is_scripting():
        return _rt.clamp_tree(output, lo, hi)
    return torch.ops.picklehooks.clamp_grad(output, lo, hi)
"""
_ZERO = _HEADER + """\
def picklehooks_zero_param_grad(module: torch.nn.Module, inputs: Tuple[torch.Tensor]) -> Tuple[torch.Tensor]:
    if not torch.jit.is_scripting():
        return _rt.zero_pre(module, inputs, ({name!r},))
    params = torch.jit.annotate(List[Optional[torch.Tensor]], [module.{name}])
    return (torch.ops.picklehooks.zero_grads(inputs[0], params),)
"""


class _ZeroGradHandle(RemovableHandle):
    """The pre-hook's handle; ``remove()`` also takes the zeroing tensor hook off the parameter."""

    def __init__(self, inner: RemovableHandle, param: torch.Tensor) -> None:
        self.__dict__.update(inner.__dict__)  # same hook dict and id: removing either removes the pre-hook
        self._param = param

    def remove(self) -> None:
        super().remove()
        _ops.unzero_grads([self._param])


def zero_param_grad(module: nn.Module, name: str) -> RemovableHandle:
    """Make the gradient of ``module``'s parameter ``name`` (``"bias"``, ``"0.weight"``) zero.

    The pre-hook goes on the module that owns the parameter (``module[0]``
    for ``"0.weight"``) and attaches the zeroing the first time that module
    runs (again after a load). Only this parameter's gradient changes: the
    gradient flowing to the module's input and to its other parameters is
    untouched. ``remove()`` on the returned handle takes off both hooks.
    """
    if not isinstance(module, nn.Module):
        raise PicklehooksError(f"zero_param_grad takes an nn.Module, got {type(module).__name__}")
    if not isinstance(name, str):
        raise PicklehooksError(f"zero_param_grad: name must be a parameter's name (str), got {name!r}")
    try:
        param = module.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in module.named_parameters()]
        raise PicklehooksError(f"zero_param_grad: {type(module).__name__} has no parameter {name!r}; "
                               f"it has {names}") from None
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if not leaf.isidentifier() or keyword.iskeyword(leaf):
        raise PicklehooksError(f"zero_param_grad: parameter name {leaf!r} is not an identifier a hook can name")
    inner = owner.register_forward_pre_hook(_hook(_ZERO.format(name=leaf)))
    return _ZeroGradHandle(inner, param)
