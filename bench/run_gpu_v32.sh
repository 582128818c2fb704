#!/bin/bash
# Issue 53's DeepSeek-V3.2 work on the device machine in one call (one H100 or H200; NCCL pairs share it): everything
# into $OUT/log.txt, the bench's JSON into $OUT/json.tgz (refreshed after each step, so a cut run keeps what it had):
#   bash bench/run_gpu_v32.sh
# Run it in a tree of one commit (others' uncommitted edits travel with the working tree): carry
# `git archive HEAD | gzip >.h2tree/tree.tgz`, unpack it under /tmp, copy .whl there and run it there.
# Steps, most wanted first, each with its own time limit (STEPS picks some: kernels parity bench):
#   kernels  the sparse MLA kernels' tests on the GPU (index scores, top-k, sparse latent decode and prefill)
#   parity   tests/gpu/test_gpu_v32_afd.py: a reduced V3.2-shaped model (2 layers, real attention and indexer
#            dims, 256 experts) in bf16 and FP8: graphs == eager, kernels == torch path, monolith == AFD over NCCL
#   bench    bench/kernels/sparse_mla.py: sparse decode at 4K/16K/32K against the byte floors, 16K prefill vs dense
set -u
source bench/gpu_env.sh || exit 1
export AFD_GPU_SHARE_ONE=1
start=$SECONDS LOG=$OUT/log.txt JSON=/tmp/afd_json
mkdir -p $JSON
save() { tar czf $OUT/json.tgz -C $JSON . 2>/dev/null; }
step() {  # step SECONDS COMMAND...: the command's output into the log, its JSON under $JSON
  local limit=$1; shift
  echo "=== +$((SECONDS - start)) s: $*" | tee -a $LOG
  OUT=$JSON timeout $limit "$@" 2>&1 | tee -a $LOG | tail -n 40
  save
}
steps=" ${STEPS:-kernels parity bench} "
if [[ $steps == *" kernels "* ]]; then
  step ${KERNELS_TIMEOUT:-120} python3 -m pytest -q -rfE -p no:cacheprovider --timeout 100 \
    tests/runtime/test_sparse_mla_kernels.py tests/runtime/test_decode_kernels.py
fi
if [[ $steps == *" parity "* ]]; then
  step ${PARITY_TIMEOUT:-420} python3 -m pytest -q -rfE -p no:cacheprovider --timeout 300 --maxfail 3 \
    tests/gpu/test_gpu_v32_afd.py
fi
if [[ $steps == *" bench "* ]]; then
  step ${BENCH_TIMEOUT:-240} python3 bench/kernels/sparse_mla.py ${BENCH_ARGS:-}
fi
echo "=== done in $((SECONDS - start)) s" | tee -a $LOG
