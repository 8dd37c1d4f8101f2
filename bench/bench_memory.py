"""Memory of a long recorded run: ``record(sink=dir)`` against an in-memory log.

Run from the repository root (a few minutes on one CPU core)::

    .venv/bin/python bench/bench_memory.py                       # 10,000 steps with a sink, 2,000 without
    .venv/bin/python bench/bench_memory.py --steps 2000 --no-sink-steps 1000 --every 500

The model is ``nn.Sequential`` of 100 ``Linear(16, 16)`` layers (orthogonal
weights, so activations neither vanish nor explode through the stack),
instrumented with the defaults (capture output + grad_output, mode "stats":
200 records a step), batch 4; each step draws a new input and runs forward,
``.square().mean().backward()``, an SGD step (lr 1e-2),
``zero_grad(set_to_none=True)`` and ``log.next_step()``, so the statistics
change from step to step as in training (which matters for the size on disk). Both runs happen in
this one process, the sink run first, single-threaded
(``torch.set_num_threads(1)``).

It prints a Markdown table of the resident set size (``/proc/self/statm``;
``resource.getrusage`` where there is no /proc) every ``--every`` steps, and
its growth since step 0, which is measured after a warm-up of 50 steps and
one write to the sink (so pyarrow and the first Parquet write are loaded
before it). A line below gives the sink's size on disk and its number of
parts. Nothing is asserted; RSS includes what the allocators keep, so it is
an upper bound on what the log holds.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import shutil
import sys
import tempfile
from datetime import date

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import picklehooks  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
WARMUP = 50


def rss_mb() -> float:
    """Resident set size now, in MB (10**6 bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 1e6
    except OSError:  # no /proc: the peak, which is what getrusage has
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1e6 if sys.platform == "darwin" else peak / 1e3


def instrumented_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)])
    for layer in model:
        nn.init.orthogonal_(layer.weight)
    picklehooks.instrument(model)
    return model


def run(steps: int, every: int, sink: str | None) -> tuple[list[tuple[int, float]], int, float]:
    """RSS at step 0 and every ``every`` steps; records recorded; the fraction with a finite mean."""
    model = instrumented_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    samples = []
    with picklehooks.record(sink=sink) as log:
        for i in range(WARMUP + steps):
            if i == WARMUP:
                if sink is not None:
                    log.flush()
                gc.collect()
                samples.append((0, rss_mb()))
            model(torch.randn(4, 16)).square().mean().backward()
            optimizer.step()
            model.zero_grad(set_to_none=True)
            log.next_step()
            done = i + 1 - WARMUP
            if done > 0 and done % every == 0:
                samples.append((done, rss_mb()))
    means = (picklehooks.Log.load(sink) if sink is not None else log).to_pandas(columns=["mean"])["mean"]
    return samples, len(means), float(means.notna().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="steps of the run with a sink (default 10000)")
    parser.add_argument("--no-sink-steps", type=int, default=2_000,
                        help="steps of the in-memory run, for contrast (default 2000; 0 skips it)")
    parser.add_argument("--every", type=int, default=1_000, help="steps between RSS samples (default 1000)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    directory = tempfile.mkdtemp(prefix="picklehooks-bench-memory-")
    sink = os.path.join(directory, "run")
    try:
        print(f"# bench_memory: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, 1 thread, {date.today()}", flush=True)
        with_sink, sink_records, finite = run(args.steps, args.every, sink)
        size = sum(os.path.getsize(os.path.join(sink, n)) for n in os.listdir(sink))
        parts = sum(n.endswith(".parquet") for n in os.listdir(sink))
        without = run(args.no_sink_steps, args.every, None) if args.no_sink_steps else ([], 0, 0.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print()
    print("100 x Linear(16, 16), batch 4, forward+backward+SGD, mode='stats', 200 records a step; "
          "RSS in MB (10^6 bytes), growth since step 0")
    print()
    print("| steps | with sink: RSS | growth | without sink: RSS | growth |")
    print("|---:|---:|---:|---:|---:|")
    base_sink, base_mem = with_sink[0][1], without[0][0][1] if without[0] else None
    mem = dict(without[0])
    for step, rss in with_sink:
        other = (f"{mem[step]:.1f} | {mem[step] - base_mem:+.1f}" if step in mem else "  |  ")
        print(f"| {step:,} | {rss:.1f} | {rss - base_sink:+.1f} | {other} |")
    for step, rss in without[0]:
        if step > with_sink[-1][0]:
            print(f"| {step:,} |  |  | {rss:.1f} | {rss - base_mem:+.1f} |")
    print()
    print(f"With sink: {sink_records:,} records ({finite:.0%} with a finite mean) in {parts} Parquet parts, "
          f"{size / 1e6:.1f} MB on disk.")
    if without[0]:
        growth = (without[0][-1][1] - base_mem) / without[0][-1][0] * 1000
        print(f"Without sink: {without[1]:,} records in memory, about {growth:.1f} MB more every 1,000 steps.")


if __name__ == "__main__":
    main()
