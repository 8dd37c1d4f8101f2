"""A DDP training worker for tests/integrations/test_distributed.py (spawned, so it must be importable)."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import picklehooks
import picklehooks.integrations.distributed


_KEEP: list = []


def train(rank: int, world: int, init_file: str, model, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # torch.multiprocessing hands CPU tensors over in shared memory: without a
        # copy, both ranks' optimizers would step the very same parameters.
        model = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        # Kept until the rank's os._exit (tests._workers.run_rank): freed when train returns, its
        # Reducer drops the last reference to the gloo process group, whose destructor joins a
        # worker thread that waits for the GIL this thread holds (a deadlock seen on torch 2.13).
        _KEEP.append(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)  # each rank its own data
        with picklehooks.record() as log:
            for _ in range(3):
                opt.zero_grad()
                ddp(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
                opt.step()
                log.next_step()
        merged = picklehooks.integrations.distributed.gather(log)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(merged.table(), f)
    finally:
        dist.destroy_process_group()
