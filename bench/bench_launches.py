"""Operator launches per record on the path a GPU takes, counted on the CPU (issue #30's proxy).

Run from the repository root (a few seconds)::

    .venv/bin/python bench/bench_launches.py

On a GPU, every aten operator that runs a kernel is a launch, and at these
models' sizes launch latency, not arithmetic, is what recording costs
(``bench/results/logging_cuda.md``). The native statistics pass is CPU-only,
so a GPU takes the batched path (:mod:`picklehooks.capture.pending`): one copy
of each recorded tensor into its dtype's arena, and a fixed number of
reductions per arena when the statistics are read. This script runs that
path on the CPU (``PICKLEHOOKS_NATIVE=0``, set here before picklehooks is
imported) under ``torch.profiler`` and counts, per forward+backward,
un-instrumented and recording statistics (and reading them), for the bench's
MLP and 2-layer transformer: the operators that run a kernel, judged by
their schemas (:func:`launches_kernel`), and the leaf operators (those that
call no other). The figure that matters is kernels per record.

Counts, not times: they are the same on any host. Limits: a GPU runs some
operators as several kernels, and the count includes the read's reductions,
which a GPU pays once per log and dtype, not per record. ``--device cuda``
checks the proxy where it matters: the same models on the GPU, counting the
kernels (and memory copies and sets) the profiler sees the device run, beside
the CPU-side proxy of the same step.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable

os.environ["PICKLEHOOKS_NATIVE"] = "0"  # the non-CPU path, on the CPU

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import picklehooks  # noqa: E402
from picklehooks.capture import pending  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logging import checked_device, make_mlp, make_transformer  # noqa: E402
from bench_sizes import ResNet18  # noqa: E402


# Allocation only: a caching allocator hands out memory without a kernel.
_ALLOCATORS = frozenset({"empty", "empty_strided"})


@functools.cache
def launches_kernel(name: str) -> bool:
    """Whether the aten operator ``name`` (``aten::x``) runs a kernel, judged by its schema: not
    when every overload returns no tensor (``result_type``) or only views of its inputs (aliases
    that aren't written: ``view``, ``as_strided``, ``detach``, a ``to`` that copies nothing), and
    not for the allocators. An in-place op (``copy_``, an alias that is written) does."""
    op = name.split("::", 1)[1]
    if op in _ALLOCATORS:
        return False
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return True
    for overload in packet.overloads():
        tensors = [r for r in getattr(packet, overload)._schema.returns if "Tensor" in str(r.type)]
        if any(r.alias_info is None or r.alias_info.is_write for r in tensors):
            return True
    return False


def _kernel_below(event) -> bool:
    """Whether an aten operator that ``event`` calls (at any depth) runs a kernel."""
    return any(launches_kernel(c.name) or _kernel_below(c) for c in event.cpu_children
               if c.name.startswith("aten::"))


def leaf_aten_ops(step) -> tuple[int, int, int]:
    """Aten operators that ``step()`` runs in this thread and autograd's: the leaves (those that
    call no other); the kernels: operators that run one (:func:`launches_kernel`) and call none
    that does (so ``where``, whose only children allocate, counts, and ``to``, whose ``copy_``
    does the work, doesn't); and the dispatched ones: those no other aten operator called (from
    Python, or from autograd's engine), each a trip through the dispatcher from the host."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = sum(1 for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children))
    kernels = sum(1 for e in events if launches_kernel(e.name) and not _kernel_below(e))
    dispatched = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return leaves, kernels, dispatched


def device_kernels(step) -> int:
    """What ``step()`` makes the GPU run, as the profiler sees it: kernels, memory copies and sets
    (each a launch). Where this torch build reports no device events, the CUDA runtime's launch
    calls are counted instead."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    on_device = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    if on_device:
        return on_device
    return sum(1 for e in events if e.name.startswith(("cudaLaunchKernel", "cudaMemcpy", "cudaMemset")))


def _models(device: torch.device, smoke: bool) -> list[tuple[str, nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    """(label, model, step loss): the bench's MLP and transformer, a GPT-2-small-sized model (2 x 32
    tokens: counts don't depend on the sequence's length) and ResNet-18's layout (2 x 64 px: nor on
    the image's size); ``smoke`` shrinks GPT-2 to one small layer."""
    out = []
    for label, make in (("MLP (36 modules, batch 32)", make_mlp),
                        ("Transformer (2 encoder layers, d_model 64, batch 8 x 16)", make_transformer)):
        model, x = make()
        out.append((label, model.to(device), lambda m, x=x.to(device): m(x).sum()))
    try:
        import transformers as tf
    except ImportError:
        print("GPT-2 small: transformers is not installed (pip install transformers), skipped.\n")
    else:
        tf.logging.set_verbosity_error()
        torch.manual_seed(0)
        sizes = {"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 1000} if smoke else {}
        gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(attn_implementation="eager", **sizes)).eval().to(device)
        gpt2.config.use_cache = False
        ids = torch.randint(0, gpt2.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
        out.append(("GPT-2 small" + (" (smoke: 1 layer, 64 wide)" if smoke else " (124M parameters, 2 x 32 tokens)"),
                    gpt2, lambda m, ids=ids: m(input_ids=ids, labels=ids).loss))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64).to(device)
    out.append(("ResNet-18 layout (batch 2, 64 px)", ResNet18().train().to(device), lambda m, x=x: m(x).sum()))
    return out


def _copies_only(pending, x, site, copy=False):
    """The path before values were kept by reference: every record copied into its arena."""
    return pending.add(x.detach() if x.requires_grad else x)[0]


def read_alone(model, loss) -> int:
    """Kernels that reading a recorded step's statistics runs, beyond recording it (its last reductions)."""
    with picklehooks.record() as log:
        loss(model).backward()
    return leaf_aten_ops(lambda: [r.stats for r in log.records])[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default: the proxy alone) or cuda[:N] "
                        "(the same models on the GPU: kernels counted on the device beside the proxy)")
    parser.add_argument("--smoke", action="store_true", help="a one-layer GPT-2 (for the test suite)")
    args = parser.parse_args()
    device = checked_device(parser, args.device)
    assert not picklehooks._native.AVAILABLE, "PICKLEHOOKS_NATIVE=0 must switch the native pass off"
    rows = []
    for label, model, loss in _models(device, args.smoke):
        def plain():
            loss(model).backward()
        plain()
        base = leaf_aten_ops(plain)
        base_device = device_kernels(plain) if device.type == "cuda" else None
        for capture in ("defaults", "all"):
            counted = {}
            for path in ("copies", "references"):
                pending._SITES.clear()
                handle = picklehooks.instrument(model, **({} if capture == "defaults" else {"capture": "all"}))
                records = []

                def recording():
                    with picklehooks.record() as log:
                        loss(model).backward()
                        for r in log.records:
                            r.stats  # noqa: B018 - reading them runs the batch reductions
                    records.append(len(log.records))

                saved = pending._Pending.add_value
                if path == "copies":
                    pending._Pending.add_value = _copies_only
                try:
                    recording(), recording()  # the first learns which values get changed in place; caches
                    ops = leaf_aten_ops(recording)
                    launched = device_kernels(recording) if device.type == "cuda" else None
                    if path == "references":
                        read = read_alone(model, loss)
                finally:
                    pending._Pending.add_value = saved
                    handle.remove()
                    model.zero_grad(set_to_none=True)
                counted[path] = (records[-1], ops, launched)
            rows.append((label, capture, base, base_device, counted, read))
    print("### Operator launches per record (the GPU path, counted on the CPU)\n")
    where = f"on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "on the CPU"
    print(f"torch {torch.__version__}, {where}; `PICKLEHOOKS_NATIVE=0`; aten operators per forward+backward, "
          "recording statistics (of every output and output gradient with `instrument()`'s defaults; of every "
          "input, output, gradient, parameter and buffer with `capture=\"all\"`) and reading them, after a step "
          "that learned which values get changed in place. *Copies*: every record copied into its arena when "
          "recorded (the batching before this one; the rest of the eager path as now); *references*: the "
          "values kept by reference and laid out when reduced.\n")
    print("| model | capture | records | kernels per record: copies | references "
          "| dispatched ops per record: copies | references | leaf ops per record: copies | references |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, capture, base, _, counted, _ in rows:
        n = counted["references"][0]
        per = {p: [(c[1][i] - base[i]) / c[0] for i in (1, 2, 0)] for p, c in counted.items()}
        print(f"| {label} | {capture} | {n} | " + " | ".join(
            f"{per['copies'][i]:.2f} | {per['references'][i]:.2f}" for i in range(3)) + " |")
    print("\nKernels: operators that run one and call none that does (views, metadata and allocations "
          "run none; see `launches_kernel`); dispatched ops: operators no other operator called (what "
          "Python and autograd's engine dispatch, each several microseconds of host time on a GPU); leaf "
          "ops: operators that call no other. Read each per record as a step's total over its records: a "
          "read's reductions are a fixed number per (device, dtype), whatever the records. On the CPU "
          "`cat` slices its output once per input (leaf ops, not dispatched ones); CUDA's copies up to "
          "128 inputs per kernel.")
    print("\n#### The references path's kernels: the step's, and the read's alone\n")
    print("Issue #38's targets: at most 0.25 added kernels per record with `instrument()`'s defaults, 0.5 with "
          "`capture=\"all\"` (GPT-2 small, ResNet-18). *The read alone*: the kernels that reading the "
          "statistics of a recorded step runs (its last reductions, one per (device, dtype): about 60 "
          "operators each for float32, whatever the records), over the step's records; *the step*: the rest "
          "(copies of values that a later operator changes in place, the reductions the pending budget "
          "forces, values large enough to be reduced alone).\n")
    print("| model | capture | records | kernels per record | of which the step | of which the read alone | target |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, capture, base, _, counted, read in rows:
        n, ops = counted["references"][0], counted["references"][1]
        total = (ops[1] - base[1]) / n
        target = "0.25" if capture == "defaults" else "0.5"
        print(f"| {label} | {capture} | {n} | {total:.2f} | {total - read / n:.2f} | {read / n:.2f} | {target} |")
    if device.type == "cuda":
        print("\n#### Launches the GPU ran (torch.profiler, CUDA activity), per record\n")
        print("| model | capture | records | copies | references |")
        print("|---|---|---:|---:|---:|")
        for label, capture, _, base_device, counted, _ in rows:
            n = counted["references"][0]
            print(f"| {label} | {capture} | {n} | {(counted['copies'][2] - base_device) / n:.2f} "
                  f"| {(counted['references'][2] - base_device) / n:.2f} |")


if __name__ == "__main__":
    main()
