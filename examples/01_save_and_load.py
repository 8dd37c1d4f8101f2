"""Save a model with an ordinary closure hook, load it in another process, watch the hook fire.

Without picklehooks, ``torch.save`` fails with "Can't pickle local object".
With ``picklehooks.portable``, the hook's source travels inside its name.

Run: python examples/01_save_and_load.py
"""

import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn

import picklehooks


def make_nan_guard(layer_name: str, limit: float):
    def guard(module, inputs, output):
        if not torch.isfinite(output).all():
            raise RuntimeError(f"non-finite output in {layer_name}")
        print(f"  {layer_name}: max |output| = {output.abs().max().item():.3f} (limit {limit})")
        return output.clamp(-limit, limit)

    return guard


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].register_forward_hook(picklehooks.portable(make_nan_guard("encoder", limit=1.0)))
    model[2].register_forward_hook(picklehooks.portable(make_nan_guard("head", limit=0.5)))

    print("this process:")
    model(torch.randn(3, 4))

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        torch.save(model, path)
        print(f"another process, loading {os.path.getsize(path)} bytes with plain torch.load:")
        child = "import sys, torch; torch.load(sys.argv[1], weights_only=False)(torch.randn(3, 4))"
        subprocess.run([sys.executable, "-c", child, path], check=True)


if __name__ == "__main__":
    main()
