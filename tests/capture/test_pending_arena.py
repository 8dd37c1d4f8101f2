"""Batched statistics (the path a GPU takes): one arena per (device, dtype), a launch budget per record.

Records the native pass doesn't reduce in the hook are copied into an arena
and reduced when read (:mod:`picklehooks.capture.pending`,
:func:`picklehooks._stats.segment_stats`). Here the statistics of many
shapes and dtypes recorded in one log are held to plain PyTorch in float64
on the original tensors, and the kernels that recording and reading run are
counted: one per record plus a constant, however many shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import picklehooks
import picklehooks.capture.pending
from picklehooks.capture.log import STAT_NAMES
from tests.capture.test_stats_faithful import reference
from tests.testutils import run_fresh, use_pytorch_stats

F64 = torch.float64


class Emit(nn.Module):
    """Passes each given tensor through ``emit`` (an Identity), whose outputs are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Identity()

    def forward(self, values: list[torch.Tensor]) -> None:
        for v in values:
            self.emit(v)


def values() -> list[torch.Tensor]:
    """Tensors of many shapes and every kind of dtype, with the edge cases of each statistic."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    with_nan, with_inf, with_both, with_pos_inf = randn(7, 9), randn(300), randn(2, 200), randn(50)
    with_nan[2, 3] = math.nan
    with_inf[0], with_inf[299] = math.inf, -math.inf
    with_both[0, 0], with_both[1, 7] = math.nan, math.inf
    with_pos_inf[3] = math.inf
    big64 = torch.finfo(F64).max
    return [
        randn(5, 8),  # 40 values: a fraction of a chunk
        randn(256),  # exactly one chunk
        randn(1),  # one value
        randn(3, 1000) * 5,  # several chunks, the last one partly padding
        randn(512, 1031),  # large: several hundred thousand values
        with_nan, with_inf, with_both, with_pos_inf,
        randn(600) * 1e-2 + 1e4,  # |mean| >> std in float32
        randn(1000, dtype=F64) + 1e8,  # |mean| >> std in float64
        torch.relu(randn(100)),  # half zeros
        torch.zeros(17),  # std 0, all zeros
        torch.full((9,), -3.5),  # constant, negative: the padding's zeros are not its max
        randn(33, dtype=F64) * 1e300,  # float64 sums that overflow unscaled
        torch.full((64,), big64, dtype=F64),  # its norm is beyond float64: inf
        torch.tensor([big64, -big64, 1.0, 0.0], dtype=F64),
        randn(10, dtype=F64) * 1e-310,  # subnormal float64
        randn(300).half(),
        (randn(5, 70) * 100).bfloat16(),
        torch.tensor([math.nan, 1.0, -math.inf], dtype=torch.float16),
        torch.randint(-1000, 1000, (123,), generator=g),
        torch.randint(-100, 100, (4, 4), generator=g, dtype=torch.int8),
        torch.randint(0, 3, (300,), generator=g, dtype=torch.uint8),
        torch.rand(77, generator=g) > 0.3,
        randn(40, dtype=torch.complex64),
        randn(5, dtype=torch.complex128) * 1e300,
        torch.empty(0, 3),
        randn(6, 9).t(),  # not contiguous: copied into contiguous strides
        randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        randn(1, 7).expand(3, 7),  # a stride of 0
    ]


def check(got: dict, want: dict, what) -> None:
    slack = 1e-12 * want["absmax"] if math.isfinite(want["absmax"]) else 0.0
    for name in STAT_NAMES:
        g, w = got[name], want[name]
        if name in ("n_nan", "n_inf"):
            assert g == w, (what, name, g, w)
        elif math.isnan(w) or math.isinf(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), (what, name, g, w)
        else:
            # Sums in another order than torch's: the same float64 values up to rounding.
            assert g == pytest.approx(w, rel=1e-9, abs=slack), (what, name, g, w)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("budget", [None, 4096], ids=["reduced-when-read", "reduced-while-recording"])
def test_statistics_match_float64(budget, device, monkeypatch):
    """One log of every shape and dtype: each record's statistics are those of its own tensor in
    float64, and its kept tensor is its value; with a small PENDING_BYTES the arenas are reduced
    while the log records (several reductions before the first read) and it's the same. On the
    CPU the native pass is switched off to take this path; a GPU takes it anyway, through the
    same hooks as in use (the C ones where built)."""
    if device == "cpu":
        use_pytorch_stats(monkeypatch)
    reductions = []
    real = picklehooks.capture.pending.segment_stats
    monkeypatch.setattr(picklehooks.capture.pending, "segment_stats",
                        lambda *args: reductions.append(1) or real(*args))
    if budget is not None:
        monkeypatch.setattr(picklehooks.capture.pending, "PENDING_BYTES", budget)
    model, tensors = Emit(), [t.to(device) for t in values()]
    picklehooks.instrument(model, capture="output", mode="both")
    with picklehooks.record() as log:
        model(tensors)
    before_read = len(reductions)
    assert (before_read > 3) if budget else (before_read == 0), before_read
    assert len(log.records) == len(tensors)
    for i, (rec, t) in enumerate(zip(log.records, tensors)):
        torch.testing.assert_close(rec.tensor, t, rtol=0, atol=0, equal_nan=True)
        # On its device: a complex value's magnitude is the one that device's torch computes in its dtype.
        check(rec.stats, reference(t), (i, t.dtype, tuple(t.shape)))


def test_a_budget_reduces_full_batches_before_a_value_and_leaves_small_ones_filling(monkeypatch):
    """Past PENDING_BYTES the log reduces before the value that would pass it (a batch started for
    that value would only be reduced at the next), and only batches holding a sixteenth
    of the budget or more: a few token ids recorded beside large activations are reduced once, when
    read, not at each reduction of the activations. The statistics stay those of each tensor."""
    use_pytorch_stats(monkeypatch)
    monkeypatch.setattr(picklehooks.capture.pending, "PENDING_BYTES", 1 << 20)
    reduced = []
    real = picklehooks.capture.pending.segment_stats
    monkeypatch.setattr(picklehooks.capture.pending, "segment_stats",
                        lambda data, segment, valid, sizes: reduced.append((data.dtype, len(sizes)))
                        or real(data, segment, valid, sizes))
    g = torch.Generator().manual_seed(0)
    tensors = []
    for _ in range(20):
        tensors += [torch.randn(1 << 14, generator=g), torch.randint(0, 50000, (8,), generator=g, dtype=torch.int32)]
    model = Emit()
    picklehooks.instrument(model, capture="output")
    monkeypatch.setattr(picklehooks.capture.pending, "_SITES", {})
    with picklehooks.record() as log:  # learns that nothing changes emit's outputs: kept by reference since
        model(tensors[:1])
    log.records[0].stats  # noqa: B018 -- the read
    reduced.clear()
    with picklehooks.record() as log:
        model(tensors)
        during = list(reduced)
    # 64 KiB of float32 each, counted twice (the value, and the buffer its reduction lays it out
    # in): 128 KiB. The ids: int32 padded to 256 values, 2 KiB each. Seven of each take 910 KiB, and
    # the eighth float would pass 1 MiB: seven floats are reduced, and again at the 15th. The ids'
    # batch (40 KiB at the end) stays under a sixteenth of it.
    assert during == [(torch.float32, 7)] * 2, during
    for i, (rec, t) in enumerate(zip(log.records, tensors)):
        check(rec.stats, reference(t), (i, t.dtype))
    assert sorted(reduced[len(during):], key=str) == [(torch.float32, 6), (torch.int32, 20)], reduced


# Kernel-launching operators that recording and reading run, counted in a fresh interpreter
# (PICKLEHOOKS_NATIVE is read at import). An operator counts if it launches a kernel by its
# schema (it returns a tensor that isn't a view of an input, or writes one; allocations don't)
# and no operator it calls does (so `where`, whose only children allocate, counts): the rule of
# bench/bench_launches.py, spelled out here so that the test doesn't import the bench.
KERNELS = """
import os
os.environ["PICKLEHOOKS_NATIVE"] = "0"
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
import picklehooks

assert not picklehooks._native.AVAILABLE

def launches(name):
    op = name.split("::", 1)[1]
    if op in ("empty", "empty_strided"):
        return False
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return True
    for overload in packet.overloads():
        for r in getattr(packet, overload)._schema.returns:
            if "Tensor" in str(r.type) and (r.alias_info is None or r.alias_info.is_write):
                return True
    return False

def launches_below(event):
    children = [c for c in event.cpu_children if c.name.startswith("aten::")]
    return any(launches(c.name) or launches_below(c) for c in children)

class Emit(nn.Module):
    def __init__(self):
        super().__init__()
        self.emit = nn.Identity()

    def forward(self, values):
        for v in values:
            self.emit(v)

def kernels(n, dtype):
    model = Emit()
    picklehooks.instrument(model, capture="output")
    values = [torch.randn(i + 1, 3).to(dtype) for i in range(n)]  # n distinct shapes

    def step():
        with picklehooks.record() as log:
            model(values)
            assert all(r.stats is not None for r in log.records) and len(log.records) == n

    step()  # the first log copies each value, and learns at its read that nothing changed them in place
    step()  # the second keeps them by reference, and caches the zeros that pad them
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in events if launches(e.name) and not launches_below(e))

for dtype in (torch.float32, torch.float64):
    print(kernels(40, dtype), kernels(80, dtype))
"""

#: Kernels a log's read costs per (device, dtype) at most, the log's own included: 50 for float32
#: and 73 for float64 when written (float64 is summed scaled, in a pass of its own).
READ_KERNELS = 80


def test_no_kernel_per_record_and_a_constant_per_read():
    """Once a step has shown that nothing changes the values in place, recording N tensors of N
    distinct shapes and reading them runs at most READ_KERNELS kernels per dtype, and 40 more
    shapes cost no more (a copy per record, as before references, cost 40 more kernels here; a
    reduction per shape, as before arenas, about 25 per shape: over 1000)."""
    counts = [tuple(map(int, line.split())) for line in run_fresh(KERNELS).strip().splitlines()]
    for fewer, more in counts:
        assert fewer <= READ_KERNELS, counts
        assert more == fewer, counts
