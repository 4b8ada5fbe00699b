#!/usr/bin/env bash
# DDL throughput, one GPU (the caller picks it: CUDA_VISIBLE_DEVICES=0 bash bench/device_train.sh), ~380 s.
#   1. GPU tests of the DDL kernels (tests/test_ddl.py -m gpu) and the model on the Triton kernels
#   2. gpt2-small additive+softmax (whole-model compile): tokens/s, step ms, peak GB, MFU, then one
#      profiled step (GPU time by kind, top kernels): where the MFU goes
#   3. kernel micro-benchmarks: the update kernels' launch choices (backward loop kind, tokens per
#      program, d_v=1 row kernels, forward tokens per program), bf16 and fp32 state
#   4. if time is left: gpt2-small ddl-cc with the bf16 state, the same way (ratio to stage 2)
#   5. if time is left: gpt2-small additive with --compile-scope blocks (compile time against speed)
# Results under $OUT (4 files): device_train.log (everything), bench_train.json (stage 2),
# bench_kernels.json (stage 3), bench_train_ddl.json (stage 4).
# Every stage has its own timeout, so a hang in one still leaves the others' results.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device_train_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG=$OUT/device_train.log
WORK=$(mktemp -d)
T0=$(date +%s)
stage() { echo "=== [$(($(date +%s) - T0)) s] $*" | tee -a "$LOG"; }

stage "GPU: ${CUDA_VISIBLE_DEVICES:-all visible}; $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | head -1)"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"

stage "1. GPU tests (timeout 90 s)"
timeout -k 5 90 $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_ddl.py 2>&1 | tail -n 25 | tee -a "$LOG"
timeout -k 5 40 $PY -m pytest -q -p no:cacheprovider tests/test_model.py -k "triton_backend or bf16_state_triton" 2>&1 | tail -n 5 |
    tee -a "$LOG"

left() { local l=$((388 - $(date +%s) + T0)); echo $((l < $1 ? l : $1)); }  # min(cap, time left)
LEFT=$(left 170)
stage "2. gpt2-small additive+softmax, whole-model compile, timed and one step profiled (timeout $LEFT s)"
timeout -k 5 $LEFT $PY bench/bench_train.py --models gpt2-small --variants additive --batches 64,32 \
    --warmup 2 --steps 8 --profile --profile-top 30 --time-limit $((LEFT - 3)) --job-timeout $((LEFT - 5)) \
    --out "$OUT" 2>&1 |
    grep -v "^USDT\|SyncActivityProfilerHandler" | tee -a "$LOG"
rm -f "$OUT/bench_train.md"  # the same table is in the log; keeps $OUT at 4 files

LEFT=$(left 100)
stage "3. kernel micro-benchmarks (timeout $LEFT s)"
timeout -k 5 $LEFT $PY bench/bench_train.py --kernels-only --kernel-sweeps --out "$OUT" 2>&1 | tee -a "$LOG"

LEFT=$(left 999)
if [ $LEFT -gt 60 ]; then
    stage "4. gpt2-small ddl-cc-bf16, whole-model compile, profiled (timeout $LEFT s)"
    mkdir -p "$WORK/ddl"
    timeout -k 5 $LEFT $PY bench/bench_train.py --models gpt2-small --variants ddl-cc-bf16 --batches 64,32 \
        --warmup 2 --steps 8 --profile --profile-top 30 --time-limit $((LEFT - 3)) --job-timeout $((LEFT - 3)) \
        --out "$WORK/ddl" 2>&1 | grep -v "^USDT\|SyncActivityProfilerHandler" | tee -a "$LOG"
    [ -f "$WORK/ddl/bench_train.json" ] && cp "$WORK/ddl/bench_train.json" "$OUT/bench_train_ddl.json"
fi

LEFT=$(left 999)
if [ $LEFT -gt 45 ]; then
    stage "5. gpt2-small additive, --compile-scope blocks (compile time vs speed; the row is in this log)"
    timeout -k 5 $LEFT $PY bench/bench_train.py --models gpt2-small --variants additive --compile-scope blocks \
        --batches 64 --warmup 2 --steps 8 --time-limit $((LEFT - 3)) --job-timeout $((LEFT - 3)) \
        --out "$WORK" 2>&1 | tee -a "$LOG"
fi

stage "done"
