"""What every diagnostic shares: getting a model to record, and reading records.

A diagnostic takes a model in any form. A plain ``nn.Module`` is instrumented
for the duration of the call (and the hooks removed again); a model that
already carries picklehooks hooks (eager, pickled, scripted, FX-traced,
compiled or exported after instrumenting) is run as it is, so what it records
is what its instrumentation captures. :func:`need` turns "that capture is
missing" into an error that says how to fix it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Iterator

import torch
from torch import nn

from .._shim import PicklehooksError
from .._stats import STAT_NAMES, tensor_stats
from ..capture.instrument import _NAME_ATTR, instrument
from ..capture.log import Log, Record



def is_instrumented(model) -> bool:
    """True if ``model`` (in any form) carries picklehooks hooks."""
    if not isinstance(model, nn.Module):
        return False
    for module in model.modules():
        if hasattr(module, _NAME_ATTR):  # eager, pickled, scripted (attributes survive), FX, compiled
            return True
        # torch.export flattens modules away; its graph still calls the tap ops.
        if isinstance(module, torch.fx.GraphModule) and any(
                node.op == "call_function" and "picklehooks" in str(node.target) for node in module.graph.nodes):
            return True
    return False


@contextlib.contextmanager
def hooked(model, *, capture: Iterable[str], mode: str, modules=None) -> Iterator[bool]:
    """Make ``model`` record inside the block; yield whether the hooks are ours (temporary).

    A plain eager module is instrumented with ``capture``/``mode`` and cleaned up
    afterwards; an instrumented model keeps its own hooks.
    """
    if is_instrumented(model):
        yield False
        return
    if isinstance(model, torch.jit.ScriptModule) or hasattr(model, "_orig_mod"):
        raise PicklehooksError(
            f"{type(model).__name__} has no picklehooks hooks and can't get any now; call "
            "picklehooks.instrument(model, ...) before torch.jit.script / torch.compile, or pass the eager model")
    if not isinstance(model, nn.Module):
        raise PicklehooksError(f"model must be an nn.Module (in any form), got {type(model).__name__}")
    handle = instrument(model, capture=tuple(capture), mode=mode, modules=modules)
    try:
        yield True
    finally:
        handle.remove()


def need(log: Log, kinds: Iterable[str], what: str, *, tensors: bool = False) -> None:
    """Raise a PicklehooksError if ``log`` lacks records of every kind in ``kinds`` (or their tensors)."""
    kinds = tuple(kinds)
    found = [r for r in log.records if r.kind in kinds]
    if not found:
        seen = sorted({r.kind for r in log.records}) or ["nothing"]
        raise PicklehooksError(
            f"{what} needs {'/'.join(kinds)} records, but the model recorded {', '.join(seen)}; instrument it with "
            f"capture including {kinds[0]!r} (or pass the un-instrumented model and let {what} do it)")
    if tensors and all(r.tensor is None for r in found):
        raise PicklehooksError(
            f"{what} needs recorded tensors, but the model records statistics only; instrument it with "
            "mode='tensor' or 'both' (or pass the un-instrumented model)")


def stats_of(rec: Record) -> dict | None:
    """A record's statistics; computed from its tensor when it was recorded with ``mode="tensor"``."""
    if rec.stats is not None or rec.tensor is None:
        return rec.stats
    stats = dict(zip(STAT_NAMES, tensor_stats(rec.tensor.detach())))
    stats["nan"], stats["inf"] = int(stats["nan"]), int(stats["inf"])
    return {"shape": rec.shape, "dtype": rec.dtype, **stats}


def nonfinite_count(rec: Record) -> int:
    """NaN + Inf elements in a tensor record (0 for non-tensor values)."""
    stats = stats_of(rec)
    return 0 if stats is None else stats["nan"] + stats["inf"]


def module_types(model) -> dict[str, tuple[str, ...]]:
    """Recorded module name -> its class names (most specific first) for every module visible in ``model``.

    Names come from the modules' own ``_picklehooks_name``, so they match the
    records in eager, scripted (``original_name``), FX and compiled models.
    Exported models flatten their modules away: they give ``{}``.
    """
    types = {}
    for module in model.modules() if isinstance(model, nn.Module) else ():
        name = getattr(module, _NAME_ATTR, None)
        if name is None:
            continue
        if isinstance(module, torch.jit.ScriptModule):
            types[name] = (module.original_name,)  # its eager class's name; the base classes are lost
        else:
            types[name] = tuple(cls.__name__ for cls in type(module).__mro__)
    return types


def call(model, args: tuple):
    """``model(*args)``, with a clear error for a batch that isn't a tuple of arguments."""
    if not isinstance(args, (tuple, list)):
        raise PicklehooksError(f"a batch must be a tuple of forward arguments, got {type(args).__name__}; "
                               "for a single tensor write (x,)")
    return model(*args)


def backward(loss, model, inputs: tuple = ()) -> None:
    """Run backward from ``loss`` without touching any ``.grad`` (so a diagnostic has no side effects).

    Gradients go to the trainable parameters and the tensor inputs that require
    grad, through ``torch.autograd.grad``: the recording hooks on every value in
    between fire as in ``loss.backward()``.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PicklehooksError(f"loss_fn must return a scalar tensor, got "
                               f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
    if not loss.requires_grad:
        raise PicklehooksError("the loss doesn't require grad: the model has no trainable parameters on its path, "
                               "or it ran under torch.no_grad()")
    targets = [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    targets += [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    torch.autograd.grad(loss, targets, allow_unused=True)


def progress(batches: Iterable, desc: str) -> Iterable:
    """``batches`` with a tqdm progress bar when stderr is a terminal (tqdm is optional)."""
    if not sys.stderr.isatty():
        return batches
    try:
        from tqdm import tqdm  # only worth importing for a terminal
    except ImportError:
        return batches
    return tqdm(batches, desc=desc, unit="batch")
