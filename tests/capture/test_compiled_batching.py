"""A compiled graph hands its records to the log in one call per run, in program order (#38 item 2).

picklehooks.capture.batching merges the graph's ``record``/``record_stats`` ops into one
``record_batch`` op after Inductor's post-grad passes. What is checked here: the code Inductor
generates holds the merged op and no single record op; the records equal an un-instrumented eager
copy's values (plain PyTorch hooks, ground truth) in count, order of calls and statistics; runs are
cut at the byte budget and at other effect ops; a graph that checks for NaN/Inf keeps one op per
record; a pass the user set stays; a fresh process batches its first graph.
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
def test_one_call_for_the_graph_and_calls_in_program_order(in_graph, monkeypatch):
    monkeypatch.setattr(picklehooks._taps, "_GRAPH_STATS_ON_CPU", in_graph)
    model, x = Branches(), torch.randn(3, 4)
    want = _plain_outputs(model, x)
    log, code = _compiled_records(model, x)
    assert code.count("picklehooks.record_batch.default(") == 1
    assert "picklehooks.record.default(" not in code and "picklehooks.record_stats.default(" not in code
    _assert_matches_plain(log, want)
    emits = sorted((r for r in log.records if r.module == "emit"), key=lambda r: r.call)
    assert [r.shape for r in emits] == [(3, 5), (3, 6), (3, 7)]  # told apart by shape: the program's order


def test_runs_are_cut_at_the_budget(monkeypatch):
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


def test_other_effects_keep_their_places():
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


def test_a_graph_that_checks_for_nonfinite_values_keeps_one_op_per_record():
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


def test_a_pass_the_user_set_stays_and_runs_first(monkeypatch):
    seen: list[int] = []

    def user_pass(graph: torch.fx.Graph) -> None:
        seen.append(sum(1 for n in graph.nodes if "record" in str(n.args[1:2]) and "with_effects" in str(n.target)))

    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", user_pass)
    batching.install()
    assert inductor_config.post_grad_custom_post_pass == [user_pass, batching.PASS]
    model, x = Branches(), torch.randn(3, 4)
    want = _plain_outputs(model, x)
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
        from torch._inductor.utils import run_and_get_code
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
