"""Weights & Biases: ``log.to_wandb(run)`` and the training callbacks' summaries, with the real ``wandb``, offline.

Every run is offline (``WANDB_MODE=offline``, every W&B directory temporary) and what it wrote is
read back from its transaction log, ``<WANDB_DIR>/wandb/offline-run-*-<id>/run-<id>.wandb``:
LevelDB-style log blocks of ``wandb_internal_pb2.Record`` protobufs, parsed here (the package has
no reader of its own any more). Ground truth is float64 statistics from plain PyTorch hooks on an
un-instrumented copy, never picklehooks.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import time
import warnings
import zlib
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

import picklehooks  # noqa: E402
import picklehooks.integrations.wandb as phw  # noqa: E402
from picklehooks import PicklehooksError  # noqa: E402

# The transaction log's framing (LevelDB's log format, W&B's header and IEEE CRC-32 of type + data).
_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_BLOCK, _RECORD_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_records(path: Path):
    """Every ``Record`` of a ``.wandb`` transaction log, in order."""
    data = path.read_bytes()
    assert data[:len(_HEADER)] == _HEADER, data[:len(_HEADER)]
    pos, pending = len(_HEADER), b""
    while pos + _RECORD_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _RECORD_HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding to the end of the block
            pos += left
            continue
        if pos + _RECORD_HEADER + length > len(data):  # a record still being written
            return
        chunk = data[pos + _RECORD_HEADER:pos + _RECORD_HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos} of {path}"
        assert kind in (_FULL, _FIRST, _MIDDLE, _LAST), kind
        pos += _RECORD_HEADER + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


class OfflineRun:
    """What an offline run wrote: its history rows (``{key: value}``) and its metric definitions."""

    def __init__(self, root: Path, run_id: str):
        (path,) = root.glob(f"**/offline-run-*-{run_id}/run-{run_id}.wandb")
        records = list(run_records(path))
        for _ in range(120):  # the W&B service may still be writing when finish() returns: wait for the end
            if records and records[-1].WhichOneof("record_type") == "exit":
                break
            time.sleep(0.25)
            records = list(run_records(path))
        assert records and records[-1].WhichOneof("record_type") == "exit", f"{path} has no exit record"
        self.rows, self.metrics = [], []
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "history":
                self.rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                                  for item in record.history.item})
            elif kind == "metric":
                self.metrics.append(record.metric)

    def rows_with(self, prefix: str) -> list[dict]:
        return [row for row in self.rows if any(k.startswith(prefix) for k in row)]

    def step_metric(self, glob_name: str) -> str:
        return [m.step_metric for m in self.metrics if m.glob_name == glob_name][-1]


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """Offline W&B with every directory under ``tmp_path``; the root the runs are written under."""
    root = tmp_path / "wandb-root"
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        (root / name.lower()).mkdir(parents=True)
        monkeypatch.setenv(f"WANDB_{name}", str(root / name.lower()))
    for name, value in {"MODE": "offline", "SILENT": "true", "DISABLE_GIT": "true", "DISABLE_CODE": "true",
                        "CONSOLE": "off", "PROJECT": "picklehooks-test"}.items():
        monkeypatch.setenv(f"WANDB_{name}", value)
    yield root
    if wandb.run is not None:  # a failed test's run
        wandb.finish()
    wandb.teardown()  # W&B reads the environment once a process: the next test's directories are its own


def finished(root: Path) -> OfflineRun:
    """Finish ``wandb.run`` (writing everything) and read it back."""
    run_id = wandb.run.id
    wandb.finish()
    return OfflineRun(root, run_id)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))


# -- log.to_wandb --------------------------------------------------------------------------------

@pytest.fixture
def mlp_log():
    """Two steps of a small MLP (step 1 runs two batches: /call1) and plain PyTorch's statistics of them."""
    from tests.integrations.test_mlflow import plain_values, recorded  # the same model, steps and truth
    return recorded(), plain_values()


class TestToWandb:
    def test_rows_hold_plain_pytorch_statistics_at_their_steps(self, offline, mlp_log):
        """Every record's statistics are in the run under TensorBoard's tags, in a row carrying its step."""
        log, want = mlp_log
        written = log.to_wandb(wandb.init())
        run = finished(offline)
        assert run.step_metric("picklehooks/*") == "picklehooks/step"
        rows = run.rows_with("picklehooks/")
        assert [row["picklehooks/step"] for row in rows] == [0, 1]  # one row per step, in order
        keys = {f"{key.rsplit('/', 1)[0]}/{stat}" for key in want for stat in phw.STATS}
        got = {key: [(row["picklehooks/step"], row[key]) for row in rows if key in row] for key in keys}
        assert {k for row in rows for k in row if k.startswith("picklehooks/")} == keys | {"picklehooks/step"}
        assert written == sum(len(v) for v in got.values()) == len(phw.STATS) * len(log.records)
        for key, series in got.items():
            assert [s for s, _ in series] == [s for s, _ in want[key]], key
            assert all(close(g, e) for (_, g), (_, e) in zip(series, want[key])), (key, series, want[key])
        assert [s for s, _ in got["picklehooks/0/output/call1/mean"]] == [1]

    def test_step_stats_and_step_metric(self, offline, mlp_log):
        """step= puts every record in one row; stats= picks the statistics; step_metric= names the step key."""
        log, want = mlp_log
        run = wandb.init()
        assert log.to_wandb(step=7, stats=("norm",), step_metric="train/global_step") == len(log.records)
        rows = finished(offline).rows_with("picklehooks/")
        assert len(rows) == 1 and rows[0]["train/global_step"] == 7 and "picklehooks/step" not in rows[0]
        norms = {k for k in rows[0] if k.startswith("picklehooks/")}
        assert norms == {key for at, row in phw.metrics(log, 7, ("norm",)).items() for key in row}
        assert all(k.endswith("/norm") for k in norms) and run is not None

    def test_no_run_is_a_clear_error(self, offline, mlp_log):
        log, _ = mlp_log
        assert wandb.run is None
        with pytest.raises(PicklehooksError, match=r"call wandb\.init\(\) first"):
            log.to_wandb()
        with pytest.raises(PicklehooksError, match=r"run=object has no log\(\)"):
            log.to_wandb(object())
        with pytest.raises(PicklehooksError, match="step='1'"):
            phw.log_metrics(log, object(), step="1")
        with pytest.raises(PicklehooksError, match="step_metric='_step'"):
            phw.log_metrics(log, object(), step_metric="_step")

    def test_the_trainer_tracker_warns_once_without_a_run(self, offline):
        write = phw._tracker()
        with pytest.warns(UserWarning, match="no W&B run") as caught:
            write({"picklehooks/output/norm/a": 1.0}, 1)
            write({"picklehooks/output/norm/a": 2.0}, 2)
        assert len(caught) == 1


# -- the transformers Trainer, report_to=["wandb"] ---------------------------------------------------

def test_trainer_run_gets_the_summaries_at_the_trainers_steps(offline, tmp_path):
    """The summaries are in the run the Trainer started, in rows carrying train/global_step (the step metric
    the Trainer declares), at the steps it logs, equal to float64 plain hooks of those steps."""
    pytest.importorskip("transformers")
    from picklehooks.integrations.transformers import PicklehooksCallback
    from tests.integrations.test_transformers_callback import ACCUM, LAYERS, PlainHooks, tiny_gpt2, train

    model = tiny_gpt2()
    plain_model = copy.deepcopy(model)
    callback = PicklehooksCallback(modules=list(LAYERS), capture=("output", "grad_output"), every_n_steps=2)
    train(model, tmp_path / "out", [callback], report_to=["wandb"], max_steps=5, logging_steps=2)
    run = finished(offline)
    plain = PlainHooks(plain_model, LAYERS)
    train(plain_model, tmp_path / "plain", [plain], max_steps=5)

    assert run.step_metric("*") == "train/global_step"
    rows = run.rows_with("picklehooks/")
    steps = [row["train/global_step"] for row in rows]
    assert steps == [2, 4] == sorted({r.step for r in callback.recorded})
    assert sorted(row["train/global_step"] for row in run.rows if "train/loss" in row) == steps  # the Trainer's
    for row in rows:
        step = row["train/global_step"]
        want = {}
        for name in LAYERS:
            outs = [plain.out[(step, name, k)] for k in range(ACCUM)]
            grads = [plain.grad_out[(step, name, k)] for k in range(ACCUM)]
            want[f"picklehooks/output/absmax/{name}"] = max(t.abs().max().item() for t in outs)
            want[f"picklehooks/output/norm/{name}"] = math.sqrt(sum(t.norm().item() ** 2 for t in outs))
            want[f"picklehooks/grad_output/norm/{name}"] = math.sqrt(sum(t.norm().item() ** 2 for t in grads))
        assert {k for k in row if k.startswith("picklehooks/")} == set(want), step
        for key, value in want.items():
            assert math.isclose(row[key], value, rel_tol=1e-5), (step, key, row[key], value)


def test_trackers_false_sends_nothing(offline, tmp_path):
    pytest.importorskip("transformers")
    from picklehooks.integrations.transformers import PicklehooksCallback
    from tests.integrations.test_transformers_callback import LAYERS, tiny_gpt2, train

    callback = PicklehooksCallback(modules=list(LAYERS), capture=("output",), trackers=False)
    train(tiny_gpt2(), tmp_path / "out", [callback], report_to=["wandb"], max_steps=2)
    run = finished(offline)
    assert len(callback.recorded) > 0 and run.rows_with("train/loss") and not run.rows_with("picklehooks/")


# -- Lightning's WandbLogger ---------------------------------------------------------------------

def test_lightning_wandb_logger_gets_the_summaries(offline, tmp_path):
    """Through trainer.loggers, at trainer/global_step (WandbLogger's step metric), equal to plain hooks."""
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import WandbLogger

    from picklehooks.integrations.lightning import PicklehooksCallback
    from tests.integrations.test_lightning_callback import ACCUM, LAYERS, STEPS, Net, PlainHooks, fit

    callback = PicklehooksCallback(modules=list(LAYERS), capture=("output",))
    logger = WandbLogger(offline=True, save_dir=str(offline / "dir"))
    module, plain_module = Net(), Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(module, tmp_path / "rec", [callback], logger=logger)
    run = finished(offline)
    plain = PlainHooks(plain_module)
    fit(plain_module, tmp_path / "plain", [plain], logger=False)

    assert run.step_metric("*") == "trainer/global_step"
    rows = run.rows_with("picklehooks/")
    assert [row["trainer/global_step"] for row in rows] == list(range(STEPS))
    for row in rows:
        step = row["trainer/global_step"]
        for name in LAYERS:
            want = math.sqrt(sum(plain.out[(step, k, name)].norm().item() ** 2 for k in range(ACCUM)))
            assert math.isclose(row[f"picklehooks/output/norm/{name}"], want, rel_tol=1e-5), (step, name)
