"""Export a hooked model with torch.package; load it where picklehooks is not installed.

The archive carries picklehooks' shim (standard library + zstd only), so the
loading side needs nothing but torch and zstandard. The child process below
refuses every import of picklehooks to prove it.

Run: python examples/02_torch_package.py
"""

import os
import subprocess
import sys
import tempfile
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import picklehooks
import picklehooks.serialize.package


def soft_cap(module: nn.Module, inputs: Tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    # Typed, so the loaded model can also be scripted.
    return 3.0 * torch.tanh(F.relu(output) / 3.0)


CHILD = """
import sys
class NoPicklehooks:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'picklehooks':
            raise ImportError('not installed here')
sys.meta_path.insert(0, NoPicklehooks())

import torch
from torch.package import PackageImporter
model = PackageImporter(sys.argv[1]).load_pickle("model", "model.pkl")
x = torch.full((1, 4), 10.0)
print("  loaded output :", model(x).tolist())
print("  scripted      :", torch.jit.script(model)(x).tolist())
print("  picklehooks imported:", any(m.startswith("picklehooks") for m in sys.modules))
"""


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        layer.register_forward_hook(picklehooks.portable(soft_cap))
    print("  eager output  :", model(torch.full((1, 4), 10.0)).tolist())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        picklehooks.serialize.package.save(path, model)
        subprocess.run([sys.executable, "-c", CHILD, path], check=True)


if __name__ == "__main__":
    main()
