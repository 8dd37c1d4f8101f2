"""The benchmarks the README quotes still run (in a few rounds; their figures are not checked here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from picklehooks import _native

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_logging_bench_prints_its_tables():
    """One round of the MLP section: both workloads' tables, each with its per-record line, and the summary."""
    out = run("bench_logging.py", "--rounds", "1", "--only", "mlp", "--no-torchlens")
    assert out.count("#### MLP") == 2 and "#### Summary" in out, out
    lines = re.findall(r"per record \((\d+) per call\), µs: (.*)\.", out)
    assert [n for n, _ in lines] == ["36", "72"], out  # 36 outputs; and as many gradients
    for _, cells in lines:
        assert "recording stats (+ reading them): " in cells and "nan" not in cells, cells
    # The coverage line counts the instrumented modules while they are instrumented (not 0).
    assert re.search(r"MLP \(36 modules, batch 32\): 36 modules instrumented, 72 records", out), out


def test_launch_count_bench_prints_a_count_per_record():
    """The GPU path's operators per record, counted on the CPU, each model and capture on both paths:
    kernels are a subset of the leaf operators, and keeping values by reference runs fewer kernels."""
    out = run("bench_launches.py", "--smoke")
    number = r" (\d+\.\d\d) \|"
    rows = re.findall(r"^\| ([^|]+) \| (defaults|all) \| (\d+) \|" + number * 6 + "$", out, flags=re.M)
    assert [(r[0].split(" (")[0], r[1]) for r in rows] == [
        (m, c) for m in ("MLP", "Transformer", "GPT-2 small", "ResNet-18 layout") for c in ("defaults", "all")], out
    for _, _, records, *per in rows:
        kernels_copies, kernels_refs, _, _, leaves_copies, leaves_refs = map(float, per)
        assert int(records) > 0 and kernels_refs < kernels_copies
        assert kernels_copies <= leaves_copies and kernels_refs <= leaves_refs


def test_profile_prints_where_a_recording_step_spends():
    """The diagnostic's eager step: its Python functions (the forward hook among them) and its operators."""
    out = run("profile_record.py", "--no-compile")
    assert out.count("### ") == 1 and "eager, recording statistics" in out, out
    assert re.search(r"^\s+720\s.*_hookrt\.py:\d+\(forward\)", out, flags=re.M), out  # 36 hooks x 20 calls
    assert "Self CPU time total" in out, out


@pytest.mark.skipif(not _native.AVAILABLE, reason="the microbenchmark times the native path")
def test_record_path_microbench_prints_every_piece():
    out = run("bench_record_path.py", "--rounds", "2", "--calls", "20")
    rows = re.findall(r"^\| ([^|]+) \| (\d+\.\d\d) \|$", out, flags=re.M)
    # The pieces of one record (6 rows, then building Records by C and by the Python loop), then
    # one op call from TorchScript (10 rows, and the C++ reference op where it compiles).
    cpp = "No C++ reference op" not in out
    assert len(rows) == 18 + cpp and all(float(v) > 0 for _, v in rows), out
    assert [name for name, _ in rows[6:8]] == ["building one Record when read (C)",
                                               "building one Record when read (Python loop)"], out
    assert "One op call from TorchScript" in out and "torch.library.custom_op" in rows[15][0], out
    kernel = "C" if _native.AVAILABLE else "Python"
    assert f"its kernel here: {kernel})" in rows[9][0] and "Python kernel" in rows[10][0], out
    assert not cpp or "C++ kernel does nothing" in rows[-1][0], out
    lane_rows = re.findall(r"^\| (forward[^|]*)(?: \| -?\d+\.\d\d){4} \|$", out, flags=re.M)
    assert lane_rows == ["forward (no_grad)", "forward+backward"], out


def test_sizes_bench_prints_both_models_and_the_summary():
    """bench_sizes.py's tables, on shrunken models (--smoke): every variant, the record counts, the summary."""
    pytest.importorskip("transformers")
    out = run("bench_sizes.py", "--rounds", "1", "--smoke")
    assert out.count("#### GPT-2 small") == 1 and out.count("#### ResNet-18") == 1 and "#### Summary" in out, out
    counts = re.findall(r"^Records per forward\+backward: (\d+) \(defaults\), (\d+) \(everything\)\.$", out, flags=re.M)
    assert len(counts) == 2 and all(0 < int(d) < int(e) for d, e in counts), out
    assert out.count("| recording stats of every input, output, gradient and parameter") == 3, out


def test_instruction_bench_measures_what_it_says(tmp_path):
    """bench_instructions.py's measured step, run once without valgrind (which takes minutes): the
    floor computes and the recording records the bench's 36 outputs (and 36 gradients)."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_instructions
    finally:
        sys.path.remove(str(BENCH))
    script = tmp_path / "child.py"
    script.write_text(bench_instructions.CHILD.format(here=str(BENCH)), encoding="utf-8")
    for backward, count in (("0", 36), ("1", 72)):
        for variant in bench_instructions.VARIANTS:
            proc = subprocess.run([sys.executable, str(script), variant, backward, "1"], capture_output=True,
                                  text=True, timeout=600, cwd=BENCH.parent)
            assert proc.returncode == 0, proc.stderr
            if variant != "plain" and (_native.AVAILABLE or variant == "recording"):
                assert proc.stdout.split() == [variant, str(count)], proc.stdout


def test_sources_bench_prints_a_ratio_per_model():
    """One round: each model's row has the three ratios; each traced form's row its five."""
    out = run("bench_sources.py", "--rounds", "1")
    rows = re.findall(r"^\| (MLP|GPT-2)[^|]*\| ([\d.]+)x, [\d.]+x \| ([\d.]+)x, [\d.]+x \| ([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows][:1] == ["MLP"] and len(rows) >= 1, out
    traced = re.findall(r"^\| (jit\.trace|torch\.export) \|(?: [\d.]+x \|){5}$", out, re.M)
    assert traced == ["jit.trace", "torch.export"], out
