"""Find dead ReLU units and saturated Tanh units over many batches, then prune the dead ones.

Shows:

1. ``dead_units(model, batches)`` over 20 batches: per activation layer, how
   many units never activate (ReLU output <= 0 on every sample) or are always
   saturated (|tanh| > 0.99 on every sample). The model was "initialised"
   badly on purpose: half of the first layer's biases are very negative, and
   a few units of the second layer have large weights and a huge bias.
2. The case study from the talk: a dead ReLU unit contributes nothing, so
   removing it (a row of the layer before, a column of the layer after)
   leaves the model's output exactly the same, with fewer parameters.

Synthetic data, CPU, a few seconds. A progress bar appears when stderr is a terminal and tqdm is installed.

Run: python examples/05_dead_units.py
"""

import torch
import torch.nn as nn

from picklehooks.diagnostics import dead_units


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[str(row.get(c, "")) if not isinstance(row.get(c), float) else f"{row[c]:.2f}" for c in columns]
             for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)))


def prune(linear_in: nn.Linear, linear_out: nn.Linear, keep: torch.Tensor) -> tuple[nn.Linear, nn.Linear]:
    """Drop units: rows of the layer that makes them, columns of the layer that reads them."""
    smaller_in, smaller_out = nn.Linear(linear_in.in_features, len(keep)), nn.Linear(len(keep), linear_out.out_features)
    with torch.no_grad():
        smaller_in.weight.copy_(linear_in.weight[keep])
        smaller_in.bias.copy_(linear_in.bias[keep])
        smaller_out.weight.copy_(linear_out.weight[:, keep])
        smaller_out.bias.copy_(linear_out.bias)
    return smaller_in, smaller_out


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].bias[::2] = -20.0  # every other unit: the input would need a norm of ~80 to wake it
        model[2].weight[:5] *= 10  # 5 units driven far into the flat tails of tanh
        model[2].bias[:5] = 50.0
    model.eval()
    batches = [(torch.randn(64, 16),) for _ in range(20)]

    rows = dead_units(model, batches)
    for row in rows:
        row["frac"] = row.get("dead_frac", row.get("saturated_frac"))
        row["count"] = row.get("dead", row.get("saturated"))
    print(f"activation units over {rows[0]['batches']} batches of 64 samples:")
    print_table(rows, ["module", "type", "criterion", "units", "count", "frac"])

    dead = set(rows[0]["indices"])
    keep = torch.tensor([i for i in range(64) if i not in dead])
    first, second = prune(model[0], model[2], keep)
    pruned = nn.Sequential(first, nn.ReLU(), second, nn.Tanh(), model[4]).eval()
    x = torch.cat([b[0] for b in batches])
    with torch.no_grad():
        diff = (model(x) - pruned(x)).abs().max().item()
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"pruned the {len(dead)} dead ReLU units: {params(model)} -> {params(pruned)} parameters, "
          f"max |output difference| = {diff:.3g}")


if __name__ == "__main__":
    main()
