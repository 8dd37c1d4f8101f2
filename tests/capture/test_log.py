"""instrument() + record(): what gets recorded, its statistics, call/step numbering, tables and files."""

from __future__ import annotations

import copy
import gc
import json
import math
import weakref
from unittest import mock

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture.log import STAT_NAMES, held
from tests.testutils import plain_stats

TABLE_KEYS = ["module", "kind", "path", "call", "step", "shape", "dtype", "value", "source", "note", *STAT_NAMES]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def inputs(seed: int = 1, shape=(5, 4)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def same_float(a, b) -> bool:
    """Equal, counting NaN as equal to NaN."""
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


class PlantNonFinite(nn.Module):
    """Copies its input and writes NaN and ±Inf at known positions."""

    NAN_AT = [(0, 0), (1, 2), (4, 7)]
    INF_AT = [(0, 1), (2, 3)]
    NEG_INF_AT = [(3, 5)]

    def forward(self, x):
        y = x.clone()
        for i, j in self.NAN_AT:
            y[i, j] = math.nan
        for i, j in self.INF_AT:
            y[i, j] = math.inf
        for i, j in self.NEG_INF_AT:
            y[i, j] = -math.inf
        return y


class CalledTwice(nn.Module):
    """Applies the same Linear twice in one forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6)))
        self.decoder = nn.Sequential(nn.Linear(6, 2), nn.Tanh())

    def forward(self, x):
        return self.decoder(self.encoder(x))


class WithCount(nn.Module):
    """Returns a tensor and a plain int."""

    def forward(self, x):
        return x * 2, 3


@pytest.mark.usefixtures("stats_path")
class TestStats:
    def test_stats_match_torch(self):
        """Every output record's statistics equal the same statistics computed from its tensor."""
        model = mlp()
        picklehooks.instrument(model, capture=("output",), mode="both")
        with picklehooks.record() as log:
            model(inputs())
        assert [r.module for r in log.records] == ["0", "1", "2"]
        for rec in log.records:
            assert rec.tensor is not None and rec.stats is not None
            want = plain_stats(rec.tensor)
            for name in STAT_NAMES:
                # float32 tensors are reduced in float32 (see picklehooks._stats).
                assert rec.stats[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (rec.key, name)
            assert rec.stats["shape"] == tuple(rec.tensor.shape) == rec.shape
            assert rec.stats["dtype"] == "float32" == rec.dtype
            assert isinstance(rec.stats["n_nan"], int) and isinstance(rec.stats["n_inf"], int)

    def test_float64_stats_are_exact(self):
        """float64 tensors are reduced in float64: statistics agree with torch to 1e-12."""
        model = mlp().double()
        picklehooks.instrument(model, capture=("output",), mode="both")
        with picklehooks.record() as log:
            model(inputs().double())
        for rec in log.records:
            want = plain_stats(rec.tensor)
            for name in STAT_NAMES:
                assert rec.stats[name] == pytest.approx(want[name], rel=1e-12, abs=1e-12), (rec.key, name)

    def test_recorded_tensor_is_the_output(self):
        """The recorded tensors are the values the modules computed."""
        model, plain = mlp(), mlp()
        picklehooks.instrument(model, capture=("output",), mode="both")
        x = inputs()
        with picklehooks.record() as log:
            model(x)
        h0 = plain[0](x)
        h1 = plain[1](h0)
        for rec, want in zip(log.records, [h0, h1, plain[2](h1)]):
            assert torch.equal(rec.tensor, want)

    def test_std_is_population(self):
        """std uses correction=0, not Bessel's correction."""
        model = nn.Sequential(nn.Identity())
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert log.records[0].stats["std"] == pytest.approx(math.sqrt(1.25))

    def test_relu_zero_frac(self):
        """zero_frac counts exact zeros (ReLU output)."""
        model = mlp()
        picklehooks.instrument(model, modules=["1"], capture="output", mode="both")
        with picklehooks.record() as log:
            model(inputs())
        rec = log.records[0]
        assert 0 < rec.stats["zero_frac"] < 1
        assert rec.stats["zero_frac"] == (rec.tensor == 0).double().mean().item()

    def test_tensor_mode_has_no_stats(self):
        """mode='tensor' keeps tensors and no statistics."""
        model = mlp()
        picklehooks.instrument(model, capture=("output",), mode="tensor")
        with picklehooks.record() as log:
            model(inputs())
        assert len(log) == 3
        assert all(r.tensor is not None and r.stats is None for r in log.records)
        assert all(r.shape == tuple(r.tensor.shape) for r in log.records)

    def test_stats_mode_has_no_tensor(self):
        """mode='stats' (the default) keeps statistics and no tensors."""
        model = mlp()
        picklehooks.instrument(model, capture=("output",))
        with picklehooks.record() as log:
            model(inputs())
        assert len(log) == 3
        assert all(r.tensor is None and r.stats is not None for r in log.records)

    def test_reading_one_record_reads_all(self, stats_path):
        """Reading one record's stats brings every statistic of the log to the host in one go
        (none at all natively: those statistics were computed on the host, in the hooks)."""
        model = mlp()
        picklehooks.instrument(model, capture=("output", "grad_output"))
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        transfers = []
        real_cpu = torch.Tensor.cpu

        def counting_cpu(self, *args, **kwargs):
            transfers.append(self.shape)
            return real_cpu(self, *args, **kwargs)

        with mock.patch.object(torch.Tensor, "cpu", counting_cpu):
            assert log.records[-1].stats is not None
            assert all(r.stats is not None for r in log.records)
        assert len(transfers) == (0 if stats_path == "native" else 1), transfers

    def test_log_is_freed_without_the_garbage_collector(self, stats_path):
        """A dropped log frees its records and copies at once: no reference cycle holds them."""
        model = mlp()
        picklehooks.instrument(model, capture=("output", "grad_output"))
        gc.disable()
        try:
            with picklehooks.record() as log:
                model(inputs()).sum().backward()
            refs = [weakref.ref(log), weakref.ref(log.records[0])]
            if stats_path == "fallback":
                refs.append(weakref.ref(held(log).copies[0]))
            else:
                assert not held(log).copies  # statistics computed in the hooks: no copies
            del log
            assert [r() for r in refs] == [None] * len(refs)
        finally:
            gc.enable()

    def test_records_pickle_copy_and_weakref(self, stats_path):
        """Records travel through pickle (``distributed.gather`` sends them so), copy and
        ``dataclasses.replace`` with their statistics, read or not yet read, and take weak references."""
        import dataclasses
        import pickle

        model, plain = mlp(), mlp()
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(inputs())
        records = log.records
        outputs = []
        plain[0].register_forward_hook(lambda m, i, o: outputs.append(o.detach()))
        plain(inputs())
        unread = [pickle.loads(pickle.dumps(r)) for r in records]  # statistics not read yet
        for rec in records[1:]:
            rec.stats  # noqa: B018 -- read before copying
        copies = [pickle.loads(pickle.dumps(records[1])), copy.copy(records[2]),
                  dataclasses.replace(records[2], step=7)]
        for rec in [*unread, *copies]:
            original = records[[r.module for r in records].index(rec.module)]
            assert rec.key == original.key and rec.shape == original.shape and rec.dtype == original.dtype
            assert rec.stats == original.stats
        assert copies[2].step == 7 and records[2].step == 0
        want = plain_stats(outputs[0])
        for name in STAT_NAMES:
            assert unread[0].stats[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
        ref = weakref.ref(records[0])
        assert ref() is records[0]

    @pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
    def test_sparse_and_mkldnn_values_are_recorded_as_their_dense_values(self, stats_path, layout):
        """A module returning a sparse or mkldnn tensor records the statistics of the dense value it
        stands for (implicit zeros counted), and mode="tensor" keeps that dense value; the model's
        own output is untouched. (Recording one used to raise inside the hook.)"""
        convert = {"sparse_coo": torch.Tensor.to_sparse, "sparse_csr": torch.Tensor.to_sparse_csr,
                   "mkldnn": torch.Tensor.to_mkldnn}[layout]

        class Convert(nn.Module):
            def forward(self, x):
                return convert(x)

        x = torch.relu(inputs(shape=(6, 7)))
        for mode in ("stats", "tensor"):
            model = nn.Sequential(Convert())
            picklehooks.instrument(model, capture="output", mode=mode)
            with picklehooks.record() as log:
                out = model(x)
            assert out.layout == convert(x).layout and torch.equal(out.to_dense(), x)
            (rec,) = log.records
            assert rec.shape == (6, 7) and rec.dtype == "float32"
            if mode == "tensor":
                assert rec.tensor.layout == torch.strided and torch.equal(rec.tensor, x)
                continue
            want = plain_stats(x)
            for name in STAT_NAMES:
                assert rec.stats[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12), name

    def test_sparse_embedding_gradients_are_recorded(self, stats_path):
        """nn.Embedding(sparse=True) gives its weight a sparse gradient: param_grad records the dense
        gradient's statistics, as plain PyTorch computes them on an un-instrumented copy."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 3, sparse=True))
        plain = copy.deepcopy(model)
        picklehooks.instrument(model, capture=("output", "param_grad"))
        ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
        with picklehooks.record() as log:
            model(ids).pow(2).sum().backward()
        plain(ids).pow(2).sum().backward()
        assert model[0].weight.grad.is_sparse  # the model's own gradient stays sparse
        (rec,) = [r for r in log.records if r.kind == "param_grad"]
        want = plain_stats(plain[0].weight.grad.to_dense())
        assert rec.shape == (10, 3)
        for name in STAT_NAMES:
            assert rec.stats[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12), name

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_std_with_large_mean_and_huge_values(self, dtype):
        """Rows whose one-pass std is inaccurate (|mean| >> std) or overflowed get the exact std."""
        model = nn.Sequential(nn.Identity())
        picklehooks.instrument(model, capture="output", mode="both")
        torch.manual_seed(0)
        values = [1e4 + torch.randn(64, dtype=dtype), torch.full((64,), 0.1, dtype=dtype),
                  torch.randn(64, dtype=dtype) * 1e30, torch.randn(64, dtype=dtype)]
        with picklehooks.record() as log:
            for v in values:
                model(v)
        for rec, v in zip(log.records, values):
            want = v.double().std(correction=0).item()
            assert rec.stats["std"] == pytest.approx(want, rel=1e-5, abs=1e-6), rec.key
            assert rec.stats["mean"] == pytest.approx(v.double().mean().item(), rel=1e-5), rec.key
            assert rec.stats["norm"] == pytest.approx(v.double().norm().item(), rel=1e-5), rec.key


@pytest.mark.usefixtures("stats_path")
class TestBatchedReduction:
    """Records of one shape are reduced together; every path gives each record's own statistics."""

    @staticmethod
    def values() -> list[torch.Tensor]:
        torch.manual_seed(0)
        out = []
        for i in range(41):  # more rows than a first group holds, so groups fill and grow
            v = torch.randn(5, 8) * (i + 1)
            if i % 7 == 3:
                v[1, 2] = math.nan
            if i % 11 == 5:
                v[0, 0], v[2, 1] = math.inf, -math.inf
            if i % 13 == 6:
                v = v + 1e4  # |mean| >> std: the one-pass std is repaired
            if i % 5 == 0:
                v[v < 0] = 0
            out.append(v)
        return out

    @pytest.mark.parametrize("budget", [None, 5 * 8 * 4 * 3])  # default, or reduce (exactly) every 3 records
    def test_each_record_has_its_own_stats(self, budget, monkeypatch):
        if budget is not None:
            monkeypatch.setattr(picklehooks.capture.pending, "PENDING_BYTES", budget)
        model = nn.Sequential(nn.Identity())
        picklehooks.instrument(model, capture="output", mode="both")
        values = self.values()
        with picklehooks.record() as log:
            for v in values:
                model(v)
        assert len(log.records) == len(values)
        for rec, v in zip(log.records, values):
            assert torch.equal(rec.tensor.nan_to_num(), v.nan_to_num())
            want = plain_stats(v)
            for name in STAT_NAMES:
                got = rec.stats[name]
                assert same_float(got, want[name]) or got == pytest.approx(want[name], rel=1e-5, abs=1e-5), \
                    (rec.call, name, got, want[name])


@pytest.mark.usefixtures("stats_path")
class TestNonFinite:
    def test_nan_inf_counts(self):
        """nan and inf count exactly the planted NaN and ±Inf values."""
        model = nn.Sequential(nn.Linear(8, 8), PlantNonFinite(), nn.Linear(8, 2))
        picklehooks.instrument(model, capture="output", mode="both")
        with picklehooks.record() as log:
            model(inputs(shape=(5, 8)))
        planted = log.find(module="1", kind="output")[0]
        assert planted.stats["n_nan"] == len(PlantNonFinite.NAN_AT)
        assert planted.stats["n_inf"] == len(PlantNonFinite.INF_AT) + len(PlantNonFinite.NEG_INF_AT)
        assert planted.stats["n_nan"] == int(torch.isnan(planted.tensor).sum())
        clean = log.find(module="0", kind="output")[0]
        assert clean.stats["n_nan"] == 0 and clean.stats["n_inf"] == 0

    def test_counts_without_tensor(self):
        """Counts are exact in mode='stats' too, where no tensor is kept."""
        model = nn.Sequential(PlantNonFinite())
        picklehooks.instrument(model, capture="output", mode="stats")
        with picklehooks.record() as log:
            model(torch.ones(5, 8))
        stats = log.records[0].stats
        assert (stats["n_nan"], stats["n_inf"]) == (3, 3)
        assert stats["zero_frac"] == 0.0


@pytest.mark.usefixtures("stats_path")
class TestEmptyTensor:
    def test_empty_output(self):
        """An empty tensor has counts 0 and NaN statistics, and the other records' stats still read."""
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(torch.randn(0, 4))
            model(torch.randn(2, 4))
        stats = [r.stats for r in log.records]
        assert all(s is not None for s in stats)
        assert stats[0]["n_nan"] == stats[0]["n_inf"] == 0 and math.isnan(stats[0]["mean"])
        assert stats[0]["shape"] == (0, 4)
        assert not math.isnan(stats[2]["mean"])


class TestRecordingOff:
    def test_nothing_added_outside_record(self):
        """Running outside record() adds no records to an earlier log."""
        model = mlp()
        picklehooks.instrument(model, capture="all")
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        count = len(log)
        assert count > 0
        model(inputs()).sum().backward()
        assert len(log) == count
        with picklehooks.record() as other:
            pass
        assert len(other) == 0

    @pytest.mark.parametrize("recording", [False, True], ids=["off", "on"])
    def test_output_bit_identical(self, recording):
        """Instrumentation does not change the output, recording or not."""
        plain = mlp()
        model = copy.deepcopy(plain)
        picklehooks.instrument(model, capture="all", mode="both")
        x = inputs()
        if recording:
            with picklehooks.record():
                got = model(x)
        else:
            got = model(x)
        assert torch.equal(got, plain(x))

    @pytest.mark.parametrize("recording", [False, True], ids=["off", "on"])
    def test_grads_bit_identical(self, recording):
        """Parameter gradients after backward are the same with and without instrumentation."""
        plain = mlp()
        model = copy.deepcopy(plain)
        picklehooks.instrument(model, capture="all", mode="both")
        x = inputs()
        plain(x).pow(2).sum().backward()
        if recording:
            with picklehooks.record():
                model(x).pow(2).sum().backward()
        else:
            model(x).pow(2).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad), name


class TestRemove:
    def test_remove_restores_hooks(self):
        """remove() leaves exactly the hooks that were there before, user hooks included."""
        model = mlp()
        calls = []
        model[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
        model[2].register_forward_pre_hook(lambda m, i: calls.append("pre"))
        before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
        handle = picklehooks.instrument(model, capture="all")
        assert any(dict(m._forward_hooks) != before[n][0] for n, m in model.named_modules())
        handle.remove()
        after = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
        assert after == before
        model(inputs())
        assert calls == ["fwd", "pre"]

    def test_remove_drops_name_attribute(self):
        """remove() deletes every module's _picklehooks_name."""
        model = mlp()
        handle = picklehooks.instrument(model)
        assert all(hasattr(model[i], "_picklehooks_name") for i in range(3))
        handle.remove()
        assert not any(hasattr(m, "_picklehooks_name") for m in model.modules())
        assert handle.modules == {}

    def test_no_records_after_remove(self):
        """Recording after remove() yields no records."""
        model = mlp()
        handle = picklehooks.instrument(model, capture=("input", "output", "grad_input", "grad_output", "param"))
        handle.remove()
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        assert log.records == []

    def test_context_manager_removes(self):
        """Using the handle as a context manager removes it on exit; the model can be instrumented again."""
        model = mlp()
        with picklehooks.instrument(model):
            pass
        assert not any(m._forward_hooks for m in model.modules())
        picklehooks.instrument(model)


    def test_no_param_grad_after_remove(self):
        """After remove(), a recorded backward yields no param_grad records."""
        model = mlp()
        handle = picklehooks.instrument(model, capture="param_grad")
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        assert len(log) == 4
        handle.remove()
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        assert log.records == []

    def test_reinstrument_with_other_mode(self):
        """After remove(), instrumenting again with another mode applies to param_grad too."""
        model = mlp()
        handle = picklehooks.instrument(model, capture="param_grad", mode="stats")
        with picklehooks.record():
            model(inputs()).sum().backward()
        handle.remove()
        picklehooks.instrument(model, capture="param_grad", mode="tensor")
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        assert len(log) == 4
        assert all(r.tensor is not None and r.stats is None for r in log.records)


class TestLiveValues:
    def test_param_and_grad_records_are_snapshots(self):
        """Recorded parameters and gradients keep their values after optimizer.step() and another backward."""
        model = mlp()
        picklehooks.instrument(model, capture=("param", "param_grad"), mode="tensor")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        weight = log.find(module="0", kind="param", path="weight")[0].tensor
        grad = log.find(module="0", kind="param_grad", path="weight")[0].tensor
        saved_weight, saved_grad = weight.clone(), grad.clone()
        assert torch.equal(grad, model[0].weight.grad)
        opt.step()
        model(inputs()).sum().backward()  # accumulates into .grad in place
        assert torch.equal(weight, saved_weight) and torch.equal(grad, saved_grad)
        assert not torch.equal(model[0].weight, saved_weight)

    def test_param_capture_adds_no_input_grad(self):
        """Capturing parameters does not make a module's input require grad (no extra grad_input)."""
        model = mlp()
        picklehooks.instrument(model, capture=("param", "input", "grad_input"))
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        assert log.find(module="0", kind="grad_input") == []
        assert len(log.find(module="2", kind="grad_input")) == 1


class TestCallNumbering:
    def test_runtime_of_earlier_archives_still_pairs_gradients(self):
        """The hook runtime an earlier version copied into a torch.package archive calls
        ``log._note_call(module, kind, path)``; its gradients still pair, latest call first."""
        from picklehooks._ops import GRAD, TENSOR

        log = picklehooks.Log()
        for _ in range(2):
            log._note_call("m", "output", "")  # forward calls whose values aren't recorded
        for g in (torch.ones(2), torch.zeros(2)):
            log._add_tensor("m", "grad_output", "", g, GRAD | TENSOR)
        assert [(r.call, r.tensor.sum().item()) for r in log.records] == [(1, 2.0), (0, 0.0)]

    def test_outputs_numbered_in_order(self):
        """A module called twice records call 0 then call 1."""
        model = CalledTwice()
        picklehooks.instrument(model, capture="output", mode="both")
        with picklehooks.record() as log:
            model(inputs())
        assert [(r.module, r.call) for r in log.records] == [("lin", 0), ("lin", 1)]
        assert not torch.equal(log.records[0].tensor, log.records[1].tensor)

    def test_grad_output_maps_to_call(self):
        """grad_output of call k is the gradient of call k's output (checked with autograd.grad)."""
        torch.manual_seed(0)
        plain = CalledTwice()
        model = copy.deepcopy(plain)
        picklehooks.instrument(model, capture=("output", "grad_output"), mode="both")
        x = inputs()
        weight = torch.arange(20, dtype=torch.float32).reshape(5, 4)
        with picklehooks.record() as log:
            (model(x) * weight).sum().backward()

        h0 = plain.lin(x)
        h1 = plain.lin(torch.tanh(h0))
        g0, g1 = torch.autograd.grad((h1 * weight).sum(), [h0, h1])
        assert not torch.allclose(g0, g1)

        outs = {r.call: r for r in log.find(module="lin", kind="output")}
        grads = {r.call: r for r in log.find(module="lin", kind="grad_output")}
        assert sorted(outs) == sorted(grads) == [0, 1]
        assert torch.equal(outs[0].tensor, h0) and torch.equal(outs[1].tensor, h1)
        torch.testing.assert_close(grads[0].tensor, g0, rtol=0, atol=0)
        torch.testing.assert_close(grads[1].tensor, g1, rtol=0, atol=0)
        # backward runs in reverse: the gradient of call 1 is recorded first
        assert [r.call for r in log.find(module="lin", kind="grad_output")] == [1, 0]

    def test_training_loop_grad_calls(self):
        """In a loop of forward+backward recorded into one log, each gradient has its own forward's call."""
        model = mlp()
        picklehooks.instrument(model, modules=["2"], capture=("output", "grad_output"))
        with picklehooks.record() as log:
            for _ in range(3):
                model(inputs()).sum().backward()
                log.next_step()
        assert [(r.kind, r.step, r.call) for r in log.records] == [
            ("output", 0, 0), ("grad_output", 0, 0),
            ("output", 1, 1), ("grad_output", 1, 1),
            ("output", 2, 2), ("grad_output", 2, 2),
        ]

    def test_calls_count_across_forwards_in_one_log(self):
        """Two forwards in one log number the calls 0 and 1."""
        model = mlp()
        picklehooks.instrument(model, modules=["0"], capture="output")
        with picklehooks.record() as log:
            model(inputs())
            model(inputs())
        assert [r.call for r in log.records] == [0, 1]


class TestStep:
    def test_next_step(self):
        """next_step() changes the step of records made after it."""
        model = mlp()
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(inputs())
            assert log.next_step() == 1
            model(inputs())
        assert [r.step for r in log.records] == [0, 0, 0, 1, 1, 1]
        assert log.step == 1

    def test_record_step_argument(self):
        """record(step=5) starts the log at step 5."""
        model = mlp()
        picklehooks.instrument(model, capture=("output", "grad_output"))
        with picklehooks.record(step=5) as log:
            model(inputs()).sum().backward()
            log.next_step()
            model(inputs())
        assert {r.step for r in log.records[:6]} == {5}
        assert {r.step for r in log.records[6:]} == {6}
        assert log.table()[0]["step"] == 5

    def test_record_into_existing_log(self):
        """record(log=...) appends to an existing log."""
        model = mlp()
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(inputs())
        log.next_step()
        with picklehooks.record(log=log) as same:
            model(inputs())
        assert same is log and len(log) == 6 and log.records[-1].step == 1


class TestTable:
    def test_table_keys(self):
        """table() is one dict per record with the documented keys."""
        model = mlp()
        picklehooks.instrument(model, capture="all")
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        table = log.table()
        assert isinstance(table, list) and len(table) == len(log)
        for row, rec in zip(table, log.records):
            assert list(row) == TABLE_KEYS
            assert (row["module"], row["kind"], row["path"], row["call"]) == rec.key
            assert row["shape"] == list(rec.shape)
            assert row["mean"] == rec.stats["mean"] and row["n_nan"] == rec.stats["n_nan"]

    def test_table_without_stats(self):
        """Rows of tensor-only records have None statistics."""
        model = mlp()
        picklehooks.instrument(model, capture="output", mode="tensor")
        with picklehooks.record() as log:
            model(inputs())
        assert all(row[name] is None for row in log.table() for name in STAT_NAMES)

    def test_to_pandas(self):
        """to_pandas() gives a DataFrame with the table's rows and columns."""
        pd = pytest.importorskip("pandas")
        model = mlp()
        picklehooks.instrument(model, capture=("output", "grad_output"))
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
        frame = log.to_pandas()
        assert isinstance(frame, pd.DataFrame)
        assert len(frame) == len(log) and list(frame.columns) == TABLE_KEYS
        assert frame["mean"].iloc[0] == pytest.approx(log.records[0].stats["mean"])


class TestSaveLoad:
    @pytest.fixture
    def log(self):
        model = mlp()
        capture = ("input", "output", "grad_input", "grad_output")  # "param": see test_save_params_twice
        picklehooks.instrument(model, capture=capture, mode="both")
        with picklehooks.record() as log:
            model(inputs()).sum().backward()
            log.next_step()
            model(inputs())
        return log

    def test_records_json_is_plain_json(self, log, tmp_path):
        """records.json loads with the json module and holds the statistics."""
        log.save(tmp_path / "log")
        with open(tmp_path / "log" / "records.json") as f:
            document = json.load(f)
        assert document["format"] == "picklehooks-log"
        assert document["step"] == 1
        assert len(document["records"]) == len(log)
        first = document["records"][0]
        assert first["module"] == log.records[0].module
        assert first["mean"] == log.records[0].stats["mean"]
        assert first["shape"] == list(log.records[0].shape)

    def test_tensors_file(self, log, tmp_path):
        """tensors.safetensors holds every kept tensor, keyed by record index."""
        safetensors_torch = pytest.importorskip("safetensors.torch")
        log.save(tmp_path / "log")
        tensors = safetensors_torch.load_file(str(tmp_path / "log" / "tensors.safetensors"))
        assert sorted(tensors, key=int) == [str(i) for i in range(len(log))]
        for i, rec in enumerate(log.records):
            assert torch.equal(tensors[str(i)], rec.tensor)

    def test_round_trip(self, log, tmp_path):
        """Log.load gives back equal fields, statistics and tensors."""
        pytest.importorskip("safetensors")
        log.save(tmp_path / "log")
        loaded = picklehooks.Log.load(tmp_path / "log")
        assert isinstance(loaded, picklehooks.Log)
        assert loaded.step == log.step and len(loaded) == len(log)
        for a, b in zip(log.records, loaded.records):
            assert (a.module, a.kind, a.path, a.call, a.step) == (b.module, b.kind, b.path, b.call, b.step)
            assert (a.shape, a.dtype, a.value) == (b.shape, b.dtype, b.value)
            assert a.stats == b.stats
            assert torch.equal(a.tensor, b.tensor) and a.tensor.dtype == b.tensor.dtype
        assert loaded.table() == log.table()

    def test_round_trip_non_finite_and_values(self, tmp_path):
        """NaN/Inf statistics and non-tensor values survive save/load (stats mode, no tensor file)."""
        model = nn.Sequential(PlantNonFinite(), WithCount())
        picklehooks.instrument(model, capture="output")
        with picklehooks.record() as log:
            model(torch.ones(5, 8))
        log.save(tmp_path)
        assert not (tmp_path / "tensors.safetensors").exists()
        loaded = picklehooks.Log.load(tmp_path)
        for a, b in zip(log.table(), loaded.table()):
            assert a.keys() == b.keys()
            assert all(same_float(a[k], b[k]) for k in a), (a, b)
        assert loaded.find(module="1", path="1")[0].value == "3"
        assert loaded.records[0].stats["n_nan"] == 3

    def test_save_params_twice(self, tmp_path):
        """A log holding the same parameter at two steps saves and loads (each record its own value)."""
        model = mlp()
        picklehooks.instrument(model, capture="param", mode="tensor")
        with picklehooks.record() as log:
            model(inputs())
            log.next_step()
            with torch.no_grad():
                model[0].weight.add_(1.0)
            model(inputs())
        log.save(tmp_path)
        loaded = picklehooks.Log.load(tmp_path)
        first, second = (r.tensor for r in loaded.find(module="0", path="weight"))
        torch.testing.assert_close(second, first + 1.0)

    def test_save_same_tensor_recorded_twice(self, tmp_path):
        """A tensor recorded under several records (self-attention's query, key and value) saves and loads."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, batch_first=True, dropout=0.0))
        picklehooks.instrument(model, modules=nn.MultiheadAttention, capture="input", mode="tensor")
        with picklehooks.record() as log:
            model(torch.randn(2, 5, 16))
        assert [r.path for r in log.records if r.tensor is not None] == ["0", "1", "2"]  # (+ keyword non-tensors)
        log.save(tmp_path)
        loaded = picklehooks.Log.load(tmp_path)
        assert len(loaded) == len(log)
        for a, b in zip(log.records, loaded.records):
            assert (a.tensor is None) == (b.tensor is None)
            if a.tensor is not None:
                assert torch.equal(a.tensor, b.tensor)

    def test_load_non_log_directory(self, tmp_path):
        """Loading a directory without records.json raises PicklehooksError naming it."""
        with pytest.raises(picklehooks.PicklehooksError) as info:
            picklehooks.Log.load(tmp_path)
        assert str(tmp_path) in str(info.value)

    def test_load_foreign_json(self, tmp_path):
        """A records.json of another format raises PicklehooksError naming the directory."""
        (tmp_path / "records.json").write_text(json.dumps({"records": []}))
        with pytest.raises(picklehooks.PicklehooksError) as info:
            picklehooks.Log.load(tmp_path)
        assert str(tmp_path) in str(info.value)


class TestBadInput:
    def test_bad_capture(self):
        """An unknown capture kind is named in the error."""
        with pytest.raises(picklehooks.PicklehooksError, match="bogus"):
            picklehooks.instrument(mlp(), capture=["bogus"])

    def test_bad_mode(self):
        """An unknown mode is named in the error."""
        with pytest.raises(picklehooks.PicklehooksError, match="mode='x'"):
            picklehooks.instrument(mlp(), mode="x")

    def test_bad_depth(self):
        """A negative depth is named in the error."""
        with pytest.raises(picklehooks.PicklehooksError, match="-1"):
            picklehooks.instrument(mlp(), depth=-1)

    def test_pattern_matching_nothing(self):
        """A pattern that chooses no module is named in the error."""
        with pytest.raises(picklehooks.PicklehooksError, match=r"nomatch\*"):
            picklehooks.instrument(mlp(), modules=["nomatch*"])

    def test_not_a_module(self):
        """instrument() of a non-module names its type."""
        with pytest.raises(picklehooks.PicklehooksError, match="function"):
            picklehooks.instrument(lambda x: x)

    def test_example_inputs_not_a_tuple(self):
        """example_inputs must be a tuple of arguments."""
        with pytest.raises(picklehooks.PicklehooksError, match="example_inputs"):
            picklehooks.instrument(mlp(), example_inputs=inputs())

    def test_instrument_twice(self):
        """Instrumenting the same module twice raises and leaves the first instrumentation working."""
        model = mlp()
        picklehooks.instrument(model, capture="output")
        hooks_before = [dict(m._forward_hooks) for m in model]
        with pytest.raises(picklehooks.PicklehooksError, match="already instrumented"):
            picklehooks.instrument(model, modules=["2"], capture="input")
        assert [dict(m._forward_hooks) for m in model] == hooks_before
        with picklehooks.record() as log:
            model(inputs())
        assert len(log) == 3


class TestSelection:
    def test_glob(self):
        """A glob chooses the modules whose qualified names match it."""
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, modules="encoder.*", capture="output")
        assert sorted(handle.modules) == ["encoder.0", "encoder.1", "encoder.2", "encoder.2.0"]
        with picklehooks.record() as log:
            model(inputs())
        assert {r.module for r in log.records} == set(handle.modules)

    def test_several_patterns(self):
        """Several patterns choose the union of their matches."""
        model = EncoderDecoder()  # held: a handle holds its model weakly
        handle = picklehooks.instrument(model, modules=["encoder", "decoder.1"])
        assert sorted(handle.modules) == ["decoder.1", "encoder"]

    def test_root_only_when_named(self):
        """The root is never chosen by default, and is chosen by the pattern ''."""
        model = EncoderDecoder()  # held: a handle holds its model weakly
        assert "" not in picklehooks.instrument(model).modules
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, modules=[""], capture="output")
        assert list(handle.modules) == [""]
        with picklehooks.record() as log:
            model(inputs())
        assert [r.module for r in log.records] == [""]

    def test_type(self):
        """A module type chooses every module of that type."""
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, modules=nn.Linear, capture="output")
        assert sorted(handle.modules) == ["decoder.0", "encoder.0", "encoder.2.0"]

    def test_type_and_glob(self):
        """Types and globs mix."""
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, modules=[nn.Tanh, "encoder.1"])
        assert sorted(handle.modules) == ["decoder.1", "encoder.1"]

    def test_depth(self):
        """depth=1 chooses the root's children only."""
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, depth=1, capture="output")
        assert sorted(handle.modules) == ["decoder", "encoder"]
        with picklehooks.record() as log:
            model(inputs())
        assert [r.module for r in log.records] == ["encoder", "decoder"]

    def test_depth_with_pattern(self):
        """depth limits what a pattern chooses."""
        model = EncoderDecoder()
        handle = picklehooks.instrument(model, modules=nn.Linear, depth=2)
        assert sorted(handle.modules) == ["decoder.0", "encoder.0"]


class TestNonTensorValues:
    @pytest.mark.parametrize("observe", [False, True], ids=["plain", "example_inputs"])
    def test_int_in_output(self, observe):
        """A non-tensor value in an output is recorded by repr, with no stats or tensor."""
        model = nn.Sequential(nn.Linear(4, 4), WithCount())
        kwargs = {"example_inputs": (inputs(),)} if observe else {}
        picklehooks.instrument(model, modules=["1"], capture="output", mode="both", **kwargs)
        with picklehooks.record() as log:
            out, count = model(inputs())
        assert count == 3
        assert [r.path for r in log.records] == ["0", "1"]
        tensor_rec, value_rec = log.records
        assert torch.equal(tensor_rec.tensor, out) and tensor_rec.value is None
        assert tensor_rec.stats["mean"] == pytest.approx(out.double().mean().item())
        assert value_rec.value == "3"
        assert value_rec.stats is None and value_rec.tensor is None and value_rec.shape is None
        assert log.table()[1]["value"] == "3" and log.table()[1]["mean"] is None


class TestExampleForward:
    def test_example_forward_leaves_model_unchanged(self):
        """The observation forward restores BatchNorm buffers and doesn't consume the RNG."""
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(8, 4) * 5 + 3
        torch.manual_seed(123)
        expected_next = torch.rand(3)
        torch.manual_seed(123)
        picklehooks.instrument(model, example_inputs=(x,))
        assert torch.equal(torch.rand(3), expected_next)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)

    def test_failing_example_forward_is_explained(self):
        """A bad example input gets a PicklehooksError naming the failure, and no hooks stay behind."""
        model = nn.Sequential(nn.Linear(4, 4))
        with pytest.raises(picklehooks.PicklehooksError, match="example forward failed"):
            picklehooks.instrument(model, example_inputs=(torch.randn(2, 7),))
        assert not model[0]._forward_hooks and "_picklehooks_name" not in model[0].__dict__


class TestVjp:
    def test_vjp_matches_autograd_jacobian(self):
        """log.vjp between two recorded layers equals v^T J from torch.autograd.functional.jacobian."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        picklehooks.instrument(model, capture=("output",))
        x = torch.randn(1, 3)
        with picklehooks.record(keep_graph=True) as log:
            model(x)
        v = torch.tensor([[1.0, -2.0]])
        got = log.vjp("2", "0", v)
        h = model[0](x).detach()
        jac = torch.autograd.functional.jacobian(lambda t: model[2](model[1](t)), h)  # (1,2,1,4)
        want = torch.einsum("bo,boci->ci", v, jac)
        torch.testing.assert_close(got, want)

    def test_vjp_needs_keep_graph_and_known_names(self):
        """Without keep_graph, or with a name that matches nothing, vjp says what to do."""
        model = mlp()
        picklehooks.instrument(model, capture=("output",))
        with picklehooks.record() as log:
            model(inputs())
        with pytest.raises(picklehooks.PicklehooksError, match="keep_graph=True"):
            log.vjp("2", "0")
        with pytest.raises(picklehooks.PicklehooksError, match="names 0 records"):
            log.vjp("nope", "0")


class Transposes(nn.Module):
    def forward(self, x):
        return x.t()  # a non-contiguous view of its input


@pytest.mark.parametrize("mode", ["tensor", "both"])
def test_kept_tensors_are_contiguous_detached_copies(mode):
    """What ``mode="tensor"`` keeps is a plain, contiguous, detached copy: a transposed view, a
    value that requires grad and a frozen parameter alike; later in-place changes don't reach it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), Transposes())
    model[0].bias.requires_grad_(False)
    picklehooks.instrument(model, capture=("output", "param"), mode=mode)
    x = torch.randn(2, 4)
    with picklehooks.record() as log:
        out = model(x)
    want = {("1", "output", ""): out.detach().clone(), ("0", "output", ""): model[0](x).detach(),
            ("0", "param", "weight"): model[0].weight.detach().clone(), ("0", "param", "bias"): model[0].bias.clone()}
    with torch.no_grad():
        out.mul_(0)
        model[0].bias.zero_()
    got = {r.key[:3]: r.tensor for r in log.records}
    assert got.keys() == want.keys()
    for key, tensor in got.items():
        assert type(tensor) is torch.Tensor and tensor.is_contiguous() and not tensor.requires_grad, key
        torch.testing.assert_close(tensor, want[key], rtol=0, atol=0)


def test_statistics_computed_on_a_device_are_read_with_the_rest():
    """What a compiled graph on a GPU hands the log (``_Pending.add_table``): kept on the device until
    the first read, which brings them over with the batched statistics (here on the CPU)."""
    from picklehooks.capture.pending import _Pending, _read_pending

    pending = _Pending()
    first = torch.arange(9, dtype=torch.float64)
    copied = torch.randn(4, 5)
    group_a = pending.add_table(first.clone())
    group_b, _ = pending.add(copied)
    group_c = pending.add_table(first * 2)
    assert group_a.rows is None and group_c.rows is None  # nothing read yet
    assert _read_pending((pending, group_a, 0)) == first.tolist()
    assert _read_pending((pending, group_c, 0)) == (first * 2).tolist()
    stats = dict(zip(STAT_NAMES, _read_pending((pending, group_b, 0))))
    assert stats["mean"] == pytest.approx(copied.double().mean().item(), rel=1e-9)
