#!/bin/bash
# Issue 54, item 1: the MoE at the FFN's operating point (8,192-32,768 tokens) on the device machine, one step per
# bench, each with its own time limit; everything into $OUT/log.txt, the benches' JSON into $OUT/json.tgz, tuned
# tables into $OUT (refreshed after each step, so a cut run keeps what it had):
#   bash bench/run_gpu_ffn_point.sh baseline   # FP8 + bf16 layers with the profiler's parts; DeepGEMM beside them
#   bash bench/run_gpu_ffn_point.sh tune       # FP8 tables (both shapes) at those counts, then bf16 (Qwen3)
#   BEFORE_DIR=DIR bash bench/run_gpu_ffn_point.sh final   # the layers on the tables here and on DIR's (before)
#   BEFORE_DIR=DIR bash bench/run_gpu_ffn_point.sh all     # tune, final, then DeepGEMM: one device call (~8 min)
#   BEFORE_DIR=DIR bash bench/run_gpu_ffn_point.sh quick   # a short lease (~6 min): 128-row layouts only, FP8 only
#   bash bench/run_gpu_ffn_point.sh variant   # (~6 min) FP8 tables at 8,192 and 32,768 tokens, both shapes, 128-row
#     layouts, with gate_up's HALVES variant among the candidates (moe_tune prints each count's best with and
#     without it), then the layers on the new tables beside the tables this checkout shipped (copied first)
# TOKENS (default 8192,16384,32768) picks the counts. DeepGEMM runs where .dgwhl/dgsrc.tgz was packed
# (bench/comparisons/deepgemm_build.sh pack; skipped without it). Every bench measures the dense rates it divides by
# in the run.
set -u
SERVING_IMPORTS=0 source bench/gpu_env.sh || exit 1
mode=${1:?usage: run_gpu_ffn_point.sh baseline|tune|final|all|quick|variant}
start=$SECONDS LOG=$OUT/log.txt JSON=/tmp/afd_json tokens=${TOKENS:-8192,16384,32768}
mkdir -p $JSON
card=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))") || exit 1
save() { tar czf $OUT/json.tgz -C $JSON . 2>/dev/null; cp runtime/afd/kernels/configs/*"$card".json $OUT/ 2>/dev/null; }
step() {  # step SECONDS COMMAND...: the command's output into the log, its JSON under $JSON
  local limit=$1; shift
  echo "=== +$((SECONDS - start)) s: $*" | tee -a $LOG
  OUT=$JSON timeout $limit "$@" 2>&1 | tee -a $LOG | tail -n 40
  save
}
deepgemm() {  # build DeepGEMM from the packed sources, then time it beside our kernels
  echo "=== +$((SECONDS - start)) s: DeepGEMM build" | tee -a $LOG
  local dg
  if dg=$(timeout 200 bash bench/comparisons/deepgemm_build.sh build .dgwhl/dgsrc.tgz 2>>$LOG); then
    eval "$dg"
    step ${DG_TIMEOUT:-200} python3 bench/comparisons/moe_deepgemm.py --formats ${DG_FORMATS:-fp8,bf16} --tokens $tokens
  fi
}
fp8_table() { echo "$1_fp8_$card.json"; }  # fp8_table E257_H7168_I2048
case $mode in
baseline)
  step 170 python3 bench/kernels/moe_layer_fp8.py --shape deepseek-v3 --tokens $tokens --profile
  step 90 python3 bench/kernels/moe_layer_fp8.py --shape qwen3-30b-a3b --tokens $tokens --profile
  step 70 python3 bench/kernels/moe_layer.py --shape qwen3-30b-a3b --tokens $tokens
  [ -f .dgwhl/dgsrc.tgz ] && deepgemm ;;
esac
if [[ $mode == tune || $mode == all ]]; then  # DeepSeek-V3: a 16,384-token gate_up takes ~20 ms, so that count on
  # the 128-row layout only (every tile full there) and 32,768 left to it (the table's nearest entry)
  step 110 python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 8192 --layouts 64,128 --workers 12
  step 80 python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 16384 --layouts 128 --workers 12
  step 80 python3 bench/kernels/moe_tune.py --fp8 --shape qwen3-30b-a3b --tokens $tokens --layouts 64,128 \
    --deadline 40 --workers 15
  [ -n "${BF16_TUNE:-}" ] && step 150 python3 bench/kernels/moe_tune.py --shape qwen3-30b-a3b --tokens $BF16_TUNE \
    --layouts 128 --deadline 60 --workers 15
fi
if [[ $mode == quick ]]; then  # the tables' 8,192 (both shapes) and Qwen3's 32,768 entries, then the FP8 figures
  step 90 python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 8192 --layouts 128 --workers 12
  step 70 python3 bench/kernels/moe_tune.py --fp8 --shape qwen3-30b-a3b --tokens 8192,32768 --layouts 128 --workers 15
fi
if [[ $mode == variant ]]; then  # the shipped tables kept as the before, then retuned with HALVES tried
  tokens=${TOKENS:-8192,32768}
  BEFORE_DIR=/tmp/before_variant
  mkdir -p $BEFORE_DIR && cp runtime/afd/kernels/configs/*_fp8_"$card".json $BEFORE_DIR/
  step 155 python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens $tokens --layouts 128 --workers 12
  step 50 python3 bench/kernels/moe_tune.py --fp8 --shape qwen3-30b-a3b --tokens $tokens --layouts 128 --workers 15
  step 90 python3 bench/kernels/moe_layer_fp8.py --shape deepseek-v3 --tokens $tokens --profile \
    --before $BEFORE_DIR/$(fp8_table E257_H7168_I2048)
  step 40 python3 bench/kernels/moe_layer_fp8.py --shape qwen3-30b-a3b --tokens $tokens --profile \
    --before $BEFORE_DIR/$(fp8_table E128_H2048_I768)
  # the new tables' entries and the HALVES settings against the dequantized experts, on this GPU
  step 40 python3 -m pytest -q -p no:cacheprovider --timeout 30 tests/gpu/test_gpu_fp8.py \
    tests/runtime/test_moe_fp8.py -k "shipped_fp8_table or halves"
  echo "=== the tunes' winners (each count's best gate_up with and without HALVES, first pass):"
  grep -h "^=== \|best with\|^tokens .*: BM\|spills: gate_up.*HALVES" $LOG | grep -v "moe_layer_fp8" | head -60
  echo "elapsed: $((SECONDS - start)) s" | tee -a $LOG
  exit 0
fi
case $mode in
final|all|quick)
  before() { [ -n "${BEFORE_DIR:-}" ] && echo "--before $BEFORE_DIR/$1"; }
  step 130 python3 bench/kernels/moe_layer_fp8.py --shape deepseek-v3 --tokens $tokens --profile \
    $(before $(fp8_table E257_H7168_I2048))
  step 90 python3 bench/kernels/moe_layer_fp8.py --shape qwen3-30b-a3b --tokens $tokens --profile \
    $(before $(fp8_table E128_H2048_I768))
  if [[ $mode == quick ]]; then  # the tuned FP8 entries against the dequantized experts, and no more
    step 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 tests/gpu/test_gpu_fp8.py -k shipped_fp8_table
    echo "elapsed: $((SECONDS - start)) s" | tee -a $LOG
    exit 0
  fi
  step ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider --timeout 100 --maxfail 10 \
    tests/runtime/test_moe_tuned_configs.py tests/gpu/test_gpu_fp8.py tests/runtime/test_moe_fp8.py \
    $([ -n "${BF16_TUNE:-}" ] && echo "tests/gpu/test_gpu_path.py::test_every_entry_of_a_shipped_table_equals_the_\
reference")
  step 70 python3 bench/kernels/moe_layer.py --shape qwen3-30b-a3b --tokens $tokens \
    $([ -n "${BF16_TUNE:-}" ] && before E128_H2048_I768_$card.json) ;;
baseline|tune) ;;
*) echo "usage: run_gpu_ffn_point.sh baseline|tune|final|all|quick|variant" >&2; exit 2 ;;
esac
if [[ $mode == all && -f .dgwhl/dgsrc.tgz ]]; then
  deepgemm
fi
echo "elapsed: $((SECONDS - start)) s" | tee -a $LOG
