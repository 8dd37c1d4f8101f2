"""Recording at real model sizes: a GPT-2-small-sized transformer and a ResNet-18-sized CNN.

Run from the repository root (a few minutes on one CPU thread)::

    .venv/bin/python bench/bench_sizes.py --rounds 5

``bench_logging.py`` measures tiny models, where a hook's fixed cost is most of
the step; this script measures the sizes people train, where the cost that
counts is the statistics' pass over each value:

* ``gpt2``: ``transformers.GPT2LMHeadModel`` from the default ``GPT2Config``
  (12 layers, n_embd 768, 124M parameters, random init, eager attention,
  eval mode: no dropout), input ids 2 x 128, forward+backward of ``.loss``.
  Skipped with a message where ``transformers`` isn't installed.
* ``resnet``: ResNet-18's layout (BasicBlocks [2, 2, 2, 2], 11.7M parameters)
  written here with ``torch.nn`` (no torchvision), batch 8 x 3 x 224 x 224,
  forward+backward of the logits' sum, training mode (BatchNorm updates its
  running statistics, as in training).

Variants, all on one model (each sample puts its hooks on, makes one untimed
call, is timed and takes them off again; see ``bench_logging.measure``):
un-instrumented; ``instrument()``'s defaults, not recording; recording the
statistics of the defaults (every output and output gradient); recording the
statistics of everything (``capture=`` every input, output, gradient,
parameter and parameter gradient), the figure issue #30 targets for GPT-2
small (≤ 1.05× on CPU, ≤ 1.10× on a GPU; the ResNet has no target: its
activations are large against its compute, and reading them all, about 317M
values a step at about 0.16 ns each, is 5% of its step by itself). Ratios
are of thread CPU time on the CPU and of wall clock on a GPU (``--device
cuda``), as in ``bench_logging.py``. On the CPU, a floor in the same run: the un-instrumented step, then the native statistics
of as many values of the same shapes as "everything" records (views of one
random buffer): the cost of reading each value once, which no recording of
them can go below.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

import picklehooks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logging import (  # noqa: E402
    BASE, QUIET, SUMMARY, Setup, Task, begin, checked_device, hf_task, instrumenting, measure, progress, recording,
    statistics_floor, summary, table, tensor_task, workload)

EVERYTHING = ("input", "output", "grad_input", "grad_output", "param", "param_grad")
DEFAULTS = "recording stats of instrument()'s defaults (+ reading them)"
ALL = "recording stats of every input, output, gradient and parameter (+ reading them)"
FLOOR = "un-instrumented, then the native statistics of as many values of the same sizes (floor of the row above)"
TARGETS = {"cpu": {ALL: 1.05}, "cuda": {ALL: 1.10}}
SECTIONS = ("gpt2", "resnet")


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (the same modules and shapes), written with torch.nn alone."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        cin = 64
        for i, width in enumerate(widths, 1):
            stride = 1 if i == 1 else 2
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(cin, width, stride), BasicBlock(width, width, 1)))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_gpt2_small(device: torch.device, smoke: bool) -> Task | None:
    try:
        import transformers as tf
    except ImportError:
        print("\nGPT-2 small: transformers is not installed (pip install transformers), skipped.")
        return None
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    sizes = {"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 1000} if smoke else {}
    model = tf.GPT2LMHeadModel(tf.GPT2Config(attn_implementation="eager", **sizes))
    model.config.use_cache = False
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    return hf_task(model.eval().to(device), ids.to(device))


def make_resnet(device: torch.device, smoke: bool) -> Task:
    torch.manual_seed(0)
    shape = (2, 3, 64, 64) if smoke else (8, 3, 224, 224)
    return tensor_task(ResNet18().train().to(device), torch.randn(shape).to(device))


def section(label: str, short: str, task: Task, setup: Setup, targets: dict[str, float]) -> None:
    params = sum(p.numel() for p in task.model.parameters())
    run = workload(task.model, task, backward=True)
    variants = {BASE: run, QUIET: run, DEFAULTS: recording(run, read_stats=True),
                ALL: recording(run, read_stats=True)}
    installs = {QUIET: instrumenting(task), DEFAULTS: instrumenting(task),
                ALL: instrumenting(task, capture=EVERYTHING)}
    if picklehooks._native.AVAILABLE and setup.device.type == "cpu":
        undo = installs[ALL]()
        try:
            variants[FLOOR] = statistics_floor(run, run)
        finally:
            undo()
    counts = {}
    for name in (DEFAULTS, ALL):
        undo = installs[name]()
        try:
            with picklehooks.record() as log:
                run()
            counts[name] = len(log.records)
        finally:
            undo()
    phase = f"{label} ({params / 1e6:.1f}M parameters), forward+backward"
    progress(f"measuring: {phase}")
    # A step takes seconds here: one call per sample, and one untimed call after each install.
    times = measure(variants, setup, installs=installs, warmup=1, settle=1, budget_s=0)
    table(phase, times, BASE, setup, targets, summary=f"{short} fwd+bwd")
    print(f"\nRecords per forward+backward: {counts[DEFAULTS]} (defaults), {counts[ALL]} (everything).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved samples per variant (default 5)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny inputs and a 1-layer GPT-2, to check that the script runs (figures meaningless)")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if not sections or any(s not in SECTIONS for s in sections):
        parser.error(f"--only: choose from {','.join(SECTIONS)}")
    device = checked_device(parser, args.device)
    setup = Setup(device, args.rounds)
    started = begin(setup, sections)
    if "gpt2" in sections:
        task = make_gpt2_small(device, args.smoke)
        if task is not None:
            section("GPT-2 small (12 layers, n_embd 768), input ids 2 x 128", "GPT-2 small", task, setup,
                    TARGETS[device.type])
    if "resnet" in sections:
        section("ResNet-18 layout, batch 8 x 3 x 224 x 224", "ResNet-18", make_resnet(device, args.smoke), setup, {})
    if SUMMARY:
        summary(setup)
    progress(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
