"""torch.distributed: an instrumented model trained with DDP on 2 CPU ranks (gloo), logs merged on rank 0."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

import picklehooks
import picklehooks.integrations.distributed
from tests import hooks
from tests.integrations._ddp_worker import train
from tests._workers import run_rank


def test_ddp_two_ranks(tmp_path):
    """Each rank records 3 steps; the merged log has both ranks, in sync where DDP syncs them."""
    model = hooks.mlp()
    picklehooks.instrument(model, capture=("output", "grad_output", "param"))
    out = tmp_path / "merged.json"
    # spawn pickles the instrumented model into each worker: the hooks travel by name.
    mp.spawn(run_rank, args=(train, 2, str(tmp_path / "init"), model, str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())
    assert {r["rank"] for r in rows} == {0, 1}
    by_rank = {rank: [r for r in rows if r["rank"] == rank] for rank in (0, 1)}
    keys = [[(r["module"], r["kind"], r["path"], r["call"], r["step"]) for r in by_rank[k]] for k in (0, 1)]
    assert keys[0] == keys[1] and {r["step"] for r in rows} == {0, 1, 2}
    # DDP all-reduces gradients, so parameters are identical on both ranks at every step...
    params = [{k: r["norm"] for k, r in zip(keys[i], by_rank[i]) if r["kind"] == "param"} for i in (0, 1)]
    assert params[0] and all(params[0][k] == pytest.approx(params[1][k], rel=1e-6) for k in params[0])
    # ...while each rank's activations come from its own data.
    outputs = [[r["mean"] for r in by_rank[i] if r["kind"] == "output"] for i in (0, 1)]
    assert outputs[0] != outputs[1]


def test_gather_needs_a_process_group():
    """Calling gather() without torch.distributed set up says what to do."""
    with picklehooks.record() as log:
        pass
    with pytest.raises(picklehooks.PicklehooksError, match="init_process_group"):
        picklehooks.integrations.distributed.gather(log)
