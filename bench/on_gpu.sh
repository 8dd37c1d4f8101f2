#!/usr/bin/env bash
# Issue #30's device checks as one command, for a session lent a machine with a GPU (its `run` tool):
#
#   bash bench/on_gpu.sh "$OUT"        # from the repository root, on the GPU machine
#
# Builds the C extension there, runs tests/runtime/test_gpu.py (no host sync while recording) and
# the benchmarks with --device cuda: the tiny models (bench_logging.py) and the GPT-2-small-sized
# and ResNet-18-sized ones (bench_sizes.py). Each step has its own time limit, so a slow one
# leaves the others' files; the whole takes about 8 minutes on an H100. Where `zstandard` isn't
# importable it is installed from the wheels in .whl/, a folder to fill here first and carry (the
# machine reaches no package index; the H100 of an earlier session had Python 3.12):
#
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/pip download zstandard --only-binary=:all: --python-version 3.12 --no-deps -d .whl
set -uo pipefail
out=${1:-/tmp/picklehooks-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD
if ! python3 -c "import zstandard" 2>/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
python3 setup.py build_ext --inplace -q > "$out/build.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt"
timeout 180 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/runtime/test_gpu.py > "$out/test_gpu.txt" 2>&1
command="bench/bench_logging.py --device cuda --rounds 7 --only mlp,transformer,hf --no-torchlens"
{ echo "<!-- \$ python $command -->"; timeout 240 python3 $command; } > "$out/logging_cuda.md" 2> "$out/logging_cuda.err"
command="bench/bench_sizes.py --device cuda --rounds 5"
{ echo "<!-- \$ python $command -->"; timeout 150 python3 $command; } > "$out/sizes_cuda.md" 2> "$out/sizes_cuda.err"
exit 0
