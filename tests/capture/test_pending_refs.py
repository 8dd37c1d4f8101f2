"""The device path keeps recorded values by reference until it reduces them (#38 item 3).

On the CPU with the native pass switched off (the path a GPU takes), a value is kept with its
version counter and laid out for the batch's reduction only when read, or when the pending bytes
reach the budget. A value changed in place between the two is never reported with its later value:
the first step copies every site's values and learns which sites a later operator changes
(BatchNorm's output before ``ReLU(inplace=True)``, a block's output before ``+= residual``); a site
learned as safe that changes later loses that record (``stats`` is ``None``, with a warning) and is
copied from then on. Ground truth: plain PyTorch hooks on an un-instrumented copy, cloned in float64
when the hook runs.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import picklehooks
import picklehooks.capture.pending as pending
from picklehooks.capture.log import STAT_NAMES, held
from tests.capture.test_pending_arena import Emit, check, values
from tests.capture.test_stats_faithful import reference
from tests.testutils import plain_stats, use_pytorch_stats


@pytest.fixture
def device_path(monkeypatch):
    """The PyTorch fallback, with nothing learned about any site yet; counts the batches laid out by reference."""
    use_pytorch_stats(monkeypatch)
    monkeypatch.setattr(pending, "_SITES", {})
    laid_out = []
    real = pending._lay_out
    monkeypatch.setattr(pending, "_lay_out", lambda pieces: laid_out.append(len(pieces)) or real(pieces))
    return laid_out


def test_statistics_by_reference_match_float64(device_path):
    """Every shape and dtype of the arena tests, three steps: the first copies (learning), the later
    ones keep the values by reference; each record is its own tensor's statistics in float64, and
    each step lays out one batch per dtype."""
    model, tensors = Emit(), values()
    picklehooks.instrument(model, capture="output")
    for step in range(3):
        device_path.clear()
        with picklehooks.record() as log:
            model(tensors)
        assert len(log.records) == len(tensors)
        for i, (rec, t) in enumerate(zip(log.records, tensors)):
            check(rec.stats, reference(t), (step, i, t.dtype, tuple(t.shape)))
        assert len(device_path) == len({t.dtype for t in tensors if t.numel()})
        assert pending._SITES == {("emit", "output", ""): True}  # learned at the first step's read


class _Block(nn.Module):
    """A ResNet basic block: BatchNorm then ReLU(inplace=True), twice, and an in-place residual add."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _plain_truth(model: nn.Module) -> dict:
    """(module, kind, call) -> the value's float64 clone when its hook ran: plain PyTorch forward
    pre-hooks and hooks, and a tensor hook on each output for its gradient (registered before any in-place change, so it
    sees the gradient of the value the module returned)."""
    seen: dict = {}
    calls: dict = {}

    def pre(name):
        def hook(module, args):
            seen[(name, "input", calls.get(name, -1) + 1)] = args[0].detach().double().clone()
        return hook

    def forward(name):
        def hook(module, args, output):
            call = calls[name] = calls.get(name, -1) + 1
            seen[(name, "output", call)] = output.detach().double().clone()
            output.register_hook(lambda g: seen.__setitem__((name, "grad_output", call), g.detach().double().clone()))
        return hook

    for name, module in model.named_children():
        module.register_forward_pre_hook(pre(name))
        module.register_forward_hook(forward(name))
    seen["_calls"] = calls
    return seen


def test_values_changed_in_place_keep_the_statistics_they_had_when_recorded(device_path):
    """A ResNet block (BatchNorm outputs changed by ReLU(inplace=True), a block output by ``+=``), three
    training steps: every record is the value as it was when recorded; nothing is lost."""
    model = _Block()
    plain = copy.deepcopy(model)
    truth = _plain_truth(plain)
    picklehooks.instrument(model, capture=("input", "output", "grad_output"))
    for step in range(3):
        x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(step))
        truth["_calls"].clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a lost record warns
            with picklehooks.record() as log:
                model(x.clone()).sum().backward()
            got = {(r.module, r.kind, r.call): r.stats for r in log.records}
        plain(x.clone()).sum().backward()
        want = {k: v for k, v in truth.items() if k != "_calls"}
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for key, value in want.items():
            assert got[key] is not None, (step, key)
            expected = plain_stats(value)
            for name in STAT_NAMES:
                assert got[key][name] == pytest.approx(expected[name], rel=1e-9, abs=1e-12), (step, key, name)
    assert pending._SITES[("bn1", "output", "")] is False and pending._SITES[("bn2", "output", "")] is False
    assert pending._SITES[("conv1", "output", "")] is True
    assert device_path, "later steps keep the unchanged sites' values by reference"


class _SometimesChanged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.change = False

    def forward(self, x):
        h = self.lin(x)
        if self.change:
            with torch.no_grad():
                h.mul_(100)  # after lin's output was recorded
        return h


def test_a_site_learned_safe_that_changes_later_loses_that_record_flagged_then_copies(device_path):
    """Data-dependent code changes a value only from the third step: that step's record has no
    statistics and reading warns (never the later value's statistics); the next step copies it."""
    model = _SometimesChanged()
    picklehooks.instrument(model, capture="output", modules=["lin"])
    x = torch.randn(4, 3)
    want = plain_stats(model.lin(x))
    results = []
    for change in (False, False, True, True):
        model.change = change
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with picklehooks.record() as log:
                model(x)
            stats = log.records[0].stats
        lost = [w for w in caught if "changed in place" in str(w.message) and "(lin output)" in str(w.message)]
        if stats is None:
            assert lost and change, "only the step where the learned-safe value changed is lost"
        else:
            assert not lost
            assert stats["mean"] == pytest.approx(want["mean"], rel=1e-9) and stats["norm"] == pytest.approx(
                want["norm"], rel=1e-9)
        results.append(stats is None)
    # Learned safe from the first step; the third changes it (lost, flagged); the fourth copies it.
    assert results == [False, False, True, False], results
    assert pending._SITES[("lin", "output", "")] is False


def test_a_record_pickled_before_it_is_read_keeps_whether_its_value_changed(device_path):
    model = _SometimesChanged()
    picklehooks.instrument(model, capture="output", modules=["lin"])
    x = torch.randn(4, 3)
    for _ in range(2):  # learn: kept by reference from now on
        with picklehooks.record() as log:
            model(x)
        log.records[0].stats  # noqa: B018 -- the read the learning happens at
    want = plain_stats(model.lin(x))
    with picklehooks.record() as log:
        model(x)
    unchanged = pickle.loads(pickle.dumps(log.records[0]))
    assert unchanged.stats["norm"] == pytest.approx(want["norm"], rel=1e-9)
    model.change = True
    with picklehooks.record() as log:
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert pickle.loads(pickle.dumps(log.records[0])).stats is None


def test_values_kept_by_reference_stay_within_the_budget(device_path, monkeypatch):
    """With PENDING_BYTES at 1 MiB, the values kept by reference never pass half of it (the other
    half is the buffer their reduction lays them out in); in the first step, which clones each value
    and watches the original, the two never pass two thirds; a value of an eighth of it or more is
    reduced alone when recorded, and kept by nothing; statistics stay exact."""
    monkeypatch.setattr(pending, "PENDING_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1 << 14, generator=g) for _ in range(24)]  # 64 KiB each
    tensors[5] = torch.randn(1 << 15, generator=g)  # 128 KiB: reduced alone
    peak = []

    class Watch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emit = nn.Identity()

        def forward(self, values, log=None):
            for v in values:
                self.emit(v)
                if log is not None:
                    peak.append(sum(t.nbytes for t in held(log).copies))

    model = Watch()
    picklehooks.instrument(model, capture="output", modules=["emit"])
    with picklehooks.record() as log:
        model(tensors, log)
    assert max(peak) <= (1 << 20) * 2 // 3, max(peak)
    assert all(t is not tensors[5] for t in held(log).copies)
    for rec, t in zip(log.records, tensors):  # the read learns
        check(rec.stats, reference(t), tuple(t.shape))
    peak.clear()
    with picklehooks.record() as log:
        model(tensors, log)
        assert device_path, "kept by reference"
    assert max(peak) <= (1 << 20) // 2, max(peak)
    for rec, t in zip(log.records, tensors):
        check(rec.stats, reference(t), tuple(t.shape))


def test_values_made_under_inference_mode_are_copied(device_path):
    """An inference tensor has no version counter to watch: its values are copied when recorded,
    every step, and recording under ``torch.inference_mode()`` works as under ``no_grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    picklehooks.instrument(model, capture="output")
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            want = plain_stats(model[0](x))  # before the in-place ReLU changes it
        with picklehooks.record() as log:
            with torch.inference_mode():
                model(x)
        got = {r.module: r.stats for r in log.records}
        assert got["0"]["mean"] == pytest.approx(want["mean"], rel=1e-9), step
    assert ("0", "output", "") not in pending._SITES
