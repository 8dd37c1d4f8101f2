"""What every diagnostic shares: getting a model to record, and reading records.

A diagnostic takes a model in any form. A plain ``nn.Module`` is instrumented
for the duration of the call (and the hooks removed again); a model that
already carries picklehooks hooks (eager, pickled, scripted, FX-traced,
compiled or exported after instrumenting) is run as it is, so what it records
is what its instrumentation captures. :func:`need` turns "that capture is
missing" into an error that says how to fix it.

How a diagnostic calls a model is decided here too: :func:`split_batch`
takes a batch in the forms HF models and data loaders give (tuple, dict of
keyword arguments, single tensor), :func:`loss_of` applies the one rule for
``loss_fn`` (output and leftover batch items; the output alone for a
one-argument function; the output's own ``.loss`` without one), and
:func:`progress` adds a tqdm bar in a terminal. Limits: a batch of another
type (a string, a number, a custom object) is refused rather than guessed at;
a ``loss_fn`` whose signature can't be read gets every argument.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from .._shim import PicklehooksError
from .._stats import tensor_stats
from ..capture.instrument import _NAME_ATTR, instrument
from ..capture.log import Log, Record
from ..capture.record import _stats_dict
from ..capture.spec import class_path  # specs name module types the same way



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
    return _stats_dict(rec.shape, rec.dtype, tensor_stats(rec.tensor.detach()))


def nonfinite_count(rec: Record) -> int:
    """NaN + Inf elements in a tensor record (0 for non-tensor values)."""
    stats = stats_of(rec)
    return 0 if stats is None else stats["n_nan"] + stats["n_inf"]


def module_types(model, *, named: bool = True) -> dict[str, tuple[str, ...]]:
    """Module name -> its classes' qualified names (most specific first) for every module visible in ``model``.

    ``named=True``: the modules carrying a ``_picklehooks_name``, under that
    name, so they match the records in eager, scripted, FX and compiled
    models; a scripted module gives only its eager class's bare name
    (``original_name``: its module and base classes are lost). ``named=False``:
    every module of a plain model, under its qualified name. Exported models
    flatten their modules away: they give ``{}``.
    """
    types = {}
    items = model.named_modules() if isinstance(model, nn.Module) else ()
    for qualified, module in items:
        name = getattr(module, _NAME_ATTR, None) if named else qualified
        if name is None:
            continue
        if isinstance(module, torch.jit.ScriptModule):
            types[name] = (module.original_name,)
        else:
            types[name] = tuple(class_path(cls) for cls in type(module).__mro__)
    return types


# -- batches and losses: the one place that decides how a diagnostic calls a model ----------
#
# A batch is what one forward pass takes, in the forms data loaders and Hugging Face give:
# a tuple or list of positional arguments (``model(*batch)``), a mapping of keyword arguments
# (``model(**batch)``: a dict, an HF ``BatchEncoding``) or a single tensor (``model(batch)``).

BATCH_FORMS = ("a tuple of positional arguments ((x,) or (x, y)), a dict of keyword arguments "
               "(called as model(**batch), e.g. an HF batch) or a single tensor")


def split_batch(batch, what: str = "a batch", n_inputs: int | None = None) -> tuple[tuple, dict, tuple]:
    """``(args, kwargs, rest)``: ``model(*args, **kwargs)`` runs ``batch``; ``rest`` goes to the loss.

    ``n_inputs`` (tuple batches only) gives the model the first ``n_inputs``
    items and leaves the rest for ``loss_fn(output, *rest)``; a dict goes to
    the model whole.
    """
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if isinstance(batch, (tuple, list)):
        split = len(batch) if n_inputs is None else n_inputs
        return tuple(batch[:split]), {}, tuple(batch[split:])
    if isinstance(batch, Mapping):
        bad = next((k for k in batch if not isinstance(k, str)), None)
        if bad is not None:
            raise PicklehooksError(f"{what} is a dict with the key {bad!r}; a dict batch is called as model(**batch), "
                                   "so its keys must be the names of forward arguments")
        if n_inputs is not None:
            raise PicklehooksError(f"n_inputs={n_inputs!r} splits tuple batches, but {what} is a "
                                   f"{type(batch).__name__}, which goes to the model whole: leave n_inputs out "
                                   "(the loss then comes from loss_fn(output) or the output's .loss)")
        return (), dict(batch), ()
    raise PicklehooksError(f"{what} is a {type(batch).__name__} ({_short(batch)}); use {BATCH_FORMS}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def batch_tensors(args: tuple, kwargs: dict) -> tuple:
    """The forward arguments of a split batch, positional then keyword (for :func:`backward`)."""
    return tuple(args) + tuple(kwargs.values())


def batches_of(batches, what: str) -> Iterable:
    """``batches``, refused when it is one batch (a tensor or a dict) rather than an iterable of batches."""
    if isinstance(batches, (torch.Tensor, Mapping, str, bytes)) or not isinstance(batches, Iterable):
        raise PicklehooksError(f"{what} takes an iterable of batches, got one {type(batches).__name__}; for a "
                               f"single batch write [batch], each batch being {BATCH_FORMS}")
    return batches


def call(model, batch, what: str = "a batch"):
    """Run ``model`` on one batch in any of its forms (see :func:`split_batch`)."""
    args, kwargs, _ = split_batch(batch, what)
    return model(*args, **kwargs)


def own_loss(output):
    """The loss a model returned with its output (an HF ``ModelOutput``'s ``.loss``, a dict's ``"loss"``), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _takes_output_only(loss_fn, extra: int) -> bool:
    """True when ``loss_fn``'s signature accepts the output alone but not the output and ``extra`` more."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a readable signature: give it everything
        return False
    try:
        signature.bind(None, *([None] * extra))
        return False
    except TypeError:
        pass
    try:
        signature.bind(None)
        return True
    except TypeError:
        return False


def loss_of(output, loss_fn=None, rest: tuple = (), what: str = "loss_fn"):
    """The loss of one batch: ``loss_fn(output, *rest)``, or ``loss_fn(output)``, or the output's own loss.

    The rule: ``loss_fn`` gets the model's output followed by the batch items
    the model didn't take (``rest``); when its signature accepts only one
    argument (``lambda out: out.loss``) it gets the output alone. Without
    ``loss_fn`` the output's own loss is used (an HF ``ModelOutput``'s
    ``.loss``, computed when the batch has ``labels``; a dict's ``"loss"``).
    """
    if loss_fn is None:
        loss = own_loss(output)
        if loss is None:
            raise PicklehooksError(
                f"no {what} was given and the model's output ({type(output).__name__}) carries no loss tensor "
                "(.loss or ['loss']); pass loss_fn=lambda out: ..., or give an HF model labels in the batch")
        return loss
    if not callable(loss_fn):
        raise PicklehooksError(f"{what} must be callable (loss_fn(output) or loss_fn(output, *rest)), "
                               f"got {type(loss_fn).__name__}")
    if rest and _takes_output_only(loss_fn, len(rest)):
        return loss_fn(output)
    return loss_fn(output, *rest)


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


def progress(batches: Iterable, desc: str, unit: str = "batch") -> Iterable:
    """``batches`` with a tqdm progress bar when stderr is a terminal; as they are otherwise.

    tqdm is optional (the ``plots`` extra): without it there is no bar, and no error.
    """
    isatty = getattr(sys.stderr, "isatty", None)  # stderr may be None (pythonw) or a bare file-like object
    if isatty is None or not isatty():
        return batches
    try:
        from tqdm import tqdm  # only worth importing for a terminal
    except ImportError:
        return batches
    return tqdm(batches, desc=desc, unit=unit, file=sys.stderr)
