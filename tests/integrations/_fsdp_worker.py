"""An FSDP2 training worker for tests/integrations/test_fsdp.py (spawned, so it must be importable).

Each rank trains the same tiny model, sharded with ``fully_shard``, on its
slice of each step's global batch, recording with picklehooks; the model is
instrumented before sharding in one run and after it in another, and runs
with activation checkpointing in a third. Rank 0
saves the merged logs, the reduced gradients (``param.grad.full_tensor()``)
and every rank's warnings.
"""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import picklehooks
import picklehooks.integrations.distributed

CAPTURE = ("input", "output", "grad_output", "param", "param_grad")
STEPS, BATCH, LR = 2, 3, 0.1  # BATCH: rows per rank


def make_model() -> nn.Sequential:
    """Sharded over 2 ranks: Linear(4, 6) evenly, Linear(6, 3) unevenly (2 + 1 rows), Linear(3, 1) with
    an empty shard on rank 1."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 1))


class Checkpointed(nn.Sequential):
    """The same layers, Linear 2 and 4 under activation checkpointing (non-reentrant and reentrant)."""

    def forward(self, x):
        for i, layer in enumerate(self):
            x = checkpoint(layer, x, use_reentrant=i == 4) if i in (2, 4) else layer(x)
        return x


def global_batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(BATCH * world, 4, generator=torch.Generator().manual_seed(100 + step))


def train(rank: int, world: int, init_file: str, out_path: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for when, mode in (("before", "stats"), ("after", "both"), ("checkpointed", "stats")):
                model = make_model() if when != "checkpointed" else Checkpointed(*make_model())
                if when != "after":
                    picklehooks.instrument(model, capture=CAPTURE, mode=mode)
                for layer in (model[0], model[2], model[4]):
                    fully_shard(layer)
                fully_shard(model)
                if when == "after":
                    picklehooks.instrument(model, capture=CAPTURE, mode=mode)
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                grads = []
                with picklehooks.record() as log:
                    for step in range(STEPS):
                        opt.zero_grad()
                        x = global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH]
                        model(x).pow(2).mean().backward()
                        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
                        opt.step()
                        log.next_step()
                merged = picklehooks.integrations.distributed.gather(log)
                result[when] = {
                    "local": log.table(),  # this rank's own log: its shards
                    "merged": merged.table(),
                    "tensors": [r.tensor for r in merged.records],
                    "grads": grads,
                }
            result["tp"] = _tensor_parallel(world)
        messages = [f"{w.category.__name__}: {w.message}" for w in caught]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, messages)
        if rank == 0:
            result["warnings"] = everyone
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def _tensor_parallel(world: int) -> dict:
    """Parameters that are DTensors in the module itself (tensor parallelism): recorded in the
    pre-hook and by autograd's own post-accumulate-grad hooks as shards, merged by gather()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    picklehooks.instrument(model, modules=["0"], capture=("param", "param_grad"))
    parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate())})
    with picklehooks.record() as log:
        model(global_batch(0, world)).pow(2).mean().backward()
    merged = picklehooks.integrations.distributed.gather(log)
    whole = {f"{kind}:{name}": (p if kind == "param" else p.grad).full_tensor()
             for name, p in model.named_parameters() if name.startswith("0.") for kind in ("param", "param_grad")}
    return {"merged": merged.table(), "whole": whole}
