"""Training at scale: FSDP2 (``fully_shard``) on 2 CPU ranks (gloo), and activation checkpointing.

Ground truth comes from plain PyTorch: an un-instrumented copy of each model
run with ordinary module and tensor hooks (:func:`reference`), on one process
and the whole batch, without checkpointing.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

import picklehooks
from picklehooks._stats import tensor_stats
from picklehooks.capture.record import STAT_NAMES  # the kernels' values, positionally, under the names records use
from picklehooks.capture.instrument import CAPTURE_KINDS

REL, ABS = 1e-5, 1e-6


def _fsdp_missing() -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available"
    if not dist.is_gloo_available():
        return "the gloo backend is not available"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return "this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    return None


# -- ground truth ----------------------------------------------------------------------------------

def reference(model: nn.Module, batches: list, loss_fn, kinds, *, lr: float = 0.1) -> dict:
    """Train an un-instrumented copy of ``model`` with plain PyTorch; return what picklehooks should record.

    ``{(module, kind, path, call, step): tensor}`` for ``input`` (first
    positional), ``output``, ``grad_input`` and ``grad_output`` (through the
    module's own use of its input, the caller's uses of its output: hooks on
    views), ``param`` (before the forward) and ``param_grad`` (after
    backward), of every module with a forward of its own but the root;
    ``call`` counts per (module, kind, path) over the run, as in a log. Only
    records of ``kinds`` (``"all"``: every kind) are returned.
    """
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out: dict = {}
    calls: dict = {}
    step = [0]

    def add(name, kind, path, value):
        call = calls.get((name, kind, path), 0)
        calls[(name, kind, path)] = call + 1
        out[(name, kind, path, call, step[0])] = value.detach().clone()
        return call

    chosen = {name: m for name, m in model.named_modules()
              if name and type(m).forward is not nn.Module.forward}
    for name, module in chosen.items():
        def grad_hook(key):
            def hook(g, key=key, at=step[0]):
                out[(*key, at)] = g.detach().clone()

            return hook

        def pre(mod, args, name=name):
            for pname, p in mod.named_parameters(recurse=False):
                add(name, "param", pname, p)
            call = add(name, "input", "0", args[0])
            if args[0].requires_grad:
                x = args[0].view_as(args[0])
                x.register_hook(grad_hook((name, "grad_input", "0", call)))
                return (x, *args[1:])

        def post(mod, args, output, name=name):
            call = add(name, "output", "", output)
            output.register_hook(grad_hook((name, "grad_output", "", call)))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    for x in batches:
        opt.zero_grad()
        loss_fn(model(x)).backward()
        for name, module in chosen.items():
            for pname, p in module.named_parameters(recurse=False):
                add(name, "param_grad", pname, p.grad)
        opt.step()
        step[0] += 1
    kinds = CAPTURE_KINDS if kinds == "all" else kinds
    return {key: value for key, value in out.items() if key[1] in kinds}


def by_key(rows: list[dict]) -> dict:
    """Table rows by (module, kind, path, call, step); no key twice."""
    found = {(r["module"], r["kind"], r["path"], r["call"], r["step"]): r for r in rows}
    assert len(found) == len(rows), "a record was made twice"
    return found


def assert_stats(row: dict, expected: torch.Tensor, where, rel: float = REL, abs_: float = ABS) -> None:
    assert row["shape"] is not None and tuple(row["shape"]) == tuple(expected.shape), where
    want = dict(zip(STAT_NAMES, tensor_stats(expected)))
    for name in STAT_NAMES:
        assert row[name] == pytest.approx(want[name], rel=rel, abs=abs_, nan_ok=True), (where, name)


# -- FSDP2 -----------------------------------------------------------------------------------------

def _spawn(fn, args: tuple, nprocs: int, timeout: float = 240.0) -> None:
    """``mp.spawn``, with a deadline: a rank stuck in a collective fails the test instead of hanging it."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=2):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            pytest.fail(f"the {nprocs} ranks did not finish within {timeout:.0f} s")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    missing = _fsdp_missing()
    if missing:
        pytest.skip(missing)
    from tests.integrations import _fsdp_worker
    from tests._workers import run_rank

    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "result.pt"
    _spawn(run_rank, (_fsdp_worker.train, 2, str(tmp / "init"), str(out)), nprocs=2)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single_process():
    """The same model, one process, the concatenated batch: plain PyTorch, and picklehooks' records."""
    from tests.integrations import _fsdp_worker as w

    batches = [w.global_batch(step, 2) for step in range(w.STEPS)]
    truth = reference(w.make_model(), batches, lambda y: y.pow(2).mean(), w.CAPTURE, lr=w.LR)
    model = w.make_model()
    picklehooks.instrument(model, capture=w.CAPTURE)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR)
    with picklehooks.record() as log:
        for x in batches:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            log.next_step()
    return truth, by_key(log.table())


def test_single_process_reference_agrees(single_process):
    """The yardstick itself: one process, instrumented, records what plain PyTorch computes."""
    truth, records = single_process
    assert set(records) == set(truth)
    for key, row in records.items():
        assert_stats(row, truth[key], key)


@pytest.mark.parametrize("when", ["before", "after", "checkpointed"])
def test_fsdp_two_ranks_match_one_process(fsdp_run, single_process, when):
    """Instrumented before or after fully_shard (and with activation checkpointing), each rank records
    what one process records on the whole batch: activations rank by rank, parameters and reduced
    gradients whole, once per step."""
    from tests.integrations._fsdp_worker import BATCH

    truth, single = single_process
    merged = fsdp_run[when]["merged"]
    assert {r["rank"] for r in merged} == {0, 1}
    for rank in (0, 1):
        records = by_key([r for r in merged if r["rank"] == rank])
        assert set(records) == set(single), rank  # the same records, each once (param_grad: once per step)
        for key, row in records.items():
            module, kind, path, call, step = key
            expected = truth[key]
            if kind in ("input", "output"):  # this rank's slice of the batch
                expected = expected[rank * BATCH:(rank + 1) * BATCH]
            elif kind == "grad_output":  # each rank's loss is the mean over its slice: 2x the slice's share
                expected = 2 * expected[rank * BATCH:(rank + 1) * BATCH]
            assert_stats(row, expected, (rank, key))


@pytest.mark.parametrize("when", ["before", "after", "checkpointed"])
def test_fsdp_param_grad_is_the_reduced_gradient(fsdp_run, when):
    """Merged, a param_grad record is the statistics of ``param.grad.full_tensor()``; with tensors kept,
    the reassembled tensor is that gradient, bit for bit. Before gather, each rank has its shard's."""
    run = fsdp_run[when]
    for row, tensor in zip(run["merged"], run["tensors"]):
        if row["kind"] != "param_grad":
            continue
        full = run["grads"][row["step"]][f"{row['module']}.{row['path']}"]
        assert_stats(row, full, row, rel=1e-9, abs_=1e-12)
        if when == "after":  # mode="both"
            assert tensor is not None and torch.equal(tensor, full)
    local = {(r["module"], r["path"]): tuple(r["shape"]) for r in run["local"] if r["kind"] == "param_grad"}
    assert local[("2", "weight")] == (2, 6) and local[("4", "bias")] == (1,)  # rank 0's shards


def test_dtensor_parameters_merge(fsdp_run):
    """Tensor parallelism: a module whose parameters are DTensors has them, and their gradients,
    recorded as shards; merged, each record describes the whole tensor."""
    run = fsdp_run["tp"]
    rows = [r for r in run["merged"] if r["kind"] in ("param", "param_grad")]
    assert sorted((r["rank"], r["kind"], r["path"]) for r in rows) == sorted(
        (rank, kind, path) for rank in (0, 1) for kind in ("param", "param_grad") for path in ("weight", "bias"))
    for row in rows:
        assert_stats(row, run["whole"][f"{row['kind']}:0.{row['path']}"], row, rel=1e-9, abs_=1e-12)


def test_fsdp_no_hook_warnings(fsdp_run):
    """Neither FSDP's checks nor anything else warned about hooks (nor picklehooks about anything),
    on any rank, in any of the runs."""
    for rank, messages in enumerate(fsdp_run["warnings"]):
        assert not [m for m in messages if "hook" in m.lower()], (rank, messages)


# -- merging shards (no processes needed) ----------------------------------------------------------

def _shard_rows(t: torch.Tensor, sizes: list[int]) -> list[tuple[int, dict]]:
    rows, start = [], 0
    for size in sizes:
        part = t[start:start + size]
        rows.append((part.numel(), dict(zip(STAT_NAMES, tensor_stats(part)))))
        start += size
    return rows


MERGE_CASES = {
    "normal": (torch.randn(10, 3, generator=torch.Generator().manual_seed(0)), [4, 4, 2]),
    "empty shard": (torch.randn(3, 2, generator=torch.Generator().manual_seed(1)), [2, 1, 0]),
    "mean >> std": (1e4 + torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), [5, 4]),
    "huge": (torch.tensor([1e300, -3e300, 2e300, 5e299], dtype=torch.float64), [1, 3]),
    "zeros": (torch.tensor([0.0, 1.0, 0.0, 0.0, -2.0, 0.0]), [3, 3]),
    "nan": (torch.tensor([1.0, float("nan"), 2.0, 3.0]), [2, 2]),
    "inf": (torch.tensor([1.0, float("inf"), -2.0, 3.0]), [2, 2]),
    "both infs": (torch.tensor([1.0, float("inf"), float("-inf"), 3.0]), [2, 2]),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merged_statistics_are_the_whole_tensors(case):
    """Chan's formula and friends: the statistics of the shards combine into those of the whole."""
    from picklehooks.integrations.distributed import _merge_stats

    t, sizes = MERGE_CASES[case]
    merged = _merge_stats(_shard_rows(t, sizes))
    want = dict(zip(STAT_NAMES, tensor_stats(t)))
    for name in STAT_NAMES:
        assert merged[name] == pytest.approx(want[name], rel=1e-12, abs=1e-300, nan_ok=True), name


def test_replicated_shards_merge_once():
    """On a 2 x 2 mesh (replicate x shard), each shard is recorded twice and counted once; tensors kept
    are put back together; a value missing a shard stays per shard."""
    from picklehooks.integrations.distributed import _Layout, _merge_shards

    t = torch.arange(12.0).reshape(4, 3)
    rows, tensors, layouts = [], [], []
    for rank in range(4):
        coord = rank % 2
        part = t[2 * coord:2 * coord + 2]
        layouts.append(_Layout((4, 3), (2, 3), (2 * coord, 0), (coord,), 2, (0, 1, 2, 3)))
        rows.append({"module": "fc", "kind": "param_grad", "path": "weight", "call": 0, "step": 0, "rank": rank,
                     "shape": [2, 3], **dict(zip(STAT_NAMES, tensor_stats(part)))})
        tensors.append(part.clone())
    rows.append({**rows[0], "path": "bias"})  # its other shard is missing
    tensors.append(None)
    layouts.append(layouts[0])
    assert _merge_shards(rows, tensors, layouts) == {("fc", "param_grad", "bias")}
    for row, tensor in zip(rows[:4], tensors[:4]):
        assert_stats(row, t, row, rel=1e-12, abs_=0)
        assert torch.equal(tensor, t)
    assert rows[4]["shape"] == [2, 3]


# -- activation checkpointing ----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)
        self.act = act  # shared by every block: called once per block, in different checkpointed segments

    def forward(self, x):
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.act = nn.Tanh()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8, self.act), Block(8, self.act)])
        self.head = nn.Linear(8, 2)
        self.reentrant = reentrant  # None: no checkpointing

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _net(reentrant) -> Net:
    torch.manual_seed(0)
    return Net(reentrant)


CKPT_BATCHES = [torch.randn(5, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]


def _record(model: nn.Module, capture) -> dict:
    picklehooks.instrument(model, capture=capture)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with picklehooks.record() as log:
        for x in CKPT_BATCHES:
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
            log.next_step()
    return by_key(log.table())


@pytest.mark.parametrize("capture", ["all", ("grad_input", "grad_output", "param_grad")],
                         ids=["all", "gradients-only"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_records_as_without(reentrant, capture):
    """A checkpointed forward, recomputed in backward, is recorded once, gradients included: the records
    are those of the same model without checkpointing, and plain PyTorch's values."""
    truth = reference(_net(None), CKPT_BATCHES, lambda y: y.pow(2).sum(), capture)
    plain = _record(_net(None), capture)
    checkpointed = _record(_net(reentrant), capture)
    assert set(plain) == set(truth)
    assert set(checkpointed) == set(plain)
    for key, row in checkpointed.items():
        assert_stats(row, truth[key], key)
        assert_stats(plain[key], truth[key], key)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_recompute_is_silent_not_blind(reentrant):
    """During the recomputation nothing is recorded, yet the recorded gradients are exact: the shared
    module's gradients pair with their own forward calls."""
    model = _net(reentrant)
    picklehooks.instrument(model, capture=("output", "grad_output"))
    x = CKPT_BATCHES[0]
    with picklehooks.record() as log:
        y = model(x)
        before = len(log.records)
        y.pow(2).sum().backward()
    grads = [r for r in log.records[before:]]
    assert {r.kind for r in grads} == {"grad_output"}  # backward (with its recomputation) added gradients only
    assert sorted(r.call for r in grads if r.module == "act") == [0, 1]
