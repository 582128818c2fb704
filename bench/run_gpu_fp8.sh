#!/bin/bash
# Issue 32's FP8 work on the device machine in one call; everything into $OUT/log.txt, the benches' JSON into
# $OUT/json.tgz, the tuned FP8 tables into $OUT (all refreshed after each step, so a cut run keeps what it had):
#   bash bench/run_gpu_fp8.sh
# Run it in a tree of one commit (others' uncommitted edits travel with the working tree): e.g. carry
# `git archive HEAD | gzip >.h1tree/tree.tgz`, unpack it under /tmp, copy .whl there and run it there.
# FP8 MoE tables tuned (TUNE_SHAPES, TUNE_TOKENS, TUNE_ARGS), the FP8 MoE layer benches on them (BENCH_SHAPES), the
# FP8 GPU tests (TESTS; with the registers/spills of the FP8 defaults, before and now, and of the tuned entries
# beside them), then the DeepSeek-V3-shaped monolith = AFD-over-NCCL tests (one GPU shared; V3_TESTS). Each step
# has its own time limit.
set -u
source bench/gpu_env.sh || exit 1
start=$SECONDS LOG=$OUT/log.txt JSON=/tmp/afd_json
mkdir -p $JSON
save() { tar czf $OUT/json.tgz -C $JSON . 2>/dev/null; cp runtime/afd/kernels/configs/*fp8*.json $OUT/ 2>/dev/null; }
step() {  # step SECONDS COMMAND...: the command's output into the log, its JSON under $JSON
  local limit=$1; shift
  echo "=== +$((SECONDS - start)) s: $*" | tee -a $LOG
  OUT=$JSON timeout $limit "$@" 2>&1 | tee -a $LOG | tail -n 25
  save
}
# most wanted first: a deadline skips the last ones. Session 40 on one H200: compiling took 8-30 s a shape; timing
# DeepSeek-V3 took over 60 s a token count over all layouts (TUNE_ARGS="--layouts 16,64": 64, 256 and 4,096 in 25 s)
tune_tokens=${TUNE_TOKENS:-1024,4096,64,256,2048}
for shape in ${TUNE_SHAPES:-deepseek-v3:130:65 qwen3-30b-a3b:95:40}; do
  IFS=: read -r name limit deadline <<<"$shape"
  step $limit python3 bench/kernels/moe_tune.py --fp8 --shape $name --tokens $tune_tokens --deadline $deadline --workers 15 \
    ${TUNE_ARGS:-}
done
for shape in ${BENCH_SHAPES:-deepseek-v3:50 qwen3-30b-a3b:35}; do
  IFS=: read -r name limit <<<"$shape"
  step $limit python3 bench/kernels/moe_layer_fp8.py --shape $name --tokens ${BENCH_TOKENS:-64,256,1024,4096}
done
(OUT=$JSON timeout 60 python3 bench/kernels/moe_fp8_spills.py --shape deepseek-v3 >/tmp/spills.log 2>&1) &
step ${TESTS_TIMEOUT:-60} python3 -m pytest -q -p no:cacheprovider --timeout 50 --maxfail 30 ${TESTS:-tests/gpu/test_gpu_fp8.py \
  tests/runtime/test_moe_fp8.py tests/runtime/test_routing_kernel.py tests/runtime/test_moe_tuned_configs.py}
wait
cat /tmp/spills.log >>$LOG; tail -n 20 /tmp/spills.log; save
v3=tests/gpu/test_gpu_v3_afd.py
v3_tests=("$v3::test_v3_shaped_monolith_equals_afd_with_graphs_in_batch_invariant_mode[fp8-2A1F-stages2]"
          "$v3::test_v3_shaped_monolith_equals_afd_with_graphs_in_batch_invariant_mode[fp8-1A1F-stages2-gate_attention-ep2]"
          "$v3::test_v3_shaped_monolith_equals_afd_over_nccl[fp8]")
[ -n "${V3_TESTS:-}" ] && read -r -a v3_tests <<<"$V3_TESTS"
export AFD_GPU_SHARE_ONE=1 NCCL_DEBUG=WARN AFD_V3_FORMATS=${V3_FORMATS:-fp8}
v3_limit=${V3_TIMEOUT:-150}
step $v3_limit python3 -m pytest -q -rA -p no:cacheprovider --timeout $v3_limit "${v3_tests[@]}"
echo "elapsed: $((SECONDS - start)) s" | tee -a $LOG
