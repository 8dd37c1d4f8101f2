"""Operator launches per record on the path a GPU takes, counted on the CPU (issue #30's proxy).

Run from the repository root (a few seconds)::

    .venv/bin/python bench/bench_launches.py

On a GPU, every aten operator the recording path runs is at least one kernel
launch, and at these models' sizes launch latency, not arithmetic, is what
recording costs (``bench/results/logging_cuda.md``). The native statistics
pass is CPU-only, so a GPU takes the Python path: a copy of each recorded
tensor into a row of a batch matrix, reduced when the statistics are read.
This script runs that path on the CPU (``PICKLEHOOKS_NATIVE=0``, set here
before picklehooks is imported) under ``torch.profiler`` and counts the
*leaf* aten operators (those that call no other aten operator: the ones that
would launch kernels) per forward+backward, un-instrumented and recording
statistics (and reading them), for the bench's MLP and 2-layer transformer.
The figure that matters is the difference per record.

Counts, not times: they are the same on any host. Limits: a GPU runs some
operators as several kernels (or none, for views), and the CPU count
includes the reads' reductions, which a GPU pays once per batch of a shape.
"""

from __future__ import annotations

import os
import sys

os.environ["PICKLEHOOKS_NATIVE"] = "0"  # the non-CPU path, on the CPU

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import picklehooks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logging import make_mlp, make_transformer  # noqa: E402


def leaf_aten_ops(step) -> int:
    """Leaf aten operators that ``step()`` runs in this thread and autograd's."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children))


def main() -> None:
    assert not picklehooks._native.AVAILABLE, "PICKLEHOOKS_NATIVE=0 must switch the native pass off"
    torch.manual_seed(0)
    rows = []
    for label, make in (("MLP (36 modules, batch 32)", make_mlp),
                        ("Transformer (2 encoder layers, d_model 64, batch 8 x 16)", make_transformer)):
        model, x = make()

        def plain():
            model(x).sum().backward()

        handle = picklehooks.instrument(model)
        records = []

        def recording():
            with picklehooks.record() as log:
                model(x).sum().backward()
                for r in log.records:
                    r.stats  # noqa: B018 - reading them runs the batch reductions
            records.append(len(log.records))

        for warm in (plain, recording):  # first calls allocate and build caches
            warm()
        handle.remove()
        base = leaf_aten_ops(plain)
        picklehooks.instrument(model)
        recorded = leaf_aten_ops(recording)
        n = records[-1]
        rows.append((label, n, base, recorded, (recorded - base) / n))
    print("### Operator launches per record (the GPU path, counted on the CPU)\n")
    print(f"torch {torch.__version__}; `PICKLEHOOKS_NATIVE=0`; leaf aten operators per forward+backward, "
          "recording statistics of every output and output gradient (`instrument()`'s defaults) and reading them.\n")
    print("| model | records | un-instrumented | recording | per record |")
    print("|---|---:|---:|---:|---:|")
    for label, n, base, recorded, per in rows:
        print(f"| {label} | {n} | {base} | {recorded} | {per:.1f} |")


if __name__ == "__main__":
    main()
