"""Hooks of the kinds people register in practice, for bench/bench_serializer.py.

They are ordinary code: module-level defs, closures made by factories, a
typed hook of the shape TorchScript accepts, a pre-hook and a lambda. None of
them knows about picklehooks (the benchmark calls ``picklehooks.portable`` on
them), and none copies a line of the shim's zstd dictionary verbatim, so the
dictionary's gain is not flattered. The factories (``make_clamp``,
``make_scale``, ``make_nan_guard``) also serve as the "non-portable
originals" that cloudpickle pickles by value.
"""

import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def print_stats(module, inputs, output):
    """Print a one-line summary of a module's output."""
    print(
        f"{module.__class__.__name__:>12} shape={tuple(output.shape)} "
        f"mean={output.mean().item():+.4f} std={output.std().item():.4f}"
    )


def nan_guard(module, inputs, output):
    if torch.isnan(output).any():
        raise RuntimeError(f"NaN in the output of {type(module).__name__}")


def make_clamp(limit):
    def clamp_output(module, inputs, output):
        return output.clamp(min=-limit, max=limit)

    return clamp_output


def make_scale(scale):
    def scale_output(module, inputs, output):
        return output * scale

    return scale_output


def make_nan_guard(max_abs):
    def guard_output(module, inputs, output):
        peak = output.detach().abs().max()
        if not torch.isfinite(peak) or peak > max_abs:
            raise RuntimeError(f"{module.__class__.__name__}: |output| reached {peak.item()} (limit {max_abs})")

    return guard_output


def typed_forward_hook(module: nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    x = inputs[0]
    if x.shape == output.shape:
        return output + 0.1 * x
    return output


def center_inputs_pre_hook(module, inputs):
    x = inputs[0]
    return (x - x.mean(dim=-1, keepdim=True),)


double_output = lambda module, inputs, output: output * 2  # noqa: E731 - a lambda on purpose


def scaled_relu(module, inputs, output):
    # He-style gain keeps the variance of a ReLU'd output near that of its input.
    return F.relu(output) * math.sqrt(2.0)


#: label -> (kind, hook function), in the order the benchmark reports them.
HOOKS = {
    "print_stats": ("module-level def, stats printer", print_stats),
    "nan_guard": ("module-level def, raises", nan_guard),
    "clamp_output": ("closure: make_clamp(1.0)", make_clamp(1.0)),
    "scale_output": ("closure: make_scale(0.5)", make_scale(0.5)),
    "typed_forward_hook": ("typed, Tuple[torch.Tensor]", typed_forward_hook),
    "center_inputs_pre_hook": ("forward pre-hook", center_inputs_pre_hook),
    "double_output": ("lambda", double_output),
    "scaled_relu": ("F.relu + math", scaled_relu),
}
