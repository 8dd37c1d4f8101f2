#!/usr/bin/env bash
# Issue #30's device checks as one command, for a session lent a machine with a GPU (its `run` tool):
#
#   bash bench/on_gpu.sh "$OUT"        # from the repository root, on the GPU machine
#
# Builds the C extension there, runs tests/runtime/test_gpu.py (no host sync while recording) and
# tests/capture/test_pending_arena.py (the arenas' statistics against float64 PyTorch, on the GPU), then
# the benchmarks with --device cuda, most wanted first: the GPT-2-small-sized and ResNet-18-sized
# models (bench_sizes.py), the launches the GPU runs per record (bench_launches.py), where a
# recording step's host time goes (profile_record.py), the tiny models (bench_logging.py) and the
# compiled MLP (its compile section). Each step has its own time limit, so a slow one leaves the
# others' files (8 in all, the most a run brings back); the whole took about 4 minutes on an H200.
# Where `zstandard` isn't importable it is installed from the wheels in .whl/, a folder to fill
# here first and carry (the machine reaches no package index; the H100 and H200 of earlier
# sessions had Python 3.12):
#
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/pip download zstandard --only-binary=:all: --python-version 3.12 --no-deps -d .whl
set -uo pipefail
out=${1:-/tmp/picklehooks-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
errors="$out/errors.txt"
if ! python3 -c "import zstandard" 2>/dev/null; then
    # Into the environment, not a --target folder: tests start fresh interpreters without PYTHONPATH.
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 setup.py build_ext --inplace -q 2>&1; } > "$out/setup.txt"
timeout 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/runtime/test_gpu.py tests/capture/test_pending_arena.py > "$out/test_gpu.txt" 2>&1
bench() {  # bench NAME SECONDS SCRIPT ARGS...: $out/NAME.md, headed by the command as bench/results/ wants it
    local name=$1 limit=$2; shift 2
    echo "== $name" >> "$errors"
    { echo "<!-- \$ python $* -->"; timeout "$limit" python3 "$@"; } > "$out/$name.md" 2>> "$errors"
}
bench sizes_cuda 120 bench/bench_sizes.py --device cuda --rounds 5
bench launches_cuda 60 bench/bench_launches.py --device cuda
bench profile_cuda 150 bench/profile_record.py --device cuda
bench logging_cuda 120 bench/bench_logging.py --device cuda --rounds 5 --only mlp,transformer,hf --no-torchlens
bench compile_cuda 150 bench/bench_logging.py --device cuda --rounds 5 --only compile --no-torchlens
exit 0
