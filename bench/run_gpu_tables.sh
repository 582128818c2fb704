#!/bin/bash
# The kernels' tuned tables for the card at hand (a card without its own tables runs the untuned defaults: session 45
# found the H100 had none; sessions 46-47 tuned all of them there). Every table written so
# far goes to $OUT after each step, so a cut run keeps what it had; commit them under runtime/afd/kernels/configs/,
# then check them on the card (`pytest tests/runtime/test_moe_tuned_configs.py tests/runtime/test_skinny_gemm.py tests/gpu/test_gpu_path.py`).
#   bash bench/run_gpu_tables.sh
# Run it in a tree of one commit (`git archive HEAD`, unpacked under /tmp, .whl copied beside it). Steps, most wanted
# first (TABLES picks some): skinny (the decode projections), bf16 (the MoE of both sample shapes), fp8 (DeepSeek-V3 and
# Qwen3 FP8 experts; BF16_SHAPES picks the bf16 shapes); each step has its own time limit and deadline (DEADLINE
# scales them). A bf16 shape takes up to ~110 s to compile its candidates on a cold Triton cache before its deadline's
# clock starts, then ~10-25 s a token count (H100, sessions 46-47: Qwen3's 12 counts took 156 s, DeepSeek-V2-Lite's
# five largest 132 s): one device call each for skinny, each bf16 shape (BF16_SHAPES) and fp8. DeepSeek-V3's FP8 table
# takes 16- and 64-row layouts up to 1,024 tokens and 64- and 128-row ones at 2,048 and 4,096 (on an H100, session 48,
# a 128-row gate_up won at 4,096: 79 s for those two counts).
set -u
SERVING_IMPORTS=0 source bench/gpu_env.sh || exit 1
start=$SECONDS LOG=$OUT/log.txt
scale=${DEADLINE:-1}  # all three steps take about 15 minutes at 1: split them with TABLES
card=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))") || exit 1
save() { cp runtime/afd/kernels/configs/*"$card".json $OUT/ 2>/dev/null; }
step() {  # step SECONDS COMMAND...: the command's output into the log
  local limit=$1; shift
  echo "=== +$((SECONDS - start)) s: $*" | tee -a $LOG
  OUT=/tmp/afd_tables timeout $limit "$@" 2>&1 | tee -a $LOG | tail -n 20
  save
}
mkdir -p /tmp/afd_tables
tables=" ${TABLES:-skinny bf16 fp8} "
tokens=1,64,256,16,4,8,1024,4096,32,128,512,2048  # most wanted first: a deadline drops the last
seconds() { python3 -c "print(int($1 * $scale))"; }
if [[ $tables == *" skinny "* ]]; then
  step $(seconds 75) python3 bench/kernels/skinny_tune.py --deadline $(seconds 40) --write
fi
if [[ $tables == *" bf16 "* ]]; then
  for shape in ${BF16_SHAPES:-qwen3-30b-a3b deepseek-v2-lite}; do
    step $(seconds 330) python3 bench/kernels/moe_tune.py --shape $shape --tokens $tokens --deadline $(seconds 200) --workers 15
  done
fi
if [[ $tables == *" fp8 "* ]]; then
  step $(seconds 130) python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 64,256,1024 --layouts 16,64 \
    --deadline $(seconds 60) --workers 10  # DeepSeek-V3's FP8 experts take ~12 GB beside each worker's ~3.4 GB
  step $(seconds 150) python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 4096,2048 --layouts 64,128 \
    --deadline $(seconds 90) --workers 10
  step $(seconds 95) python3 bench/kernels/moe_tune.py --fp8 --shape qwen3-30b-a3b --tokens 64,256,1024,4096 \
    --deadline $(seconds 40) --workers 15
fi
echo "=== done at +$((SECONDS - start)) s; tables in \$OUT: $(cd $OUT && ls *.json 2>/dev/null | tr '\n' ' ')" | tee -a $LOG
