"""Benchmark of ``picklehooks.instrument`` + ``record()``: what logging costs, next to the alternatives.

Run from the repository root (about two minutes on an idle CPU)::

    .venv/bin/python bench/bench_logging.py              # default: 25 interleaved rounds
    .venv/bin/python bench/bench_logging.py --rounds 9   # quicker, noisier

It prints Markdown tables (progress goes to stderr). Every figure comes from
this one run, on this machine, single-threaded CPU (``torch.set_num_threads(1)``);
nothing is asserted, the targets are printed next to the figures.

Models:

* **MLP**: ``nn.Sequential`` of 12 x (Linear(256, 256), LayerNorm(256), GELU):
  36 modules besides the root; batch 32.
* **Transformer**: ``nn.Sequential`` of 2 x ``nn.TransformerEncoderLayer(d_model=64,
  nhead=4, batch_first=True, dropout=0.0)``; batch 8, sequence 16. Kept in
  training mode so that the plain and the hooked models run the same Python
  code (in eval mode under no_grad PyTorch may take a fused fast path).
  Instrumented with default settings; the table below it lists modules that
  were chosen but produced no record.

Workloads: **forward** (under ``torch.no_grad()``) and **forward+backward**
(``model(x).sum().backward()``, then ``zero_grad(set_to_none=True)``).

Variants, each on its own deep copy of the same initial model:

1. un-instrumented (the baseline every ratio divides by);
1b. a forward hook that does nothing on every module: the floor that any
   module hook pays in ``nn.Module.__call__`` (``instrument``'s defaults add
   exactly one forward hook per module);
1c. a forward hook on every module that only copies its output (and, with
   backward, a tensor hook that copies the gradient): the floor of any
   recording that must survive later in-place changes, before computing
   a single statistic;
2. ``instrument(model)`` (defaults: capture output + grad_output, stats), not recording;
3. the same model under ``record()``, then ``log.records[-1].stats``, which
   copies every record's statistics to the host (so the cost of reading them is included);
4. ``instrument(model, mode="tensor")`` under ``record()``: keeps every tensor;
5. hand-written closure hooks computing the same statistics the naive way: a
   forward hook per module computing mean, std, min, max, absmax, norm, nan,
   inf, zero_frac (in float64, like picklehooks) with one ``.item()`` each,
   and a full backward hook (``register_full_backward_hook``) doing the same
   for the gradient of the output;
6. TorchLens (``torchlens.trace(model, x)``, its current name for the old
   ``log_forward_pass``; it saves every activation by default), MLP forward
   only. It wraps torch's functions on its first call and leaves them wrapped,
   so it runs in a last phase of its own; that phase also times the plain
   model again, with torch wrapped.

Method: a sample times ``n`` consecutive calls (``n`` chosen so the baseline
sample takes about 20 ms); each round takes one sample of every variant, in an
order that rotates each round; the garbage collector is off while sampling.
Reported: per-call medians, ratio of medians to the baseline, and ratio of
minimums (other work on the machine only ever adds time).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import warnings
from typing import Callable

import torch
from torch import nn

import picklehooks

TARGETS = {"instrumented, not recording": 1.10, "recording stats (+ reading them)": 1.5}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- models ---------------------------------------------------------------------------------------

def make_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()]
    model = nn.Sequential(*layers)
    assert len(list(model.modules())) - 1 == 36
    return model, torch.randn(32, 256)


def make_transformer() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.TransformerEncoderLayer(64, 4, batch_first=True, dropout=0.0) for _ in range(2)))
    return model, torch.randn(8, 16, 64)


# -- the hand-written alternative -----------------------------------------------------------------

def naive_stats(t: torch.Tensor) -> dict:
    v = t.detach().double()
    return {
        "mean": v.mean().item(),
        "std": v.std(correction=0).item(),
        "min": v.min().item(),
        "max": v.max().item(),
        "absmax": v.abs().max().item(),
        "norm": v.norm().item(),
        "nan": torch.isnan(v).sum().item(),
        "inf": torch.isinf(v).sum().item(),
        "zero_frac": (v == 0).double().mean().item(),
    }


def add_naive_hooks(model: nn.Module, store: list) -> None:
    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield "", value
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield str(i), v

    for name, module in model.named_modules():
        if name == "":
            continue

        def forward_hook(mod, inputs, output, name=name):
            for path, t in tensors(output):
                store.append((name, "output", path, naive_stats(t)))

        def backward_hook(mod, grad_input, grad_output, name=name):
            for path, t in tensors(grad_output):
                if t is not None:
                    store.append((name, "grad_output", path, naive_stats(t)))

        module.register_forward_hook(forward_hook)
        module.register_full_backward_hook(backward_hook)


def noop_hook(module, inputs, output):
    return None


def add_copy_hooks(model: nn.Module, store: list) -> None:
    """The least any recording does: copy every output (and, in backward, its gradient), nothing else."""
    def keep_grad(grad):
        store.append(grad.clone())

    def copy_hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            store.append(output.detach().clone())
            if output.requires_grad:
                output.register_hook(keep_grad)

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(copy_hook)


# -- timing ---------------------------------------------------------------------------------------

def workload(model: nn.Module, x: torch.Tensor, backward: bool) -> Callable[[], None]:
    if backward:
        def run():
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)
    else:
        def run():
            with torch.no_grad():
                model(x)
    return run


def recording(run: Callable[[], None], read_stats: bool) -> Callable[[], None]:
    def rec():
        with picklehooks.record() as log:
            run()
        if read_stats:
            log.records[-1].stats  # noqa: B018 -- materialises every record's statistics
    return rec


def sample(fn: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def measure(variants: dict[str, Callable[[], None]], rounds: int, budget_s: float = 0.02) -> dict[str, list[float]]:
    """Per-call times of every variant, ``rounds`` samples each, interleaved in rotating order."""
    names = list(variants)
    for fn in variants.values():  # warm-up (allocator, lazy init)
        for _ in range(3):
            fn()
    base = min(sample(variants[names[0]], 5) for _ in range(3))
    n = max(1, round(budget_s / base))
    times: dict[str, list[float]] = {name: [] for name in names}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                times[name].append(sample(variants[name], n))
            gc.collect()
    finally:
        if gc_was:
            gc.enable()
    return times


def table(title: str, times: dict[str, list[float]], base: str, notes: dict[str, str] | None = None) -> None:
    notes = notes or {}
    b_med, b_min = statistics.median(times[base]), min(times[base])
    print(f"\n#### {title}\n")
    print("| variant | median per call | ratio (medians) | ratio (minimums) | target |")
    print("|---|---:|---:|---:|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        target = TARGETS.get(name)
        if target is not None:
            target_cell = f"≤ {target:.2f}× ({'met' if med / b_med <= target else 'missed'})"
        else:
            target_cell = notes.get(name, "")
        print(f"| {name} | {med * 1e3:.3f} ms | {med / b_med:.2f}× | {min(ts) / b_min:.2f}× | {target_cell} |")


# -- main -----------------------------------------------------------------------------------------

def picklehooks_variants(model: nn.Module, x: torch.Tensor, backward: bool) -> tuple[dict, dict]:
    plain = copy.deepcopy(model)
    stats_model = copy.deepcopy(model)
    tensor_model = copy.deepcopy(model)
    naive_model = copy.deepcopy(model)
    noop_model = copy.deepcopy(model)
    copy_model = copy.deepcopy(model)
    for name, module in noop_model.named_modules():
        if name:
            module.register_forward_hook(noop_hook)
    handle = picklehooks.instrument(stats_model, example_inputs=(x,))
    picklehooks.instrument(tensor_model, mode="tensor", example_inputs=(x,))
    store: list = []
    add_naive_hooks(naive_model, store)
    copies: list = []
    add_copy_hooks(copy_model, copies)
    copy_work = workload(copy_model, x, backward)

    def copy_run():
        copy_work()
        copies.clear()

    naive_work = workload(naive_model, x, backward)

    def naive_run():
        naive_work()
        store.clear()

    variants = {
        "un-instrumented": workload(plain, x, backward),
        "no-op forward hook on every module (floor)": workload(noop_model, x, backward),
        "instrumented, not recording": workload(stats_model, x, backward),
        "hooks that only copy every output and gradient (floor)": copy_run,
        "recording stats (+ reading them)": recording(workload(stats_model, x, backward), read_stats=True),
        "recording tensors (mode=\"tensor\")": recording(workload(tensor_model, x, backward), read_stats=False),
        "hand-written closure hooks (.item() stats)": naive_run,
    }
    return variants, {"handle": handle, "model": stats_model, "store": store, "naive_work": naive_work}


def coverage(name: str, model: nn.Module, x: torch.Tensor, handle, extra: dict) -> None:
    """What one recorded forward+backward captured, and which chosen modules gave nothing."""
    with picklehooks.record() as log:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    extra["store"].clear()
    extra["naive_work"]()
    naive_records = len(extra["store"])
    extra["store"].clear()
    seen = {r.module for r in log.records}
    silent = [m for m in handle.modules if m not in seen]
    kinds = {k: sum(1 for r in log.records if r.kind == k) for k in ("output", "grad_output")}
    print(f"\n{name}: {len(handle.modules)} modules instrumented, "
          f"{len(log.records)} records per forward+backward ({kinds['output']} output, "
          f"{kinds['grad_output']} grad_output); hand-written hooks: {naive_records} stats per forward+backward.")
    if handle.skipped:
        print(f"Skipped by instrument(): {handle.skipped}")
    if silent:
        print(f"Chosen but never recorded (their forward() is not called): {', '.join(silent)}")


def torchlens_phase(model: nn.Module, x: torch.Tensor, rounds: int, baseline: list[float]) -> None:
    try:
        import torchlens
    except ImportError:
        print("\nTorchLens: not installed (pip install torchlens), skipped.")
        return
    version = getattr(torchlens, "__version__", "?")
    trace = getattr(torchlens, "trace", None)
    if trace is None:  # before 2.0 the capture verb was log_forward_pass
        trace = torchlens.log_forward_pass
    plain = copy.deepcopy(model)
    lens_model = copy.deepcopy(model)

    def lens():
        with torch.no_grad():
            trace(lens_model, x)

    progress("torchlens: first call (wraps torch)")
    start = time.perf_counter()
    lens()
    first = time.perf_counter() - start
    times = measure({"un-instrumented, torch wrapped by TorchLens": workload(plain, x, False),
                     f"TorchLens {version} trace() (saves every activation)": lens}, max(5, rounds // 2))
    times = {"un-instrumented (main phase, before TorchLens)": baseline, **times}
    table("MLP, forward: TorchLens (last phase; ratios against the main phase's baseline)", times,
          "un-instrumented (main phase, before TorchLens)",
          notes={f"TorchLens {version} trace() (saves every activation)": f"first call: {first * 1e3:.0f} ms"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved samples per variant (default 25)")
    parser.add_argument("--no-torchlens", action="store_true", help="skip the TorchLens phase")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # The first module's input needs no gradient, so its full backward hook fires on outputs only (as intended).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    started = time.perf_counter()
    print(f"### picklehooks logging overhead (torch {torch.__version__}, 1 CPU thread, "
          f"{args.rounds} interleaved rounds, medians)")
    mlp_forward_baseline: list[float] = []
    for model_name, make in (("MLP (36 modules, batch 32)", make_mlp),
                             ("Transformer (2 encoder layers, d_model 64, batch 8 x 16)", make_transformer)):
        model, x = make()
        for backward in (False, True):
            phase = f"{model_name}, {'forward+backward' if backward else 'forward (no_grad)'}"
            progress(f"measuring: {phase}")
            variants, extra = picklehooks_variants(model, x, backward)
            times = measure(variants, args.rounds)
            table(phase, times, "un-instrumented")
            if backward:
                coverage(model_name, extra["model"], x, extra["handle"], extra)
            elif make is make_mlp:
                mlp_forward_baseline = times["un-instrumented"]
    if not args.no_torchlens:
        torchlens_phase(make_mlp()[0], make_mlp()[1], args.rounds, mlp_forward_baseline)
    else:
        print("\nTorchLens: skipped (--no-torchlens).")
    print(f"\nTorchLens forward+backward: not measured (trace() logs a forward pass).")
    progress(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
