"""Compare a model before and after transformations, layer by layer, and find where a bad one goes wrong.

Shows:

1. ``record_forward(model, x)`` records every layer's output tensor, from a
   model in any form; ``compare(log_a, log_b)`` matches the records by
   (module, kind, path, call) and gives per layer the max abs error, relative
   error, SQNR (dB) and cosine similarity, and the first diverging layer.
2. Faithful transformations: ``torch.jit.script``, ``torch.fx.symbolic_trace`` and
   ``torch.compile(fullgraph=True)``
   of the instrumented model agree with eager (errors ~0).
3. ``quantize_dynamic`` (int8 Linear weights): small errors everywhere, SQNR
   ~30-40 dB. It swaps the Linear modules, so the quantized copy is
   instrumented on its own (the module names are unchanged).
4. Magnitude pruning of one layer (the smallest 30% of layer 3's weights set
   to 0): the first divergence is that layer, every earlier layer is exact,
   and the per-layer table shows how the error carries to the output.

Synthetic data, CPU, a few seconds.

Run: python examples/08_compare_transformations.py
"""

import copy
import warnings

import torch
import torch.nn as nn

import picklehooks
from picklehooks.diagnostics import compare, record_forward


def prune_smallest(model: nn.Sequential, index: int, fraction: float) -> nn.Sequential:
    """Magnitude pruning: zero the smallest ``fraction`` of one Linear layer's weights."""
    pruned = copy.deepcopy(model)
    weight = pruned[index].weight
    with torch.no_grad():
        weight[weight.abs() <= weight.abs().flatten().kthvalue(int(fraction * weight.numel())).values] = 0
    return pruned


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 10)).eval()
    x = torch.randn(256, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated; it still works
        quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    picklehooks.instrument(model, capture="output", mode="tensor", example_inputs=(x,), scriptable=True)
    reference = record_forward(model, x)

    candidates = {"torch.jit.script": torch.jit.script(model), "torch.fx": torch.fx.symbolic_trace(model),
                  "torch.compile": torch.compile(model, fullgraph=True),
                  "quantize_dynamic": quantized, "prune layer 3": prune_smallest(model, 3, 0.3)}
    results = {name: compare(reference, record_forward(other, x)) for name, other in candidates.items()}
    print(f"{'transformation':<18}{'first divergence':>18}{'max rel err':>13}{'min SQNR dB':>13}")
    for name, result in results.items():
        first = result.first_divergence["module"] if result.first_divergence else "-"
        worst = max(row["rel_err"] for row in result.rows)
        sqnr = min(row["sqnr_db"] for row in result.rows)
        print(f"{name:<18}{first:>18}{worst:>13.2g}{sqnr:>13.1f}")

    for name in ("quantize_dynamic", "prune layer 3"):
        print(f"{name}, per layer:")
        print(f"  {'layer':<7}{'max abs':>10}{'rel err':>10}{'SQNR dB':>9}{'cosine':>10}")
        for row in results[name].rows:
            print(f"  {row['module']:<7}{row['max_abs']:>10.3g}{row['rel_err']:>10.3g}{row['sqnr_db']:>9.1f}"
                  f"{row['cosine']:>10.6f}")


if __name__ == "__main__":
    main()
