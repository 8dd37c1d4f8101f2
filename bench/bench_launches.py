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

os.environ["PICKLEHOOKS_NATIVE"] = "0"  # the non-CPU path, on the CPU

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import picklehooks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logging import checked_device, make_mlp, make_transformer  # noqa: E402


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


def leaf_aten_ops(step) -> tuple[int, int]:
    """Aten operators that ``step()`` runs in this thread and autograd's: the leaves (those that
    call no other), and the kernels: operators that run one (:func:`launches_kernel`) and call none
    that does (so ``where``, whose only children allocate, counts, and ``to``, whose ``copy_``
    does the work, doesn't)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = sum(1 for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children))
    kernels = sum(1 for e in events if launches_kernel(e.name) and not _kernel_below(e))
    return leaves, kernels


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default: the proxy alone) or cuda[:N] "
                        "(the same models on the GPU: kernels counted on the device beside the proxy)")
    device = checked_device(parser, parser.parse_args().device)
    assert not picklehooks._native.AVAILABLE, "PICKLEHOOKS_NATIVE=0 must switch the native pass off"
    torch.manual_seed(0)
    rows = []
    for label, make in (("MLP (36 modules, batch 32)", make_mlp),
                        ("Transformer (2 encoder layers, d_model 64, batch 8 x 16)", make_transformer)):
        model, x = make()
        model, x = model.to(device), x.to(device)

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
        base_device = device_kernels(plain) if device.type == "cuda" else None
        picklehooks.instrument(model)
        recorded = leaf_aten_ops(recording)
        recorded_device = device_kernels(recording) if device.type == "cuda" else None
        n = records[-1]
        rows.append((label, n, base, recorded, base_device, recorded_device))
    print("### Operator launches per record (the GPU path, counted on the CPU)\n")
    where = f"on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "on the CPU"
    print(f"torch {torch.__version__}, {where}; `PICKLEHOOKS_NATIVE=0`; aten operators per forward+backward, "
          "recording statistics of every output and output gradient (`instrument()`'s defaults) and reading them.\n")
    print("| model | records | kernels: un-instrumented | kernels: recording | kernels per record "
          "| leaf ops: un-instrumented | leaf ops: recording | leaf ops per record |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, (base, base_k), (recorded, recorded_k), _, _ in rows:
        print(f"| {label} | {n} | {base_k} | {recorded_k} | {(recorded_k - base_k) / n:.2f} "
              f"| {base} | {recorded} | {(recorded - base) / n:.1f} |")
    print("\nKernels: operators that run one and call none that does (views, metadata and allocations "
          "run none; see `launches_kernel`); leaf ops: operators that call no other.")
    if device.type == "cuda":
        print("\n#### Launches the GPU ran (torch.profiler, CUDA activity)\n")
        print("| model | records | un-instrumented | recording | launches per record |")
        print("|---|---:|---:|---:|---:|")
        for label, n, _, _, base_device, recorded_device in rows:
            print(f"| {label} | {n} | {base_device} | {recorded_device} | {(recorded_device - base_device) / n:.2f} |")


if __name__ == "__main__":
    main()
