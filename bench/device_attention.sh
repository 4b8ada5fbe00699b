#!/usr/bin/env bash
# Deltaformer attention on one GPU (issue 5): the GPU tests of tests/test_deltaformer.py, then
# bench/bench_attention.py (five shapes, per-kernel profile, kernel variants), without FLA.
#
#   CUDA_VISIBLE_DEVICES=1 OUT=/some/dir bash bench/device_attention.sh
#
# Needs only torch, triton, numpy, pytest. Writes under $OUT (default out_device_attention/): tests.log,
# bench.log, bench.json. At most ~390 s: tests 180 s, bench 205 s, each cut by `timeout` (the bench
# writes its JSON after every shape and variant group, so a cut run keeps what it measured).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-out_device_attention}
mkdir -p "$OUT"
{
    echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}" 2>/dev/null)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null)"
} | tee "$OUT/tests.log"

# (a) GPU tests, -s: every case prints its relative errors. Triton compiles (~125 kernels, ~2 s each)
# dominate, so four pytest processes run groups of tests side by side (they share the GPU by time
# slicing, which cannot deadlock a wavefront: all of a kernel's programs belong to one process).
TMP=$(mktemp -d)
GROUPS_K=("reflection" "matches_reference and softmax" "matches_reference and relu"
    "(matches_reference and linear) or repeatable")
for i in "${!GROUPS_K[@]}"; do
    timeout 180 python -m pytest -q -s -rfE -m gpu tests/test_deltaformer.py -k "${GROUPS_K[$i]}" \
        >"$TMP/group$i.log" 2>&1 &
done
wait
for i in "${!GROUPS_K[@]}"; do
    echo "=== group $i: -k '${GROUPS_K[$i]}'"
    cat "$TMP/group$i.log"
done | tee -a "$OUT/tests.log"
echo "summary: $(grep -h -E '[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$TMP"/group*.log | tr '\n' ';')" \
    | tee -a "$OUT/tests.log"
rm -rf "$TMP"

# (b) speed: main table, profile, then variants (softmax, then relu, at 8,12,1024,64 and 4,12,2048,64)
timeout 205 python bench/bench_attention.py --no-fla --profile --variants --variant-shapes 0,2 \
    --variant-kernels softmax,relu --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?" | tee -a "$OUT/bench.log"
