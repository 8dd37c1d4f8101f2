"""Regenerate tests/data/frozen_v1.pt: a checkpoint in hook-name format 1 (letter 'a').

Run once per *new* format, never to "fix" a failing test: the point of a
frozen file is that old checkpoints keep loading. Usage:

    python tests/data/make_frozen.py tests/data/frozen_v1.pt
"""

import sys

import torch
import torch.nn as nn

import picklehooks


def make_scale(factor):
    def scale_output(module, inputs, output):
        return output * factor

    return scale_output


def shift_input(module, inputs):
    return (inputs[0] + 0.5,)


if __name__ == "__main__":
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    model[0].register_forward_hook(picklehooks.portable(make_scale(-2.0)))
    model[2].register_forward_pre_hook(picklehooks.portable(shift_input))
    x = torch.randn(4, 3)
    hooks = [*model[0]._forward_hooks.values(), *model[2]._forward_pre_hooks.values()]
    torch.save(
        {
            "model": model,
            "input": x,
            "expected": model(x).detach(),
            "sources": [picklehooks.codec.decode(h.__name__) for h in hooks],
            "format": "a",
        },
        sys.argv[1],
    )
