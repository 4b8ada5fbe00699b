#!/usr/bin/env bash
# Deltaformer attention on one GPU (issue 5): the GPU tests of tests/test_deltaformer.py, then
# bench/bench_attention.py (five shapes; per-kernel profile of the variants), without FLA.
#
#   CUDA_VISIBLE_DEVICES=1 OUT=/some/dir bash bench/device_attention.sh
#
# WITH_DDL=1 adds the GPU tests of the DDL kernels and of the model on the Triton kernels as a fifth group
# (tests.log), finished before any timing starts.
# Needs only torch, triton, numpy, pytest. Writes under $OUT (default out_device_attention/): tests.log,
# bench.log, bench.json, profile_softmax.json, profile_relu.json. At most ~460 s: tests 180 s, table 90 s,
# profiles 190 s, each cut by `timeout` (the table writes its JSON after every shape). Nothing else may
# run on the GPU meanwhile (the timings), nor on the CPUs (Python launch overhead is in the f+b walls).
# Before a device call: PYTHONPATH=<triton 3.6 wheel> python bench/compile_check.py (NOTES V6).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-out_device_attention}
PY=${PYTHON:-python3}
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
    "(matches_reference and linear) or repeatable or speed_switches")
for i in "${!GROUPS_K[@]}"; do
    timeout 180 $PY -m pytest -q -s -rfE -m gpu tests/test_deltaformer.py -k "${GROUPS_K[$i]}" \
        >"$TMP/group$i.log" 2>&1 &
done
if [ "${WITH_DDL:-0}" = 1 ]; then
    GROUPS_K+=("ddl kernels + model on Triton")
    {
        timeout 120 $PY -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_ddl.py
        timeout 55 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_model.py -k "triton_backend or bf16_state_triton"
    } >"$TMP/group4.log" 2>&1 &
fi
wait
for i in "${!GROUPS_K[@]}"; do
    echo "=== group $i: -k '${GROUPS_K[$i]}'"
    cat "$TMP/group$i.log"
done | tee -a "$OUT/tests.log"
echo "summary: $(grep -h -E '[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$TMP"/group*.log | tr '\n' ';')" \
    | tee -a "$OUT/tests.log"
rm -rf "$TMP"

# (b) speed: the five-shape table (softmax, relu, SDPA), then the per-kernel profile at 8,12,1024,64 of
# the open launch/precision variants (bench_attention.py VARIANTS), softmax, then relu's default
timeout 90 $PY bench/bench_attention.py --no-fla --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?" | tee -a "$OUT/bench.log"
timeout 150 $PY bench/bench_attention.py --no-fla --kernel-profile softmax --json "$OUT/profile_softmax.json" \
    2>&1 | tee -a "$OUT/bench.log"
timeout 40 $PY bench/bench_attention.py --no-fla --kernel-profile relu --profile-variants default \
    --json "$OUT/profile_relu.json" 2>&1 | tee -a "$OUT/bench.log"
echo "profile exit: $?" | tee -a "$OUT/bench.log"
