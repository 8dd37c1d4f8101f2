"""Merging the logs of several processes with ``torch.distributed``; sharded models (FSDP2, DTensor).

With more than one process (DDP training, several machines), each rank
records its own log; every record carries its ``rank``. :func:`gather`
collects them with ``all_gather_object`` over the default (or a given)
process group, so any backend torch.distributed supports carries them.

**FSDP2** (``torch.distributed.fsdp.fully_shard``): ``instrument()`` the model
before or after sharding it.

* ``param`` records describe the whole parameter, on every rank: FSDP
  prepends its pre-forward hook, which all-gathers the parameters, so the
  pre-hook that records them reads the unsharded parameter.
* ``param_grad`` records the reduced gradient (``param.grad.full_tensor()``),
  once per backward. The autograd gradient of the unsharded parameter is
  this rank's alone, so the hook goes on FSDP's sharded parameter instead
  (:func:`fsdp_sharded`), which FSDP calls once reduce-scatter has assigned
  the gradient; that gradient is a ``DTensor``, and each rank records the
  statistics of its own shard. :func:`gather` merges them exactly (element
  counts, means and standard deviations by Chan's formula, norms, min/max,
  NaN/Inf/zero counts) and, where tensors were kept, reassembles the tensor:
  in the merged log each rank's record describes the whole gradient. No
  collective runs inside a hook.
* Activations are each rank's own, from its own part of the batch.

Any other ``DTensor`` a hook records (tensor parallelism: parameters, their
gradients, activations still DTensors where the hook sees them) is recorded
and merged in the same way (:func:`add_shard`). Activation checkpointing
(``torch.utils.checkpoint``), with FSDP2 or without, records each forward
once: the recomputation during backward records nothing again (see
:func:`picklehooks._hookrt._recomputing`).

Limits: statistics are read (one sync) and tensors moved to the CPU before
sending; gathering full tensors sends them all to every rank, so prefer
``mode="stats"`` for large models. Every rank of the group must call
:func:`gather`, as with any collective. Before :func:`gather`, a rank's own
log describes its shard of a sharded value (the record's ``shape`` is the
shard's). Where a shard lies is kept beside the live log, so only
:func:`gather` merges shards: not a log saved and loaded again, nor records a
sink already wrote. A shard merges only when every shard of the value was
recorded on a rank of the group (else it stays as it is, with a warning).
``Partial`` DTensors (not yet reduced) are recorded as this rank's values,
unmerged. Instrumented before ``fully_shard``, a parameter whose module
never runs its own forward (``MultiheadAttention.out_proj``) records no
``param_grad`` (instrumenting after sharding hooks it at once).

Not ours, but seen here: on torch 2.13 a gloo process (DDP or FSDP2 on CPU)
can abort as it exits, after its work is done ("terminate called without an
active exception"), in about one two-rank run in four, with or without picklehooks and
even after ``destroy_process_group()``: a gloo thread releases a finished
collective's tensors while the interpreter finalises (pytorch/pytorch#179291).
Write results before exiting; the test workers leave with ``os._exit(0)``
(``tests/_workers.py``).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from .._shards import _LAYOUTS, _Layout, add_shard, fsdp_sharded
from .._shim import PicklehooksError
from ..capture.log import Log

__all__ = ["gather", "add_shard", "fsdp_sharded"]


# -- merging ---------------------------------------------------------------------------------------

def gather(log: Log, group=None) -> Log:
    """Every rank's records, merged in rank order, on every rank::

        with picklehooks.record() as log:
            train_step(ddp_model)
        merged = picklehooks.integrations.distributed.gather(log)

    Shards of sharded values (FSDP2's ``param_grad``, DTensors) are merged:
    each rank's record of its shard becomes a record of the whole value.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PicklehooksError("gather() needs torch.distributed to be initialised (dist.init_process_group)")
    payload = (log.table(), [None if r.tensor is None else r.tensor.detach().cpu() for r in log.records],
               dict(_LAYOUTS.get(log, {})))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, payload, group=group)
    rows, tensors, layouts = [], [], []
    for part_rows, part_tensors, part_layouts in everyone:
        rows += part_rows
        tensors += part_tensors
        layouts += [_shard_of(row, part_layouts) for row in part_rows]
    unmerged = _merge_shards(rows, tensors, layouts)
    unmerged |= {key for _, _, part_layouts in everyone for key, layout in part_layouts.items() if layout is None}
    if unmerged:
        warnings.warn(f"picklehooks.integrations.distributed.gather: the records of {', '.join(map(str, sorted(unmerged)))} "
                      "stay per shard: some shards were not recorded on the ranks gathered, or the value was "
                      "sharded differently within the log", stacklevel=2)
    return Log.from_rows(rows, tensors, step=log.step)


def _shard_of(row: dict, layouts: dict) -> _Layout | None:
    """The layout of the shard ``row`` describes; None for a row that describes a whole value."""
    layout = layouts.get((row["module"], row["kind"], row["path"]))
    # The same name may be recorded whole elsewhere (an unsharded parameter): told by its shape
    # (a shard as large as the whole leaves the others empty: merged, it stays what it was).
    if layout is None or row["shape"] is None or tuple(row["shape"]) != layout.local:
        return None
    return layout


def _merge_shards(rows: list[dict], tensors: list, layouts: list) -> set:
    """Replace every shard's row (and tensor) by the whole value's, in place; return the
    (module, kind, path) of the shards left as they were, whose other shards are missing."""
    groups: dict[tuple, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout is not None:
            row = rows[i]
            key = (row["module"], row["kind"], row["path"], row["call"], row["step"], layout.shape, layout.ranks)
            groups.setdefault(key, []).append(i)
    unmerged = set()
    for key, members in groups.items():
        distinct: dict[tuple, int] = {}
        for i in members:
            distinct.setdefault(layouts[i].shard, i)
        first = layouts[members[0]]
        if len(distinct) != first.count:
            unmerged.add(key[:3])
            continue
        parts = [(math.prod(layouts[i].local), rows[i]) for i in distinct.values()]
        merged = {"shape": list(first.shape)}
        if all(row.get("n_nan") is not None for _, row in parts):
            merged.update(_merge_stats(parts))
        whole = _assemble([(layouts[i], tensors[i]) for i in distinct.values()], first.shape)
        for i in members:
            rows[i] = {**rows[i], **merged}
            if whole is not None:
                tensors[i] = whole
            elif tensors[i] is not None:
                tensors[i] = None  # a shard is not the value the record now describes
    return unmerged


def _merge_stats(parts: list[tuple[int, dict]]) -> dict:
    """The :data:`STAT_NAMES` of a tensor from those of its parts: ``(element count, row)`` each.

    Exact but for rounding: counts add up, min/max/absmax take the extremes,
    the norm is the root of the summed squared norms, mean and std combine
    by Chan's formula (``M2 = sum(n_i (std_i**2 + (mean_i - mean)**2))``), in
    float64, scaled by the largest magnitude so nothing overflows. NaN and
    Inf follow the statistics of one tensor: any NaN makes mean, std, min,
    max, absmax and norm NaN; an Inf makes std NaN and the norm infinite.
    """
    parts = [(n, row) for n, row in parts if n]
    n = sum(k for k, _ in parts)
    if not n:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "absmax": math.nan,
                "norm": math.nan, "n_nan": 0, "n_inf": 0, "zero_frac": math.nan}
    nan = sum(int(row["n_nan"]) for _, row in parts)
    inf = sum(int(row["n_inf"]) for _, row in parts)
    zeros = sum(round(row["zero_frac"] * k) for k, row in parts)
    out = {"n_nan": nan, "n_inf": inf, "zero_frac": zeros / n}
    if nan:
        return {**out, **dict.fromkeys(("mean", "std", "min", "max", "absmax", "norm"), math.nan)}
    absmax = max(float(row["absmax"]) for _, row in parts)
    out.update(min=min(float(row["min"]) for _, row in parts), max=max(float(row["max"]) for _, row in parts),
               absmax=absmax)
    if inf:
        out.update(mean=sum(k / n * float(row["mean"]) for k, row in parts), std=math.nan, norm=math.inf)
        return out
    scale = absmax if 0 < absmax < math.inf else 1.0
    means = [(k / n, float(row["mean"]) / scale, float(row["std"]) / scale, float(row["norm"]) / scale)
             for k, row in parts]
    mean = sum(w * m for w, m, _, _ in means)
    var = sum(w * (s * s + (m - mean) ** 2) for w, m, s, _ in means)
    out.update(mean=mean * scale, std=math.sqrt(var) * scale,
               norm=math.sqrt(sum(r * r for _, _, _, r in means)) * scale)
    return out


def _assemble(shards: list[tuple[_Layout, torch.Tensor | None]], shape: tuple) -> torch.Tensor | None:
    """The whole tensor from its distinct shards' kept tensors; None unless every one was kept."""
    if not shards or any(t is None or layout.offset is None for layout, t in shards):
        return None
    first = shards[0][1]
    whole = torch.empty(shape, dtype=first.dtype)
    for layout, t in shards:
        if t.numel():
            whole[tuple(slice(o, o + s) for o, s in zip(layout.offset, layout.local))] = t.reshape(layout.local)
    return whole
