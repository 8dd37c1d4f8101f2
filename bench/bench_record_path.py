"""Microbenchmark of one recorded value on the eager path: where a record's microseconds go.

Run from the repository root (about two minutes)::

    .venv/bin/python bench/bench_record_path.py
    .venv/bin/python bench/bench_record_path.py --rounds 2 --calls 50   # a quick check that it runs

``bench_logging.py`` measures whole models, whose ratios move by about ±0.07×
between runs on a shared machine; this one times the pieces of one record in
a tight loop (everything in cache, so each piece costs less than inside a
model), which is what a change to the hook path moves. It reaches into
picklehooks' internals on purpose, and is a developer's tool: the figures are
not targets.

The value: one GELU output of 32 × 256 float32 (8192 elements, as in the
bench's MLP), recorded under ``torch.no_grad()`` with ``instrument()``'s
defaults (statistics of the output; no gradient hook, since nothing requires
grad). Rows, per call, median of interleaved rounds of the benchmarking
thread's CPU time (``time.thread_time``), garbage collector off:

* the native pass alone (``picklehooks._native.stats``);
* the runtime's call, as a generated forward hook makes it
  (``picklehooks._hookrt.forward``: the idle and tracing checks, call
  numbering, the native pass, the row);
* the leanest Python that still does those things for this one case,
  inlined into one function (a reference, not used by picklehooks; where the
  native kernel isn't built it falls back to the runtime's call);
* building one ``Record`` from a row when ``log.records`` is read, by
  ``csrc/records.c`` and by the Python loop it replaced (the same
  rows, alternating);
* a module call without hooks, with a no-op forward hook, and instrumented
  while a log records: what ``nn.Module``'s hook dispatch adds.

Then, inside the bench's MLP (12 × Linear(256)+LayerNorm+GELU, batch 32,
forward under ``no_grad`` and forward+backward, recording statistics and
reading them, and recording with ``mode="tensor"``), the C lanes
(``csrc/rows.c``'s record lane and ``csrc/hooks.c``'s hook
lane) against the Python path they replace (``_hookrt`` and
``Log._add_tensor`` with the lanes switched off), interleaved in one
process: thread time above the un-instrumented model per record.

Last, what one call of picklehooks' ops costs from a scripted function,
against an empty one, a ``torch.library.custom_op`` doing the same work, and
an op whose C++ kernel does nothing (compiled here against this torch's
headers with the system C++ compiler, in a few seconds; left out, saying
why, where that fails): the floor an op registered in C++ would start from.

It needs the native kernel (built, and ``PICKLEHOOKS_NATIVE`` not ``0``):
without it a record is a copy into a batch reduced later, which this loop,
never reading, would time by its batch reductions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from torch import nn

import picklehooks
from picklehooks import _hookrt, _native, _ops
from picklehooks import _taps
from picklehooks.capture import pairing as _pairing, rows as _rows

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample (default 2000)")
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        parser.error(f"--rounds {args.rounds} --calls {args.calls}: give 1 or more of each")
    rounds, calls = args.rounds, args.calls
    if not _native.AVAILABLE:
        sys.exit("bench_record_path.py times the native path: build the extension "
                 "(pip install -e .) and leave PICKLEHOOKS_NATIVE unset")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(32, 256)
    output = nn.functional.gelu(x)
    plain = nn.GELU()
    hooked = nn.GELU()
    hooked.register_forward_hook(lambda module, args, out: None)
    holder = nn.Sequential(nn.GELU())
    picklehooks.instrument(holder)
    instrumented = holder[0]
    forward = _hookrt.forward

    def lean(module, out, flags, inputs=None):
        """The runtime's work for this case, inlined (valid only here: plain CPU float tensor, no grad)."""
        if _hookrt._is_compiling() or _hookrt._FX_SYMBOLIC() or _hookrt._is_jit_tracing():
            return forward(module, out, flags, inputs)
        log = _hookrt._active_log()
        if log is None or out.requires_grad or _hookrt._graph_task_id() != -1:
            return forward(module, out, flags, inputs)
        name = module._picklehooks_name
        call = log._next_call(name, "output", "", 0 if torch.is_grad_enabled() else _pairing._MAYBE)
        dtype, shape = out.dtype, out.shape
        stats = _native._kernel(out.data_ptr(), _native._CODES[dtype], shape, out.stride())
        log._rows.append((name, "output", "", call, log.step, shape, dtype, stats, None, None, None))
        return None

    cases = {
        "native pass alone": lambda: _native.stats(output),
        "runtime call (_hookrt.forward)": lambda: forward(instrumented, output, 7, (x,)),
        "leanest inlined Python (reference)": lambda: lean(instrumented, output, 7, (x,)),
        "GELU call, no hooks": lambda: plain(x),
        "GELU call, a no-op forward hook": lambda: hooked(x),
        "GELU call, instrumented, recording": lambda: instrumented(x),
    }
    # Reading: the Records of every row so far, built by _speedups.build_records and by the Python loop it
    # replaces (the same rows each time, in alternating order).
    builders = {"building one Record when read (C)": _rows._build_records,
                "building one Record when read (Python loop)": None}
    if builders["building one Record when read (C)"] is None:
        del builders["building one Record when read (C)"]
    times: dict[str, list[float]] = {name: [] for name in [*cases, *builders]}
    gc.disable()
    try:
        with torch.no_grad(), picklehooks.record() as log:
            for r in range(rounds):
                names = list(cases)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    fn = cases[name]
                    t0 = time.thread_time()
                    for _ in range(calls):
                        fn()
                    times[name].append((time.thread_time() - t0) / calls * 1e6)
                    log._records.clear()  # the rows stay, to be built below
                    log._maybe_grad.clear()  # no_grad calls wait for a gradient that never comes
                rows = list(log._rows)
                order = list(builders) if r % 2 == 0 else list(builders)[::-1]
                for name in order:
                    log._rows[:] = rows
                    _rows._build_records = builders[name]
                    t0 = time.thread_time()
                    log.records  # noqa: B018 -- builds a Record from every row
                    times[name].append((time.thread_time() - t0) / max(len(rows), 1) * 1e6)
                    log._records.clear()
    finally:
        _rows._build_records = builders.get("building one Record when read (C)")
        gc.enable()
    print(f"One recorded GELU output (32 x 256 float32, no_grad), {rounds} interleaved rounds of {calls} calls.\n")
    print("| piece | µs per call (median thread time) |")
    print("| :--- | ---: |")
    for name, samples in times.items():
        print(f"| {name} | {statistics.median(samples):.2f} |")
    lane_in_a_model(rounds)
    ops_from_torchscript(rounds, calls)


def lane_in_a_model(rounds: int) -> None:
    """The C lanes against the Python path, per record, inside the MLP (see the module docstring)."""
    import copy
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_logging import make_mlp

    lanes = (_rows._add_row, _hookrt._forward_lane, _taps._GradRecorder)
    python = (None, None, _taps._PyGradRecorder)
    if lanes[0] is None or lanes[1] is None:
        print("\n(no C lanes here: picklehooks._speedups isn't built)")
        return
    model, x = make_mlp()
    plain = copy.deepcopy(model)
    # One model per variant: a variant run right after another on the same model finds its
    # weights and hooks in cache, which measured up to 2.5 µs per record in its favour.
    models = {}
    for mode in ("stats", "tensor"):
        for path in ("python", "lane"):
            models[mode, path] = copy.deepcopy(model)
            picklehooks.instrument(models[mode, path], mode=mode)

    def step(m: nn.Module, backward: bool) -> None:
        if backward:
            m(x).sum().backward()
            m.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                m(x)

    def recorded(m: nn.Module, with_lane: bool, backward: bool):
        def run() -> None:
            _rows._add_row, _hookrt._forward_lane, _taps._GradRecorder = lanes if with_lane else python
            try:
                with picklehooks.record() as log:
                    step(m, backward)
                log.records[-1].stats  # noqa: B018 -- reading, as bench_logging.py does
            finally:
                _rows._add_row, _hookrt._forward_lane, _taps._GradRecorder = lanes
        return run

    print("\nInside the MLP: thread time above the un-instrumented model, µs per record (median of "
          f"{rounds} interleaved rounds).\n")
    print("| workload | stats, Python path (lanes off) | stats, C lanes "
          "| mode=\"tensor\", Python path | mode=\"tensor\", C lanes |")
    print("| :--- | ---: | ---: | ---: | ---: |")
    for backward in (False, True):
        variants = {"plain": lambda b=backward: step(plain, b),
                    "stats python": recorded(models["stats", "python"], False, backward),
                    "stats lane": recorded(models["stats", "lane"], True, backward),
                    "tensor python": recorded(models["tensor", "python"], False, backward),
                    "tensor lane": recorded(models["tensor", "lane"], True, backward)}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        calls = 4 if backward else 15
        gc.disable()
        try:
            for r in range(rounds):
                names = list(variants)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.thread_time()
                    for _ in range(calls):
                        variants[name]()
                    samples[name].append((time.thread_time() - t0) / calls * 1e6)
                gc.collect()
        finally:
            gc.enable()
        base = statistics.median(samples["plain"])
        records = 72 if backward else 36
        cells = " | ".join(f"{(statistics.median(samples[name]) - base) / records:.2f}"
                           for name in ("stats python", "stats lane", "tensor python", "tensor lane"))
        print(f"| {'forward+backward' if backward else 'forward (no_grad)'} | {cells} |")


# An op whose C++ kernel does nothing: the floor a picklehooks op registered in C++ would start from.
_NOOP_CPP = r"""
#include <torch/library.h>
static void noop(const at::Tensor&, c10::string_view, c10::string_view, c10::string_view, int64_t) {}
TORCH_LIBRARY_FRAGMENT(picklehooks_bench, m) {
  m.def(torch::schema("noop(Tensor x, str module, str kind, str path, int flags) -> ()",
                      c10::AliasAnalysisKind::CONSERVATIVE));  // kept by TorchScript, as picklehooks' ops are
}
TORCH_LIBRARY_IMPL(picklehooks_bench, CompositeExplicitAutograd, m) { m.impl("noop", noop); }
"""


def _load_cpp_noop_op() -> str | None:
    """Compile ``_NOOP_CPP`` against this torch's headers and load it; why not, where it can't be."""
    import os
    import shutil
    import subprocess
    import tempfile

    from torch.utils import cpp_extension

    if not sys.platform.startswith("linux"):
        return "built on Linux only"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return "no C++ compiler"
    with tempfile.TemporaryDirectory(prefix="picklehooks_bench_") as work:  # loaded, the file can go
        source, library = os.path.join(work, "noop.cpp"), os.path.join(work, "noop.so")
        with open(source, "w") as f:
            f.write(_NOOP_CPP)
        command = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", source, "-o", library,
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *(f"-I{p}" for p in cpp_extension.include_paths()),
                   *(f"-L{p}" for p in cpp_extension.library_paths()), "-ltorch_cpu", "-lc10"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=600)
            torch.ops.load_library(library)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return f"it didn't build or load ({type(e).__name__})"
    return None


def ops_from_torchscript(rounds: int, calls: int) -> None:
    """What one call of picklehooks' ops costs from TorchScript, against a ``torch.library.custom_op``
    doing the same (the kind of op the issue measured at 13.5 µs) and against no op at all."""
    x = torch.randn(32, 256)
    x_grad = torch.randn(32, 256, requires_grad=True)

    # A custom op must return something for TorchScript to keep it: a copy, as the old tap did.
    @torch.library.custom_op("picklehooks_bench::record_copy", mutates_args=())
    def custom_record_copy(x: torch.Tensor, module: str, kind: str, path: str, flags: int) -> torch.Tensor:
        _ops._record_kernel(x, module, kind, path, flags)
        return x.clone()

    def script(body: str):
        return torch.jit.CompilationUnit(f"def fn(x: Tensor) -> Tensor:\n    {body}\n    return x\n").fn

    # active's Python kernel, side by side with the registered one (C where _speedups is built).
    bench_lib = torch.library.Library("picklehooks_bench", "FRAGMENT")
    bench_lib.define("active_py(int flags) -> bool", alias_analysis="CONSERVATIVE")
    bench_lib.impl("active_py", _ops._active_kernel, "CompositeExplicitAutograd")
    dump = torch._C._dispatch_dump("picklehooks::active")
    active_kernel = "C" if "csrc/kernels.c" in dump else "Python"

    value = _ops.VALUE | _ops.STATS
    tap = _ops.GRAD | _ops.STATS | _ops.COUNTED  # what a scripted hook's tap passes: the gradient only
    functions = {
        "an empty scripted function (reference)": (script("pass"), x),
        f"active (what an idle scripted hook asks; its kernel here: {active_kernel})":
            (script("torch.ops.picklehooks.active(7)"), x),
        "active's Python kernel (what it is without picklehooks._speedups)":
            (script("torch.ops.picklehooks_bench.active_py(7)"), x),
        "record, while nothing records": (script(f"torch.ops.picklehooks.record(x, 'm', 'output', '', {value})"), x),
        "record, recording statistics": (script(f"torch.ops.picklehooks.record(x, 'm', 'output', '', {value})"), x),
        "x.clone() (reference)": (script("x = x.clone()"), x_grad),
        "record, recording statistics, then x.clone()":
            (script(f"torch.ops.picklehooks.record(x, 'm', 'output', '', {value})\n    x = x.clone()"), x),
        "the same in one torch.library.custom_op, recording":
            (script(f"x = torch.ops.picklehooks_bench.record_copy(x, 'm', 'output', '', {value})"), x),
        "tap, on a value that requires grad (forward)":
            (script(f"x = torch.ops.picklehooks.tap(x, 'm', 'output', '', {tap})"), x_grad),
        "tap, on a value that doesn't require grad (a traced graph under no_grad)":
            (script(f"x = torch.ops.picklehooks.tap(x, 'm', 'output', '', {tap})"), x),
    }
    why_not = _load_cpp_noop_op()
    if why_not is None:
        functions["an op whose C++ kernel does nothing (reference)"] = \
            (script(f"torch.ops.picklehooks_bench.noop(x, 'm', 'output', '', {value})"), x)
    times: dict[str, list[float]] = {name: [] for name in functions}
    gc.disable()
    try:
        for r in range(rounds):
            names = list(functions)
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, arg = functions[name]
                with picklehooks.record() if "recording" in name else _nothing() as log:
                    t0 = time.thread_time()
                    for _ in range(calls):
                        fn(arg)
                    times[name].append((time.thread_time() - t0) / calls * 1e6)
                if log is not None:
                    log._records.clear()
                    log._rows.clear()
    finally:
        gc.enable()
    print(f"\nOne op call from TorchScript ({rounds} interleaved rounds of {calls} calls; one 32 x 256 float32 "
          "value; µs per call of the scripted function, median thread time).\n")
    print("| scripted function calls | µs per call |")
    print("| :--- | ---: |")
    for name, samples in times.items():
        print(f"| {name} | {statistics.median(samples):.2f} |")
    if why_not is not None:
        print(f"\n(No C++ reference op: {why_not}.)")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
