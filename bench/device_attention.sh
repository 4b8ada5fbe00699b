#!/usr/bin/env bash
# Deltaformer attention on one GPU (issue 5): the GPU tests of tests/test_deltaformer.py, then
# bench/bench_attention.py: the variants as CUDA graph replays, the five-shape table, the host-overhead
# table, the per-kernel profile of the defaults.
#
#   CUDA_VISIBLE_DEVICES=1 OUT=/some/dir bash bench/device_attention.sh
#
# STAGES (default "tests table overhead profile"; also "graphvar") picks the stages; they run in the order
# tests, graphvar, table, overhead, profile. WITH_DDL=1 adds the GPU tests of the DDL kernels and of the
# model on the Triton kernels as one more test group (~60 + ~150 s: the model's tests compile many
# kernels; 55 s cut them after one test in session 4). WITH_FLA=1 puts FLA 0.6.0 in the table (its wheels
# installed first, see the device README; its autotuning adds ~60 s).
# Needs only torch, triton, numpy, pytest. Writes under $OUT (default out_device_attention/): tests.log,
# bench.log, graphvar<i>.json, bench.json, overhead.json, profile0.json, profile1.json.
# Times (sessions 4-5, one H200): tests up to 240 s (parallel compiles dominate), graphvar ~30 s to compile
# side by side + a few s per variant, table ~100 s (+60 s with FLA), overhead ~40 s, profile ~45 s per
# kernel and shape; a device call is at most 600 s, so split the stages over two calls. Every stage has
# its own `timeout`; the table writes its JSON after every shape. Nothing else may run on the GPU (the
# timings) nor on the CPUs (the host's launch work is in the f+b walls: bench_attention.py --overhead)
# meanwhile.
# Before a device call: PYTHONPATH=<triton 3.6 wheel> python bench/compile_check.py (NOTES V6).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out_device_attention}
PY=${PYTHON:-python3}
STAGES=${STAGES:-tests table overhead profile}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
{
    echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}" 2>/dev/null)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null); stages: $STAGES"
} | tee "$OUT/tests.log"

# (a) GPU tests, -s: every case prints its relative errors. Triton compiles (~125 kernels, ~2 s each)
# dominate, so pytest processes run groups of tests side by side (they share the GPU by time slicing,
# which cannot deadlock a wavefront: all of a kernel's programs belong to one process).
if has tests; then
    TMP=$(mktemp -d)
    GROUPS_K=("reflection" "matches_reference and softmax" "matches_reference and relu"
        "(matches_reference and linear) or repeatable" "speed_switches")
    for i in "${!GROUPS_K[@]}"; do
        timeout 240 $PY -m pytest -q -s -rfE -p no:cacheprovider -m gpu tests/test_deltaformer.py \
            -k "${GROUPS_K[$i]}" >"$TMP/group$i.log" 2>&1 &
    done
    if [ "${WITH_DDL:-0}" = 1 ]; then
        GROUPS_K+=("ddl kernels + model on Triton")
        {
            timeout 120 $PY -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_ddl.py
            timeout 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_model.py \
                -k "triton_backend or bf16_state_triton"
        } >"$TMP/group$((${#GROUPS_K[@]} - 1)).log" 2>&1 &
    fi
    wait
    for i in "${!GROUPS_K[@]}"; do
        echo "=== group $i: -k '${GROUPS_K[$i]}'"
        cat "$TMP/group$i.log"
    done | tee -a "$OUT/tests.log"
    echo "summary: $(grep -h -E '[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$TMP"/group*.log |
        tr '\n' ';')" | tee -a "$OUT/tests.log"
    rm -rf "$TMP"
fi

# (b) speed
B=bench/bench_attention.py
# graphvar: the variants' f+b times as CUDA graph replays (GPU time; a few s each); "shape kernel variants"
# per line of GRAPHVAR (VARIANTS names, comma-separated), compiled side by side first.
GRAPHVAR=${GRAPHVAR:-"0 softmax default,lse_kernel=64,lse_kernel=128,xprec=bf16x3
1 softmax default,lse_kernel=64,lse_kernel=128
4 softmax default,lse_kernel=64,lse_kernel=128"}
if has graphvar; then
    while read -r shape kernel variants; do
        for v in ${variants//,/ }; do
            timeout 150 $PY $B --no-fla --graph-variants "$kernel" --variant-shapes "$shape" \
                --profile-variants "$v" --compile-only >/dev/null 2>&1 &
        done
    done <<<"$GRAPHVAR"
    wait
    i=0
    while read -r shape kernel variants; do
        timeout 150 $PY $B --no-fla --graph-variants "$kernel" --variant-shapes "$shape" \
            --profile-variants "$variants" --json "$OUT/graphvar$i.json" 2>&1 | tee -a "$OUT/bench.log"
        i=$((i + 1))
    done <<<"$GRAPHVAR"
fi
if has table; then
    FLA_FLAG=--no-fla
    [ "${WITH_FLA:-0}" = 1 ] && FLA_FLAG=
    timeout 240 $PY $B $FLA_FLAG --json "$OUT/bench.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "table exit: $?" | tee -a "$OUT/bench.log"
fi
if has overhead; then
    timeout 90 $PY $B --no-fla --overhead softmax,relu --json "$OUT/overhead.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "overhead exit: $?" | tee -a "$OUT/bench.log"
fi
if has profile; then
    # the defaults kernel by kernel (variants are compared by the graphvar stage: ~45 s each here)
    for shape in 0 1; do
        timeout 150 $PY $B --no-fla --kernel-profile softmax,relu --profile-variants default \
            --profile-shape $shape --json "$OUT/profile$shape.json" 2>&1 | grep -v "Warn\|_warn" |
            tee -a "$OUT/bench.log"
    done
    echo "profile exit: $?" | tee -a "$OUT/bench.log"
fi
