"""A compiled graph hands its records to the log in one call per run, in program order (#38 item 2).

picklehooks.capture.batching merges the graph's ``record``/``record_stats`` ops into one
``record_batch`` op after Inductor's post-grad passes. What is checked here: the code Inductor
generates holds the merged op and no single record op; the records equal an un-instrumented eager
copy's values (plain PyTorch hooks, ground truth) in count, order of calls and statistics; runs are
cut at the byte budget and at other effect ops; a graph that checks for NaN/Inf keeps one op per
record; a pass the user set stays; a fresh process batches its first graph; a training step pairs
each gradient with its call; on the device path
(``PICKLEHOOKS_NATIVE=0``) a batch's values are not copied, even where a later in-place op changes
them. Values on the CPU join batches only where ``CPU_VALUES`` says (the ``cpu_values`` fixture:
the merging is the same for every device, and this machine has only a CPU).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import picklehooks
from picklehooks.capture import batching
from tests.capture.test_compiled_idle import _SharedOnTwoBranches
from tests.testutils import plain_stats


class Branches(nn.Module):
    """One module called on three independent branches (Inductor may run them in any order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(4, 6), nn.Linear(4, 7)
        self.emit = nn.Identity()

    def forward(self, x):
        ys = [self.emit(lin(x).to(torch.bfloat16)) for lin in (self.a, self.b, self.c)]
        return sum(y.float().sum() for y in ys)


@pytest.fixture
def cpu_values(monkeypatch):
    monkeypatch.setattr(batching, "CPU_VALUES", True)


def _plain_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each module's outputs in call order, from plain forward hooks on an un-instrumented copy."""
    plain, seen = copy.deepcopy(model), {}
    for name, module in plain.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, []).append(out.detach().clone()))
    with torch.no_grad():
        plain(x)
    return seen


def _compiled_records(model: nn.Module, x: torch.Tensor):
    picklehooks.instrument(model, capture="output")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with picklehooks.record() as log, torch.no_grad():
        _, (code,) = run_and_get_code(compiled, x)
    return log, code


def _assert_matches_plain(log, want: dict[str, list[torch.Tensor]]) -> None:
    got: dict[str, list] = {}
    for r in sorted(log.records, key=lambda r: (r.module, r.call)):
        got.setdefault(r.module, []).append(r)
    assert sorted(got) == sorted(want)
    for name, records in got.items():
        assert [r.call for r in records] == list(range(len(want[name])))
        for r, value in zip(records, want[name]):
            assert r.shape == tuple(value.shape), (name, r.call)
            ref = plain_stats(value)
            assert r.stats["mean"] == pytest.approx(ref["mean"], rel=1e-3, abs=1e-3), (name, r.call)
            assert r.stats["absmax"] == pytest.approx(ref["absmax"], rel=1e-3), (name, r.call)


@pytest.mark.parametrize("in_graph", [False, True], ids=["kernel", "graph"])
def test_one_call_for_the_graph_and_calls_in_program_order(in_graph, monkeypatch, cpu_values):
    monkeypatch.setattr(picklehooks._taps, "_GRAPH_STATS_ON_CPU", in_graph)
    model, x = Branches(), torch.randn(3, 4)
    want = _plain_outputs(model, x)
    log, code = _compiled_records(model, x)
    assert code.count("picklehooks.record_batch.default(") == 1
    assert "picklehooks.record.default(" not in code and "picklehooks.record_stats.default(" not in code
    _assert_matches_plain(log, want)
    emits = sorted((r for r in log.records if r.module == "emit"), key=lambda r: r.call)
    assert [r.shape for r in emits] == [(3, 5), (3, 6), (3, 7)]  # told apart by shape: the program's order


def test_runs_are_cut_at_the_budget(monkeypatch, cpu_values):
    """Values that would hold more than the budget alive go to more than one call, still in order."""
    # Bytes: a's output 60 and emit's 30, b's 72 and 36, c's 84 and 42: three runs of two.
    monkeypatch.setattr(batching, "BUDGET", 130)
    model, x = Branches(), torch.randn(3, 4)
    want = _plain_outputs(model, x)
    log, code = _compiled_records(model, x)
    assert code.count("picklehooks.record_batch.default(") == 3
    assert "picklehooks.record.default(" not in code
    _assert_matches_plain(log, want)


class StateBetween(nn.Module):
    """A module whose parameters are recorded (``record_state``) between two modules' outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.third(self.second(self.first(x)))


def test_other_effects_keep_their_places(cpu_values):
    """A ``record_state`` op (parameters) ends a run: the parameters' record sits where eager puts it."""
    model, x = StateBetween(), torch.randn(2, 4)
    eager = copy.deepcopy(model)
    picklehooks.instrument(eager, capture=("output", "param"))
    with picklehooks.record() as want, torch.no_grad():
        eager(x)
    picklehooks.instrument(model, capture=("output", "param"))
    torch._dynamo.reset()
    with picklehooks.record() as log, torch.no_grad():
        _, (code,) = run_and_get_code(torch.compile(model, fullgraph=True), x)
    assert "picklehooks.record_state.default(" in code
    assert [(r.module, r.kind, r.path, r.call) for r in log.records] == \
        [(r.module, r.kind, r.path, r.call) for r in want.records]
    for got, ref in zip(log.records, want.records):
        assert got.stats["mean"] == pytest.approx(ref.stats["mean"], rel=1e-5, abs=1e-6)


def test_a_graph_that_checks_for_nonfinite_values_keeps_one_op_per_record(cpu_values):
    """on_nonfinite='raise' raises mid-graph: the records made before the bad value are kept."""
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bad, self.after = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4)

        def forward(self, x):
            return self.after(self.bad(self.lin(x) / 0.0))

    model = Bad()
    picklehooks.instrument(model, capture="output", on_nonfinite="raise")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with picklehooks.record() as log, torch.no_grad():
        with pytest.raises(picklehooks.NonfiniteError):
            compiled(torch.ones(2, 4))
    assert [r.module for r in log.records][:1] == ["lin"]


def test_a_pass_the_user_set_stays_and_runs_first(cpu_values):
    seen: list[int] = []

    def user_pass(graph: torch.fx.Graph) -> None:
        seen.append(sum(1 for n in graph.nodes if "record" in str(n.args[1:2]) and "with_effects" in str(n.target)))

    model, x = Branches(), torch.randn(3, 4)
    want = _plain_outputs(model, x)
    with inductor_config.patch(post_grad_custom_post_pass=user_pass):  # (put back as it was after)
        batching.install()
        assert inductor_config.post_grad_custom_post_pass == [user_pass, batching.PASS]
        log, code = _compiled_records(model, x)
    assert seen == [len(log.records)]  # it saw every record op, before they were merged
    assert code.count("picklehooks.record_batch.default(") == 1
    _assert_matches_plain(log, want)


def test_a_fresh_process_batches_from_its_first_graph(tmp_path):
    """A process that imports picklehooks and compiles an instrumented model: the pass is set up
    while the first graph is traced (nothing compiled before it), and that graph batches. (Inductor
    in torch 2.13 caches no graph with effect ops, so no process reads another's compiled graph.)"""
    script = textwrap.dedent("""
        import torch, picklehooks
        from picklehooks.capture import batching
        from torch._inductor.utils import run_and_get_code
        batching.CPU_VALUES = True
        from tests.capture.test_compiled_batching import Branches, _plain_outputs, _assert_matches_plain
        model, x = Branches(), torch.randn(3, 4)
        want = _plain_outputs(model, x)
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log, torch.no_grad():
            _, (code,) = run_and_get_code(torch.compile(model, fullgraph=True), x)
        _assert_matches_plain(log, want)
        print(code.count("picklehooks.record_batch.default("), code.count("picklehooks.record.default("))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["1", "0"]


def test_by_default_cpu_values_keep_their_ops_and_graph_statistics_are_batched(monkeypatch):
    """CPU_VALUES off (the default): a CPU value's record op stays where the graph made it (the native
    pass reads it in cache), the statistics a graph computed (float32, graph statistics) join a batch."""
    class Float(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.b(self.a(x))

    x = torch.randn(3, 4)
    for in_graph, batches, records in ((False, 0, 2), (True, 1, 0)):
        monkeypatch.setattr(picklehooks._taps, "_GRAPH_STATS_ON_CPU", in_graph)
        model = Float()
        want = _plain_outputs(model, x)
        log, code = _compiled_records(model, x)
        assert code.count("picklehooks.record_batch.default(") == batches, in_graph
        assert code.count("picklehooks.record.default(") == records, in_graph
        _assert_matches_plain(log, want)


def test_lent_statistics_are_stacked_once_and_kept_as_they_were():
    """_Pending's loan (what record_batch's kernel opens): statistics tensors handed over during it are
    one table when it ends, stacked then, so a graph reusing their buffers afterwards changes no record."""
    from picklehooks.capture.pending import _Pending, _read_pending, _PendingRow

    pending = _Pending()
    buffers = [torch.arange(9, dtype=torch.float64) + 10 * i for i in range(3)]
    pending.lend()
    rows = [_PendingRow((pending, *pending.add_graph_stats(b))) for b in buffers]
    pending.give_back()
    assert len({id(r[1]) for r in rows}) == 1 and [r[2] for r in rows] == [0, 1, 2]  # one table, three rows
    want = [b.tolist() for b in buffers]
    for b in buffers:
        b.fill_(-1.0)  # the graph's next values
    assert [_read_pending(r) for r in rows] == want
    (one,) = [_PendingRow((pending, *pending.add_graph_stats(buffers[0])))]  # not lent: a copy of its own
    buffers[0].fill_(7.0)
    assert _read_pending(one) == [-1.0] * 9


_LENT = textwrap.dedent("""
    import copy
    import torch, picklehooks
    from torch import nn
    from picklehooks.capture import batching
    assert not picklehooks._native.AVAILABLE  # PICKLEHOOKS_NATIVE=0: the device path, on the CPU
    batching.CPU_VALUES = True
    picklehooks._taps._GRAPH_STATS_ON_CPU = False  # values go to the record op's kernel, batched on their device

    class Block(nn.Module):  # BatchNorm then ReLU(inplace=True), and an in-place residual add
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv2(self.relu(self.bn(self.conv(x))))
            y += x
            return self.relu(y)

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()).eval(), torch.randn(2, 4, 8, 8)
    plain, want = copy.deepcopy(model), {}
    for name, module in plain.named_modules():
        if name:
            module.register_forward_hook(
                lambda m, a, out, name=name: want.setdefault(name, []).append(out.detach().double().clone()))
    with torch.no_grad():
        plain(x)
    clones = []
    for batched in (True, False):
        hooked = copy.deepcopy(model)
        picklehooks.instrument(hooked, capture="output")
        torch._dynamo.reset()
        batching.ENABLED = batched
        compiled = torch.compile(hooked, fullgraph=True)
        with torch.no_grad(), picklehooks.record():
            compiled(x)
        with torch.no_grad(), picklehooks.record() as log:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                compiled(x)
                log.records[-1].stats
        clones.append(sum(1 for e in prof.events() if e.name == "aten::clone"))
        assert sorted((r.module, r.call) for r in log.records) == sorted(
            (name, call) for name, values in want.items() for call in range(len(values)))
        for r in log.records:
            v = want[r.module][r.call]
            for stat, ref in (("mean", v.mean()), ("std", v.std(unbiased=False)), ("absmax", v.abs().max()),
                              ("zero_frac", (v == 0).double().mean())):
                assert abs(r.stats[stat] - ref.item()) <= 1e-5 * max(1.0, abs(ref.item())), (batched, r.module, stat)
    print(*clones)
""")


def test_a_batch_keeps_device_values_by_reference_and_reads_them_before_they_change(tmp_path):
    """On the device path a compiled graph's record op copies its value (Inductor reuses buffers once
    the op returns); a batch's kernel keeps them by reference and reduces them before it returns:
    fewer copies, and the statistics of each value as the program made it, though ReLU(inplace=True)
    and ``+=`` change them later in the graph (ground truth: plain hooks on an eager copy)."""
    env = {**os.environ, "PICKLEHOOKS_NATIVE": "0", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", _LENT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    batched, per_op = map(int, run.stdout.split()[-2:])
    assert batched < per_op, (batched, per_op)


def test_a_training_step_pairs_each_gradient_with_its_call(cpu_values):
    """Forward+backward of a module called on two branches, its forward records batched: every
    output and output gradient equals what plain hooks see on an un-instrumented copy, call by call
    (gradients find their call by the site the merged kernel notes, as one op per record did)."""
    model, x = _SharedOnTwoBranches(), torch.randn(2, 3)
    plain, outs, grads = copy.deepcopy(model), {}, {}
    for name, module in plain.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, o, name=name: outs.setdefault(name, []).append(o.detach().clone()))
            module.register_full_backward_hook(
                lambda m, gi, go, name=name: grads.setdefault(name, []).insert(0, go[0].detach().clone()))
    plain(x).sum().backward()
    picklehooks.instrument(model)  # outputs and their gradients
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with picklehooks.record() as log:
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    assert "picklehooks.record_batch.default(" in codes[0]
    for kind, want in (("output", outs), ("grad_output", grads)):
        got = sorted((r for r in log.records if r.kind == kind), key=lambda r: (r.module, r.call))
        assert [(r.module, r.call) for r in got] == [(m, c) for m in sorted(want) for c in range(len(want[m]))], kind
        for r in got:
            ref = plain_stats(want[r.module][r.call])
            assert r.stats["mean"] == pytest.approx(ref["mean"], rel=1e-5, abs=1e-6), (kind, r.module, r.call)
            assert r.stats["absmax"] == pytest.approx(ref["absmax"], rel=1e-5), (kind, r.module, r.call)
