"""Record a long training run to Parquet as it goes, then query it without loading it all.

Shows:

1. ``picklehooks.record(sink=DIR)``: every step's statistics go to Parquet
   files in ``DIR`` (written every ``flush_rows`` records and when the run
   ends), so memory stays flat however many steps the run has.
2. ``picklehooks.Log.load(DIR)``: reads the run back lazily; ``len()`` reads
   only the files' footers.
3. ``log.to_pandas(module=..., kind=..., step=range(...))``: filters pushed
   down to the files, so only matching rows are read.
4. The same files read by pandas alone (no picklehooks needed).

Needs pyarrow and pandas: ``pip install 'picklehooks[parquet,log]'``.
Synthetic data, CPU, a few seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas
import torch
from torch import nn

import picklehooks

STEPS = 200


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    picklehooks.instrument(model, capture=("output", "grad_output", "param_grad"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tempfile.TemporaryDirectory(prefix="picklehooks-run-") as tmp:
        record_and_query(model, opt, Path(tmp) / "run")


def record_and_query(model: nn.Module, opt: torch.optim.Optimizer, run: Path) -> None:
    with picklehooks.record(sink=run, flush_rows=1000) as log:
        for step in range(STEPS):
            x = torch.randn(16, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.next_step()
        print(f"streamed to {log.sink}; records still in memory at the end: {len(log.records)}")

    parts = sorted(p.name for p in run.glob("part-*.parquet"))
    loaded = picklehooks.Log.load(run)
    print(f"{len(parts)} Parquet parts, {len(loaded)} records")

    # The gradient norm of the first layer's weight, steps 0, 50, 100, 150: only those rows are read.
    df = loaded.to_pandas(module="0", kind="param_grad", path="weight", step=range(0, STEPS, 50))
    print(df[["step", "norm", "mean", "absmax"]].to_string(index=False))
    assert list(df["step"]) == list(range(0, STEPS, 50))

    # Any Parquet reader takes the directory as it is.
    everything = pandas.read_parquet(run)
    assert len(everything) == len(loaded)
    print(everything.groupby("kind")["norm"].mean().round(4).to_string())


if __name__ == "__main__":
    main()
