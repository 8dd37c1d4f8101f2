"""Benchmark of picklehooks' serializer: name sizes, decode latency, torch.save/load.

Run from the repository root (about a minute on 2 idle CPU cores)::

    .venv/bin/python bench/bench_serializer.py            # default: 9 fresh-process loads per variant
    .venv/bin/python bench/bench_serializer.py --reps 15  # more repetitions, steadier medians

It prints Markdown tables (progress goes to stderr, so stdout can be pasted
into the README as is). Every figure comes from this one run, on this
machine; nothing is asserted, the targets are printed next to the figures.

What it measures:

1. **Name size.** For each hook in ``bench/representative_hooks.py``: the
   length of the module text ``portable()`` encodes
   (``picklehooks.serialize.portable.module_text``), the length of its name in the
   current format (zstd with the raw-content dictionary ``_DICTIONARY_1``),
   and the length of the name the same zstd settings give *without* a
   dictionary (a temporary format letter mapped to ``None``, removed again
   afterwards), which shows what the dictionary buys. Ratio = name / source.
2. **First-decode latency.** ``codec.decode(name)`` alone (also with the
   shim's cached zstd dictionary object dropped before each sample, which is
   what the first name a process decodes pays), and a complete first
   resolution (decode + parse + shape check + compile + exec) through a
   *fresh* ``_HubLoader`` attached to a fresh module for every sample, so no
   sample finds a cached hook. Medians in microseconds, garbage collector off
   during sampling (as ``timeit`` does).
3. **torch.save / torch.load** of an ``nn.Sequential`` of 50 blocks of
   (Linear(32, 32), LayerNorm(32), GELU) -- 151 modules counting the root --
   in four variants, with a forward hook on *every* module:

   (a) no hooks;
   (b) one portable hook, the same function on every module;
   (c) three distinct portable hooks, round-robin over the modules;
   (d) the originals of (c): closures made per module by their factories
       (``make_clamp(1.0)``, ...), saved with ``pickle_module=cloudpickle``,
       which pickles closures by value.

   Save time is an in-process median. Load time is measured in a *fresh
   interpreter per sample* (``python -c`` that imports torch, picklehooks and
   cloudpickle, then times only ``torch.load(path, weights_only=False)``), so
   the portable variants pay their first-decode cost in every sample. One
   untimed process first loads every file (page cache, imports); then the
   variants are interleaved, one sample of each per round, in an order that
   rotates each round. Medians are reported, and the ratio of minimums
   too, since other work on the machine only ever adds time.

   The per-module cost "beyond the first occurrence of each distinct hook"
   is a slope: the same variant is saved at 25 and 50 blocks (76 and 151
   modules), the size difference is divided by the 75 extra modules, and the
   same slope without hooks is subtracted. The first occurrence of each name
   is in both files and cancels. Each model's hook ids start at the same
   value, because they pickle as ints whose width depends on their size.
   File sizes move in steps (``torch.save``'s zip aligns records to 64
   bytes), so the slope of the pickle alone (``data.pkl`` inside the
   archive) is printed too; it is exact.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import cloudpickle
import torch
import torch.nn as nn
import zstandard

import picklehooks
from picklehooks import _shim, codec
from picklehooks.serialize.portable import module_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
import representative_hooks as rh  # noqa: E402 - needs the path above
from _machine import cpu_model  # noqa: E402

# Targets, printed next to the figures they are about.
TARGET_LOAD_RATIO = 1.2  # load time with portable hooks / load time without hooks
TARGET_BYTES_PER_MODULE = 32  # per hooked module, beyond the first occurrence of each hook

N_BLOCKS = 50  # the model of part 3: 3 * 50 + 1 = 151 modules
N_BLOCKS_SMALL = 25  # the second point of the slope: 76 modules
HOOK_ID_START = 1000  # first hook id of every model (see hooked_model)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Output helpers


def table(headers: list[str], rows: list[list[object]], align: str | None = None) -> str:
    """A Markdown table; ``align`` has one letter per column, 'l' or 'r' (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in row] for row in rows]
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def machine_info() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return table(
        ["Item", "Value"],
        [
            ["CPU", cpu_model()],
            ["CPU count (usable / os.cpu_count)", f"{usable} / {os.cpu_count()}"],
            ["torch threads", torch.get_num_threads()],
            ["OS", platform.platform()],
            ["Python", platform.python_version()],
            ["torch", torch.__version__],
            ["zstandard", f"{zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})"],
            ["cloudpickle", cloudpickle.__version__],
            ["picklehooks", f"{picklehooks.__version__}, format {_shim.CURRENT_FORMAT!r}"],
        ],
        "ll",
    )


# --------------------------------------------------------------------------
# 1. Name size


@contextlib.contextmanager
def format_without_dictionary():
    """Register a temporary format letter whose zstd dictionary is None; yield the letter."""
    letter = next(c for c in "zyxwvu" if c not in _shim.FORMATS)
    _shim.FORMATS[letter] = None
    try:
        yield letter
    finally:
        del _shim.FORMATS[letter]
        # Drop what was cached for the temporary letter (compressor, decompression dictionary).
        for cached in (codec._compressor, getattr(_shim, "_zstd_dict", None)):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()


def bench_name_sizes() -> tuple[str, dict[str, str]]:
    rows, ratios, ratios_plain, names = [], [], [], {}
    with format_without_dictionary() as plain:
        for label, (kind, fn) in rh.HOOKS.items():
            source = module_text(fn)
            name = codec.encode(source)
            plain_name = codec.encode(source, format=plain)
            if codec.decode(name) != source or codec.decode(plain_name) != source:
                raise RuntimeError(f"{label}: a name does not decode back to its source")
            names[label] = name
            n_src = len(source.encode())
            ratio, ratio_plain = len(name) / n_src, len(plain_name) / n_src
            ratios.append(ratio)
            ratios_plain.append(ratio_plain)
            rows.append([f"`{label}`", kind, n_src, len(name), f"{ratio:.2f}", len(plain_name),
                         f"{ratio_plain:.2f}", len(plain_name) - len(name)])
    mean, mean_plain = statistics.mean(ratios), statistics.mean(ratios_plain)
    rows.append(["**mean**", "", "", "", f"**{mean:.2f}**", "", f"**{mean_plain:.2f}**", ""])
    text = table(
        ["Hook", "Kind", "Source bytes", "Name chars", "Name / source",
         "Name chars, no dictionary", "Name / source, no dictionary", "Chars the dictionary saves"],
        rows,
        "llrrrrrr",
    )
    return text + f"\n\nMean name/source ratio: **{mean:.2f}** with the dictionary, {mean_plain:.2f} without.", names


# --------------------------------------------------------------------------
# 2. First-decode latency


def median_us(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:.0f}"


def fresh_hub(number: int) -> _shim._HubLoader:
    """A new hub loader bound to a new, empty module: nothing is decoded or cached in it."""
    loader = _shim._HubLoader(f"bench_hub_{number}", f"<bench>/hub_{number}.py")
    module = types.ModuleType(loader.module_name)
    if hasattr(loader, "bind"):
        loader.bind(module.__dict__)
    else:  # the shim's earlier API
        loader.attach(module)
    return loader


def bench_decode(names: dict[str, str], reps: int) -> str:
    # The shim may cache the zstd dictionary object per format letter; the first
    # name a process decodes pays for building it. Clearing that cache before a
    # sample measures that cold first decode.
    clear_dictionary = getattr(getattr(_shim, "_zstd_dict", None), "cache_clear", None)
    rows = []
    hubs = 0
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for label, name in names.items():
            cold_s, decode_s, resolve_s = [], [], []
            for _ in range(reps):
                if clear_dictionary:
                    clear_dictionary()
                t0 = time.perf_counter()
                codec.decode(name)
                cold_s.append(time.perf_counter() - t0)
            for _ in range(reps):
                t0 = time.perf_counter()
                codec.decode(name)
                decode_s.append(time.perf_counter() - t0)
            for _ in range(reps):
                hubs += 1
                loader = fresh_hub(hubs)
                t0 = time.perf_counter()
                fn = loader.resolve(name)
                resolve_s.append(time.perf_counter() - t0)
                if not callable(fn) or fn.__name__ != name:
                    raise RuntimeError(f"{label}: resolve() returned {fn!r}")
            share = 1 - statistics.median(decode_s) / statistics.median(resolve_s)
            rows.append([f"`{label}`", len(name), median_us(cold_s), median_us(decode_s),
                         median_us(resolve_s), f"{share:.0%}"])
    finally:
        if gc_was_enabled:
            gc.enable()
    note = (
        "the shim caches the dictionary per format, so only a process's first decode pays the cold figure"
        if clear_dictionary
        else "this shim builds the dictionary on every decode, so both decode columns measure the same thing"
    )
    return table(
        ["Hook", "Name chars", "decode µs, cold dictionary", "decode µs", "decode + parse + compile + exec µs",
         "Share not in decode"],
        rows,
    ) + (
        f"\n\nMedians of {reps} samples each. Resolve samples use a fresh `_HubLoader` and module every time "
        f"(dictionary warm); {note}."
    )


# --------------------------------------------------------------------------
# 3. torch.save / torch.load


def build_model(n_blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_blocks):
        layers += [nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU()]
    return nn.Sequential(*layers)


# The factories of variant (c)/(d); their closures are the "non-portable originals".
FACTORIES = [(rh.make_clamp, 1.0), (rh.make_scale, 0.5), (rh.make_nan_guard, 1e4)]

VARIANTS = {
    "a": "(a) no hooks",
    "b": "(b) 1 portable hook on every module",
    "c": "(c) 3 distinct portable hooks, round-robin",
    "d": "(d) closures of (c) per module, cloudpickle",
}


def hooked_model(variant: str, n_blocks: int) -> nn.Sequential:
    # Hook ids come from a process-global counter and pickle as 2-, 3- or 5-byte
    # ints depending on their size; start every model at the same id so that
    # variants and module counts compare fairly (1000: a process that has
    # registered some hooks already, as real ones have).
    torch.utils.hooks.RemovableHandle.next_id = HOOK_ID_START
    model = build_model(n_blocks)
    modules = list(model.modules())
    if variant == "b":
        hook = picklehooks.portable(rh.make_clamp(1.0))
        hooks = [hook] * len(modules)
    elif variant == "c":
        distinct = [picklehooks.portable(factory(arg)) for factory, arg in FACTORIES]
        hooks = [distinct[i % len(distinct)] for i in range(len(modules))]
    elif variant == "d":  # a new closure per module, as code that doesn't know picklehooks makes them
        hooks = []
        for i in range(len(modules)):
            factory, arg = FACTORIES[i % len(FACTORIES)]
            hooks.append(factory(arg))
    else:
        hooks = []
    for module, hook in zip(modules, hooks):
        module.register_forward_hook(hook)
    return model


def save(model: nn.Module, path: Path, variant: str) -> None:
    if variant == "d":
        torch.save(model, path, pickle_module=cloudpickle)
    else:
        torch.save(model, path)


def pickle_bytes(path: Path) -> int:
    """Size of the pickle inside a torch.save archive (its data.pkl record)."""
    with zipfile.ZipFile(path) as archive:
        return next(info.file_size for info in archive.infolist() if info.filename.endswith("/data.pkl"))


# The child interpreter of a load sample: imports first, then times torch.load alone.
LOAD_CHILD = r"""
import json, sys, time
import torch, picklehooks, cloudpickle
torch.set_num_threads(1)
results = []
for path in sys.argv[1:]:
    t0 = time.perf_counter()
    model = torch.load(path, weights_only=False)
    seconds = time.perf_counter() - t0
    hooks = [h for m in model.modules() for h in m._forward_hooks.values()]
    results.append({"seconds": seconds, "modules": len(list(model.modules())), "hooks": len(hooks),
                    "portable": sum(map(picklehooks.is_portable, hooks)),
                    "distinct": len({id(h) for h in hooks})})
print(json.dumps(results))
"""


def load_in_fresh_process(*paths: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_CHILD, *map(str, paths)],
        capture_output=True, text=True, env=env, cwd=paths[0].parent, timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load child failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout)


def bench_save_load(workdir: Path, reps: int) -> str:
    sizes: dict[tuple[str, int], tuple[int, int]] = {}  # (variant, blocks) -> (file bytes, pickle bytes)
    save_ms: dict[str, float] = {}
    modules: dict[int, int] = {}
    paths: dict[str, Path] = {}
    for variant in VARIANTS:
        for n_blocks in (N_BLOCKS_SMALL, N_BLOCKS):
            model = hooked_model(variant, n_blocks)
            modules[n_blocks] = len(list(model.modules()))
            path = workdir / f"{variant}_{n_blocks}.pt"
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                save(model, path, variant)
                samples.append(time.perf_counter() - t0)
            sizes[variant, n_blocks] = (path.stat().st_size, pickle_bytes(path))
            if n_blocks == N_BLOCKS:
                save_ms[variant] = statistics.median(samples) * 1e3
                paths[variant] = path
    n = modules[N_BLOCKS]
    log(f"  saved; loading each variant {reps} times, one fresh interpreter per load ...")

    # One untimed round warms the page cache and the .pyc files; then interleaved rounds.
    load_in_fresh_process(*paths.values())
    load_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for rnd in range(reps):
        for variant in order[rnd % len(order):] + order[: rnd % len(order)]:  # rotate the order each round
            (result,) = load_in_fresh_process(paths[variant])
            expected = {  # (modules, hooks, portable hooks, distinct hook objects)
                "a": (n, 0, 0, 0), "b": (n, n, n, 1), "c": (n, n, n, len(FACTORIES)), "d": (n, n, 0, n),
            }[variant]
            got = (result["modules"], result["hooks"], result["portable"], result["distinct"])
            if got != expected:
                raise RuntimeError(f"variant {variant} loaded wrongly: {result}, expected {expected}")
            load_s[variant].append(result["seconds"])
        log(f"  round {rnd + 1}/{reps} done")

    base_file = sizes["a", N_BLOCKS][0]
    load_a = statistics.median(load_s["a"])
    load_rows, slope_rows, slopes = [], [], {}
    span = modules[N_BLOCKS] - modules[N_BLOCKS_SMALL]
    no_hook_file = (sizes["a", N_BLOCKS][0] - sizes["a", N_BLOCKS_SMALL][0]) / span
    no_hook_pkl = (sizes["a", N_BLOCKS][1] - sizes["a", N_BLOCKS_SMALL][1]) / span
    for variant, label in VARIANTS.items():
        file_bytes, pkl = sizes[variant, N_BLOCKS]
        median_load = statistics.median(load_s[variant])
        ratio = median_load / load_a
        ratio_min = min(load_s[variant]) / min(load_s["a"])
        target = "" if variant == "a" else (f"≤ {TARGET_LOAD_RATIO}×: {verdict(ratio <= TARGET_LOAD_RATIO)}"
                                              if variant in "bc" else "(reference)")
        load_rows.append([
            label, f"{file_bytes:,}", f"{pkl:,}",
            "" if variant == "a" else f"{(file_bytes - base_file) / n:.1f}",
            f"{save_ms[variant]:.1f}",
            f"{median_load * 1e3:.1f} ({min(load_s[variant]) * 1e3:.1f}–{max(load_s[variant]) * 1e3:.1f})",
            f"{ratio:.2f}×", f"{ratio_min:.2f}×", target,
        ])
        if variant == "a":
            continue
        file_slope = (file_bytes - sizes[variant, N_BLOCKS_SMALL][0]) / span - no_hook_file
        pkl_slope = (pkl - sizes[variant, N_BLOCKS_SMALL][1]) / span - no_hook_pkl
        slopes[variant] = pkl_slope
        target = (f"≤ {TARGET_BYTES_PER_MODULE}: {verdict(pkl_slope <= TARGET_BYTES_PER_MODULE)}"
                  if variant in "bc" else "(reference)")
        slope_rows.append([label, f"{sizes[variant, N_BLOCKS_SMALL][0]:,}", f"{file_bytes:,}",
                           f"{file_slope:.1f}", f"{pkl_slope:.1f}", target])

    out = [
        f"Model: `nn.Sequential` of {N_BLOCKS} × (Linear(32, 32), LayerNorm(32), GELU): "
        f"**{n} modules** (`len(list(model.modules()))`), a forward hook on every one of them in (b)–(d).",
        "",
        table(
            ["Variant", "File bytes", "data.pkl bytes", "Bytes per hooked module vs (a)", "Save ms",
             f"Load ms, median (min–max) of {reps} fresh processes", "Load / (a), medians",
             "Load / (a), minimums", "Target"],
            load_rows, "lrrrrrrrl",
        ),
        "",
        "`(size − size(a)) / modules` includes the first occurrence of each distinct hook name. "
        "The cost of each further hooked module, as the slope between "
        f"{modules[N_BLOCKS_SMALL]} and {modules[N_BLOCKS]} modules minus the slope without hooks "
        f"({no_hook_file:.1f} file bytes, {no_hook_pkl:.1f} pickle bytes per module):",
        "",
        table(
            ["Variant", f"File bytes, {modules[N_BLOCKS_SMALL]} modules", f"File bytes, {modules[N_BLOCKS]} modules",
             "Extra file bytes per hooked module", "Extra data.pkl bytes per hooked module (exact)", "Target"],
            slope_rows, "lrrrrl",
        ),
        "",
        "Load times are medians; the ratio of minimums is printed too because other work on the machine "
        "only ever adds time, so a wide min–max spread means the medians are noisy.",
    ]

    summary = []
    for variant in "bc":
        ratio = statistics.median(load_s[variant]) / load_a
        ratio_min = min(load_s[variant]) / min(load_s["a"])
        summary.append([f"{VARIANTS[variant]}: load time / (a), medians (minimums)", f"≤ {TARGET_LOAD_RATIO}×",
                        f"{ratio:.2f}× ({ratio_min:.2f}×)", verdict(ratio <= TARGET_LOAD_RATIO)])
        summary.append([f"{VARIANTS[variant]}: bytes per further hooked module", f"≤ {TARGET_BYTES_PER_MODULE}",
                        f"{slopes[variant]:.1f}", verdict(slopes[variant] <= TARGET_BYTES_PER_MODULE)])
    for variant in "bc":
        smaller = sizes[variant, N_BLOCKS][0] < sizes["d", N_BLOCKS][0]
        faster = statistics.median(load_s[variant]) < statistics.median(load_s["d"])
        summary.append([f"{VARIANTS[variant]} vs (d) cloudpickle: file size", "smaller",
                        f"{sizes[variant, N_BLOCKS][0]:,} vs {sizes['d', N_BLOCKS][0]:,}", verdict(smaller)])
        summary.append([f"{VARIANTS[variant]} vs (d) cloudpickle: load time", "faster",
                        f"{statistics.median(load_s[variant]) * 1e3:.1f} vs "
                        f"{statistics.median(load_s['d']) * 1e3:.1f} ms", verdict(faster)])
    out += ["", "### Targets", "", table(["Figure", "Target", "Measured", "Met"], summary, "llrl")]
    return "\n".join(out)


# --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="fresh-process loads (and saves) per variant")
    parser.add_argument("--decode-reps", type=int, default=200, help="samples per hook in part 2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()

    print("## picklehooks serializer benchmark\n")
    print(machine_info())

    log("1. name sizes ...")
    text, names = bench_name_sizes()
    print(f"\n### 1. Name length vs source length ({len(names)} representative hooks)\n")
    print(text)

    log("2. first-decode latency ...")
    print("\n### 2. First-decode latency\n")
    print(bench_decode(names, args.decode_reps))

    log("3. torch.save / torch.load ...")
    print("\n### 3. torch.save / torch.load\n")
    with tempfile.TemporaryDirectory(prefix="picklehooks-bench-") as tmp:
        print(bench_save_load(Path(tmp), args.reps))

    print(f"\n_Benchmark wall time: {time.perf_counter() - started:.0f} s._")


if __name__ == "__main__":
    main()
