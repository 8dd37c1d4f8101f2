"""record(sink=dir): records streamed to Parquet parts, read back by pandas, pyarrow, DuckDB and Log.load."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

import picklehooks
import picklehooks.capture.log
from picklehooks.capture.log import held
from picklehooks.capture.log import STAT_NAMES

from tests.testutils import REPO, run_fresh

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TABLE = ["module", "kind", "path", "call", "step", "shape", "dtype", "value", "source", "note", *STAT_NAMES]
STEPS = 4


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def train(model: nn.Module, log: picklehooks.Log | None, steps: int = STEPS) -> None:
    """Forward, backward and an SGD step per step, so every step's values differ."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if log is not None:
            log.next_step()


def recorded(sink=None, *, steps: int = STEPS, mode: str = "stats", capture=("output", "grad_output"), **kwargs):
    """A fresh instrumented mlp trained ``steps`` steps inside record(); its log."""
    model = mlp()
    picklehooks.instrument(model, capture=capture, mode=mode)
    with picklehooks.record(sink=sink, **kwargs) as log:
        train(model, log, steps)
    return log


def plain_outputs(steps: int = STEPS) -> list[tuple[str, int, torch.Tensor]]:
    """(module, step, output) of an un-instrumented copy, from plain forward hooks."""
    model, seen, step = mlp(), [], [0]
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, i, o, name=name: seen.append((name, step[0], o.detach().clone())))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step[0] in range(steps):
        model(batch(step[0])).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


def torch_stats(t: torch.Tensor) -> dict:
    """The documented statistics, computed directly with torch in float64 (population std)."""
    v = t.detach().to(torch.float64)
    return {"mean": v.mean().item(), "std": v.std(correction=0).item(), "min": v.min().item(),
            "max": v.max().item(), "absmax": v.abs().max().item(), "norm": torch.linalg.vector_norm(v).item(),
            "n_nan": int(torch.isnan(v).sum()), "n_inf": int(torch.isinf(v).sum()),
            "zero_frac": (v == 0).sum().item() / v.numel()}


def parquet_frame(sink) -> pd.DataFrame:
    """The sink as plain pandas reads it, in the columns of Log.table()."""
    frame = pd.read_parquet(sink)
    frame["shape"] = frame["shape"].map(list)
    return frame[TABLE]


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Equal frames: same rows in the same order and equal values, whatever pandas' dtypes
    (Arrow strings with NaN, or objects with None) say is missing."""
    assert list(got.columns) == list(want.columns)

    def plain(frame):
        frame = frame.reset_index(drop=True).astype(object)
        frame = frame.where(frame.notna(), None)
        frame["shape"] = frame["shape"].map(lambda s: None if s is None else [int(d) for d in s])
        return frame

    pd.testing.assert_frame_equal(plain(got), plain(want), check_dtype=False)


@pytest.fixture()
def sink(tmp_path):
    return tmp_path / "run"


class TestRoundTrip:
    @pytest.mark.usefixtures("stats_path")
    def test_pandas_reads_what_the_log_holds(self, sink):
        """pandas.read_parquet(sink) equals the in-memory log of an identical run, row for row."""
        recorded(sink, flush_rows=1)
        assert len([n for n in os.listdir(sink) if n.endswith(".parquet")]) == STEPS
        assert_same_rows(parquet_frame(sink), recorded().to_pandas())

    @pytest.mark.usefixtures("stats_path")
    def test_statistics_are_pytorch_float64(self, sink):
        """Each output's statistics in the sink equal float64 PyTorch statistics of the plain model's output."""
        recorded(sink, flush_rows=1)
        frame = pd.read_parquet(sink, filters=[("kind", "==", "output")])
        plain = plain_outputs()
        assert list(zip(frame["module"], frame["step"])) == [(name, step) for name, step, _ in plain]
        for (_, row), (_, _, out) in zip(frame.iterrows(), plain):
            want = torch_stats(out)
            for name in STAT_NAMES:
                assert row[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (row["module"], name)
            assert list(row["shape"]) == list(out.shape) and row["dtype"] == "float32"

    def test_pyarrow_schema(self, sink):
        """pyarrow reads the parts with the documented column types: counts are int64, shapes lists."""
        recorded(sink, flush_rows=1)
        table = pq.read_table(sink)
        assert table.schema.field("shape").type == pa.list_(pa.int64())
        assert table.schema.field("n_nan").type == table.schema.field("n_inf").type == pa.int64()
        assert table.schema.field("mean").type == pa.float64()
        assert table.num_rows == len(recorded())
        assert table.column("tensor_file").null_count == table.num_rows  # stats mode: no tensors

    def test_duckdb_reads_the_parts(self, sink):
        """DuckDB reads the parts through a glob, with the same values."""
        duckdb = pytest.importorskip("duckdb")
        recorded(sink, flush_rows=1)
        got = duckdb.sql(f"SELECT module, step, mean, nan FROM read_parquet('{sink}/*.parquet') "
                         "WHERE kind = 'grad_output' ORDER BY step, module").df()
        want = recorded().to_pandas(kind="grad_output").sort_values(["step", "module"], kind="stable")
        assert got["module"].tolist() == want["module"].tolist()
        assert got["step"].tolist() == want["step"].tolist()
        assert got["mean"].tolist() == want["mean"].tolist()
        assert got["n_nan"].tolist() == want["n_nan"].tolist() == [0] * len(want)

    def test_polars_reads_the_parts(self, sink):
        """polars reads the parts through a glob, with the same values."""
        polars = pytest.importorskip("polars")
        recorded(sink, flush_rows=1)
        frame = polars.scan_parquet(f"{sink}/*.parquet").filter(polars.col("kind") == "output").collect()
        assert frame["mean"].to_list() == recorded().to_pandas(kind="output")["mean"].tolist()

    def test_log_load(self, sink):
        """Log.load(sink) gives records equal to the in-memory log's, and its step."""
        live = recorded(sink, flush_rows=3)
        memory = recorded()
        loaded = picklehooks.Log.load(sink)
        assert loaded.step == live.step == memory.step == STEPS
        assert len(loaded) == len(memory)
        for a, b in zip(memory.records, loaded.records):
            assert (a.key, a.step, a.shape, a.dtype, a.value, a.rank) == (b.key, b.step, b.shape, b.dtype, b.value,
                                                                         b.rank)
            assert a.stats == b.stats
        assert loaded.table() == memory.table()

    def test_non_finite_and_values(self, sink):
        """NaN/Inf statistics, counts and non-tensor values survive the sink."""
        model = nn.Sequential(PlantNonFinite(), WithCount())
        picklehooks.instrument(model, capture="output")
        with picklehooks.record(sink=sink) as log:
            model(torch.ones(5, 8))
        assert log.records == []  # written on exit
        with picklehooks.record() as memory:
            model(torch.ones(5, 8))
        loaded = picklehooks.Log.load(sink)
        for a, b in zip(memory.table(), loaded.table()):
            assert a.keys() == b.keys()
            assert all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
                       for k in a), (a, b)
        assert loaded.find(module="1", path="1")[0].value == "3"
        stats = loaded.records[0].stats
        assert (stats["n_nan"], stats["n_inf"]) == (3, 3) and isinstance(stats["n_nan"], int)

    def test_empty_run(self, sink):
        """A run that records nothing leaves a sink that loads as an empty log."""
        with picklehooks.record(sink=sink):
            pass
        loaded = picklehooks.Log.load(sink)
        assert len(loaded) == 0 and loaded.records == [] and loaded.step == 0
        assert list(loaded.to_pandas(kind="output").columns) == TABLE

    def test_fresh_process_reads_the_sink(self, sink):
        """A sink written here loads in a fresh interpreter, with the same statistics."""
        recorded(sink, flush_rows=2)
        out = run_fresh(f"""
            import sys; sys.path.insert(0, {str(REPO)!r})
            import picklehooks
            log = picklehooks.Log.load({str(sink)!r})
            print(len(log), log.step, repr(sum(r.stats["norm"] for r in log.records)))
        """)
        memory = recorded()
        assert out.split() == [str(len(memory)), str(STEPS), repr(sum(r.stats["norm"] for r in memory.records))]

    def test_reads_a_sink_another_process_wrote(self, sink):
        """A sink a fresh interpreter wrote, then left without leaving record() (os._exit: no flush),
        loads here with every part it wrote."""
        run_fresh(f"""
            import os
            import torch
            import picklehooks
            from tests.capture.test_sink import mlp, train
            model = mlp()
            picklehooks.instrument(model)
            with picklehooks.record(sink={str(sink)!r}, flush_rows=1) as log:
                train(model, log, {STEPS})
                model(torch.ones(5, 4))  # recorded, never written: the process dies first
                os._exit(0)  # like a kill: record() never exits
        """, cwd=REPO)
        loaded = picklehooks.Log.load(sink)
        assert_same_rows(loaded.to_pandas(), recorded().to_pandas())


class TestFilters:
    CASES = [
        {"module": "2"},
        {"kind": "grad_output"},
        {"step": 2},
        {"step": range(1, 3), "kind": ("output",)},
        {"step": range(0, STEPS, 2)},
        {"module": ["0", "2"], "call": 3},
        {"path": "", "rank": 0},  # no rank recorded: nothing matches
        {"module": "nope"},
    ]

    @staticmethod
    def expected(frame: pd.DataFrame, filters: dict) -> pd.DataFrame:
        keep = pd.Series(True, index=frame.index)
        for name, want in filters.items():
            values = [want] if isinstance(want, (str, int)) else list(want)
            keep &= frame[name].isin(values) if name in frame else False
        return frame[keep]

    @pytest.mark.parametrize("filters", CASES)
    def test_filters_match_pandas(self, sink, filters):
        """to_pandas(filters) returns exactly the rows pandas selects, from a loaded sink (reading nothing
        into memory) and from an in-memory log."""
        recorded(sink, flush_rows=2 * 6 + 1)  # 6 records a step: a part of 3 steps, then the rest on exit
        memory = recorded()
        full = memory.to_pandas()
        want = self.expected(full, filters)
        loaded = picklehooks.Log.load(sink)
        assert_same_rows(loaded.to_pandas(**filters), want)
        assert_same_rows(memory.to_pandas(**filters), want)
        assert held(loaded).unread_sink and held(loaded).records == 0  # nothing else read

    def test_live_log_reads_disk_and_memory(self, sink):
        """Inside record(), to_pandas covers the parts written and the records still in memory."""
        model = mlp()
        picklehooks.instrument(model)
        with picklehooks.record(sink=sink, flush_rows=6) as log:
            train(model, log, 2)
            model(batch(2))  # one step's outputs, not written yet
            assert len(log.records) == 3
            frame = log.to_pandas(kind="output")
            assert frame["step"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
            assert log.to_pandas(step=2)["module"].tolist() == ["0", "1", "2"]
            assert_same_rows(log.to_pandas(), pd.concat([parquet_frame(sink), pd.DataFrame(log.table())]))

    def test_find_reads_only_matches(self, sink):
        """find() on a loaded sink returns the matching records and leaves the rest on disk."""
        recorded(sink, flush_rows=1)
        loaded = picklehooks.Log.load(sink)
        found = loaded.find(module="1", kind="output")
        assert [(r.module, r.step) for r in found] == [("1", s) for s in range(STEPS)]
        assert held(loaded).unread_sink and held(loaded).records == 0
        assert [r.stats for r in found] == [r.stats for r in recorded().find(module="1", kind="output")]

    def test_columns(self, sink):
        """columns= returns those columns only, in the order given."""
        recorded(sink, flush_rows=1)
        frame = picklehooks.Log.load(sink).to_pandas(kind="output", columns=["module", "mean"])
        assert list(frame.columns) == ["module", "mean"] and len(frame) == 3 * STEPS

    @pytest.mark.parametrize("bad", [{"step": "3"}, {"module": 0}, {"kind": []}, {"call": 1.5},
                                     {"step": True}, {"step": range(2, 2)}, {"columns": ["bogus"]}])
    def test_bad_filter(self, sink, bad):
        """A filter of the wrong type is refused, naming it."""
        recorded(sink)
        with pytest.raises(picklehooks.PicklehooksError, match=next(iter(bad))):
            picklehooks.Log.load(sink).to_pandas(**bad)

    def test_no_arguments_as_before(self):
        """to_pandas() of an in-memory log is the DataFrame of table(), as always."""
        log = recorded()
        pd.testing.assert_frame_equal(log.to_pandas(), pd.DataFrame(log.table()))


class TestTensors:
    @pytest.mark.parametrize("mode", ["tensor", "both"])
    def test_tensors_round_trip(self, sink, mode, stats_path):
        """Kept tensors go to safetensors files beside the parts and load equal to the plain outputs."""
        pytest.importorskip("safetensors")
        recorded(sink, mode=mode, capture="output", flush_rows=1)
        assert sorted(os.listdir(sink / "_tensors")) == [f"part-{i:06d}.safetensors" for i in range(STEPS)]
        loaded = picklehooks.Log.load(sink)
        plain = plain_outputs()
        assert len(loaded) == len(plain)
        for rec, (name, step, out) in zip(loaded.records, plain):
            assert (rec.module, rec.step) == (name, step)
            assert torch.equal(rec.tensor, out)
            assert (rec.stats is None) == (mode == "tensor")
        assert len(parquet_frame(sink)) == len(plain)  # pandas still reads the directory

    def test_find_reads_only_matching_tensors(self, sink):
        """find() on a loaded sink reads the tensor of the record it returns, equal to the plain output."""
        pytest.importorskip("safetensors")
        recorded(sink, mode="tensor", capture="output", flush_rows=1)
        (rec,) = picklehooks.Log.load(sink).find(module="2", call=1)
        assert torch.equal(rec.tensor, [o for n, s, o in plain_outputs() if (n, s) == ("2", 1)][0])

    def test_tensor_of_other_shape_refused(self, sink):
        """A tensors file whose tensor doesn't match its record is refused, naming the file."""
        st = pytest.importorskip("safetensors.torch")
        recorded(sink, mode="tensor", capture="output", flush_rows=1)
        file = sink / "_tensors" / "part-000001.safetensors"
        tensors = st.load_file(str(file))
        tensors["1"] = torch.zeros(2, 2)
        st.save_file(tensors, str(file))
        with pytest.raises(picklehooks.PicklehooksError, match="part-000001.safetensors.*'1'"):
            picklehooks.Log.load(sink).records

    def test_large_tensors_flush_each_step(self, sink, monkeypatch):
        """Kept tensors past FLUSH_BYTES are written at the next step, however few records wait."""
        monkeypatch.setattr(picklehooks.capture.log, "FLUSH_BYTES", 1)
        recorded(sink, mode="tensor", capture="output")
        assert len(list(sink.glob("part-*.parquet"))) == STEPS


class TestDirectoryRules:
    def test_file_in_the_way(self, tmp_path):
        """A file at the sink's path is refused and left as it was."""
        (tmp_path / "run").write_text("mine")
        with pytest.raises(picklehooks.PicklehooksError, match="not a directory"):
            recorded(tmp_path / "run")
        assert (tmp_path / "run").read_text() == "mine"

    def test_parent_is_a_file(self, tmp_path):
        """A path that can't be created is refused, naming it."""
        (tmp_path / "file").write_text("mine")
        with pytest.raises(picklehooks.PicklehooksError, match="can't create"):
            recorded(tmp_path / "file" / "run")
        assert (tmp_path / "file").read_text() == "mine"

    def test_not_a_path(self):
        """sink= of another type is refused, naming the value."""
        with pytest.raises(picklehooks.PicklehooksError, match="sink=3"):
            recorded(3)

    def test_foreign_files_refused_and_kept(self, tmp_path):
        """A directory holding other files is refused before the run, naming them; nothing is added."""
        (tmp_path / "notes.txt").write_text("mine")
        (tmp_path / "data.parquet").write_bytes(b"PAR1")
        with pytest.raises(picklehooks.PicklehooksError, match="'data.parquet', 'notes.txt'.*new or empty"):
            recorded(tmp_path)
        assert sorted(os.listdir(tmp_path)) == ["data.parquet", "notes.txt"]
        assert (tmp_path / "notes.txt").read_text() == "mine"

    def test_parts_without_marker_refused(self, tmp_path):
        """Parquet files named like parts but not marked as a sink are some other tool's: refused."""
        (tmp_path / "part-000000.parquet").write_bytes(b"PAR1")
        with pytest.raises(picklehooks.PicklehooksError, match="part-000000.parquet"):
            recorded(tmp_path, append=True)
        assert sorted(os.listdir(tmp_path)) == ["part-000000.parquet"]

    def test_saved_log_refused(self, tmp_path):
        """A directory holding a Log.save() log is refused, saying so, and still loads."""
        recorded().save(tmp_path / "log")
        with pytest.raises(picklehooks.PicklehooksError, match=r"records.json.*Log.save\(\)"):
            recorded(tmp_path / "log")
        assert picklehooks.Log.load(tmp_path / "log").table() == recorded().table()

    def test_earlier_run_refused_then_appended(self, sink):
        """A sink holding parts is refused without append=True, intact; with it, new parts follow."""
        recorded(sink, flush_rows=1)
        before = {n: (sink / n).read_bytes() for n in os.listdir(sink)}
        with pytest.raises(picklehooks.PicklehooksError, match="append=True"):
            recorded(sink)
        assert {n: (sink / n).read_bytes() for n in os.listdir(sink)} == before
        recorded(sink, append=True, step=STEPS, flush_rows=1)
        assert sorted(n for n in os.listdir(sink) if n.endswith(".parquet")) == [
            f"part-{i:06d}.parquet" for i in range(2 * STEPS)]
        loaded = picklehooks.Log.load(sink)
        assert loaded.step == 2 * STEPS
        steps = loaded.to_pandas(kind="output", module="0")["step"].tolist()
        assert steps == list(range(2 * STEPS))

    def test_newer_format_refused(self, sink):
        """A sink marked with a format version from the future is refused."""
        recorded(sink)
        (sink / "_picklehooks.json").write_text('{"format": "picklehooks-sink", "version": 99}')
        with pytest.raises(picklehooks.PicklehooksError, match="newer picklehooks"):
            picklehooks.Log.load(sink)

    def test_corrupt_part(self, sink):
        """A part that isn't Parquet is refused when read, naming the sink."""
        recorded(sink, flush_rows=1)
        (sink / "part-000001.parquet").write_bytes(b"not parquet")
        with pytest.raises(picklehooks.PicklehooksError, match="not Parquet"):
            picklehooks.Log.load(sink).records

    def test_without_pyarrow(self, tmp_path, monkeypatch):
        """Without pyarrow a sink is refused naming the extra to install, before anything is created."""
        monkeypatch.setitem(sys.modules, "pyarrow", None)
        with pytest.raises(picklehooks.PicklehooksError, match=r"pip install 'picklehooks\[parquet\]'"):
            recorded(tmp_path / "run")
        assert not (tmp_path / "run").exists()

    def test_save_and_flush_refused(self, sink):
        """A streaming log refuses save() (its records are in the sink); a log without a sink refuses flush()."""
        with picklehooks.record(sink=sink) as log:
            with pytest.raises(picklehooks.PicklehooksError, match="Log.load"):
                log.save(sink.parent / "saved")
        with pytest.raises(picklehooks.PicklehooksError, match="sink="):
            recorded().flush()

    def test_into_existing_log(self, sink):
        """record(log=..., sink=...) streams a log made earlier; a second sink for it is refused."""
        log = picklehooks.Log()
        with picklehooks.record(log=log, sink=sink):
            pass
        assert log.sink == str(sink)
        with pytest.raises(picklehooks.PicklehooksError, match="streams to"):
            with picklehooks.record(log=log, sink=sink.parent / "other"):
                pass


class TestCrash:
    def test_exception_inside_record(self, sink):
        """An exception mid-run leaves every step before it readable, the unfinished step included."""
        model = mlp()
        picklehooks.instrument(model)
        with pytest.raises(RuntimeError, match="boom"):
            with picklehooks.record(sink=sink, flush_rows=1) as log:
                train(model, log, 2)
                model(batch(2))  # forward of step 2, then the crash
                raise RuntimeError("boom")
        frame = picklehooks.Log.load(sink).to_pandas()
        assert frame["step"].tolist() == [0] * 6 + [1] * 6 + [2] * 3
        assert not [n for n in os.listdir(sink) if n.startswith(".")]

    def test_failed_write_keeps_records(self, sink, monkeypatch):
        """A write that fails leaves the records in memory and no temporary file; the next write has them."""
        model = mlp()
        picklehooks.instrument(model)
        real = pq.write_table
        with picklehooks.record(sink=sink, flush_rows=1) as log:
            train(model, log, 1)
            model(batch(1)).square().mean().backward()
            monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
            with pytest.raises(OSError, match="disk full"):
                log.next_step()
            assert len(log.records) == 6
            assert not [n for n in os.listdir(sink) if n.startswith(".")]
            monkeypatch.setattr(pq, "write_table", real)
        assert picklehooks.Log.load(sink).to_pandas()["step"].tolist() == [0] * 6 + [1] * 6


class TestMemory:
    @pytest.mark.usefixtures("stats_path")
    def test_records_leave_memory(self, sink):
        """With flush_rows=1 nothing stays in memory from one step to the next, and no batch of pending
        copies outlives its step (structure, not RSS: bench/bench_memory.py measures RSS)."""
        model = mlp()
        picklehooks.instrument(model)
        with picklehooks.record(sink=sink, flush_rows=1) as log:
            for step in range(20):
                model(batch(step)).sum().backward()
                log.next_step()
                now = held(log)
                assert (now.records, now.rows, now.copies, now.batches) == (0, 0, [], 0)
        assert len(picklehooks.Log.load(sink)) == 20 * 6

    def test_records_in_memory_bounded(self, sink):
        """With the default threshold the records in memory never exceed flush_rows plus one step."""
        model = mlp()
        picklehooks.instrument(model)
        with picklehooks.record(sink=sink, flush_rows=50) as log:
            most = 0
            for step in range(40):
                model(batch(step)).sum().backward()
                most = max(most, held(log).records + held(log).rows)
                log.next_step()
        assert most <= 50 + 6
        assert len(picklehooks.Log.load(sink)) == 40 * 6


class PlantNonFinite(nn.Module):
    """Copies its input and writes NaN and +-Inf at known positions."""

    def forward(self, x):
        y = x.clone()
        y[0, 0] = y[1, 2] = y[4, 7] = math.nan
        y[0, 1] = y[2, 3] = math.inf
        y[3, 5] = -math.inf
        return y


class WithCount(nn.Module):
    """Returns a tensor and a plain int."""

    def forward(self, x):
        return x * 2, 3
