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

A second table: programs that ``jit.trace`` and ``torch.export`` made of the instrumented MLP,
whose graphs carry a ``picklehooks::call_site`` op per module call, against the same programs
traced without those ops (the hook runtime's op handle set to None while tracing: programs made
before sources, whose records now get theirs from the program's graphs under ``jit.trace`` and
none under ``torch.export``), idle and recording, forward+backward, as ratios to the program
made of the plain MLP.

``torch.set_num_threads(1)``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser.add_argument("--no-traced", action="store_true", help="skip the jit.trace and torch.export table")
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
    if not args.no_traced:
        traced_forms(args.rounds)


def _program(form: str, model, x):
    if form == "jit.trace":
        return torch.jit.trace(model, (x,))
    return torch.export.export(model, (x,)).module()


def traced_forms(rounds: int) -> None:
    """The second table (see the module docstring)."""
    print("\n| program (MLP, forward+backward) | idle, without call sites / plain | idle, with / plain "
          "| recording, without / plain | recording, with / plain | with / without, recording (thread) |")
    print("|---|---|---|---|---|---|")
    model, x = make_mlp()
    for form in ("jit.trace", "torch.export"):
        programs = {"plain": _program(form, copy.deepcopy(model), x)}
        for sources in (False, True):
            hooked = copy.deepcopy(model)
            picklehooks.instrument(hooked, capture="all")
            real, _hookrt._call_site = _hookrt._call_site, (_hookrt._call_site if sources else None)
            try:
                programs["with" if sources else "without"] = _program(form, hooked, x)
            finally:
                _hookrt._call_site = real

        def step(program, log):
            if log is not None:
                log.begin_step(0)
            program(x).sum().backward()

        times: dict[tuple, list] = {}
        with picklehooks.record() as log:
            for name, program in programs.items():
                step(program, log)  # warm-up
        for recording in (False, True):
            for _ in range(rounds):
                with picklehooks.record() if recording else contextlib.nullcontext() as log:
                    for name, program in programs.items():
                        times.setdefault((name, recording), []).append(_timed(lambda p=program: step(p, log))[1])
        cpu = {k: statistics.median(v) for k, v in times.items()}
        idle = [cpu[(n, False)] / cpu[("plain", False)] for n in ("without", "with")]
        busy = [cpu[(n, True)] / cpu[("plain", True)] for n in ("without", "with")]
        print(f"| {form} | {idle[0]:.3f}x | {idle[1]:.3f}x | {busy[0]:.3f}x | {busy[1]:.3f}x "
              f"| {cpu[('with', True)] / cpu[('without', True)]:.3f}x |")


if __name__ == "__main__":
    main()
