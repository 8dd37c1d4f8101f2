"""Sharded values (FSDP2, DTensor) where the hooks record them: shards and their layouts.

Beneath the log (this module imports nothing of picklehooks), so that the
recording ops can call it; :mod:`picklehooks.integrations.distributed` merges what it
notes, in :func:`~picklehooks.integrations.distributed.gather`.

* :func:`add_shard`: record a ``DTensor`` as this rank's shard and note where
  the shard lies in the whole, beside the live log.
* :func:`fsdp_sharded`: FSDP2's sharded parameter in place of the unsharded
  one a module holds during its forward, whose hooks see the reduced gradient.

Limits: FSDP2's parameters are found through its private state
(``torch.distributed._composable_state``), read defensively: where that
changes, ``param_grad`` falls back to this rank's unreduced gradient.
"""

from __future__ import annotations

import importlib
import math
import weakref
from typing import NamedTuple

from torch.utils.weak import WeakIdKeyDictionary


# -- sharded values --------------------------------------------------------------------------------

class _Layout(NamedTuple):
    """Where one rank's shard of a DTensor lies in the whole (plain values: picklable, comparable)."""

    shape: tuple  # the whole tensor's
    local: tuple  # this rank's shard's
    offset: tuple | None  # the shard's first element's index in the whole (None: not known)
    shard: tuple  # this rank's coordinates on the mesh dimensions that shard: equal for equal shards
    count: int  # how many different shards make up the whole
    ranks: tuple  # the global ranks of the device mesh


# Log -> {(module, kind, path): _Layout, or None where the layout changed within the log}.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (shape, mesh, placements) -> (_Layout, or None where this rank is not in the mesh, or the
# placements leave each rank the whole: Replicate, or unmerged: Partial).
_LAYOUT_OF: dict = {}


def _layout(x) -> _Layout | None:
    key = (tuple(x.shape), x.device_mesh, tuple(x.placements))
    try:
        return _LAYOUT_OF[key]
    except KeyError:
        pass
    mesh, placements = x.device_mesh, x.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard()]
    coordinate = mesh.get_coordinate()
    layout = None
    if dims and coordinate is not None and not any(p.is_partial() for p in placements):
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
            local, offset = tuple(local), tuple(offset)
        except Exception:  # noqa: BLE001 - private API: without it, statistics still merge
            local, offset = tuple(x.to_local().shape), None
        layout = _Layout(tuple(x.shape), local, offset, tuple(coordinate[i] for i in dims),
                         math.prod(mesh.size(i) for i in dims), tuple(mesh.mesh.flatten().tolist()))
    if len(_LAYOUT_OF) >= 4096:  # a layout per parameter shape, normally: forget, don't grow
        _LAYOUT_OF.clear()
    _LAYOUT_OF[key] = layout
    return layout


def add_shard(log, module: str, kind: str, path: str, x, flags: int) -> None:
    """Record the DTensor ``x`` as this rank's shard (its statistics, or tensor) and note where it lies.

    Called by the hooks for every DTensor they record (see
    :func:`picklehooks._ops.record_tensor`); :func:`picklehooks.integrations.distributed.gather` merges the shards.
    """
    local = x.to_local()
    layout = _layout(x)
    if layout is not None:
        layouts = _LAYOUTS.get(log)
        if layouts is None:
            layouts = _LAYOUTS[log] = {}
        key = (module, kind, path)
        # Resharded within the log, or a shard not where DTensor's rules put it: merge nothing.
        usable = layouts.get(key, layout) == layout and tuple(local.shape) == layout.local
        layouts[key] = layout if usable else None
    log._add_tensor(module, kind, path, local, flags)


# A parameter seen in a module -> FSDP2's FSDPParam whose unsharded parameter it is, or None.
_FSDP_PARAM = WeakIdKeyDictionary()
_UNSEEN = object()


def fsdp_sharded(params: list) -> list:
    """``params``, with each FSDP2 unsharded parameter replaced by FSDP's sharded parameter.

    During a forward, FSDP2 sets the all-gathered (unsharded) parameter on
    the module; autograd accumulates this rank's gradient into it, and FSDP
    reduce-scatters that into the sharded parameter's ``.grad`` and then
    calls the sharded parameter's post-accumulate-grad hooks. So a hook that
    must see the reduced gradient goes on the sharded parameter.
    """
    out = None
    for i, p in enumerate(params):
        if p is None:
            continue
        fsdp_param = _FSDP_PARAM.get(p, _UNSEEN)
        if fsdp_param is _UNSEEN:
            _scan_fsdp()
            fsdp_param = _FSDP_PARAM.get(p, _UNSEEN)
            if fsdp_param is _UNSEEN:  # not FSDP's: never will be (FSDP makes new tensors)
                fsdp_param = _FSDP_PARAM[p] = None
        if fsdp_param is not None:
            if out is None:
                out = list(params)
            out[i] = fsdp_param.sharded_param
    return params if out is None else out


def _scan_fsdp() -> None:
    """Note every FSDP2 unsharded parameter in the process (FSDP's private state, read defensively)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch from before FSDP2 allowed several groups per module
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", None) or ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and hasattr(fsdp_param, "sharded_param"):
                    _FSDP_PARAM[unsharded] = fsdp_param


# A copy of this file inside a torch.package archive shares the host's notes when picklehooks
# is installed there, so that the host's gather() merges what packaged hooks record.
# (importlib, so the exporter's scan doesn't follow it.)
if __name__ != "picklehooks._shards":
    try:
        _host = importlib.import_module("picklehooks._shards")
    except ImportError:
        pass
    else:
        _LAYOUTS, add_shard, fsdp_sharded = _host._LAYOUTS, _host.add_shard, _host.fsdp_sharded
