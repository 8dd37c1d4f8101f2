"""Which module takes the time? Profiler ranges named after modules, and a per-module summary.

``instrument(model, profile=True)`` wraps every module call in a
``torch.profiler`` range called ``module:<qualified name>``, so traces and
``prof.key_averages()`` show module names; ``module_times`` turns them into a
table. The profiling hooks are portable like the rest, so a saved model keeps them.

Run: python examples/11_profile_modules.py
"""

import torch
from torch import nn

import picklehooks
from picklehooks.diagnostics.profile import module_times


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(),
        nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256)),
        nn.LayerNorm(256),
    )
    picklehooks.instrument(model, capture="output", profile=True)
    x = torch.randn(64, 256)
    model(x)  # warm up
    with torch.profiler.profile() as prof:
        for _ in range(10):
            model(x)
    print(f"{'module':<8}{'calls':>7}{'total ms':>11}{'self ms':>10}{'mean ms':>10}")
    for row in module_times(prof, model):
        print(f"{row['module']:<8}{row['calls']:>7}{row['total_ms']:>11.2f}{row['self_ms']:>10.2f}{row['mean_ms']:>10.3f}")


if __name__ == "__main__":
    main()
