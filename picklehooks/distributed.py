"""Merging the logs of several processes with ``torch.distributed``.

With more than one process (DDP training, several machines), each rank
records its own log; every record carries its ``rank``. :func:`gather`
collects them with ``all_gather_object`` over the default (or a given)
process group, so any backend torch.distributed supports carries them.

Limits: statistics are read (one sync) and tensors moved to the CPU before
sending; gathering full tensors sends them all to every rank, so prefer
``mode="stats"`` for large models. Every rank of the group must call
:func:`gather`, as with any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._shim import PicklehooksError
from .log import Log

__all__ = ["gather"]


def gather(log: Log, group=None) -> Log:
    """Every rank's records, merged in rank order, on every rank::

        with picklehooks.record() as log:
            train_step(ddp_model)
        merged = picklehooks.distributed.gather(log)
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PicklehooksError("gather() needs torch.distributed to be initialised (dist.init_process_group)")
    payload = (log.table(), [None if r.tensor is None else r.tensor.detach().cpu() for r in log.records])
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, payload, group=group)
    rows, tensors = [], []
    for part_rows, part_tensors in everyone:
        rows += part_rows
        tensors += part_tensors
    return Log.from_rows(rows, tensors, step=log.step)
