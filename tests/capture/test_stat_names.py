"""The NaN and Inf counts are ``n_nan`` and ``n_inf`` (issue #28); what used ``nan`` and ``inf`` still reads.

``nan`` and ``inf`` were column names that pandas' ``DataFrame.query`` reads
as float constants. Logs, sinks and table rows that an earlier picklehooks
wrote (under the old names) are built here by writing a log and renaming its
keys and columns back, then read with the code of the day. Ground truth for
the counts: plain PyTorch on an un-instrumented copy.
"""

from __future__ import annotations

import copy
import io
import json
import math
import warnings

import pytest
import torch
from torch import nn

import picklehooks
from picklehooks.capture.log import STAT_NAMES
from picklehooks.capture.record import RENAMED_STATS

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

OLD_STAT_NAMES = ["mean", "std", "min", "max", "absmax", "norm", "nan", "inf", "zero_frac"]


class Plant(nn.Module):
    """Its output holds 3 NaN and 2 Inf (one of each sign)."""

    def forward(self, x):
        y = x * 1.0
        y[0, :3] = math.nan
        y[1, 0], y[1, 1] = math.inf, -math.inf
        return y


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Plant(), nn.ReLU(), nn.Linear(4, 2))


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def plain_counts() -> dict[str, tuple[int, int]]:
    """Module name -> (NaN count, Inf count) of its output, from an un-instrumented copy."""
    x, counts = X, {}
    for name, module in model().named_children():
        x = module(x)
        counts[name] = (int(torch.isnan(x).sum()), int(torch.isinf(x).sum()))
    return counts


def recorded(**record) -> picklehooks.Log:
    m = model()
    with picklehooks.instrument(m, capture="output"), picklehooks.record(**record) as log:
        m(X)
    return log


def counts_of(log: picklehooks.Log) -> dict[str, tuple[int, int]]:
    return {r.module: (r.stats["n_nan"], r.stats["n_inf"]) for r in log.records}


OLD_NAME = {new: old for old, new in RENAMED_STATS.items()}


def old_row(row: dict) -> dict:
    """A table row as an earlier picklehooks wrote it (no source, which format 4 added)."""
    return {OLD_NAME.get(k, k): v for k, v in row.items() if k != "source"}


def test_names_are_the_kernels_renamed():
    """Records name the kernels' statistics positionally: only nan and inf changed."""
    assert list(STAT_NAMES) == [RENAMED_STATS.get(n, n) for n in OLD_STAT_NAMES]
    assert picklehooks.capture.log.STAT_NAMES == STAT_NAMES
    assert counts_of(recorded()) == plain_counts()


def test_pandas_query_selects_the_nonfinite_rows():
    """df.query("n_nan > 0 or n_inf > 0") selects the records holding NaN or Inf, and only those."""
    df = recorded().to_pandas()
    assert "nan" not in df.columns and "inf" not in df.columns
    want = sorted(name for name, (n, i) in plain_counts().items() if n or i)
    assert want and len(want) < len(df)
    assert sorted(df.query("n_nan > 0 or n_inf > 0")["module"]) == want
    clean = recorded()
    clean.records[:] = [r for r in clean.records if r.module == "0"]
    assert clean.records and clean.to_pandas().query("n_nan > 0 or n_inf > 0").empty


class TestOldKeys:
    def test_old_key_warns_and_reads_the_new_one(self):
        """stats["nan"] and stats.get("inf") still give the counts, with a DeprecationWarning naming the new key."""
        stats = next(r for r in recorded().records if r.module == "1").stats
        assert list(stats) == ["shape", "dtype", *STAT_NAMES] and "nan" not in stats
        with pytest.warns(DeprecationWarning, match="'n_nan'") as caught:
            assert stats["nan"] == plain_counts()["1"][0] == 3
        assert caught[0].filename == __file__  # the user's line, where the default filters show it
        with pytest.warns(DeprecationWarning, match="'n_inf'"):
            assert stats.get("inf") == plain_counts()["1"][1] == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert stats.get("median") is None and stats.get("n_nan") == 3
            with pytest.raises(KeyError):
                stats["median"]

    def test_stats_save_as_a_dict(self):
        """Saved stats load back, with weights_only=True too, equal to what was saved."""
        stats = recorded().records[0].stats
        buffer = io.BytesIO()
        torch.save(stats, buffer)
        buffer.seek(0)
        assert torch.load(buffer, weights_only=True) == stats
        assert copy.deepcopy(stats) == stats and type(copy.copy(stats)) is type(stats)

    def test_mlflow_old_stat_names(self):
        """metrics(stats=("nan",)) warns and logs the n_nan series (no MLflow needed to list them)."""
        from picklehooks.integrations import mlflow as phm

        log = recorded()
        with pytest.warns(DeprecationWarning, match="'nan' is now 'n_nan'"):
            old = phm.metrics(log, stats=("nan", "mean"))
        assert old == phm.metrics(log, stats=("n_nan", "mean"))
        assert {key.rsplit("/", 1)[1] for key, _, _ in old} == {"n_nan", "mean"}


class TestOldFiles:
    def test_from_rows_of_old_rows(self):
        """Log.from_rows takes rows with nan and inf and gives records with n_nan and n_inf."""
        rows = [old_row(row) for row in recorded().table()]
        assert "nan" in rows[0] and "n_nan" not in rows[0]
        log = picklehooks.Log.from_rows(rows)
        assert counts_of(log) == plain_counts()
        assert list(log.table()[0]) == list(recorded().table()[0])

    @pytest.mark.parametrize("version", [1, 2])
    def test_old_records_json(self, tmp_path, version):
        """A records.json of format 1 or 2 (nan, inf) loads under the new names."""
        recorded().save(tmp_path / "log")
        file = tmp_path / "log" / "records.json"
        document = json.loads(file.read_text())
        assert document["version"] == picklehooks.capture.logfile.VERSION and document["stat_names"] == list(STAT_NAMES)
        document.update(version=version, stat_names=OLD_STAT_NAMES, records=list(map(old_row, document["records"])))
        if version == 1:
            del document["tensors"]
        file.write_text(json.dumps(document))
        assert '"nan": 3' in file.read_text()
        loaded = picklehooks.Log.load(tmp_path / "log")
        assert counts_of(loaded) == plain_counts()
        assert "n_nan" in loaded.to_pandas() and "nan" not in loaded.to_pandas()

    @staticmethod
    def make_old_sink(path) -> None:
        """A sink as format 1 wrote it: parts and manifest with columns nan and inf."""
        recorded(sink=path)
        manifest = json.loads((path / "_picklehooks.json").read_text())
        manifest.update(version=1, columns=[OLD_NAME.get(c, c) for c in manifest["columns"]])
        (path / "_picklehooks.json").write_text(json.dumps(manifest))
        for part in path.glob("part-*.parquet"):
            table = pq.read_table(part)
            meta = json.loads(table.schema.metadata[b"picklehooks"])
            meta["version"] = 1
            table = table.rename_columns([OLD_NAME.get(c, c) for c in table.column_names])
            pq.write_table(table.replace_schema_metadata({"picklehooks": json.dumps(meta)}), part)

    def test_old_sink(self, tmp_path):
        """A format-1 sink loads under the new names, through Log.load and filtered to_pandas."""
        self.make_old_sink(tmp_path / "run")
        part = pq.read_table(next((tmp_path / "run").glob("part-*.parquet")))
        assert "nan" in part.column_names and "n_nan" not in part.column_names
        loaded = picklehooks.Log.load(tmp_path / "run")
        assert counts_of(loaded) == plain_counts()
        df = loaded.to_pandas(module="1", columns=["module", "n_nan", "n_inf"])
        assert df.to_dict("records") == [{"module": "1", "n_nan": 3, "n_inf": 2}]
        assert "nan" not in loaded.to_pandas().columns

    def test_appending_to_an_old_sink(self, tmp_path):
        """Appending to a format-1 sink marks it the current format; its old and new parts read back alike."""
        self.make_old_sink(tmp_path / "run")
        recorded(sink=tmp_path / "run", append=True)
        manifest = json.loads((tmp_path / "run" / "_picklehooks.json").read_text())
        assert manifest["version"] == picklehooks.capture.sink.VERSION and "n_nan" in manifest["columns"] and "nan" not in manifest["columns"]
        loaded = picklehooks.Log.load(tmp_path / "run")
        assert len(loaded) == 2 * len(plain_counts())
        old, new = loaded.records[:len(plain_counts())], loaded.records[len(plain_counts()):]
        assert [(r.module, r.stats["n_nan"], r.stats["n_inf"]) for r in old] == \
            [(r.module, r.stats["n_nan"], r.stats["n_inf"]) for r in new] == \
            [(name, *counts) for name, counts in plain_counts().items()]
        df = loaded.to_pandas()
        assert df.query("n_nan > 0 or n_inf > 0")["module"].tolist() == \
            [name for name, (n, i) in plain_counts().items() if n or i] * 2
