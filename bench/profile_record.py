"""Where a recording step's host time goes, operator by operator: a diagnostic, not a benchmark.

Run from the repository root (seconds on the CPU; compiling adds about a minute)::

    .venv/bin/python bench/profile_record.py                  # the CPU
    .venv/bin/python bench/profile_record.py --device cuda    # a GPU (bench/on_gpu.sh runs this)

The bench's MLP (36 modules, batch 32), ``instrument()``'s defaults, forward
under ``no_grad``: three steps, each after warm-up calls, run 20 times under
``cProfile`` (Python functions and the torch calls they make, by own time)
and then under ``torch.profiler`` (aten operators by self CPU time, and
with ``--device cuda`` the device's kernels): a recording step that reads
its statistics, and the same model compiled with ``fullgraph=True``, idle
and recording. Tables of times, no ratios: ``bench_logging.py`` gives those.
The profilers' own overhead inflates small functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import picklehooks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logging import checked_device, make_mlp  # noqa: E402

CALLS = 20


def report(label: str, step, device: torch.device) -> None:
    for _ in range(3):
        step()
    stats = cProfile.Profile()
    stats.enable()
    for _ in range(CALLS):
        step()
    stats.disable()
    text = io.StringIO()
    pstats.Stats(stats, stream=text).sort_stats("tottime").print_stats(18)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(CALLS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(f"\n### {label}: {CALLS} calls\n\n```")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
    print("```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled steps")
    args = parser.parse_args()
    device = checked_device(parser, args.device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="picklehooks-profile-"))
    torch.manual_seed(0)
    model, x = make_mlp()
    model, x = model.to(device), x.to(device)
    picklehooks.instrument(model)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", native statistics pass: {picklehooks._native.AVAILABLE}")

    def recording(call):
        def step():
            with torch.no_grad(), picklehooks.record() as log:
                call(x)
            for r in log.records:
                r.stats  # noqa: B018 - reading them is part of the step

        return step

    report("eager, recording statistics (+ reading them)", recording(model), device)
    if not args.no_compile:
        compiled = torch.compile(model, fullgraph=True)

        def idle():
            with torch.no_grad():
                compiled(x)

        report("compiled, not recording", idle, device)
        report("compiled, recording statistics (+ reading them)", recording(compiled), device)


if __name__ == "__main__":
    main()
