"""``python -m picklehooks demo``: save a hooked model here, watch its hook fire in another process.

The hook is a closure (the classic "Can't pickle local object" case). The
child process is a fresh interpreter that never imports this module; it
only runs ``torch.load`` and calls the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import torch

from .serialize.portable import portable


def _make_hook(label: str, threshold: float):
    def report(module, inputs, output):
        frac = (output.abs() > threshold).float().mean().item()
        print(f"  [hook {label}] {type(module).__name__} output {tuple(output.shape)}, "
              f"{frac:.0%} of |values| > {threshold}")

    return report


_CHILD = textwrap.dedent(
    """
    import sys, torch
    model = torch.load(sys.argv[1], weights_only=False)
    print(f"child  (pid {__import__('os').getpid()}): loaded; demo module imported: "
          f"{'picklehooks.demo' in sys.modules}")
    model(torch.randn(4, 8))
    """
)


def run() -> int:
    """Run the demo; return a process exit code."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    hook = portable(_make_hook("activations", threshold=0.5))
    for layer in (model[0], model[2]):
        layer.register_forward_hook(hook)
    print(f"parent (pid {os.getpid()}): the hook is named {hook.__name__[:40]}... "
          f"({len(hook.__name__)} characters); it fires here:")
    model(torch.randn(4, 8))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        torch.save(model, path)
        print(f"parent: saved to {path} ({os.path.getsize(path)} bytes); loading it in a fresh process:")
        return subprocess.call([sys.executable, "-c", _CHILD, path])
