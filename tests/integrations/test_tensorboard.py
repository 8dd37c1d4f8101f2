"""Log.to_tensorboard(): the event files it writes, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

import picklehooks  # noqa: E402
from picklehooks.integrations import tensorboard as pt  # noqa: E402

STATS = ("mean", "std", "norm", "n_nan")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(seed: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def log():
    """Two steps of an instrumented MLP (mode="both"): one pass in step 0, two passes in step 1."""
    model = mlp()
    handle = picklehooks.instrument(model, capture=("output", "grad_output"), mode="both")
    try:
        with picklehooks.record() as log:
            model(batch(1)).sum().backward()
            log.next_step()
            model(batch(2)).sum().backward()
            model(batch(3)).pow(2).sum().backward()
    finally:
        handle.remove()
    return log


def tag_of(log, rec, step=None) -> str:
    """The tag prefix the docs promise, derived from the records: /call<k> for the k-th call in a step."""
    at = rec.step if step is None else step
    earlier = [r for r in log.records if (r.module, r.kind, r.path) == (rec.module, rec.kind, rec.path)
               and (r.step if step is None else step) == at and r.call < rec.call]
    parts = ["picklehooks", rec.module or "(root)", rec.kind, *([rec.path] if rec.path else [])]
    if earlier:
        parts.append(f"call{len(earlier)}")
    return "/".join(parts)


def write_and_read(log, log_dir, **kwargs) -> tuple[int, EventAccumulator]:
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        written = log.to_tensorboard(writer, **kwargs)
    finally:
        writer.close()
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, HISTOGRAMS: 0})
    events.Reload()
    return written, events


def f32(value: float) -> float:
    """``value`` as TensorBoard stores it: a float32."""
    return torch.tensor(float(value), dtype=torch.float32).item()


class TestScalars:
    def test_tags_are_the_expected_set(self, log, tmp_path):
        """The scalar tags are exactly module/kind[/path][/call<k>]/{mean,std,norm,nan} of every record."""
        _, events = write_and_read(log, tmp_path)
        expected = {f"{tag_of(log, r)}/{s}" for r in log.records for s in STATS}
        assert set(events.Tags()[SCALARS]) == expected
        assert "picklehooks/0/output/call1/mean" in expected  # step 1 calls each module twice
        assert "picklehooks/0/grad_output/mean" in expected

    def test_values_match_the_records_at_their_steps(self, log, tmp_path):
        """Each scalar is the record's statistic (as float32) at the record's step, one point per record."""
        _, events = write_and_read(log, tmp_path)
        for rec in log.records:
            for stat in STATS:
                points = events.Scalars(f"{tag_of(log, rec)}/{stat}")
                at_step = [p.value for p in points if p.step == rec.step]
                assert at_step == [f32(rec.stats[stat])], (rec.key, stat)
        assert {p.step for p in events.Scalars("picklehooks/2/output/mean")} == {0, 1}
        assert [p.step for p in events.Scalars("picklehooks/2/output/call1/mean")] == [1]

    def test_nan_counts_and_nonfinite_values(self, tmp_path):
        """A tensor holding NaN gets its NaN count as a scalar, NaN mean, and a histogram of its finite values."""
        class Plant(nn.Module):
            def forward(self, x):
                y = x.clone()
                y[0, 0] = math.nan
                y[1, 1] = math.inf
                return y

        model = nn.Sequential(Plant())
        with picklehooks.instrument(model, capture="output", mode="both"), picklehooks.record() as log:
            model(batch(4))
        _, events = write_and_read(log, tmp_path)
        assert [p.value for p in events.Scalars("picklehooks/0/output/n_nan")] == [1.0]
        assert math.isnan(events.Scalars("picklehooks/0/output/mean")[0].value)
        hist = events.Histograms("picklehooks/0/output")[0].histogram_value
        assert hist.num == 5 * 4 - 2


class TestHistograms:
    def test_one_histogram_per_tensor_record(self, log, tmp_path):
        """Every record with a tensor has a histogram under its tag prefix, at its step."""
        _, events = write_and_read(log, tmp_path)
        assert all(r.tensor is not None for r in log.records)
        assert set(events.Tags()[HISTOGRAMS]) == {tag_of(log, r) for r in log.records}
        for rec in log.records:
            assert [h.step for h in events.Histograms(tag_of(log, rec)) if h.step == rec.step] == [rec.step]

    def test_num_sum_min_max_match_the_tensor(self, log, tmp_path):
        """A histogram's num, sum, min, max and sum of squares are the recorded tensor's."""
        _, events = write_and_read(log, tmp_path)
        for rec in log.records:
            (hist,) = [h.histogram_value for h in events.Histograms(tag_of(log, rec)) if h.step == rec.step]
            t = rec.tensor.to(torch.float64)
            assert hist.num == t.numel()
            assert hist.sum == pytest.approx(t.sum().item(), rel=1e-12, abs=1e-12)
            assert hist.sum_squares == pytest.approx(t.square().sum().item(), rel=1e-12)
            assert (hist.min, hist.max) == (t.min().item(), t.max().item())
            assert sum(hist.bucket) == t.numel()

    def test_empty_huge_bf16_complex_and_bool_tensors(self, tmp_path):
        """Empty and all-NaN tensors get no histogram; values beyond ±1e20, bf16, complex and bool get one each."""
        class Odd(nn.Module):
            def forward(self, x):
                return (x[:0], x * 1e25, x.to(torch.bfloat16), torch.complex(x, -x), torch.full_like(x, math.nan),
                        x > 0)

        model = nn.Sequential(Odd())
        with picklehooks.instrument(model, capture="output", mode="both"), picklehooks.record() as log:
            model(batch(6))
        written, events = write_and_read(log, tmp_path)
        assert written == len(STATS) * 6 + 4
        assert set(events.Tags()[HISTOGRAMS]) == {f"picklehooks/0/output/{p}" for p in "1235"}
        for path, rec in zip("1235", [log.records[i] for i in (1, 2, 3, 5)]):
            hist = events.Histograms(f"picklehooks/0/output/{path}")[0].histogram_value
            t = rec.tensor.abs() if rec.tensor.is_complex() else rec.tensor
            t = t.to(torch.float64)
            assert (hist.num, sum(hist.bucket)) == (t.numel(), t.numel()), path
            assert (hist.min, hist.max) == (t.min().item(), t.max().item()), path

    def test_histograms_false_writes_scalars_only(self, log, tmp_path):
        """histograms=False writes no histogram and counts only the scalars."""
        written, events = write_and_read(log, tmp_path, histograms=False)
        assert events.Tags()[HISTOGRAMS] == []
        assert written == len(STATS) * len(log.records)

    def test_stats_mode_writes_no_histograms(self, tmp_path):
        """mode="stats" keeps no tensors, so only scalars are written."""
        model = mlp()
        with picklehooks.instrument(model, mode="stats"), picklehooks.record() as log:
            model(batch(1)).sum().backward()
        written, events = write_and_read(log, tmp_path)
        assert events.Tags()[HISTOGRAMS] == []
        assert written == len(STATS) * len(log.records) == len(events.Tags()[SCALARS])


class TestReturnAndWriter:
    def test_returns_the_number_of_values_written(self, log, tmp_path):
        """The count is one per scalar plus one per histogram, and matches what the file holds."""
        written, events = write_and_read(log, tmp_path)
        assert written == (len(STATS) + 1) * len(log.records)
        stored = sum(len(events.Scalars(t)) for t in events.Tags()[SCALARS])
        stored += sum(len(events.Histograms(t)) for t in events.Tags()[HISTOGRAMS])
        assert stored == written

    def test_any_object_with_add_scalar_and_add_histogram(self, log):
        """A duck-typed writer gets the same calls: (tag, value, step)."""
        class Recorder:
            def __init__(self):
                self.scalars, self.histograms = [], []

            def add_scalar(self, tag, value, step):
                self.scalars.append((tag, value, step))

            def add_histogram(self, tag, values, step):
                self.histograms.append((tag, values, step))

        w = Recorder()
        assert pt.write(log, w) == len(w.scalars) + len(w.histograms)
        rec = log.records[0]
        assert (f"{tag_of(log, rec)}/mean", rec.stats["mean"], rec.step) in w.scalars

    def test_directory_opens_and_closes_a_writer(self, log, tmp_path):
        """A directory instead of a writer: write() opens a SummaryWriter there and closes it."""
        written = log.to_tensorboard(tmp_path / "run")
        events = EventAccumulator(str(tmp_path / "run"), size_guidance={SCALARS: 0, HISTOGRAMS: 0})
        events.Reload()
        assert written == (len(STATS) + 1) * len(log.records)
        assert len(events.Tags()[SCALARS]) == len(STATS) * len({tag_of(log, r) for r in log.records})

    def test_bad_writer_and_step(self, log):
        """A writer without add_scalar, or a non-int step, is refused with PicklehooksError."""
        with pytest.raises(picklehooks.PicklehooksError, match="add_scalar"):
            log.to_tensorboard(object())
        with pytest.raises(picklehooks.PicklehooksError, match="step="):
            log.to_tensorboard(object(), step=1.5)

    def test_root_module_is_named_root(self, tmp_path):
        """The model itself (module "") is tagged (root); a tuple output's parts get /<path>."""
        class Pair(nn.Module):
            def forward(self, x):
                return x + 1, x * 2

        model = Pair()
        with picklehooks.instrument(model, modules=[""], capture="output"), picklehooks.record() as log:
            model(batch(5))
        _, events = write_and_read(log, tmp_path)
        assert set(events.Tags()[SCALARS]) == {f"picklehooks/(root)/output/{p}/{s}" for p in "01" for s in STATS}


class TestRanks:
    def test_merged_ranks_get_a_rank_segment(self, log, tmp_path):
        """A log merging two ranks (as distributed.gather() returns) tags each rank's series /rank<r>."""
        rows = [{**row, "rank": rank} for rank in (0, 1) for row in log.table()]
        merged = picklehooks.Log.from_rows(rows, [r.tensor for r in log.records] * 2)
        _, events = write_and_read(merged, tmp_path)
        expected = set()
        for rank in (0, 1):
            for rec in log.records:
                parts = tag_of(log, rec).split("/")
                expected.add("/".join([*parts[:2], f"rank{rank}", *parts[2:]]))
        assert set(events.Tags()[HISTOGRAMS]) == expected
        assert "picklehooks/0/rank1/output/call1" in expected

    def test_one_rank_gets_no_rank_segment(self, log, tmp_path):
        """Records all from one rank (each rank writing its own log) keep the plain tags."""
        one = picklehooks.Log.from_rows([{**row, "rank": 3} for row in log.table()])
        _, events = write_and_read(one, tmp_path)
        assert set(events.Tags()[SCALARS]) == {f"{tag_of(log, r)}/{s}" for r in log.records for s in STATS}


class TestStepOverride:
    def test_every_value_at_the_given_step(self, log, tmp_path):
        """step=7 puts every record at step 7; same-step calls are numbered across the log's steps."""
        _, events = write_and_read(log, tmp_path, step=7)
        expected = {f"{tag_of(log, r, step=7)}/{s}" for r in log.records for s in STATS}
        assert set(events.Tags()[SCALARS]) == expected
        assert "picklehooks/0/output/call2/mean" in expected  # one call in step 0, two in step 1
        for rec in log.records:
            for stat in STATS:
                points = events.Scalars(f"{tag_of(log, rec, step=7)}/{stat}")
                assert [(p.step, p.value) for p in points] == [(7, f32(rec.stats[stat]))]
        for tag in events.Tags()[HISTOGRAMS]:
            assert [h.step for h in events.Histograms(tag)] == [7]

    def test_step_zero_is_not_none(self, log, tmp_path):
        """step=0 overrides too (it is not treated as "use the records' steps")."""
        _, events = write_and_read(log, tmp_path, step=0)
        assert {p.step for t in events.Tags()[SCALARS] for p in events.Scalars(t)} == {0}


class TestWithoutTensorboard:
    def test_directory_without_tensorboard_says_what_to_install(self, log, tmp_path, monkeypatch):
        """With torch.utils.tensorboard unimportable, a directory writer raises PicklehooksError naming the extra."""
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
        with pytest.raises(picklehooks.PicklehooksError) as info:
            log.to_tensorboard(tmp_path)
        assert "pip install 'picklehooks[tensorboard]'" in str(info.value)
        assert not any(tmp_path.iterdir())

    def test_import_picklehooks_never_imports_tensorboard(self):
        """import picklehooks (and picklehooks.tensorboard) works with tensorboard blocked, and loads none of it."""
        code = textwrap.dedent("""
            import sys
            sys.modules["tensorboard"] = None
            sys.modules["torch.utils.tensorboard"] = None
            import picklehooks, picklehooks.tensorboard
            loaded = [m for m in sys.modules if m.startswith("tensorboard") or m.startswith("torch.utils.tensorboard")]
            assert all(sys.modules[m] is None for m in loaded), loaded
            log = picklehooks.Log()
            try:
                log.to_tensorboard("unused-dir")
            except picklehooks.PicklehooksError as exc:
                assert "picklehooks[tensorboard]" in str(exc)
            else:
                raise AssertionError("no error")
            print("ok")
        """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "ok"
