#!/usr/bin/env bash
# Issue 6's training-throughput table in one device call on an nvidia-h200-x2 machine (2 GPUs), < 590 s:
#   1. GPU tests, both at once (<= 80 s): tests/test_ddl.py -m gpu on GPU 0, the model on the Triton
#      kernels (tests/test_model.py, incl. the bf16 state) on GPU 1
#   2. one bench_train.py run over gpt2-small and gpt2-medium on both GPUs (one job per GPU at a time,
#      longest first): the issue's six variants, then ddl-cc-bf16, ddl-tc-bf16, ddl-bf16 while time is left
# Results under $OUT (5 files): device_table.log (everything), bench_train.json and bench_train.md (the
# table; merge with `python bench/bench_train.py --merge bench_train.json`), tests_ddl.log, tests_model.log.
# Run from the repo root: OUT=/tmp/o bash bench/device_table.sh   (SKIP_TESTS=1: the table alone)
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/device_table_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}  # not `python`: a symlink to the venv's python breaks imports on the device machine
LOG=$OUT/device_table.log
T0=$(date +%s)
END=${DEVICE_TABLE_SECONDS:-585}  # the whole script ends by T0 + END (the call's limit is 600 s)
stage() { echo "=== [$(($(date +%s) - T0)) s] $*" | tee -a "$LOG"; }

stage "GPUs: $(nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader | tr '\n' ';')"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"

if [ -z "$SKIP_TESTS" ]; then  # SKIP_TESTS=1: when an earlier call of the session ran them on this code
    stage "1. GPU tests, test_ddl on GPU 0 and test_model on GPU 1 (timeout 80 s)"
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 75 $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_ddl.py \
        >"$OUT/tests_ddl.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout -k 5 75 $PY -m pytest -q -p no:cacheprovider tests/test_model.py \
        -k "triton_backend or bf16_state_triton" >"$OUT/tests_model.log" 2>&1 &
    wait
    { echo "--- tests_ddl:"; tail -n 15 "$OUT/tests_ddl.log"; echo "--- tests_model:"; tail -n 5 "$OUT/tests_model.log"; } |
        tee -a "$LOG"
fi

LEFT=$((END - 25 - $(date +%s) + T0))  # 25 s: start-up, reaping the last workers, the table
VARIANTS=additive,ddl,ddl-tc,ddl-cc,additive+deltaformer,ddl-cc+deltaformer,ddl-cc-bf16,ddl-tc-bf16,ddl-bf16
stage "2. the table on GPUs 0,1 (--time-limit $LEFT s)"
timeout -k 5 $((LEFT + 20)) $PY bench/bench_train.py --models gpt2-small,gpt2-medium --variants "$VARIANTS" \
    --gpus 0,1 --batches "gpt2-small=64,32;gpt2-medium=32,16" --warmup 2 --steps 8 \
    --time-limit "$LEFT" --job-timeout 150 --out "$OUT" 2>&1 | tee -a "$LOG"
stage "done"
