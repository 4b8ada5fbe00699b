#!/usr/bin/env bash
# Deltaformer attention on one GPU (issue 5): the GPU tests of tests/test_deltaformer.py, then
# bench/bench_attention.py (five shapes, kernel variants, per-kernel profile), without FLA.
#
#   CUDA_VISIBLE_DEVICES=1 OUT=/some/dir bash bench/device_attention.sh
#
# Needs only torch, triton, numpy, pytest (pytest-xdist used when present). Writes under $OUT (default
# out_device_attention/): tests.log, bench.log, bench.json. Total under 400 s: 190 s tests, 195 s bench,
# each step cut by `timeout` (the bench writes its JSON after every shape, so a cut run keeps what it has).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-out_device_attention}
mkdir -p "$OUT"
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}" 2>/dev/null)"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null)"

# (a) GPU tests: -s prints every case's relative errors; compiles dominate, so use 4 workers if we can
# (the kernels only share the GPU through time slicing, which cannot deadlock the wavefronts).
PAR=""
python -c "import xdist" 2>/dev/null && PAR="-n 4"
timeout 190 python -m pytest -q -s -rfEx $PAR -m gpu tests/test_deltaformer.py --durations=5 2>&1 \
    | tee "$OUT/tests.log"
echo "tests exit: $?" | tee -a "$OUT/tests.log"

# (b) speed: main table, profile, then variants (softmax at 8,12,1024,64 and 2,12,4096,64; relu at the first)
timeout 195 python bench/bench_attention.py --no-fla --profile --variants --variant-shapes 0,3 \
    --variant-kernels softmax,relu --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?" | tee -a "$OUT/bench.log"
