"""Log.save replaces a log completely; Log.load refuses records and tensors that don't match."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import picklehooks

safetensors_torch = pytest.importorskip("safetensors.torch")


def _log(mode: str, batch: int = 3) -> picklehooks.Log:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    picklehooks.instrument(model, capture=("input", "output"), mode=mode)
    with picklehooks.record() as log:
        model(torch.randn(batch, 4))
    return log


@pytest.fixture()
def saved(tmp_path):
    path = tmp_path / "log"
    _log("both").save(path)
    return path


class TestSaveReplaces:
    def test_stats_log_over_tensor_log(self, saved):
        """A stats-only log saved over a tensor log leaves no tensors file to be attached to it."""
        stats_log = _log("stats", batch=5)
        stats_log.save(saved)
        assert sorted(os.listdir(saved)) == ["records.json"]
        loaded = picklehooks.Log.load(saved)
        assert len(loaded) == len(stats_log)
        assert all(r.tensor is None for r in loaded.records)
        assert [r.shape for r in loaded.records] == [r.shape for r in stats_log.records]

    def test_tensor_log_over_tensor_log(self, saved):
        """Saving a log with other shapes over an old one gives exactly the new tensors back."""
        new = _log("both", batch=7)
        new.save(saved)
        loaded = picklehooks.Log.load(saved)
        for a, b in zip(new.records, loaded.records):
            assert torch.equal(a.tensor, b.tensor)

    def test_foreign_files_refused_and_kept(self, tmp_path):
        """A directory holding other files is refused, and those files are untouched."""
        (tmp_path / "notes.txt").write_text("mine")
        with pytest.raises(picklehooks.PicklehooksError, match="notes.txt"):
            _log("stats").save(tmp_path)
        assert (tmp_path / "notes.txt").read_text() == "mine"
        assert sorted(os.listdir(tmp_path)) == ["notes.txt"]

    def test_failed_save_keeps_old_log(self, saved, monkeypatch):
        """An error while writing leaves the old log loadable and no temporary directories behind."""
        before = picklehooks.Log.load(saved).table()

        def broken(*args, **kwargs):
            raise OSError("disk full")

        monkeypatch.setattr(safetensors_torch, "save_file", broken)
        with pytest.raises(OSError, match="disk full"):
            _log("both", batch=9).save(saved)
        assert picklehooks.Log.load(saved).table() == before
        assert sorted(os.listdir(saved.parent)) == ["log"]

    def test_file_in_the_way(self, tmp_path):
        (tmp_path / "log").write_text("x")
        with pytest.raises(picklehooks.PicklehooksError, match="not a directory"):
            _log("stats").save(tmp_path / "log")


def _rewrite(path, edit):
    document = json.loads((path / "records.json").read_text())
    edit(document)
    (path / "records.json").write_text(json.dumps(document))


class TestLoadChecks:
    def test_shape_mismatch(self, saved):
        """A tensor whose shape differs from its record's is refused, naming the record."""
        tensors = safetensors_torch.load_file(str(saved / "tensors.safetensors"))
        tensors["1"] = torch.zeros(2, 2)
        safetensors_torch.save_file(tensors, str(saved / "tensors.safetensors"))
        with pytest.raises(picklehooks.PicklehooksError, match="record 1"):
            picklehooks.Log.load(saved)

    def test_dtype_mismatch(self, saved):
        tensors = safetensors_torch.load_file(str(saved / "tensors.safetensors"))
        tensors["0"] = tensors["0"].double()
        safetensors_torch.save_file(tensors, str(saved / "tensors.safetensors"))
        with pytest.raises(picklehooks.PicklehooksError, match="record 0.*float64"):
            picklehooks.Log.load(saved)

    def test_extra_tensor(self, saved):
        tensors = safetensors_torch.load_file(str(saved / "tensors.safetensors"))
        tensors["99"] = torch.zeros(1)
        safetensors_torch.save_file(tensors, str(saved / "tensors.safetensors"))
        with pytest.raises(picklehooks.PicklehooksError, match="'99'"):
            picklehooks.Log.load(saved)

    def test_missing_tensor(self, saved):
        tensors = safetensors_torch.load_file(str(saved / "tensors.safetensors"))
        del tensors["2"]
        safetensors_torch.save_file(tensors, str(saved / "tensors.safetensors"))
        with pytest.raises(picklehooks.PicklehooksError, match=r"lacks the tensors of records \['2'\]"):
            picklehooks.Log.load(saved)

    def test_missing_tensor_file(self, saved):
        (saved / "tensors.safetensors").unlink()
        with pytest.raises(picklehooks.PicklehooksError, match="is missing"):
            picklehooks.Log.load(saved)

    def test_corrupt_tensor_file(self, saved):
        (saved / "tensors.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        with pytest.raises(picklehooks.PicklehooksError, match="tensors.safetensors"):
            picklehooks.Log.load(saved)

    def test_truncated_json(self, saved):
        text = (saved / "records.json").read_text()
        (saved / "records.json").write_text(text[: len(text) // 2])
        with pytest.raises(picklehooks.PicklehooksError, match="records.json"):
            picklehooks.Log.load(saved)

    @pytest.mark.parametrize("field, value", [("call", "zero"), ("shape", [2, -1]), ("module", None), ("mean", [1])])
    def test_bad_record_field(self, saved, field, value):
        """A record with a field of the wrong type is refused, naming the record and the field."""
        _rewrite(saved, lambda d: d["records"][3].__setitem__(field, value))
        with pytest.raises(picklehooks.PicklehooksError, match=f"record 3 has (shape|{field})"):
            picklehooks.Log.load(saved)

    def test_fewer_records_than_tensors_v1(self, saved):
        """A format-1 log (no tensor list) whose tensors outnumber its records is refused."""
        _rewrite(saved, lambda d: (d.pop("tensors"), d.__setitem__("version", 1), d["records"].pop()))
        with pytest.raises(picklehooks.PicklehooksError, match="no record"):
            picklehooks.Log.load(saved)

    def test_v1_log_still_loads(self, saved):
        """Logs written before the tensor list (format 1) load as before."""
        expected = picklehooks.Log.load(saved).table()
        _rewrite(saved, lambda d: (d.pop("tensors"), d.__setitem__("version", 1)))
        assert picklehooks.Log.load(saved).table() == expected

    def test_newer_format(self, saved):
        _rewrite(saved, lambda d: d.__setitem__("version", 99))
        with pytest.raises(picklehooks.PicklehooksError, match="newer picklehooks"):
            picklehooks.Log.load(saved)
