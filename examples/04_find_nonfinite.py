"""Find the first module where NaN or Inf appears, forward or backward, in eager and TorchScript.

Shows:

1. ``find_nonfinite(model, x)`` on a plain model: a normalisation layer divides
   by the norm of an all-zero row (0/0 = NaN); the report names the layer and
   shows that its input was finite.
2. The same model instrumented and scripted with ``torch.jit.script``: the
   same answer from the scripted model's hooks.
3. A backward-only fault: ``sqrt`` of a ReLU output is finite going forward but
   its gradient at 0 is Inf; with ``loss_fn`` the report names the module whose
   backward made the gradient non-finite.

Synthetic data, CPU, a few seconds.

Run: python examples/04_find_nonfinite.py
"""

import torch
import torch.nn as nn

import picklehooks
from picklehooks.diagnostics import find_nonfinite


class RowNormalize(nn.Module):
    """x / ||x|| per row: NaN for a row that is all zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()


def show(title: str, report) -> None:
    print(title)
    if report is None:
        print("  everything stayed finite")
        return
    s = report.stats
    print(f"  module {report.module!r} ({report.phase}, {report.kind}, call {report.call}, step {report.step}): "
          f"{s['n_nan']} NaN, {s['n_inf']} Inf of shape {s['shape']}")
    for row in report.inputs:
        print(f"  its input {row['path']}: shape {row['shape']}, absmax {row['absmax']:.3g}, "
              f"zero_frac {row['zero_frac']:.2f}, NaN {row['n_nan']}, Inf {row['n_inf']}")
    print(f"  -> {report.note}")


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), RowNormalize(), nn.Linear(6, 2))
    with torch.no_grad():
        model[0].bias[:] = -0.8  # half the rows of the ReLU output are now all zero
    show("plain model, forward:", find_nonfinite(model, x))

    picklehooks.instrument(model, capture=("input", "output", "grad_output", "grad_input"),
                           example_inputs=(x,), scriptable=True)
    show("the same model instrumented, then torch.jit.script:", find_nonfinite(torch.jit.script(model), x))

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Sqrt(), nn.Linear(6, 2))
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    show("sqrt after ReLU, forward only:", find_nonfinite(model, x))
    show("sqrt after ReLU, forward and backward:", find_nonfinite(model, x, loss_fn=loss_fn))


if __name__ == "__main__":
    main()
