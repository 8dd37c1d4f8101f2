"""Measure how a multi-task model's task gradients agree or fight on the shared trunk.

Shows:

1. ``gradient_conflict(model, inputs, {task: loss_fn})``: each task's
   gradient norm on the parameters two or more tasks share, and the cosine
   similarity of every pair of task gradients.
2. Three tasks on one trunk: ``price`` and ``discount`` read the same head with
   targets that mostly contradict each other (cosine near -1: one task's step
   undoes the other's), ``category`` uses its own head on an unrelated target
   (cosine near 0), and ``discount`` is weighted 10x (its gradient dominates the trunk).
3. ``layers``: the same cosines per shared module.

Synthetic data, CPU, a few seconds.

Run: python examples/07_gradient_conflict.py
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from picklehooks.diagnostics import gradient_conflict


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.value_head = nn.Linear(32, 1)
        self.class_head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"value": self.value_head(h).squeeze(-1), "logits": self.class_head(h)}


def main() -> None:
    torch.manual_seed(0)
    model = MultiTask()
    x = torch.randn(128, 16)
    price = x[:, :4].sum(1)
    discount = -price + 0.3 * torch.randn(128)  # nearly the opposite target, on the same head
    category = torch.randint(0, 4, (128,))
    losses = {
        "price": lambda out: F.mse_loss(out["value"], price),
        "discount": lambda out: 10 * F.mse_loss(out["value"], discount),
        "category": lambda out: F.cross_entropy(out["logits"], category),
    }
    report = gradient_conflict(model, (x,), losses)
    print(f"shared parameters: {', '.join(report.params)}")
    print(f"  {'task':<10}{'loss':>8}{'|grad|':>9}   cosine with " + " ".join(f"{t:>9}" for t in report.tasks))
    for task, row in zip(report.tasks, report.matrix):
        print(f"  {task:<10}{report.losses[task]:>8.3f}{report.norms[task]:>9.3f}   {'':12}"
              + " ".join(f"{c:>9.3f}" for c in row))
    print("per shared module (pairs where both tasks reach it):")
    for row in report.layers:
        if math.isnan(row["cosine"]):  # one task has no gradient there, so no direction
            continue
        print(f"  {row['module']:<14}{row['task_a']:>9} vs {row['task_b']:<9} cosine {row['cosine']:>7.3f}")


if __name__ == "__main__":
    main()
