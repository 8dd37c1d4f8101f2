"""What finding each record's source (the line that called its module) costs while recording, in eager mode.

Run from the repository root::

    .venv/bin/python bench/bench_sources.py              # 25 interleaved rounds
    .venv/bin/python bench/bench_sources.py --rounds 3   # a quick, noisy check

A training loop (``log.begin_step`` per step, so each step counts calls from 0 and finds no new
call site: the steady state) of forward+backward, per model: the plain model, the instrumented
model recording without sources (the hook runtime's ``_call_begins`` replaced by a no-op: what
recording cost before sources), and recording with sources. The variants run interleaved, one
step each per round, after a warm-up step each; the medians of the per-step times (thread time,
the CPU this thread used, beside wall clock) are printed as ratios to the plain model's. Models:
the logging bench's MLP (36 modules: small matrices, where per-call costs show most) and a
GPT-2-sized model from a config (2 layers, n_embd 64; skipped without ``transformers``).
``torch.set_num_threads(1)``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time

import torch

import picklehooks
from picklehooks import _hookrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_model  # noqa: E402
from bench_logging import make_hf, make_mlp  # noqa: E402


def _models() -> list[tuple[str, torch.nn.Module, object]]:
    model, x = make_mlp()
    out = [("MLP (36 modules, batch 32)", model, lambda m, x=x: m(x).sum())]
    try:
        model, ids = make_hf("gpt2")
    except ImportError:
        print("GPT-2: transformers is not installed (pip install transformers), skipped.\n")
    else:
        out.append(("GPT-2 (2 layers, n_embd 64, 4 x 32 tokens)", model, lambda m, ids=ids: m(input_ids=ids, labels=ids).loss))
    return out


def _timed(step) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Machine: {cpu_model()}, torch {torch.__version__}, 1 thread; {args.rounds} interleaved rounds, "
          f"medians; {datetime.date.today()}\n")
    print("| model | recording without sources / plain (thread, wall) | recording with sources / plain "
          "(thread, wall) | with / without sources (thread) |")
    print("|---|---|---|---|")
    real = _hookrt._call_begins
    for label, model, loss in _models():
        plain = model
        hooked = copy.deepcopy(model)
        picklehooks.instrument(hooked, capture="all")
        step_count = [0]

        def run_plain():
            loss(plain).backward()
            plain.zero_grad(set_to_none=True)

        def recording(sources: bool):
            def step():
                _hookrt._call_begins = real if sources else (lambda module, name, pre: None)
                try:
                    log.begin_step(step_count[0])
                    step_count[0] += 1
                    loss(hooked).backward()
                    hooked.zero_grad(set_to_none=True)
                finally:
                    _hookrt._call_begins = real
            return step

        with picklehooks.record() as log:
            variants = {"plain": run_plain, "without": recording(False), "with": recording(True)}
            for step in variants.values():
                step()  # warm-up: the sources' first walk, allocations
            times: dict[str, list] = {k: [] for k in variants}
            for _ in range(args.rounds):
                for name, step in variants.items():
                    times[name].append(_timed(step))
                if len(log._rows) > 100_000:  # bounded memory: the rows aren't what is timed
                    log._rows.clear()
        wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
        cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        print(f"| {label} | {cpu['without'] / cpu['plain']:.3f}x, {wall['without'] / wall['plain']:.3f}x "
              f"| {cpu['with'] / cpu['plain']:.3f}x, {wall['with'] / wall['plain']:.3f}x "
              f"| {cpu['with'] / cpu['without']:.3f}x |")


if __name__ == "__main__":
    main()
