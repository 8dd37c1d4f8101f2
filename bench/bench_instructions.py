"""Instructions per step under callgrind: recording against its floors, without the host's noise.

Run from the repository root (about 10 minutes: each measurement is a fresh
interpreter under valgrind, two at a time; needs ``valgrind`` on the PATH)::

    .venv/bin/python bench/bench_instructions.py              # MLP forward and forward+backward
    .venv/bin/python bench/bench_instructions.py --only fwd   # forward only

Timing ratios on a shared 2-core host move by ±0.05× and more from run to run
(``bench_logging.py``'s header says so), which is the size of the tiny-module
target's margin (recording within 0.05× of the native-statistics floor). The
instructions a step executes don't move with the neighbours: this script runs
the bench's MLP (36 modules, batch 32) through ``bench_logging.py``'s step,
plain, with its native-statistics floor (``add_native_hooks``) and recording
``instrument()``'s defaults (untyped hooks: no example inputs; a ``record()``
block per step, then reading the last record's statistics), each in its own
process under ``valgrind
--tool=callgrind``, twice: with ``--steps`` timed steps and with none, after
the same warm-up, the garbage collector off, one hash seed and no BLAS or
OpenMP worker threads (see ``QUIET``: two runs then count the same to within
a hundred instructions). The difference divided by the steps is what one step
executes, start-up and imports cancelled out.

Limits: instructions are not time. A Python-level instruction costs more time
than one of a vectorised kernel, and cache misses cost none here; callgrind
emulates a CPU without AVX-512, so the statistics pass runs its AVX2 loop. The
ratios say where extra work is, not what it costs in seconds; ``bench_logging.py``
gives those.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

# The measured process: imports, builds the variant, warms up, runs the steps, with no garbage collector.
CHILD = """
import gc, sys
sys.path.insert(0, {here!r})
import torch
import picklehooks
from bench_logging import add_native_hooks, make_mlp, tensor_task, workload
torch.set_num_threads(1)
variant, backward, steps = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
model, x = make_mlp()
run = workload(model, tensor_task(model, x), backward)  # bench_logging's step: forward (no_grad), or +backward
store = []
if variant == "floor":
    add_native_hooks(model, store)
elif variant == "recording":
    picklehooks.instrument(model)

def step():
    if variant == "recording":
        with picklehooks.record() as log:
            run()
        log.records[-1].stats
        return len(log.records)
    run()
    kept = len(store)
    store.clear()
    return kept

for _ in range(5):
    step()
gc.disable()
for _ in range(steps):
    step()
print(variant, step())  # what one step records (or its floor computes): in every run alike
"""

VARIANTS = ("plain", "floor", "recording")
LABELS = {"plain": "un-instrumented", "floor": "hooks that only compute the native statistics (floor)",
          "recording": "recording stats (+ reading them)"}


# What makes a run's count repeatable to within a hundred instructions: one hash seed, and no BLAS
# or OpenMP worker threads, which spin for as long as the scheduler lets them (callgrind counts
# every thread; without these, two runs of the same steps differed by 0.4M instructions a step).
QUIET = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def instructions(script: str, variant: str, backward: bool, steps: int) -> int:
    """The instructions callgrind counts for one run of ``script`` (valgrind's 'Collected' line)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
                               script, variant, "1" if backward else "0", str(steps)],
                              capture_output=True, text=True, check=False, env={**os.environ, **QUIET})
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"valgrind failed for {variant}: {proc.stderr[-2000:]}")
    return int(found.group(1))


def per_step(script: str, variant: str, backward: bool, steps: int, pool: ThreadPoolExecutor) -> float:
    with_steps = pool.submit(instructions, script, variant, backward, steps)
    without = pool.submit(instructions, script, variant, backward, 0)
    return (with_steps.result() - without.result()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measured run (default 30)")
    parser.add_argument("--only", choices=("fwd", "fwd+bwd"), help="one workload (default both)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions.py needs valgrind on the PATH (apt-get install valgrind)")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    workloads = [w for w in ("fwd", "fwd+bwd") if args.only in (None, w)]
    import torch  # the header names it; the children import their own

    print("### Instructions per step under callgrind\n")
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread; the bench's MLP (36 modules, "
          f"batch 32); {args.steps} steps a run, minus a run of none; garbage collector off, "
          "PYTHONHASHSEED=0, one BLAS/OpenMP thread.\n")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        script = os.path.join(tmp, "child.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHILD.format(here=HERE))
        for workload in workloads:
            backward = workload == "fwd+bwd"
            counts = {}
            for variant in VARIANTS:
                print(f"measuring {workload} {variant}", file=sys.stderr, flush=True)
                counts[variant] = per_step(script, variant, backward, args.steps, pool)
            base = counts["plain"]
            title = "forward (no_grad)" if workload == "fwd" else "forward+backward"
            print(f"#### MLP, {title}\n\n| variant | instructions per step | ratio | above the floor |")
            print("|---|---:|---:|---:|")
            for variant in VARIANTS:
                above = "" if variant != "recording" else f"{(counts[variant] - counts['floor']) / base:+.3f}×"
                print(f"| {LABELS[variant]} | {counts[variant] / 1e6:.2f} M | {counts[variant] / base:.3f}× "
                      f"| {above} |")
            print()


if __name__ == "__main__":
    main()
