#!/bin/bash
# The first device call after sessions without a GPU: every GPU test that the CPU-only changes since could break,
# most wanted first, each group with its own time limit, then what the FP8 shared-row change costs. Each group's
# output into $OUT/<group>.log (the tail printed):
#   bash bench/run_gpu_verify.sh            # VERIFY_GROUPS="kernels afd v3 moe_fp8 skinny moe_small" picks some (not GROUPS: bash owns that name)
# Run it in a tree of one commit (see bench/run_gpu_step.sh). What it checks (session 41, no device lent):
#   kernels  the Triton kernels against their references on the GPU, incl. the shared expert's float32 row and
#            DeepSeek-V3's shared-expert slice as a stack (tests/runtime/test_shared_stack.py), shipped tables
#   afd      AFD over NCCL == monolith after session 40's fusions and transports move, graph replay == eager,
#            piecewise prompt graphs, expert parallelism, n choices sharing a prompt's KV blocks on CUDA
#   v3       the DeepSeek-V3-shaped monolith == AFD over NCCL, FP8 then bf16 (EP2 with the gate on attention)
#   moe_fp8  bench/kernels/moe_layer_fp8.py at DeepSeek-V3 shapes (the float32 shared row's cost against RESULTS' figures)
#   skinny   the skinny GEMM (issue 33) on the GPU, then bench/kernels/skinny_tune.py's table at the decode projections
#   moe_small the small-token MoE path (issue 33) on the GPU (tests/runtime/test_moe_small.py, 60-120 s), then
#            bench/kernels/moe_small.py (60 s): it vs the aligned path at T = 1, 2, 4, 8, both bf16 sample shapes and
#            DeepSeek-V3 FP8, against the byte floor (AFD_MOE_SMALL_TOKENS: 8 by default, 16-bit experts only,
#            set on an H100 in session 45). Its settings sweep: bench/kernels/moe_small.py --variants 1,2,4,8
set -u
source bench/gpu_env.sh || exit 1
export AFD_GPU_SHARE_ONE=1 NCCL_DEBUG=WARN
group() {  # group NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ " ${VERIFY_GROUPS:-kernels afd v3 moe_fp8 skinny moe_small} " == *" $name "* ]] || return 0
  echo "=== $name: $*"
  timeout $limit "$@" 2>&1 | tee $OUT/$name.log | tail -n 30
}
pytest="python3 -m pytest -q -p no:cacheprovider -p no:warnings --timeout 120"
group kernels 150 $pytest tests/runtime/test_moe_triton_settings.py tests/runtime/test_moe_fp8.py \
  tests/runtime/test_shared_stack.py tests/runtime/test_routing_kernel.py tests/runtime/test_decode_kernels.py \
  tests/runtime/test_norm_rope.py tests/runtime/test_moe_tuned_configs.py tests/gpu/test_gpu_fp8.py
group afd 330 $pytest --maxfail 10 tests/gpu/test_gpu_path.py tests/gpu/test_gpu_expert_parallel.py \
  tests/gpu/test_gpu_pair_capture.py tests/server/test_shared_prompt.py
group v3 240 env AFD_V3_FORMATS=fp8,bf16 $pytest tests/gpu/test_gpu_v3_afd.py
group moe_fp8 60 python3 bench/kernels/moe_layer_fp8.py --shape deepseek-v3 --tokens 64,1024,4096
group skinny 90 bash -c "$pytest tests/runtime/test_skinny_gemm.py | tail -n 3; python3 bench/kernels/skinny_tune.py --deadline 30"
group moe_small 180 bash -c "timeout 120 $pytest tests/runtime/test_moe_small.py | tail -n 3; timeout 60 python3 bench/kernels/moe_small.py --deadline 40"
