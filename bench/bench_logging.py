"""Benchmark of ``picklehooks.instrument`` + ``record()``: what logging costs, next to the alternatives.

Run from the repository root (several minutes on an idle CPU with the default rounds)::

    .venv/bin/python bench/bench_logging.py                          # all sections, 25 interleaved rounds
    .venv/bin/python bench/bench_logging.py --rounds 3 --only mlp    # a quick, noisy check
    .venv/bin/python bench/bench_logging.py --only hf,script         # some sections only
    .venv/bin/python bench/bench_logging.py --device cuda            # models and inputs on the GPU

It prints Markdown tables (progress goes to stderr), headed by a line naming
the machine (CPU model, cores, torch version, threads, device), the method
and the date. Every figure comes from this one run, on this machine,
single-threaded (``torch.set_num_threads(1)``, so on the CPU the compute runs
in the benchmarking thread); nothing is asserted, the targets are printed next
to the figures and marked met or not met.

Sections (``--only`` takes a comma-separated subset; default all):

* ``mlp``: ``nn.Sequential`` of 12 x (Linear(256, 256), LayerNorm(256), GELU):
  36 modules besides the root; batch 32.
* ``transformer``: ``nn.Sequential`` of 2 x ``nn.TransformerEncoderLayer(d_model=64,
  nhead=4, batch_first=True, dropout=0.0)``; batch 8, sequence 16. Kept in
  training mode so that the plain and the hooked models run the same Python
  code (in eval mode under no_grad PyTorch may take a fused fast path).
  Instrumented with default settings; the line below its table lists modules
  that were chosen but produced no record.
* ``hf``: tiny Hugging Face models built from configs with ``transformers``
  (no downloads; skipped with a message where it is not installed), eval mode
  (no dropout), eager attention, no KV cache: GPT-2 (2 layers, n_embd 64,
  4 heads, vocabulary 1000, 64 positions) and Llama (2 layers, hidden 64,
  intermediate 128, 4 heads, 2 key/value heads, vocabulary 1000); input ids
  of batch 4 x sequence 32; forward+backward of
  ``model(input_ids=ids, labels=ids).loss``.
* ``script``: the MLP under TorchScript: ``torch.jit.script`` of the plain
  model against ``torch.jit.script`` of the model instrumented with
  ``scriptable=True`` (the baseline here is the scripted plain model); then
  ``torch.jit.trace`` of each (the baseline: the traced plain model).
* ``compile``: the MLP and the transformer under ``torch.compile(fullgraph=True)``
  (Inductor; a fresh ``TORCHINDUCTOR_CACHE_DIR`` unless one is set): the compiled
  plain model against the compiled instrumented one, idle (Dynamo's graph for
  "nothing records", compiled before measuring) and recording, with the
  statistics computed by the record op's kernel at run time (the default
  where the native kernel is built) and by the graph itself (Inductor's
  fused reductions; the default elsewhere; each call sets the switch, on
  which Dynamo guards). Each variant is its own ``nn.Sequential`` subclass
  with a ``forward`` code object of its own, so Dynamo can't reuse another's
  graph or walk its guards. A floor in the same run: the compiled plain
  model followed by the native statistics of as many values as one call
  records, of the same shapes (views of one random buffer; CPU, with the
  extension), and two lower bounds beside it: the floor plus a call of the
  record op per value that returns at once (what one op per record pays at
  least), and the plain model followed by those values added straight to a
  log and read (what one host call per graph pays at least with this log).
  Two tables per workload, each against the compiled plain model:
  the kernel's statistics (idle, recording, the floor; issue #38's targets:
  idle ≤ 1.02×, recording ≤ the floor + 0.05; and a second compiled plain
  model, whose ratio shows how far two models running the same graph differ
  here, which is what idle is judged against), then the graph's statistics
  and the eager model (the switch, flipped between them, makes Dynamo check
  guards in full at the next call: kept apart, that costs no variant). Beside
  each recording variant, the same compiled under another setting of
  ``picklehooks.capture.batching``: with the kernel's statistics, CPU values
  batched too (``CPU_VALUES``: one op per graph, each value read at its
  end); with the graph's, batching off (``ENABLED``: one op per record, as
  before #38's batching). Last (CPU), idle on models of 4 and 36
  ``Linear(4, 4)`` at batch 1, so small that Dynamo's guards on the hooks
  show: what idle adds per instrumented module and call.
* ``torchlens``: TorchLens (``torchlens.trace(model, x)``, its current name
  for the old ``log_forward_pass``; it saves every activation by default), MLP
  forward only, on the CPU whatever ``--device`` says. It wraps torch's
  functions on its first call and leaves them wrapped, so it runs in a last
  phase of its own; that phase also times the plain model again, with torch
  wrapped.

Workloads: **forward** (under ``torch.no_grad()``) and **forward+backward**
(``loss(model(x)).backward()``, then ``zero_grad(set_to_none=True)``; the loss
is ``.sum()`` of the output, or an HF model's ``.loss``). The HF section runs
forward+backward only.

Variants of ``mlp`` and ``transformer``, all on one model: each sample of a
variant puts its hooks on the model, runs 10 untimed calls, is timed, and
removes them again (deep copies of one model, one per variant, differ in speed
among themselves by a few percent, an error that stays fixed for a whole run):

1. un-instrumented (the baseline every ratio divides by);
1b. a forward hook that does nothing on every module: the floor that any
   module hook pays in ``nn.Module.__call__`` (``instrument``'s defaults add
   exactly one forward hook per module);
1c. a forward hook on every module that only copies its output (and, with
   backward, a tensor hook that copies the gradient): the floor of any
   recording that must survive later in-place changes, before computing
   a single statistic;
1d. a forward hook on every module that only computes the native statistics of
   its output (and of its gradient, through a tensor hook), keeping nothing
   else: the floor of recording statistics with ``picklehooks._native``;
2. ``instrument(model)`` (defaults: capture output + grad_output, stats), not recording;
3. the same model under ``record()``, then ``log.records[-1].stats``, which
   copies every record's statistics to the host (so the cost of reading them is included);
4. ``instrument(model, mode="tensor")`` under ``record()``: keeps every tensor;
5. hand-written closure hooks computing the same statistics the naive way: a
   forward hook per module computing mean, std, min, max, absmax, norm, nan,
   inf, zero_frac (in float64, like picklehooks) with one ``.item()`` each,
   and a full backward hook (``register_full_backward_hook``) doing the same
   for the gradient of the output.

Below each ``mlp`` and ``transformer`` table, a line gives every variant's
thread time above the baseline divided by the number of records one call
makes (``instrument()``'s defaults): what one recorded value costs in that
workload, in microseconds (a forward+backward's records are its outputs and
their gradients).

Variants of ``hf``: 1, 2 and 3 above. Variants of ``script``: the scripted
plain model (baseline), the scripted instrumented model not recording, the
same under ``record()`` with its statistics read (no target), and the eager
plain model (for reference); then the same under ``torch.jit.trace`` (traced
under ``no_grad``; no target: a traced graph runs its record and tap ops, and
each tap's copy, whether or not a log records).

Targets (judged on the thread-time ratio, on the wall ratio with ``--device cuda``):
recording stats including reading them ≤ 1.30× on all four MLP and
transformer workloads; instrumented, not recording ≤ 1.05× there;
``mode="tensor"`` ≤ 1.35× there; recording stats (+ reading them) ≤ 1.5× on
tiny GPT-2 and Llama forward+backward; the scripted instrumented MLP, not
recording, ≤ 1.10× of the scripted plain MLP, forward and forward+backward.

Method: every sample times ``n`` consecutive calls (``n`` chosen so the
baseline sample takes about 20 ms of wall clock) on two clocks at once: the
CPU time of the benchmarking thread (``time.thread_time``) and the wall clock
(``time.perf_counter``). Each round takes one sample of every variant, in an
order that rotates each round; the garbage collector is off while sampling
(and collects between rounds). On glibc the bench first pins malloc's trim and
mmap thresholds (``pin_malloc``): with the defaults, whether the memory that
copy-keeping variants free each call went back to the OS, to be faulted in
again, depended on the heap's history, and moved those variants by up to 0.6×.
Reported per variant: the median per call
(thread time), the ratio of medians to the baseline on both clocks side by
side, and the ratio of minimums on both clocks (other work on the machine only
ever adds time). Thread time is the primary figure: on the shared machine
these benches run on, other processes move the wall clock ratios by about
±0.1× from run to run, while they barely touch the CPU time this thread gets.
With ``--device cuda`` every sample ends with ``torch.cuda.synchronize()``
(once per sample, not per call); thread time then counts only this thread's
host work (Python, hooks, kernel launches; autograd's backward runs in a
device thread of its own), so there the wall ratio is the figure to read.

Only picklehooks' public API is used (``picklehooks.instrument``,
``picklehooks.record``, ``log.records``, ``Record.stats``), so the bench keeps
working while the internals change.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import itertools
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import picklehooks
from _machine import cpu_model  # bench/, this script's directory

SECTIONS = ("mlp", "transformer", "hf", "script", "compile", "torchlens")

BASE = "un-instrumented"
NOOP = "no-op forward hook on every module (floor)"
QUIET = "instrumented, not recording"
COPY = "hooks that only copy every output and gradient (floor)"
NATIVE = "hooks that only compute the native statistics of every output and gradient (floor)"
STATS = "recording stats (+ reading them)"
TENSOR = "recording tensors (mode=\"tensor\")"
NAIVE = "hand-written closure hooks (.item() stats)"
S_BASE = "scripted plain model"
S_QUIET = "scripted instrumented (scriptable=True), not recording"
S_STATS = "scripted instrumented, recording stats (+ reading them)"
T_BASE = "traced plain model"
T_QUIET = "traced instrumented (default capture), not recording"
T_STATS = "traced instrumented, recording stats (+ reading them)"
S_EAGER = "eager plain model (reference)"
C_BASE = "compiled plain model"
C_CONTROL = "another compiled plain model, the same graph (control: how far two identical models differ)"
C_QUIET = "compiled instrumented, not recording (statistics by the record op's kernel)"
C_STATS = "compiled instrumented, recording stats (by the record op's kernel, + reading them)"
C_GQUIET = "compiled instrumented, not recording (statistics by the graph)"
C_GSTATS = "compiled instrumented, recording stats (by the graph, + reading them)"
C_CPUBATCH = "the same, CPU values batched too (batching.CPU_VALUES on: one op per graph, values read at its end)"
C_UNBATCHED = "the same, one op per record (batching.ENABLED off: before #38's batching)"
C_EAGER = "eager plain model (reference)"
C_FLOOR = "compiled plain model, then the native statistics of as many values of the same sizes (floor)"
C_TRIPS = ("the floor, and a call of the record op per value with no log (it returns at once): what one op "
           "per record costs at least")
C_DIRECT = ("compiled plain model, then the values recorded straight into a log (C row lane: statistics, row) "
            "and read: what one host call per graph costs at least with this log")

# Targets of issue 12, by group of tables; a table's variants not named here have none.
TARGETS: dict[str, dict[str, float]] = {
    "eager": {QUIET: 1.05, STATS: 1.30, TENSOR: 1.35},
    "hf": {STATS: 1.5},
    "script": {S_QUIET: 1.10},
}


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


def make_hf(name: str) -> tuple[nn.Module, torch.Tensor]:
    """A tiny GPT-2 or Llama from a config (the builder of tests/models/hf.py, with the sizes of this bench)."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = {"attn_implementation": "eager", "bos_token_id": 0, "eos_token_id": 0}
    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                                 **common))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                                   max_position_embeddings=64, **common))
    else:
        raise ValueError(name)
    model.config.use_cache = False  # no KV cache to build and return
    model.loss_type = "ForCausalLM"  # named, so HF doesn't warn about guessing it
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(1))
    return model.eval(), ids  # eval: no dropout, every variant computes the same thing


@dataclass
class Task:
    """A model and how one step calls it: ``forward(model)`` and ``loss(output)``."""
    model: nn.Module
    forward: Callable[[nn.Module], Any]
    loss: Callable[[Any], torch.Tensor]
    instrument_kwargs: dict = field(default_factory=dict)  # the example call instrument() observes


def tensor_task(model: nn.Module, x: torch.Tensor) -> Task:
    return Task(model, lambda m: m(x), lambda out: out.sum(), {"example_inputs": (x,)})


def hf_task(model: nn.Module, ids: torch.Tensor) -> Task:
    kwargs = {"input_ids": ids, "labels": ids}
    return Task(model, lambda m: m(**kwargs), lambda out: out.loss, {"example_kwargs": kwargs})


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


def add_naive_hooks(model: nn.Module, store: list) -> list:
    """Returns the hooks' handles."""
    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield "", value
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield str(i), v

    handles = []
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

        handles += [module.register_forward_hook(forward_hook), module.register_full_backward_hook(backward_hook)]
    return handles


def noop_hook(module, inputs, output):
    return None


def add_copy_hooks(model: nn.Module, store: list) -> list:
    """The least any recording does: copy every output (and, in backward, its gradient), nothing else.
    Returns the hooks' handles."""
    def keep_grad(grad):
        store.append(grad.clone())

    def copy_hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            store.append(output.detach().clone())
            if output.requires_grad:
                output.register_hook(keep_grad)

    return [module.register_forward_hook(copy_hook) for name, module in model.named_modules() if name]


def add_native_hooks(model: nn.Module, store: list) -> list:
    """The least recording statistics does: one native pass over every output and gradient, no
    bookkeeping (on devices or builds without the native kernel it computes nothing). Returns the
    hooks' handles."""
    from picklehooks import _native

    def stats_of_grad(grad):
        store.append(_native.stats(grad))

    def stats_hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            store.append(_native.stats(output))
            if output.requires_grad:
                output.register_hook(stats_of_grad)

    return [module.register_forward_hook(stats_hook) for name, module in model.named_modules() if name]


# -- timing ---------------------------------------------------------------------------------------

Times = dict[str, dict[str, list[float]]]  # variant -> clock ("thread", "wall") -> per-call seconds
CLOCKS = ("thread", "wall")


@dataclass
class Setup:
    """What every measurement shares: where the models run and which clock judges the targets."""
    device: torch.device
    rounds: int

    @property
    def sync(self) -> Callable[[], None] | None:
        return torch.cuda.synchronize if self.device.type == "cuda" else None

    @property
    def judge(self) -> str:
        return "wall" if self.device.type == "cuda" else "thread"


def workload(model: nn.Module, task: Task, backward: bool) -> Callable[[], None]:
    forward, loss = task.forward, task.loss
    if backward:
        def run():
            loss(forward(model)).backward()
            model.zero_grad(set_to_none=True)
    else:
        def run():
            with torch.no_grad():
                forward(model)
    return run


def clearing(run: Callable[[], None], kept: list) -> Callable[[], None]:
    """``run``, then empty the list its hooks fill (so memory doesn't grow over the rounds)."""
    def run_and_clear():
        run()
        kept.clear()
    return run_and_clear


def recording(run: Callable[[], None], read_stats: bool) -> Callable[[], None]:
    def rec():
        with picklehooks.record() as log:
            run()
        if read_stats:
            log.records[-1].stats  # noqa: B018 -- materialises every record's statistics
    return rec


def sample(fn: Callable[[], None], n: int, sync: Callable[[], None] | None) -> tuple[float, float]:
    """Per-call (thread CPU time, wall clock) of ``n`` consecutive calls; on CUDA one sync at the end."""
    t0 = time.thread_time()
    w0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync is not None:
        sync()
    w1 = time.perf_counter()
    t1 = time.thread_time()
    return (t1 - t0) / n, (w1 - w0) / n


Install = Callable[[], Callable[[], None]]  # puts a variant's hooks on the shared model; returns their undo


def measure(variants: dict[str, Callable[[], None]], setup: Setup, rounds: int | None = None,
            budget_s: float = 0.02, warmup: int = 3, installs: dict[str, Install] | None = None,
            settle: int = 10) -> Times:
    """Per-call times of every variant on both clocks, ``rounds`` samples each, interleaved in rotating order.

    ``installs``: for variants that share one model, what puts each one's hooks on it. Such a
    variant's every sample installs them, runs ``settle`` untimed calls, samples, and removes
    them; with ``installs``, every other variant's samples also start with ``settle`` untimed
    calls. (Right after ``instrument()`` and ``remove()``, the next calls of the plain model ran
    up to 10% slower; after ten calls, within 1%.)
    """
    rounds = setup.rounds if rounds is None else rounds
    installs = installs or {}
    names = list(variants)

    def calls(name: str, count: int, timed: bool) -> tuple[float, float] | None:
        undo = installs[name]() if name in installs else None
        try:
            for _ in range(settle if installs and timed else 0):
                variants[name]()
            if timed:
                return sample(variants[name], count, setup.sync)
            for _ in range(count):
                variants[name]()
            return None
        finally:
            if undo is not None:
                undo()

    for name in names:  # warm-up (allocator, lazy init, TorchScript's profiling runs)
        calls(name, warmup, timed=False)
    if setup.sync is not None:
        setup.sync()
    n = 1  # budget_s=0: one call per sample (steps that take seconds)
    if budget_s:
        base = min(sample(variants[names[0]], 5, setup.sync)[1] for _ in range(3))
        n = max(1, round(budget_s / base))
    times: Times = {name: {clock: [] for clock in CLOCKS} for name in names}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                thread, wall = calls(name, n, timed=True)
                times[name]["thread"].append(thread)
                times[name]["wall"].append(wall)
            gc.collect()
    finally:
        if gc_was:
            gc.enable()
    return times


def ratios(times: Times, base: str) -> dict[str, dict[str, float]]:
    """Per variant: ratio of medians and of minimums to ``base``, on both clocks."""
    out: dict[str, dict[str, float]] = {}
    for name, clocks in times.items():
        out[name] = {}
        for clock in CLOCKS:
            out[name][clock] = statistics.median(clocks[clock]) / statistics.median(times[base][clock])
            out[name][f"{clock} min"] = min(clocks[clock]) / min(times[base][clock])
    return out


# For the closing summary: workload column -> variant -> (judged ratio, its target or None).
SUMMARY: dict[str, dict[str, tuple[float, float | None]]] = {}


def table(title: str, times: Times, base: str, setup: Setup, targets: dict[str, float] | None = None,
          notes: dict[str, str] | None = None, summary: str | None = None) -> dict[str, dict[str, float]]:
    targets, notes = targets or {}, notes or {}
    r = ratios(times, base)
    print(f"\n#### {title}\n")
    print("| variant | thread time per call | wall per call | thread-time ratio | wall ratio "
          "| min-ratio (thread / wall) | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, clocks in times.items():
        target = targets.get(name)
        if target is not None:
            verdict = "met" if r[name][setup.judge] <= target else "not met"
            target_cell = f"≤ {target:.2f}× ({verdict})"
            if notes.get(name):
                target_cell += f"; {notes[name]}"
        else:
            target_cell = notes.get(name, "")
        print(f"| {name} | {statistics.median(clocks['thread']) * 1e3:.3f} ms "
              f"| {statistics.median(clocks['wall']) * 1e3:.3f} ms "
              f"| {r[name]['thread']:.2f}× | {r[name]['wall']:.2f}× "
              f"| {r[name]['thread min']:.2f}× / {r[name]['wall min']:.2f}× | {target_cell} |")
        if summary is not None:
            SUMMARY.setdefault(summary, {})[name] = (r[name][setup.judge], target)
    return r


# -- sections -------------------------------------------------------------------------------------

def with_handles(add: Callable[..., list], model: nn.Module, *args) -> Install:
    """An install that calls ``add(model, *args)``; its undo removes the handles ``add`` returns."""
    def install() -> Callable[[], None]:
        handles = add(model, *args)
        return lambda: [h.remove() for h in handles]
    return install


def instrumenting(task: Task, **kwargs) -> Install:
    """An install that instruments ``task.model`` (as ``task`` calls it); its undo is the handle's ``remove``."""
    def install() -> Callable[[], None]:
        return picklehooks.instrument(task.model, **task.instrument_kwargs, **kwargs).remove
    return install


def noop_hooks(model: nn.Module) -> list:
    return [module.register_forward_hook(noop_hook) for name, module in model.named_modules() if name]


def picklehooks_variants(task: Task, backward: bool, full: bool = True) -> tuple[dict, dict, dict]:
    """The variants, all on ``task.model`` itself, and what installs each one's hooks there; ``full=False``:
    only plain, not recording, recording stats.

    One model, not a deep copy per variant: copies of one model differ in speed among themselves
    (five deep copies of the plain MLP measured up to 3% apart in one process, and the model
    they were copied from 8% faster than every one), which would add a fixed error to each variant's ratio.
    """
    model = task.model
    run = workload(model, task, backward)
    variants = {BASE: run, QUIET: run, STATS: recording(run, read_stats=True)}
    installs: dict[str, Install] = {QUIET: instrumenting(task), STATS: instrumenting(task)}
    extra: dict = {"install": instrumenting(task), "store": None, "naive_work": None}
    if not full:
        return variants, installs, extra

    store: list = []
    copies: list = []
    native_rows: list = []
    variants = {
        BASE: run,
        NOOP: run,
        QUIET: run,
        COPY: clearing(run, copies),
        NATIVE: clearing(run, native_rows),
        STATS: variants[STATS],
        TENSOR: recording(run, read_stats=False),
        NAIVE: clearing(run, store),
    }
    installs.update({
        NOOP: with_handles(noop_hooks, model),
        COPY: with_handles(add_copy_hooks, model, copies),
        NATIVE: with_handles(add_native_hooks, model, native_rows),
        TENSOR: instrumenting(task, mode="tensor"),
        NAIVE: with_handles(add_naive_hooks, model, store),
    })
    extra.update(store=store, naive_work=run, naive_install=installs[NAIVE])
    return variants, installs, extra


def coverage(name: str, task: Task, extra: dict) -> None:
    """What one recorded forward+backward captured, and which chosen modules gave nothing."""
    model = task.model
    handle = picklehooks.instrument(model, **task.instrument_kwargs)
    chosen = list(handle.modules)  # remove() empties handle.modules
    try:
        with picklehooks.record() as log:
            task.loss(task.forward(model)).backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    naive = ""
    if extra["naive_work"] is not None:
        extra["store"].clear()
        undo = extra["naive_install"]()
        try:
            extra["naive_work"]()
        finally:
            undo()
        naive = f"; hand-written hooks: {len(extra['store'])} stats per forward+backward"
        extra["store"].clear()
    seen = {r.module for r in log.records}
    silent = [m for m in chosen if m not in seen]
    kinds = {k: sum(1 for r in log.records if r.kind == k) for k in ("output", "grad_output")}
    print(f"\n{name}: {len(chosen)} modules instrumented, "
          f"{len(log.records)} records per forward+backward ({kinds['output']} output, "
          f"{kinds['grad_output']} grad_output){naive}.")
    if handle.skipped:
        print(f"Skipped by instrument(): {', '.join(handle.skipped)}")
    if silent:
        print(f"Chosen but never recorded (their forward() is not called): {', '.join(silent)}")


def records_per_call(task: Task, backward: bool, install: Install) -> int:
    """How many records one call of the workload makes (instrument()'s defaults)."""
    undo = install()
    try:
        with picklehooks.record() as log:
            if backward:
                task.loss(task.forward(task.model)).backward()
                task.model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    task.forward(task.model)
    finally:
        undo()
    return len(log.records)


def per_record(times: Times, base: str, records: int) -> None:
    """Each variant's thread time above the baseline, per recorded value (as recording makes them;
    the floors' hooks see the same values): what one record costs inside this workload."""
    base_t = statistics.median(times[base]["thread"])
    cells = [f"{name}: {(statistics.median(clocks['thread']) - base_t) / records * 1e6:.1f}"
             for name, clocks in times.items() if name != base]
    print(f"\nThread time above the un-instrumented call per record ({records} per call), µs: " + "; ".join(cells) + ".")


def eager_section(label: str, short: str, make, setup: Setup) -> dict[str, list[float]] | None:
    """The MLP or transformer, forward and forward+backward; returns the forward baseline's times."""
    model, x = make()
    task = tensor_task(model.to(setup.device), x.to(setup.device))
    forward_baseline = None
    for backward in (False, True):
        phase = f"{label}, {'forward+backward' if backward else 'forward (no_grad)'}"
        progress(f"measuring: {phase}")
        variants, installs, extra = picklehooks_variants(task, backward)
        times = measure(variants, setup, installs=installs)
        table(phase, times, BASE, setup, TARGETS["eager"],
              summary=f"{short} {'fwd+bwd' if backward else 'fwd'}")
        per_record(times, BASE, records_per_call(task, backward, extra["install"]))
        if backward:
            coverage(label, task, extra)
        else:
            forward_baseline = times[BASE]
    return forward_baseline


def hf_section(setup: Setup) -> None:
    try:
        import transformers
    except ImportError:
        print("\nTiny Hugging Face models: transformers is not installed (pip install transformers), skipped.")
        return
    for name, label in (("gpt2", "tiny GPT-2 (2 layers, n_embd 64)"),
                        ("llama", "tiny Llama (2 layers, hidden 64, GQA 4/2 heads)")):
        model, ids = make_hf(name)
        task = hf_task(model.to(setup.device), ids.to(setup.device))
        phase = (f"{label}, transformers {transformers.__version__}, input ids 4 x 32, "
                 "forward+backward of .loss")
        progress(f"measuring: {phase}")
        variants, installs, extra = picklehooks_variants(task, backward=True, full=False)
        times = measure(variants, setup, installs=installs)
        table(phase, times, BASE, setup, TARGETS["hf"], summary=f"{name} fwd+bwd")
        coverage(label, task, extra)


def script_section(setup: Setup) -> None:
    model, x = make_mlp()
    model, x = model.to(setup.device), x.to(setup.device)
    task = tensor_task(model, x)
    for backward in (False, True):
        phase = f"MLP under TorchScript, {'forward+backward' if backward else 'forward (no_grad)'}"
        progress(f"measuring: {phase}")
        plain = torch.jit.script(copy.deepcopy(model))
        hooked = copy.deepcopy(model)
        handle = picklehooks.instrument(hooked, scriptable=True, example_inputs=(x,))
        scripted = torch.jit.script(hooked)
        variants = {
            S_BASE: workload(plain, task, backward),
            S_QUIET: workload(scripted, task, backward),
            S_STATS: recording(workload(scripted, task, backward), read_stats=True),
            S_EAGER: workload(copy.deepcopy(model), task, backward),
        }
        # TorchScript's profiling executor specialises the graph over the first calls: warm up longer.
        times = measure(variants, setup, warmup=10)
        table(phase, times, S_BASE, setup, TARGETS["script"], summary=f"script {'fwd+bwd' if backward else 'fwd'}")
        if handle.skipped:
            print(f"\nSkipped by instrument(scriptable=True): {', '.join(handle.skipped)}")
    for backward in (False, True):
        # jit.trace: a graph can't branch on whether a log records, so every record and tap op
        # runs (and each tap copies its value) while nothing records. Reference only, no target.
        phase = f"MLP under torch.jit.trace, {'forward+backward' if backward else 'forward (no_grad)'}"
        progress(f"measuring: {phase}")
        hooked = copy.deepcopy(model)
        picklehooks.instrument(hooked, example_inputs=(x,))
        with torch.no_grad():
            plain, traced = (torch.jit.trace(m, (x,), check_trace=False) for m in (copy.deepcopy(model), hooked))
        variants = {
            T_BASE: workload(plain, task, backward),
            T_QUIET: workload(traced, task, backward),
            T_STATS: recording(workload(traced, task, backward), read_stats=True),
        }
        times = measure(variants, setup, warmup=10)
        table(phase, times, T_BASE, setup, {}, summary=f"trace {'fwd+bwd' if backward else 'fwd'}")


def compile_section(setup: Setup) -> None:
    import tempfile
    import types

    from picklehooks import _taps
    from picklehooks.capture import batching

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-inductor-"))
    # Each instrumented variant compiles 2 graphs (idle and recording) x grad modes, and the
    # statistics switch is guarded: room beyond Dynamo's default limit of 8 entries.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)

    def with_flag(run: Callable[[], None], in_graph: bool) -> Callable[[], None]:
        """``run`` with the statistics computed by the graph or not. Dynamo guards on the flag (a
        global its tracing reads), so each call must see it set: with the flag left as it was, the
        graph variants' calls recompiled and measured the kernel's graph (bench runs before this fix).
        Set only where it differs, and not put back after each call: writing a global of
        picklehooks._taps changes that module's dictionary, whose guards Dynamo then checks in full
        at the next call (about 50 µs here), a cost of the bench and not of a model."""
        def call() -> None:
            if _taps._GRAPH_STATS_ON_CPU is not in_graph:
                _taps._GRAPH_STATS_ON_CPU = in_graph
            run()
        return call

    saved_flag = _taps._GRAPH_STATS_ON_CPU

    def own_class(m: nn.Module, i: int) -> nn.Module:
        """``m`` as a class of its own, whose ``forward`` has a code object of its own: Dynamo keeps
        its graphs per code object and tries each one's guards in turn, so variants sharing
        nn.Sequential.forward's made every call walk the others' graphs first (measured: the
        idle variant at 1.21-1.23x of the plain model, against 1.00-1.04x for one compiled model
        of each alone). A user's model has its graphs to itself."""
        forward = nn.Sequential.forward
        code = forward.__code__.replace(co_name=f"forward_variant{i}")
        forward = types.FunctionType(code, forward.__globals__, "forward", forward.__defaults__, forward.__closure__)
        m.__class__ = type(f"BenchVariant{i}", (nn.Sequential,), {"forward": forward})  # Dynamo guards on the type
        return m

    for (label, make), backward in itertools.product((("MLP", make_mlp), ("transformer", make_transformer)),
                                                     (False, True)):
        model, x = make()
        model, x = model.to(setup.device), x.to(setup.device)
        task = tensor_task(model, x)
        phase = (f"{label} under torch.compile(fullgraph=True), "
                 f"{'forward+backward' if backward else 'forward (no_grad)'}")
        progress(f"measuring: {phase} (compiling)")
        plain = torch.compile(own_class(copy.deepcopy(model), 0), fullgraph=True)
        compiled = {}
        # (statistics by the graph, batching.ENABLED, batching.CPU_VALUES): each read while its graphs compile.
        for i, key in enumerate(((False, True, False), (False, True, True), (True, True, False), (True, False, False)),
                                start=1):
            hooked = own_class(copy.deepcopy(model), i)
            picklehooks.instrument(hooked)
            run = workload(torch.compile(hooked, fullgraph=True), task, backward)
            batching.ENABLED, batching.CPU_VALUES = key[1:]
            with_flag(run, key[0])()
            with_flag(recording(run, read_stats=True), key[0])()  # backward graphs compile on the first backward
            batching.ENABLED, batching.CPU_VALUES = True, False
            compiled[key] = run
        # Two groups, each against the compiled plain model in the same run: the statistics switch
        # changes picklehooks._taps' globals, and each change makes Dynamo check a graph's guards in
        # full at its next call; rotating through more models also starts each sample with the
        # others' weights in the caches. Within one group, what a training run sees: one model,
        # idle or recording. (Measured with the graph variants and the eager model in one rotation:
        # the idle variant at 1.12-1.23x; alone with the plain model and recording: 1.03x.)
        control = torch.compile(own_class(copy.deepcopy(model), 9), fullgraph=True)
        workload(control, task, backward)()
        kernel = {
            C_BASE: workload(plain, task, backward),
            C_CONTROL: workload(control, task, backward),
            C_QUIET: with_flag(compiled[False, True, False], False),
            C_STATS: with_flag(recording(compiled[False, True, False], read_stats=True), False),
            C_CPUBATCH: with_flag(recording(compiled[False, True, True], read_stats=True), False),
        }
        if picklehooks._native.AVAILABLE and setup.device.type == "cpu":
            kernel[C_FLOOR] = statistics_floor(kernel[C_BASE], compiled[False, True, False])
            kernel[C_TRIPS], kernel[C_DIRECT] = recording_bounds(kernel[C_BASE], compiled[False, True, False])
        times = measure(kernel, setup, warmup=5)
        targets = {C_QUIET: 1.02}
        if C_FLOOR in times:
            base = statistics.median(times[C_BASE][setup.judge])
            targets[C_STATS] = statistics.median(times[C_FLOOR][setup.judge]) / base + 0.05
        table(phase, times, C_BASE, setup, targets, {C_STATS: "the floor + 0.05"} if C_STATS in targets else {},
              summary=f"compile {label} {'fwd+bwd' if backward else 'fwd'}")
        graph = {
            C_BASE: workload(plain, task, backward),
            C_GQUIET: with_flag(compiled[True, True, False], True),
            C_GSTATS: with_flag(recording(compiled[True, True, False], read_stats=True), True),
            C_UNBATCHED: with_flag(recording(compiled[True, False, False], read_stats=True), True),
            C_EAGER: workload(copy.deepcopy(model), task, backward),
        }
        times = measure(graph, setup, warmup=5)
        table(f"{phase}: statistics by the graph, and eager mode", times, C_BASE, setup,
              summary=f"compile {label} {'fwd+bwd' if backward else 'fwd'}")
    _taps._GRAPH_STATS_ON_CPU = saved_flag
    if setup.device.type == "cpu":
        idle_guards(setup, own_class)
        if picklehooks._native.AVAILABLE:
            log_costs(setup)


def idle_guards(setup: Setup, own_class: Callable[[nn.Module, int], nn.Module]) -> None:
    """What a compiled instrumented model costs idle, where noise can't hide it: models of 4 and 36
    ``Linear(4, 4)`` (batch 1), so small that a call is mostly Dynamo's own work. The idle graph is
    the plain model's; the difference is Dynamo's guards on the hooks, per module and call."""
    added = {}
    for n in (4, 36):
        torch.manual_seed(0)
        model, x = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n))).to(setup.device), torch.randn(1, 4)
        plain = torch.compile(own_class(copy.deepcopy(model), 20 + n), fullgraph=True)
        hooked = own_class(copy.deepcopy(model), 21 + n)
        picklehooks.instrument(hooked)
        idle = torch.compile(hooked, fullgraph=True)
        task = tensor_task(model, x.to(setup.device))
        variants = {f"compiled plain, {n} Linear(4, 4)": workload(plain, task, False),
                    f"compiled instrumented, not recording, {n} Linear(4, 4)": workload(idle, task, False)}
        for run in variants.values():
            run()
        times = measure(variants, setup, warmup=5)
        table(f"Idle under torch.compile: {n} tiny modules, forward (no_grad)", times, next(iter(variants)), setup)
        plain_t, idle_t = (statistics.median(t["thread"]) for t in times.values())
        added[n] = (idle_t - plain_t) * 1e6
    per_module = (added[36] - added[4]) / 32
    print(f"\nIdle adds {added[4]:.1f} µs a call with 4 modules and {added[36]:.1f} µs with 36 (thread time): "
          f"{per_module:.2f} µs per instrumented module and call, {added[4] - 4 * per_module:.1f} µs besides.")


def log_costs(setup: Setup) -> None:
    """What a log costs per value on top of the native statistics, whatever hands it the values:
    36 values shaped like the bench MLP's outputs (32 x 256), added by ``Rows._add_tensor`` (the C
    row lane) with no op or hook, each part of a recorded step added in turn: what no design on this
    log avoids, against the floor's allowance (issue #38: the floor + 0.05 of the compiled step).
    Entering a log checks every live instrumentation's module tree (moved or replaced modules), so
    the first part grows with the instrumented models alive (the compile section leaves sixteen)."""
    values = [(f"{i}", "output", "", torch.randn(32, 256)) for i in range(36)]
    stats, flags = picklehooks._native.stats, picklehooks._ops.STATS

    def native() -> None:
        for *_, v in values:
            stats(v)

    def logged(upto: int) -> Callable[[], None]:
        def run() -> None:
            with picklehooks.record() as log:
                if upto == 0:
                    native()
                else:
                    add = log._add_tensor
                    for m, k, p, v in values:
                        add(m, k, p, v, flags)
            if upto >= 2:
                records = log.records
                if upto >= 3:
                    for r in records:
                        r.stats  # noqa: B018
        return run

    names = ["native statistics of 36 values of 32 x 256 (the floor's part)",
             "the same inside a record() block (entering and leaving a log)",
             "a row each instead (Rows._add_tensor: the C row lane, statistics included)",
             "and the records built (log.records)", "and their statistics read as dicts (record.stats)"]
    variants = dict(zip(names, [native, logged(0), logged(1), logged(2), logged(3)]))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "nothing was recorded")  # the first variant's block, by design
        times = measure(variants, setup, warmup=20)
    table("What a log adds to the statistics of 36 values, without any op or hook", times, names[0], setup)
    medians = [statistics.median(times[name]["thread"]) * 1e6 for name in names]
    steps = ", ".join(f"{label} {(b - a) / 36:.2f} µs" for label, a, b in
                      zip(("the log", "the rows", "the records", "the dicts"), medians, medians[1:]))
    print(f"\nPer value (thread time): {steps}; together {(medians[-1] - medians[0]) / 36:.2f} µs.")


def recorded_values(instrumented: Callable[[], None]) -> list[tuple[str, str, str, torch.Tensor]]:
    """``(module, kind, path, value)`` for every tensor one call of ``instrumented`` records, each
    value a random stand-in of its shape (views of one buffer, which keeps memory flat at real sizes)."""
    with picklehooks.record() as log:
        instrumented()
    rows = [(r.module, r.kind, r.path, r.shape) for r in log.records if r.shape is not None]  # tensors only
    buffer = torch.randn(max(math.prod(shape) for *_, shape in rows))
    return [(m, k, p, buffer[: math.prod(shape)].view(shape)) for m, k, p, shape in rows]


def statistics_floor(plain: Callable[[], None], instrumented: Callable[[], None]) -> Callable[[], None]:
    """``plain``, then the native statistics of tensors shaped like every value one call of
    ``instrumented`` records (:func:`recorded_values`): what reading each value once costs on the
    CPU, however recording is wired in."""
    values = [v for *_, v in recorded_values(instrumented)]
    stats = picklehooks._native.stats

    def run() -> None:
        plain()
        for v in values:
            stats(v)
    return run


def recording_bounds(plain: Callable[[], None], instrumented: Callable[[], None]) -> tuple[Callable[[], None], ...]:
    """Two lower bounds on compiled recording with the kernel's statistics, for values shaped like
    those one call of ``instrumented`` records (:func:`recorded_values`):
    ``plain``, their native statistics and a call of the ``record`` op per value while no log is
    active, whose kernel returns at once (the trip from Python through the dispatcher that each op
    in Inductor's wrapper pays: about 1.9 µs, inside a graph as outside); and ``plain``, then each value
    added to a log by ``Rows._add_tensor`` (the C row lane: statistics and row, no op) and the
    statistics read, as the recording variants read them (a graph handing its values over in one
    call could do no less with this log)."""
    values = recorded_values(instrumented)
    stats, op, flags = picklehooks._native.stats, torch.ops.picklehooks.record.default, picklehooks._ops.STATS

    def trips() -> None:
        plain()
        for _, _, _, v in values:
            stats(v)
            op(v, "", "output", "", flags)

    def direct() -> None:
        with picklehooks.record() as log:
            plain()
            add = log._add_tensor
            for m, k, p, v in values:
                add(m, k, p, v, flags)
        for r in log.records:
            r.stats  # noqa: B018 - read, as recording(read_stats=True) does
    return trips, direct


def torchlens_phase(setup: Setup, baseline: dict[str, list[float]] | None) -> None:
    try:
        import torchlens
    except ImportError:
        print("\nTorchLens: not installed (pip install torchlens), skipped.")
        return
    version = getattr(torchlens, "__version__", "?")
    trace = getattr(torchlens, "trace", None)
    if trace is None:  # before 2.0 the capture verb was log_forward_pass
        trace = torchlens.log_forward_pass
    model, x = make_mlp()  # CPU only, whatever --device says
    cpu = Setup(torch.device("cpu"), setup.rounds)
    task = tensor_task(model, x)
    plain = copy.deepcopy(model)
    lens_model = copy.deepcopy(model)
    before = "un-instrumented (main phase, before TorchLens)"
    if baseline is None:  # the MLP section did not run on the CPU: time the plain model before torch is wrapped
        progress("torchlens: plain MLP forward on the CPU, before TorchLens")
        before = "un-instrumented (this phase, before TorchLens)"
        baseline = measure({before: workload(plain, task, False)}, cpu, max(5, cpu.rounds // 2))[before]

    def lens():
        with torch.no_grad():
            trace(lens_model, x)

    progress("torchlens: first call (wraps torch)")
    start = time.perf_counter()
    lens()
    first = time.perf_counter() - start
    lens_name = f"TorchLens {version} trace() (saves every activation)"
    times = measure({"un-instrumented, torch wrapped by TorchLens": workload(plain, task, False), lens_name: lens},
                    cpu, max(5, cpu.rounds // 2))
    times = {before: baseline, **times}
    r = table("MLP, forward, CPU: TorchLens (last phase; ratios against the un-instrumented model before TorchLens)",
              times, before, cpu, notes={lens_name: f"first call: {first * 1e3:.0f} ms"})
    if "MLP fwd" in SUMMARY and setup.device.type == "cpu":
        SUMMARY["MLP fwd"][f"{lens_name}, last phase"] = (r[lens_name][cpu.judge], None)


def summary(setup: Setup) -> None:
    """One table of the judged ratios, variants by workload, as the README quotes them."""
    if len(SUMMARY) < 2:
        return
    columns = list(SUMMARY)
    variants: list[str] = []
    for col in columns:
        variants += [v for v in SUMMARY[col] if v not in variants]
    clock = "thread-time" if setup.judge == "thread" else "wall"
    print(f"\n#### Summary: {clock} ratios of medians (✓ target met, ✗ not met)\n")
    print(f"| variant | {' | '.join(columns)} | target |")
    print("|---|" + "---:|" * len(columns) + "---|")
    for v in variants:
        cells, goals = [], {}
        for c in columns:
            if v not in SUMMARY[c]:
                cells.append("")
                continue
            ratio, target = SUMMARY[c][v]
            mark = "" if target is None else (" ✓" if ratio <= target else " ✗")
            cells.append(f"{ratio:.2f}×{mark}")
            if target is not None:
                goals.setdefault(target, []).append(c)
        goal = "; ".join(f"≤ {t:.2f}× ({', '.join(cs)})" if len(goals) > 1 else f"≤ {t:.2f}×"
                         for t, cs in goals.items())
        print(f"| {v} | {' | '.join(cells)} | {goal} |")


# -- main -----------------------------------------------------------------------------------------

def header(setup: Setup, sections: list[str], allocator: str) -> None:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = "CPU"
    if setup.device.type == "cuda":
        device = f"CUDA ({torch.cuda.get_device_name(setup.device)})"
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print("### picklehooks logging overhead\n")
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores ({usable} usable); torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread (`torch.set_num_threads(1)`); device: {device}. "
          f"Method: {setup.rounds} interleaved rounds in rotating order, per-call medians of thread CPU time "
          f"(`time.thread_time`) and wall clock (`time.perf_counter`), garbage collector off while sampling; "
          f"ratios to each table's baseline in the same run; {allocator}. Sections: {', '.join(sections)}. "
          f"Date: {date}.\n")
    if setup.device.type == "cuda":
        print("On CUDA each sample ends with one `torch.cuda.synchronize()`. Thread time counts only this thread's "
              "host work (Python, hooks, kernel launches; not the GPU, nor autograd's device thread that runs "
              "backward), so it means little here: targets are judged on the **wall ratio**.")
    else:
        print("Targets are judged on the **thread-time ratio**: other processes on this shared machine move the "
              "wall ratios by about ±0.1× from run to run, and barely touch this thread's CPU time.")


def pin_malloc() -> str:
    """Keep glibc from handing freed memory back to the OS (and from mmap-ing tensors of up to 32 MiB).

    Variants that keep copies allocate and free a call's worth of tensors each call; with glibc's
    default, adaptive thresholds, whether that memory is trimmed off the heap (and faulted back
    in on the next call) depended on the heap's history, and the same variant measured 1.29× in
    one run and 1.85× in the next (transformer forward, copies of every output). Returns what the
    header says about it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        pinned = libc.mallopt(m_trim_threshold, 2**30) == 1 and libc.mallopt(m_mmap_threshold, 2**25) == 1
    except (OSError, AttributeError):
        pinned = False
    return ("glibc malloc: trim threshold 1 GiB, mmap threshold 32 MiB" if pinned
            else "the allocator's own settings (no glibc mallopt here)")


def checked_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device``'s value as a device the benchmarks run on, or the parser's error."""
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {name}: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available in this torch build or on this machine")
    return device


def begin(setup: Setup, sections: list[str]) -> float:
    """Settle the process for measuring (allocator, one thread, warnings), print the header; the start time."""
    allocator = pin_malloc()
    torch.set_num_threads(1)
    # The first module's input needs no gradient, so its full backward hook fires on outputs only (as intended).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    header(setup, sections, allocator)
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved samples per variant (default 25)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default all)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]; TorchLens runs on the CPU")
    parser.add_argument("--no-torchlens", action="store_true", help="skip the TorchLens phase")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    if args.no_torchlens and "torchlens" in sections:
        sections.remove("torchlens")
    setup = Setup(checked_device(parser, args.device), args.rounds)
    started = begin(setup, sections)
    mlp_forward_baseline = None
    if "mlp" in sections:
        mlp_forward_baseline = eager_section("MLP (36 modules, batch 32)", "MLP", make_mlp, setup)
    if "transformer" in sections:
        eager_section("Transformer (2 encoder layers, d_model 64, batch 8 x 16)", "transformer", make_transformer,
                      setup)
    if "hf" in sections:
        hf_section(setup)
    if "script" in sections:
        script_section(setup)
    if "compile" in sections:
        compile_section(setup)
    if "torchlens" in sections:
        torchlens_phase(setup, mlp_forward_baseline if setup.device.type == "cpu" else None)
        print("\nTorchLens forward+backward: not measured (trace() logs a forward pass).")
    summary(setup)
    progress(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
